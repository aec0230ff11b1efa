"""The driver of a run: steps in order, validation, checkpoints, the non-finite guard and
preemption. Synchronous by default: every step runs the five stages in order and refits the
Generator before the next step samples, so every rollout is on-policy (policy lag 0). With
async_grpo.enabled the same step takes its rollouts from a RolloutQueue that keeps the Generator
up to max_policy_lag versions ahead of the learner.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from omegaconf import OmegaConf

from rlspec.cluster.calls import Abandoned
from rlspec.data.loading import PromptSampler
from rlspec.loops.checkpoint import Checkpointer, read_queued
from rlspec.loops.partial import PartialRollouts
from rlspec.loops.preemption import NumericalDivergence, Preempted
from rlspec.loops.queue import RolloutQueue
from rlspec.loops.rollouts import validate
from rlspec.loops.runlog import RunLog
from rlspec.loops.state import Counters, Run
from rlspec.loops.step import train_step
from rlspec.messages import StepRecord


def run_loop(run: Run, resume_from: Path | None = None, restarts: int = 0) -> dict:
    """Steps from the start (or after `resume_from`) to trainer.max_steps; the run's summary.
    restarts: how often this run was restarted after an actor failure so far."""
    cfg, t = run.cfg, run.cfg.trainer
    sampler = PromptSampler(run.train, seed=t.seed, shuffle=cfg.data.shuffle)
    g = cfg.generation
    partial = (PartialRollouts(sampler, run.train.prompts, g.num_prompts_per_step, g.num_generations_per_prompt,
                               g.partial.over_provision, g.partial.max_carry_versions, g.partial.refill,
                               g.partial.max_carries)
               if g.partial.enabled else None)
    data = partial or sampler  # the data position: the sampler's, and the carried groups under partial rollouts
    ckpt = Checkpointer(run.ckpt_root, t.checkpoint_keep, run.actors, run.log,
                        OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    start, counters, queued = 1, Counters(restarts=restarts), []
    if resume_from is not None:
        state, restored = ckpt.restore(resume_from, data)
        start = state.step + 1
        counters = replace(restored, restarts=restarts)
        queued = read_queued(resume_from)
        if queued and not cfg.async_grpo.enabled:  # an async checkpoint resumed synchronously: redraw them
            data.load_state(queued[0]["sampler"])
            queued = []
    else:
        validate(run, 0)
    # Async: rollouts run ahead; a checkpoint stores the calls out with their results and the data
    # position after them (RolloutQueue.checkpoint).
    queue = RolloutQueue(run, sampler, start, partial, queued) if cfg.async_grpo.enabled else None
    position = queue or data
    stop = run.stop

    def checkpoint_due(step: int) -> bool:
        return stop.preempt or stop.checkpoint_now or bool(t.checkpoint_every and step % t.checkpoint_every == 0)

    for step in range(start, t.max_steps + 1):
        at_start = position.state()
        try:
            rec = train_step(run, counters, sampler, step, queue, partial, lambda: checkpoint_due(step))
        except Abandoned:  # before the update: the step is redone (identically when sync) after the resume
            data.load_state(at_start)
            ckpt.save(data.state(), step - 1, counters)
            raise Preempted(step - 1, run.stop.preempt_signal) from None
        run.log.step(rec)
        guard_nonfinite(counters, rec, t.max_nonfinite_steps, run.log, lambda: ckpt.save(position.state(), rec.step,
                                                                                          counters))
        if step == t.max_steps or (t.val_every and step % t.val_every == 0):
            validate(run, step)
        if checkpoint_due(step):
            # async: saved before the next call goes out (train_step held it), with the results of
            # the calls already out, so the Generator's history store saved behind them holds
            # exactly the answers the resumed run has. A preemption does not wait for them: the
            # resumed run redraws those calls on-policy (lossless; not the uninterrupted run's drafts).
            stop.checkpoint_now = False
            saved, queued = queue.checkpoint() if queue is not None and not stop.preempt else (position.state(), [])
            ckpt.save(saved, step, counters, queued)
        if queue is not None:
            queue.fill()
        if stop.preempt:
            raise Preempted(step, stop.preempt_signal)
    if queue is not None:
        queue.drain()
        run.log.notes["stale_groups_dropped"] = queue.stale_groups
    if partial is not None:  # groups still carried at the end were never trained: counted, not lost silently
        run.log.notes.update({f"partial_{k}": v for k, v in partial.totals.items()})
        run.log.notes["partial_groups_untrained_at_end"] = len(partial.carry)
    return run.log.summary()


def guard_nonfinite(counters: Counters, rec: StepRecord, limit: int, log: RunLog, save) -> None:
    """Count updates the learner skipped for a non-finite loss or gradient; past `limit`
    (trainer.max_nonfinite_steps) in a row, checkpoint through `save()` (the weights are still the
    last good ones) and stop."""
    skipped = rec.extra.get("train/skipped", 0.0) > 0
    counters.nonfinite_steps += int(skipped)
    counters.nonfinite_in_row = counters.nonfinite_in_row + 1 if skipped else 0
    log.notes["nonfinite_steps"] = counters.nonfinite_steps
    if skipped:
        log.write(f"step {rec.step}: non-finite loss or gradient, update skipped "
                  f"({counters.nonfinite_in_row} in a row, {counters.nonfinite_steps} in all)")
    if counters.nonfinite_in_row > limit:
        path = save()
        log.write_summary()  # with this step's count: the run ends here
        raise NumericalDivergence(f"{counters.nonfinite_in_row} non-finite updates in a row (more than "
                                  f"trainer.max_nonfinite_steps={limit}); last good state in {path}")
