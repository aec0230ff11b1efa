"""The GRPO loop. Synchronous by default: every step runs the five stages in order and refits
the Generator before the next step samples, so every rollout is on-policy (policy lag 0).

    data -> prep -> generation -> (reward, advantages: prep) -> logprob -> train (+ refit)

With async_grpo.enabled the same step takes its rollouts from a RolloutQueue (async_loop.py)
that keeps the Generator up to max_policy_lag versions ahead of the learner.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlspec import checkpoint
from rlspec.algo import compute_advantages, merge_weight_sums, overlong_mask, weight_stats, zero_variance_groups
from rlspec.async_loop import RolloutQueue
from rlspec.batching import build_train_batch
from rlspec.config import RLSpecConfig, recompute_logprobs
from rlspec.data.loading import Prompt, PromptSampler, PromptSet
from rlspec.messages import RolloutBatch, SpecStats, StepRecord, add_moments
from rlspec.metrics import RunLog, StageTimer
from rlspec.preemption import Abandoned, NumericalDivergence, Preempted, StopRequest
from rlspec.rewards import REWARDS
from rlspec.workers.cluster import Actors, wait


@dataclass
class Context:
    cfg: RLSpecConfig
    actors: Actors
    tokenizer: object
    train: PromptSet
    val: PromptSet
    log: RunLog
    ckpt_root: str | None = None         # trainer.checkpoint_dir, resolved
    resume_from: Path | None = None      # checkpoint to continue from
    stop: StopRequest = field(default_factory=StopRequest)
    counters: dict = field(default_factory=lambda: {"nonfinite_steps": 0, "nonfinite_in_row": 0, "restarts": 0})


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

    def add(self, ro: RolloutBatch) -> None:
        self.tokens += ro.num_tokens
        self.seconds += ro.seconds
        self.draft_schedule = ro.draft_schedule
        self.decode_moments = add_moments(self.decode_moments, ro.decode_moments)
        if ro.spec is not None:
            self.spec = ro.spec if self.spec is None else self.spec + ro.spec


def generate(ctx: Context, prompts: list[Prompt], seed: int, timer: StageTimer, totals: GenTotals):
    """Rollouts and rewards [P, G] for `prompts`."""
    g = ctx.cfg.generation
    with timer("generation"):
        ro = wait(ctx.actors.gen("generate", [p.token_ids for p in prompts], g.num_generations_per_prompt,
                                 g.temperature, g.max_new_tokens, seed, g.top_p, g.top_k),
                  ctx.actors.timeout_s, abort=lambda: ctx.stop.preempt)
    return ro, scored(ctx, prompts, ro, timer, totals)


def scored(ctx: Context, prompts: list[Prompt], ro: RolloutBatch, timer: StageTimer, totals: GenTotals):
    """[P, G] rewards of `ro` (counted into the step's totals)."""
    totals.add(ro)
    with timer("prep"):
        answers = [p.answer for p in prompts for _ in range(ctx.cfg.generation.num_generations_per_prompt)]
        return score(ctx.tokenizer, ro, answers, ctx.cfg.data.reward).view(len(prompts), -1)


def collect_groups(ctx: Context, sampler: PromptSampler, step: int, timer: StageTimer, totals: GenTotals,
                   queue: RolloutQueue | None = None):
    """One step's rollouts [P*G] and rewards [P, G], with dynamic sampling when enabled: groups
    whose rewards all agree are replaced by fresh prompts for up to max_rounds extra rounds; if the
    batch still is not full, dropped groups fill it with sample weight 0 (kept for shape only).
    Under async GRPO the first round comes from the rollout queue; extra rounds use the weights the
    Generator has then."""
    cfg = ctx.cfg
    P, G = cfg.generation.num_prompts_per_step, cfg.generation.num_generations_per_prompt
    stats = {"groups_dropped": 0.0, "sampling_rounds": 1.0, "stale_groups_dropped": 0}
    if queue is None:
        with timer("data"):
            prompts = sampler.next_batch(P)
        ro, rewards = generate(ctx, prompts, step_seed(cfg.trainer.seed, step), timer, totals)
    else:
        prompts, ro, stats["stale_groups_dropped"] = queue.take(step, timer)
        rewards = scored(ctx, prompts, ro, timer, totals)
    if not cfg.algo.dynamic_sampling:
        return ro, rewards, torch.ones(P), stats
    keep, spare = [], []
    for rnd in range(cfg.algo.dynamic_sampling_max_rounds + 1):
        if rnd:
            with timer("data"):
                prompts = sampler.next_batch(P)
            ro, rewards = generate(ctx, prompts, step_seed(cfg.trainer.seed, step, rnd), timer, totals)
            stats["sampling_rounds"] += 1
        flat = zero_variance_groups(rewards)
        for i in range(P):
            (spare if flat[i] else keep).append((ro.select(list(range(i * G, (i + 1) * G))), rewards[i]))
        if len(keep) >= P:
            break
    stats["groups_dropped"] = float(len(spare))
    weight = torch.tensor([1.0] * min(len(keep), P) + [0.0] * max(P - len(keep), 0))
    chosen = (keep + spare)[:P]
    ro = RolloutBatch.concat([c[0] for c in chosen], mixed_versions=queue is not None)
    return ro, torch.stack([c[1] for c in chosen]), weight, stats


def validate(ctx: Context, step: int) -> float:
    g, started, t0 = ctx.cfg.generation, time.time(), time.perf_counter()
    ro = wait(ctx.actors.gen("generate", [p.token_ids for p in ctx.val.prompts], 1, g.val_temperature,
                             g.max_new_tokens, step_seed(ctx.cfg.trainer.seed, step, salt=99)),
              ctx.actors.timeout_s)
    acc = score(ctx.tokenizer, ro, [p.answer for p in ctx.val.prompts], ctx.cfg.data.reward).mean().item()
    ctx.log.validation(step, acc, len(ctx.val), started, time.perf_counter() - t0)
    return acc


def train_step(ctx: Context, sampler: PromptSampler, step: int, queue: RolloutQueue | None = None) -> StepRecord:
    cfg, actors = ctx.cfg, ctx.actors
    timer, totals, t0 = StageTimer(), GenTotals(), time.perf_counter()
    ro, rewards, group_weight, stats = collect_groups(ctx, sampler, step, timer, totals, queue)
    stale = stats.pop("stale_groups_dropped")
    G = cfg.generation.num_generations_per_prompt
    with timer("prep"):
        adv = compute_advantages(cfg.algo.advantage, rewards, cfg.algo.normalize_std).flatten()  # [N]
        weight = group_weight.repeat_interleave(G)  # [N]
        if cfg.algo.overlong_filter:
            weight = weight * overlong_mask(torch.tensor(ro.truncated))
        batch = build_train_batch(ro, adv, weight, ctx.tokenizer.pad_token_id)
    if recompute_logprobs(cfg):
        with timer("logprob"):
            batch.old_logprobs, batch.ref_logprobs = wait(actors.lp("compute_logprobs", batch), actors.timeout_s,
                                                          abort=lambda: ctx.stop.preempt)
    draft_call = None
    if actors.draft_trainer is not None:
        # the features go from the log-prob workers to the DraftTrainer through the object store;
        # it trains while the learner does
        feats = [h.take_features.remote() for h in actors.logprobs]
        draft_call = actors.call(actors.draft_trainer, "draft_trainer", "update",
                                 cfg.speculation.online.steps_per_rl_step, *feats)
    with timer("train"):
        world = len(actors.learners)
        num_tokens, num_seqs = float(batch.loss_mask.sum()), float((weight > 0).sum())
        shards = [(batch.shard(r, world), num_tokens, num_seqs) for r in range(world)]
        per_rank = wait(actors.learn_sharded("train_step", shards), actors.timeout_s)
        metrics = {}
        for r in per_rank:  # partial sums over global denominators
            metrics = merge_weight_sums(metrics, r[0])
        metrics.update(per_rank[0][1])
    version = step
    if queue is not None:
        queue.before_refit(timer)
    with timer("train"):
        refit_t0 = time.perf_counter()
        to_generator, others = actors.refit(version)
        if queue is None:
            wait([*to_generator, *others], actors.timeout_s)
        else:
            queue.refit(to_generator, others)
        refit_s = time.perf_counter() - refit_t0
    draft = {} if draft_call is None else online_draft(ctx, draft_call, step, version, ro.policy_version, timer)
    # sampler vs trainer log-probs of the sampled tokens, summed by the learners over their forward
    # passes (the current weights, which are also what a recompute would use)
    mismatch = metrics.pop("mismatch_sum", 0.0) / max(metrics.pop("mismatch_tokens", 0.0), 1.0)
    iw = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith("iw_")]}  # offpolicy.weight_sums
    step_s = time.perf_counter() - t0
    spec = totals.spec
    exposed = timer.seconds["generation"]
    return StepRecord(
        step=step, policy_version=version, loss=metrics["loss"], reward_mean=rewards.mean().item(),
        accuracy=(rewards == 1).float().mean().item(), stage_seconds=dict(timer.seconds), step_seconds=step_s,
        generated_tokens=totals.tokens, tokens_per_second=totals.tokens / max(totals.seconds, 1e-9),
        logprob_mismatch=mismatch, engine_seconds=totals.seconds, exposed_generation_seconds=exposed,
        overlap_fraction=max(0.0, 1.0 - exposed / totals.seconds) if totals.seconds > 0 else 0.0,
        policy_lag_max=step - 1 - ro.policy_version, stale_groups_dropped=stale,
        importance_weight=weight_stats(iw) if iw else {},
        acceptance_length=None if spec is None else spec.acceptance_length,
        spec=None if spec is None else {"drafts": spec.drafts, "drafted_tokens": spec.draft_tokens,
                                        "accepted_tokens": spec.accepted_tokens,
                                        "acceptance_per_pos": spec.acceptance_per_pos,
                                        **({} if totals.draft_schedule is None else
                                           {"draft_schedule": totals.draft_schedule})},
        extra={**{f"train/{k}": v for k, v in metrics.items()}, **stats, **draft, "refit_seconds": refit_s,
               "response_length": ro.num_tokens / len(ro.response_ids),
               "truncated_frac": sum(ro.truncated) / len(ro.truncated),
               "behaviour_version": float(ro.policy_version)},
        decode_step_moments=totals.decode_moments)


