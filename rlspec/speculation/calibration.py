"""Adaptive k on a running engine (`speculation.num_speculative_tokens=auto`): start-up timing of
engine steps per batch-size bucket and k, the k each call drafts, and what each call feeds back
to the planner (rlspec/speculation/adaptive.py holds the planner itself).

The engine is built for k_max; a call's k per batch size is set through the scheduler's
batch-size -> k lookup (vLLM's `num_speculative_tokens_per_batch_size`; the scheduler is the same
object under Model Runner V1 and V2), and a call run without speculation also turns the drafter's
forward pass off where the runner allows it (V1). rlspec's history drafters are the exception:
they are timed with every row drafting k (filled where the lookup finds fewer: the host drafter
without its lookup, whose time it measures apart, the device drafter with it, inside the step),
planned per row from their counters, and after a call that drafted nothing they measure in
shadow what they would have drafted.

What rlspec reads or writes inside vLLM, per class, is listed in rlspec/speculation/vllm_hooks.py."""
from __future__ import annotations

import statistics
import time

import torch

from rlspec.config import SpeculationConfig
from rlspec.engines.vllm_engine import VLLMEngine, decode_only
from rlspec.messages import RolloutBatch
from rlspec.speculation.adaptive import OFF, DraftLengthPlanner, DraftPlan, load_step_costs, non_decreasing
from rlspec.speculation.history import drafters


