"""Asynchronous GRPO: the Generator runs ahead of the learner through a bounded rollout queue.

The learner is at policy version s - 1 when step s begins; the batch it trains on was sampled by
version v, so its policy lag is s - 1 - v. The queue submits the generate call of step s+L+1 right
after the refit to version s (L = async_grpo.max_policy_lag), and never more than `capacity` steps
ahead. Ray runs one actor's calls in submission order, which gives the two guarantees async needs:

- a refit never splits a rollout group: a generate call runs whole between two refits, and the
  version it reports is the one that sampled every token (behaviour log-probs included);
- with capacity L + 1 (the default) every batch is exactly L versions old when trained on (the
  first L steps less). A larger capacity runs further ahead: a batch found older than L is never
  trained on; it is counted and regenerated with current weights (or replaced by new prompts).

With max_policy_lag=0 the calls reach the actors in the synchronous loop's order with the same
seeds, so the two loops train identically.

A checkpoint is saved after a refit and before the next calls go out (`refit(fill=False)`), with
the results of the calls already out (`checkpoint`): a resumed run trains on the rollouts the
uninterrupted run trains on and submits its next calls to the same weights, so async resume is
exact at every lag. A preemption or a non-finite stop saves without waiting for them: the data
position before the oldest untrained call (`state`), whose prompts the resumed run draws again.

Partial rollouts (generation.partial, rlspec/loops/partial.py): a call's groups are the previous
call's unfinished ones plus new prompts, so a call is submitted only once the one before it has
come back (the driver holds the carried groups, and a checkpoint holds them with the queued
calls' results, or as they were before the oldest untrained call). The next call goes out as soon
as the previous one is taken when the lag bound allows (it then samples the weights of the refit
before, lag 1), else after the refit (lag 0, the synchronous loop's calls). A trained token is at
most max_policy_lag + generation.partial.max_carry_versions versions old. Every wait is bounded by
cluster.actor_timeout_s; a dead Generator surfaces on the next take as ActorFailure naming it.

    generator:  gen(s+1) gen(s+2)|refit(s) gen(s+3)|refit(s+1) ...     (L = 1, capacity 2)
    learner:    train(s)          train(s+1)          ...
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rlspec.cluster.calls import Call, wait
from rlspec.data.loading import Prompt, PromptSampler
from rlspec.loops.partial import PartialRollouts
from rlspec.loops.rollouts import step_seed, submit, submit_partial
from rlspec.loops.runlog import StageTimer
from rlspec.loops.state import Run
from rlspec.messages import RolloutBatch


@dataclass
class Pending:
    step: int
    prompts: list[Prompt]                             # partial rollouts: the completed groups, once collected
    call: Call | None                                 # None: restored from a checkpoint with its result
    sampler_state: dict                               # the sampler before these prompts were drawn
    refits: list[Call] = field(default_factory=list)  # generator refits submitted just before it
    rollouts: RolloutBatch | None = None              # the call's result once back (partial; a checkpoint's)


class RolloutQueue:
    def __init__(self, run: Run, sampler: PromptSampler, first_step: int, partial: PartialRollouts | None = None,
                 queued: list[dict] = ()):
        """queued: the calls a checkpoint saved with their results (`checkpoint`), steps first_step on."""
        q = run.cfg.async_grpo
        self.run, self.sampler, self.partial = run, sampler, partial
        self.version = first_step - 1  # the generator's weights after the refits submitted so far
        self.lag = q.max_policy_lag
        self.capacity = q.queue_capacity if q.queue_capacity is not None else q.max_policy_lag + 1
        self.on_stale = q.on_stale
        self.pending: deque[Pending] = deque()
        self.refits: list[Call] = []  # generator refits no take has waited on yet
        self.stale_groups = 0         # over the run
        for i, q in enumerate(queued):
            if q["step"] != first_step + i:
                raise ValueError(f"the checkpoint's queued rollouts are of steps {[q['step'] for q in queued]}, "
                                 f"the run resumes at step {first_step}")
            self.pending.append(Pending(q["step"], q["prompts"], None, q["sampler"], rollouts=q["rollouts"]))
        self.next_step = first_step + len(queued)
        self.fill()

    def _submit(self, step: int, prompts: list[Prompt] | None = None, salt: int = 0) -> Pending:
        cfg = self.run.cfg
        if self.partial is not None:  # its prompts are known once it is collected
            state = self.partial.state()
            call = submit_partial(self.run, self.partial, step_seed(cfg.trainer.seed, step, salt))
            item = Pending(step, [], call, state, self.refits)
            self.refits = []
            return item
        state = self.sampler.state()
        prompts = prompts if prompts is not None else self.sampler.next_batch(cfg.generation.num_prompts_per_step)
        call = submit(self.run, prompts, step_seed(cfg.trainer.seed, step, salt))
        item = Pending(step, prompts, call, state, self.refits)
        self.refits = []
        return item

    def fill(self) -> None:
        """Submit generate calls up to `capacity` steps ahead (the run's last step at most). Partial
        rollouts: only after the previous call is back, and only within the lag bound."""
        while len(self.pending) < self.capacity and self.next_step <= self.run.cfg.trainer.max_steps:
            if self.partial is not None and (self.pending and self.pending[-1].rollouts is None
                                             or self.next_step - 1 - self.version > self.lag):
                break
            self.pending.append(self._submit(self.next_step))
            self.next_step += 1

    def _collect(self, item: Pending) -> RolloutBatch:
        """A partial call's result, its completed groups' prompts and the carried groups taken in
        once (in call order: a call is submitted after the one before it is collected)."""
        if item.rollouts is None:
            item.rollouts = wait([*item.refits, item.call], self.run.actors.timeout_s,
                                 abort=lambda: self.run.stop.preempt)[-1]
            item.prompts = self.partial.returned(item.rollouts)
        return item.rollouts

    def before_refit(self, timer: StageTimer) -> None:
        """A collective refit (Refit.collective): the learner would block in it
        until the Generator has finished the rollouts queued ahead of its receive. Wait for them
        here, where the wait counts as exposed generation time."""
        if self.run.actors.refit.collective:
            with timer("generation"):
                self.drain()

    def refit(self, to_generator: list[Call], others: list[Call], fill: bool = True) -> None:
        """Wait for the refit calls the learner needs done, then fill the queue: later generate
        calls sample the new weights. Collective (drained before): the Generator joins at once,
        and waiting on its side too names a Generator that dies now instead of stalling the
        collective. Otherwise the Generator takes the weights after the rollouts already
        queued on it; the next `take` waits for that. fill=False: the next calls wait for `fill`
        (a checkpoint is saved first: the Generator's history store is saved behind the calls
        queued on it, and must not hold the answers of a call the saved data position redoes)."""
        if self.run.actors.refit.collective:
            wait([*to_generator, *others], self.run.actors.timeout_s)
        else:
            wait(others, self.run.actors.timeout_s)
            self.refits.extend(to_generator)
        self.version += 1
        if fill:
            self.fill()

    def take(self, step: int, timer: StageTimer) -> tuple[list[Prompt], RolloutBatch, int]:
        """(prompts, rollouts, stale groups dropped) of `step`, waiting (timed as 'generation':
        the exposed generation time) until they are ready and no older than max_policy_lag."""
        item = self.pending[0]
        if item.step != step:  # the loop's and the queue's steps parted: a defect, never silent (python -O)
            raise RuntimeError(f"rollout queue holds step {item.step}, the learner wants {step}")
        run, dropped, attempt = self.run, 0, 0
        if self.partial is not None:
            with timer("generation"):
                ro = self._collect(item)
            self.pending.popleft()
            # submitted within the bound (fill), sampled by the version it was submitted behind;
            # the engine restarts an answer past max_carry_versions
            if step - 1 - ro.policy_version > self.lag + self.partial.max_carry_versions:
                raise RuntimeError(f"step {step}: partial rollouts hold a token of policy {ro.policy_version}, older "
                                   f"than async_grpo.max_policy_lag={self.lag} + generation.partial."
                                   f"max_carry_versions={self.partial.max_carry_versions} allow")
            self.fill()
            return item.prompts, ro, 0
        while True:
            with timer("generation"):
                ro = item.rollouts if item.rollouts is not None else \
                    wait([*item.refits, item.call], run.actors.timeout_s, abort=lambda: run.stop.preempt)[-1]
            if self.pending and item is self.pending[0]:
                self.pending.popleft()
            lag = step - 1 - ro.policy_version
            if lag <= self.lag:
                self.stale_groups += dropped
                return item.prompts, ro, dropped
            dropped += len(item.prompts)
            attempt += 1
            run.log.write(f"step {step}: rollouts of policy {ro.policy_version} are {lag} versions old "
                          f"(async_grpo.max_policy_lag={self.lag}): {self.on_stale} {len(item.prompts)} groups")
            again = item.prompts if self.on_stale == "regenerate" else None
            item = self._submit(step, again, salt=1000 + attempt)

    def state(self) -> dict:
        """Sampler position before the oldest step not yet trained: a checkpoint saved without its
        queued calls (a preemption, a non-finite stop) stores this, so a resumed run draws those
        prompts again (and samples them with the restored weights)."""
        return self.pending[0].sampler_state if self.pending else (self.partial or self.sampler).state()

    def checkpoint(self) -> tuple[dict, list[dict]]:
        """(data position, queued calls) for a checkpoint after the step just trained: waits for the
        calls in flight (L of them at lag L: the next step waits for the first anyway) and returns
        their results with the data position after them. A run resumed from it trains on the very
        rollouts the uninterrupted run trains on, and the history store saved behind those calls
        holds the answers the resumed run has, not answers of calls it redoes."""
        self.drain()
        for p in self.pending:
            if p.rollouts is None:
                p.rollouts = wait([*p.refits, p.call], self.run.actors.timeout_s)[-1]
        queued = [{"step": p.step, "prompts": p.prompts, "rollouts": p.rollouts, "sampler": p.sampler_state}
                  for p in self.pending]
        return (self.partial or self.sampler).state(), queued

    def drain(self) -> None:
        """Wait for the refits and rollouts in flight (results stay queued for `take`)."""
        calls = [*self.refits, *[c for p in self.pending for c in (*p.refits, p.call) if c is not None]]
        self.refits = []
        if calls:
            wait(calls, self.run.actors.timeout_s)
        if self.partial is not None:
            for p in self.pending:
                self._collect(p)