def online_draft(ctx: Context, call, step: int, version: int, rollout_version: int, timer: StageTimer) -> dict:
    """Finish the DraftTrainer's step; every push_every steps push its head into the Generator.
    Metrics: draft/head_version (the head the Generator drafted this step's rollouts with: the
    step of its last push, 0 = the initial head), draft/staleness (policy versions between those
    rollouts and the newest data that head trained on), draft/pushed (a new head goes in after
    this step: this step's acceptance is the 'before', the next step's the 'after')."""
    c, o = ctx.counters, ctx.cfg.speculation.online
    head_version, head_data = c.get("draft_head_version", 0), c.get("draft_head_data_version", 0)
    t0 = time.perf_counter()
    with timer("train"):  # the draft trains beside the learner; what is left of it is exposed here
        st = wait(call, ctx.actors.timeout_s)
        pushed = step % o.push_every == 0 and bool(st)
        if pushed:
            head = ctx.actors.call(ctx.actors.draft_trainer, "draft_trainer", "weights")
            wait([head, ctx.actors.gen("push_draft_weights", head.ref, version)], ctx.actors.timeout_s)
            c["draft_head_version"], c["draft_head_data_version"] = version, st["newest_version"]
    return {"draft/head_version": float(head_version), "draft/staleness": float(rollout_version - head_data),
            "draft/pushed": float(pushed), "draft/exposed_seconds": time.perf_counter() - t0,
            **{f"draft/{k}": float(v) for k, v in st.items() if k != "newest_version"}}