class AdaptiveK:
    def __init__(self, engine: VLLMEngine, spec: SpeculationConfig):
        self.engine = engine
        self.buckets = sorted(spec.auto_buckets)
        self.probe_every, self.probe_max_cost = spec.auto_probe_every, spec.auto_probe_max_cost
        self.planner: DraftLengthPlanner | None = None
        self.plan: DraftPlan | None = None
        self.calibration_seconds = 0.0
        self.calls = 0
        self.last_lengths: list[int] | None = None
        self.given = None if spec.auto_step_costs is None else load_step_costs(spec.auto_step_costs, spec.k_max)

    def before_call(self, prompt_ids: list[list[int]], rollout: bool = True) -> float:
        """Plan the k of the next call (calibrating on its prompts on the first); returns the
        seconds spent calibrating, which the call reports as its own. Only training rollouts
        count towards probes (and, after the call, feed the estimates)."""
        t0 = time.perf_counter()
        if self.planner is None and self.given is not None:
            self.planner = DraftLengthPlanner(k_max=self.engine.k_max, step_seconds=dict(self.given), fixed=True,
                                              max_batch=len(self.engine.scheduler().dynamic_sd_lookup) - 1)
        elif self.planner is None:
            self.planner = self.calibrate(prompt_ids)
            self.planner.probe_max_cost = self.probe_max_cost
        probe = rollout and (self.calls % self.probe_every == 0 or self.planner.unmeasured())
        self.plan = self.planner.plan(self.last_lengths, probe=probe)
        self.calls += rollout
        self.set_k(OFF if self.plan.off else self.plan.k_at)
        return time.perf_counter() - t0

    def after_call(self, ro: RolloutBatch, decode: list[tuple[int, float]], rollout: bool = True) -> None:
        """Feed a training rollout's acceptance counters and decode-step timings to the planner."""
        if not rollout:
            return
        self.last_lengths = [len(r) for r in ro.response_ids]
        k_min = self.planner.calls_k_min(self.plan, len(ro.response_ids))
        if ro.history is not None:  # drafts per request: measured over every row it was asked for
            from rlspec.speculation.history.stats import per_pos

            h, k_max = ro.history, self.planner.k_max
            if h.get("propose_timing"):  # the lookups' own time, charged to drafting modes only
                self.planner.observe_drafter(h["propose_timing"])
            self.planner.observe(h["rows"], ro.spec.accepted_per_pos if ro.spec else [0] * k_max, k_min,
                                 per_pos(h, "drafts_ge", k_max))
            # and what a call that drafted nothing would have drafted (every position measured), on
            # a sample of its responses: counted as the whole call, so it weighs as a call that drafted
            w = len(ro.response_ids) / max(1, h["shadow_responses"])
            self.planner.observe(w * h["shadow_rows"], [w * x for x in per_pos(h, "shadow_accepted_ge", k_max)], k_max,
                                 [w * x for x in per_pos(h, "shadow_drafts_ge", k_max)], fresh=h["rows"] <= 0)
        else:
            self.planner.observe(ro.spec.drafts, ro.spec.accepted_per_pos, k_min)
        self.planner.observe_steps([(n, OFF if self.plan.off else self.plan.k_at(n), seconds)
                                    for n, seconds in decode])

    def draft_schedule(self) -> list[list[int]] | None:
        """The k per batch-size range the last call used ([] when it ran without speculation)."""
        if self.plan is None:
            return None
        return [] if self.plan.off else [list(r) for r in self.plan.schedule]

    def set_k(self, k_of_batch) -> None:
        """Point the scheduler's dynamic batch-size -> k lookup at a new schedule (k_of_batch: a
        function of the running batch size, or OFF for no drafting at all)."""
        sched = self.engine.scheduler()
        n = len(sched.dynamic_sd_lookup)
        off = k_of_batch == OFF
        sched.dynamic_sd_lookup[:] = [0] * n if off else [0] + [k_of_batch(b) for b in range(1, n)]
        method = self.engine.spec_config["method"]
        if method == "custom_class":  # rlspec's host history drafter reads k itself
            from rlspec.speculation.history.host import proposer as history_proposer

            self.engine.llm.collective_rpc(history_proposer.set_k, args=(list(sched.dynamic_sd_lookup),))
        # n-gram lookup costs nothing to skip; the device history drafter is handed the scheduler's
        # k and looks up nothing at k=0, and vLLM's ngram_gpu bookkeeping (the runner's device copy
        # of the rows) runs inside the draft call, which must go on
        if method not in ("ngram", "ngram_gpu"):
            self.engine.llm.collective_rpc(_set_drafting, args=(not off,))

    def _time_steps(self, prompt_ids: list[list[int]], batch: int, k: int, steps: int) -> list[float]:
        """Seconds of `steps` engine decode steps with `batch` sequences drafting k (or OFF)."""
        from vllm import SamplingParams, TokensPrompt

        self.set_k(OFF if k == OFF else (lambda b: k))
        engine = self.engine.llm.llm_engine
        params = SamplingParams(n=1, temperature=1.0, max_tokens=(steps + 4) * (max(k, 0) + 1),
                                ignore_eos=True, logprobs=0, detokenize=False)
        ids = [f"rlspec-cal-{k}-{batch}-{i}" for i in range(batch)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids[i % len(prompt_ids)]), params)
        # timed by the engine's step wrapper, as every call's decode steps are
        with self.engine.timed_steps() as log:
            while engine.has_unfinished_requests() and len(decode_only(log)) < steps:
                engine.step()
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        return [seconds for _, seconds in decode_only(log)]

    def calibrate(self, prompt_ids: list[list[int]], rounds: int = 3, steps: int = 4) -> DraftLengthPlanner:
        """Time engine steps at each bucket (up to the engine's max_num_seqs) for every k and OFF,
        `rounds` times round-robin so that load drift on shared cores hits every k alike; the
        median per (bucket, k), made non-decreasing in k (a longer draft never costs less).
        Acceptance comes from the calls themselves."""
        t0 = time.perf_counter()
        drafter = drafters.history_drafter(self.engine.spec_config)
        if drafter:  # rlspec's history drafter: time every row drafting k (the planner scales)
            self.engine.llm.collective_rpc(drafter.set_full, args=(True,))
        try:
            seconds, k_max, max_batch = self._timed_costs(prompt_ids, rounds, steps)
        finally:
            if drafter:
                self.engine.llm.collective_rpc(drafter.set_full, args=(False,))
        self.calibration_seconds = time.perf_counter() - t0
        return DraftLengthPlanner(k_max=k_max, max_batch=max_batch, step_seconds=seconds)

    def _timed_costs(self, prompt_ids: list[list[int]], rounds: int, steps: int):
        k_max = self.engine.k_max
        max_batch = len(self.engine.scheduler().dynamic_sd_lookup) - 1
        buckets = [b for b in self.buckets if b < max_batch] + [max_batch]
        ks = [OFF, *range(k_max + 1)]
        samples: dict[tuple[int, int], list[float]] = {(b, k): [] for b in buckets for k in ks}
        for _ in range(rounds):
            for b, k in samples:
                samples[(b, k)] += self._time_steps(prompt_ids, b, k, steps)
        seconds = {}
        for b in buckets:
            costs = non_decreasing([statistics.median(samples[(b, k)]) for k in ks])
            seconds.update({(b, k): c for k, c in zip(ks, costs)})
        return seconds, k_max, max_batch


def _set_drafting(worker, enabled: bool) -> None:
    """Turn the drafter's forward pass off for whole calls that 'auto' runs without speculation
    (k=0 through the schedule alone still runs the draft over the new tokens every step). Model
    Runner V1 only (CPU, and GPU methods V2 does not take): V2 drafts through its speculator and
    has no such switch, so there OFF is k=0 for every batch size, and calibration measures it as
    such."""
    if worker.use_v2_model_runner:
        return
    runner = worker.model_runner
    if not hasattr(runner, "_rlspec_propose"):
        runner._rlspec_propose = runner.propose_draft_token_ids
    runner.propose_draft_token_ids = runner._rlspec_propose if enabled else (
        lambda *args, **kwargs: torch.empty(runner.input_batch.num_reqs, 0, dtype=torch.int64))
