"""Rollouts for a step: the generate call with its sampling and seed, and the rewards of what
came back. Used by the step (synchronous), the rollout queue (async) and validation."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rlspec.cluster.calls import Call, wait
from rlspec.data.loading import Prompt
from rlspec.loops.partial import PartialRollouts
from rlspec.loops.runlog import StageTimer
from rlspec.loops.state import Run
from rlspec.messages import RolloutBatch, Sampling, SpecStats, add_moments
from rlspec.rewards import REWARDS


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """Sampling seed of one step, a function of (seed, step) only: no hidden global state."""
    return (seed * 1_000_003 + step * 7_919 + salt * 104_729) % (2**31 - 1)


def score(tokenizer, rollouts: RolloutBatch, answers: list[str], reward: str = "math") -> torch.Tensor:
    """[N] rewards; answers holds the ground truth of each sample's prompt."""
    texts = tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
    return torch.tensor(REWARDS[reward](texts, answers), dtype=torch.float32)


@dataclass
class GenTotals:
    """All generate calls of one step, including groups dynamic sampling dropped."""
    tokens: int = 0
    seconds: float = 0.0
    spec: SpecStats | None = None
    draft_schedule: list | None = None  # 'auto': the last call's [first, last, k] ranges
    decode_moments: list | None = None  # engine decode steps' step_moments(), every call and engine
    history: dict | None = None  # speculation=history: the drafter's counters, summed over calls
    partial: dict | None = None  # partial rollouts: the calls' counts (VLLMEngine.generate_groups), summed
    step_rows: list | None = None  # [engine steps, their rows summed], every call and engine

    def add(self, ro: RolloutBatch) -> None:
        self.tokens += ro.num_tokens if ro.partial is None else ro.partial["new_tokens"]
        if ro.partial is not None:
            self.partial = {k: (self.partial or {}).get(k, 0) + v for k, v in ro.partial.items()}
        if ro.history is not None:  # counters add up over calls; the store's size is the latest
            old = self.history or {}
            self.history = {k: v if k in ("prompts", "history_tokens") else old.get(k, type(v)()) + v
                            for k, v in ro.history.items()}
        self.seconds += ro.seconds
        self.draft_schedule = ro.draft_schedule
        self.decode_moments = add_moments(self.decode_moments, ro.decode_moments)
        self.step_rows = add_moments(self.step_rows, ro.step_rows)
        if ro.spec is not None:
            self.spec = ro.spec if self.spec is None else self.spec + ro.spec


def submit(run: Run, prompts: list[Prompt], seed: int) -> Call:
    """The training rollouts of `prompts` (generation.* sampling, G samples each)."""
    return run.actors.generators.generate([p.token_ids for p in prompts], Sampling.of(run.cfg.generation, seed))


def generate(run: Run, prompts: list[Prompt], seed: int, timer: StageTimer, totals: GenTotals):
    """Rollouts and rewards [P, G] for `prompts`."""
    with timer("generation"):
        ro = wait(submit(run, prompts, seed), run.actors.timeout_s, abort=lambda: run.stop.preempt)
    return ro, rewards(run, prompts, ro, timer, totals)


def submit_partial(run: Run, partial: PartialRollouts, seed: int) -> Call:
    """Partial rollouts (rlspec/loops/partial.py): the carried groups and new prompts in one call
    that returns once P groups are complete (their prompts: `partial.returned` of its result)."""
    sampling = Sampling.of(run.cfg.generation, seed)
    groups = partial.groups(partial.draw(), sampling)
    return run.actors.generators.generate_groups(groups, sampling, partial.P, partial.max_carry_versions,
                                                 partial.start, partial.max_carries)


def generate_partial(run: Run, partial: PartialRollouts, seed: int, timer: StageTimer, totals: GenTotals):
    """A partial call waited on: its completed groups' prompts, rollouts and rewards [P, G]."""
    with timer("data"):
        call = submit_partial(run, partial, seed)
    with timer("generation"):
        ro = wait(call, run.actors.timeout_s, abort=lambda: run.stop.preempt)
    prompts = partial.returned(ro)
    return prompts, ro, rewards(run, prompts, ro, timer, totals)


def rewards(run: Run, prompts: list[Prompt], ro: RolloutBatch, timer: StageTimer, totals: GenTotals) -> torch.Tensor:
    """[P, G] rewards of `ro` (counted into the step's totals)."""
    totals.add(ro)
    with timer("prep"):
        answers = [p.answer for p in prompts for _ in range(run.cfg.generation.num_generations_per_prompt)]
        return score(run.tokenizer, ro, answers, run.cfg.data.reward).view(len(prompts), -1)


def validate(run: Run, step: int) -> float:
    """Held-out accuracy: one sample per validation prompt at generation.val_temperature."""
    import time

    g, started, t0 = run.cfg.generation, time.time(), time.perf_counter()
    sampling = Sampling.of(g, step_seed(run.cfg.trainer.seed, step, salt=99), n=1, temperature=g.val_temperature,
                           rollout=False)
    ro = wait(run.actors.generators.generate([p.token_ids for p in run.val.prompts], sampling), run.actors.timeout_s)
    acc = score(run.tokenizer, ro, [p.answer for p in run.val.prompts], run.cfg.data.reward).mean().item()
    run.log.validation(step, acc, len(run.val), started, time.perf_counter() - t0)
    return acc