def run(ctx: Context) -> dict:
    cfg, t = ctx.cfg, ctx.cfg.trainer
    sampler = PromptSampler(ctx.train, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    start = 1
    if ctx.resume_from is not None:
        state = checkpoint.restore(ctx, sampler, ctx.resume_from)
        start = state.step + 1
        ctx.counters.update({k: v for k, v in state.counters.items() if k != "restarts"})
    else:
        validate(ctx, 0)
    # Async: rollouts run ahead; a checkpoint stores the sampler position before the oldest
    # untrained step (the queue's), so a resume draws those prompts again.
    queue = RolloutQueue(ctx, sampler, start) if cfg.async_grpo.enabled else None
    position = queue or sampler
    for step in range(start, t.max_steps + 1):
        at_start = position.state()
        try:
            rec = train_step(ctx, sampler, step, queue)
        except Abandoned:  # before the update: the step is redone (identically when sync) after the resume
            sampler.load_state(at_start)
            checkpoint.save(ctx, sampler, step - 1, ctx.counters)
            raise Preempted(step - 1, ctx.stop.preempt_signal) from None
        ctx.log.step(rec)
        guard_nonfinite(ctx, position, rec)
        if step == t.max_steps or (t.val_every and step % t.val_every == 0):
            validate(ctx, step)
        if ctx.stop.preempt or ctx.stop.checkpoint_now or (t.checkpoint_every and step % t.checkpoint_every == 0):
            ctx.stop.checkpoint_now = False
            checkpoint.save(ctx, position, step, ctx.counters)
        if ctx.stop.preempt:
            raise Preempted(step, ctx.stop.preempt_signal)
    if queue is not None:
        queue.drain()
        ctx.log.notes["stale_groups_dropped"] = queue.stale_groups
    return ctx.log.summary()


def guard_nonfinite(ctx: Context, sampler: PromptSampler, rec: StepRecord) -> None:
    """Count updates the learner skipped for a non-finite loss or gradient; past
    trainer.max_nonfinite_steps in a row, checkpoint (weights are still the last good ones) and stop."""
    c = ctx.counters
    skipped = rec.extra.get("train/skipped", 0.0) > 0
    c["nonfinite_steps"] += int(skipped)
    c["nonfinite_in_row"] = c["nonfinite_in_row"] + 1 if skipped else 0
    ctx.log.notes["nonfinite_steps"] = c["nonfinite_steps"]
    if skipped:
        ctx.log.write(f"step {rec.step}: non-finite loss or gradient, update skipped "
                      f"({c['nonfinite_in_row']} in a row, {c['nonfinite_steps']} in all)")
    if c["nonfinite_in_row"] > ctx.cfg.trainer.max_nonfinite_steps:
        path = checkpoint.save(ctx, sampler, rec.step, c)
        ctx.log.write_summary()  # with this step's count: the run ends here
        raise NumericalDivergence(f"{c['nonfinite_in_row']} non-finite updates in a row (more than "
                                  f"trainer.max_nonfinite_steps={ctx.cfg.trainer.max_nonfinite_steps}); "
                                  f"last good state in {path}")
