"""Generator: one vLLM engine serving rollouts (G samples per prompt with behaviour log-probs),
speculative when configured, with k chosen per call under 'auto'; its target and draft weights
are refit from the learner and the DraftTrainer."""
from __future__ import annotations

import os
import time
from dataclasses import asdict

import torch

from rlspec.config import GenerationConfig, ModelConfig, SpeculationConfig
from rlspec.engines.vllm_engine import VLLMEngine
from rlspec.messages import Group, RolloutBatch, Sampling, fresh_groups
from rlspec.models import ModelPaths
from rlspec.refit.receiver import RefitReceiver
from rlspec.speculation import vllm_hooks
from rlspec.speculation.history import drafters
from rlspec.speculation.history.host import proposer as history_proposer
from rlspec.speculation.calibration import AdaptiveK
from rlspec.speculation.vllm_config import vllm_speculative_config


class Generator(RefitReceiver):
    def __init__(self, *, paths: ModelPaths, model: ModelConfig, generation: GenerationConfig,
                 speculation: SpeculationConfig, seed: int, threads: int, nice: int = 0):
        paths.check_visible("Generator")
        torch.set_num_threads(threads)
        if nice:
            os.nice(nice)
        spec_config = vllm_speculative_config(speculation, paths.draft)
        self.drafter = drafters.history_drafter(spec_config)   # None: no history drafting
        self.history = self.drafter is not None
        # either history drafter takes its settings from the engine's config, on every worker
        plugin_config = {vllm_hooks.CONFIG_KEY: asdict(speculation.history)} if self.history else None
        if self.history and self.drafter is not history_proposer:  # the device store is built with the runner
            vllm_hooks.require_slots()
            # in this process whether or not rlspec's vLLM plugins are installed here (an unpacked
            # tree, the GPU kit): an engine core built in-process takes the drafter from it
            self.drafter.install()
        self.engine = VLLMEngine(paths.model, paths.tokenizer, generation, model.max_model_len, seed, spec_config,
                                 additional_config=plugin_config)
        self.adaptive = AdaptiveK(self.engine, speculation) if speculation.adaptive else None
        self.history_validation = speculation.history.draft_validation
        if self.history:
            self.engine.llm.collective_rpc(self.drafter.configure)
        self.engine.sleep()  # sleep mode: hold no GPU memory until the first call (learners start next)
        self.policy_version = 0
        self.draft_version = 0
        self.history_by_rank: list[dict | None] = []   # the last call's drafter counters, by rank

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> RolloutBatch:
        """sampling.n samples per prompt, prompt-major: rows [i*n, (i+1)*n) belong to prompt i (a
        call of new groups that needs them all: generate_groups). Under generation.sleep_mode the
        engine releases its GPU memory when the call is done. The batch's seconds are the whole
        call's: waking, planning 'auto' (calibrating, on the first), the drafter's work before and
        after the engine's generate (history's insert and shadow)."""
        return self.generate_groups(fresh_groups(prompt_ids, sampling), sampling)

    def generate_groups(self, groups: list[Group], sampling: Sampling, needed: int | None = None,
                        max_carry_versions: int | None = None, start: int | None = None,
                        max_carries: int | None = None) -> RolloutBatch:
        """Every generate call: `groups` continued until `needed` of them (None: all) are complete,
        the rest carried (VLLMEngine.generate_groups). The groups' finished answers join the history
        when their group is returned; a resumed answer is drafted under its own prompt, not vLLM's
        (prompt + answer so far)."""
        resumed = {VLLMEngine.request_id(self.engine.calls, gi, j): len(g.prompt_ids) for gi, g in enumerate(groups)
                   for j, a in enumerate(g.answers) if a.response_ids and not a.done}
        return self._call([g.prompt_ids for g in groups], sampling, lambda: self.engine.generate_groups(
            groups, sampling, self.policy_version, needed, max_carry_versions, start, max_carries), resumed)

    def _call(self, prompt_ids: list[list[int]], sampling: Sampling, run, resumed: dict | None = None) -> RolloutBatch:
        """One generate call around `run()` (the engine's): wake, 'auto' planning, the history
        drafter's begin and finish, sleep."""
        t0 = time.perf_counter()
        self.engine.wake_up()
        try:
            if self.adaptive:
                self.adaptive.before_call(prompt_ids, sampling.rollout)
            if self.history:
                draft = sampling.rollout or self.history_validation
                self.engine.llm.collective_rpc(self.drafter.begin_call, args=(draft, resumed or {}))
            ro = run()
            if self.history:  # under 'auto', a training call that drafted nothing is measured in shadow
                shadow = self.adaptive is not None and sampling.rollout and not (ro.spec and ro.spec.drafts)
                # every rank's counters (tensor parallel: each rank drafts from its own store, the
                # same records; the first rank's are the call's)
                self.history_by_rank = self.engine.llm.collective_rpc(self.drafter.finish_call, args=(
                    ro.prompt_ids if shadow else None, ro.response_ids if shadow else None))
                ro.history = self.history_by_rank[0]
                if sampling.rollout:  # training rollouts become history; validation answers do not
                    self.record_history(ro.prompt_ids, ro.response_ids)
            if self.adaptive:
                self.adaptive.after_call(ro, self.engine.decode_steps, sampling.rollout)
                ro.draft_schedule = self.adaptive.draft_schedule()
            ro.seconds = time.perf_counter() - t0
            return ro
        finally:
            self.engine.sleep()

    def record_history(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> None:
        """speculation=history: these responses join their prompts' history (every call's training
        rollouts do so by themselves)."""
        if not self.history:
            raise RuntimeError("record_history: speculation.method is not history")
        self.engine.llm.collective_rpc(self.drafter.record, args=(prompt_ids, response_ids))

    def history_state(self) -> dict:
        """speculation=history: the drafter's store (every prompt's recent responses)."""
        return self.engine.llm.collective_rpc(self.drafter.state_dict)[0]

    def load_history_state(self, state: dict) -> None:
        self.engine.llm.collective_rpc(self.drafter.load_state_dict, args=(state,))

    def save_history(self, path: str) -> None:
        torch.save(self.history_state(), path)

    def load_history(self, paths: list[str]) -> None:
        """The stores saved at `paths`, merged (least recently seen first, bounds applied)."""
        from rlspec.speculation.history.state import STATE_GLOBALS, merge_states

        with torch.serialization.safe_globals(STATE_GLOBALS):
            states = [torch.load(p, weights_only=True) for p in paths]
        formats = {s.get("format") == "device" for s in states}
        if formats != {self.drafter is not history_proposer}:
            raise ValueError(f"history stores {paths} were saved by another speculation.history.drafter than this "
                             "run's: a run resumes with the drafter it was saved with")
        self.load_history_state(merge_states(states))

    def refit_target(self) -> VLLMEngine:
        return self.engine

    def decode_steps(self) -> list[tuple[int, float]]:
        """The last generate call's decode steps: (running batch, seconds) each, in order."""
        return list(self.engine.decode_steps)

    def engine_steps(self) -> list[tuple[int, int]]:
        """The last generate call's engine steps, prefills too: (running, waiting) before each."""
        return [(n, waiting) for n, waiting, _ in self.engine.steps]

    def runner_info(self) -> dict:
        """The model runner vLLM gave this engine, async scheduling, CUDA graphs (VLLMEngine.runner_info)."""
        return self.engine.runner_info()

    def ping(self) -> int:
        return self.policy_version

    def shutdown(self) -> None:
        """Release the engine now (VLLMEngine.close), e.g. before another starts in this process."""
        self.engine.close()
