"""One GRPO step, its five stages timed:

    data -> generation -> prep (rewards, advantages, batch) -> logprob -> train (+ refit)

Synchronous: the step's prompts are generated on the spot with the current weights. Async: the
first round of rollouts comes from the RolloutQueue (rlspec/loops/queue.py), sampled by weights up
to async_grpo.max_policy_lag versions old. Dynamic sampling's extra rounds, the advantages, the
update and the refit are the same either way."""
from __future__ import annotations

import time

import torch

from rlspec.algo import compute_advantages, merge_weight_sums, overlong_mask, weight_stats, zero_variance_groups
from rlspec.algo.batching import build_train_batch, gradient_rows, shard_rows
from rlspec.cluster.calls import Call, wait
from rlspec.data.loading import PromptSampler
from rlspec.loops.queue import RolloutQueue
from rlspec.loops.partial import PartialRollouts
from rlspec.loops.rollouts import GenTotals, generate, generate_partial, rewards, step_seed
from rlspec.loops.runlog import StageTimer
from rlspec.loops.state import Counters, Run
from rlspec.messages import MiniBatch, RolloutBatch, StepRecord, TrainBatch


def collect_groups(run: Run, sampler: PromptSampler, step: int, timer: StageTimer, totals: GenTotals,
                   queue: RolloutQueue | None = None, partial: PartialRollouts | None = None):
    """One step's rollouts [P*G] and rewards [P, G], with dynamic sampling when enabled: groups
    whose rewards all agree are replaced by fresh prompts for up to max_rounds extra rounds; if the
    batch still is not full, dropped groups fill it with sample weight 0 (kept for shape only).
    Under async GRPO the first round comes from the rollout queue; extra rounds use the weights the
    Generator has then. With partial rollouts every round is a partial call (carried groups first);
    under async GRPO the extra rounds are whole calls (the queue's next partial call holds the carry)."""
    cfg = run.cfg
    P, G = cfg.generation.num_prompts_per_step, cfg.generation.num_generations_per_prompt
    stats = {"groups_dropped": 0.0, "sampling_rounds": 1.0, "stale_groups_dropped": 0}

    def fresh_round(rnd: int):
        seed = step_seed(cfg.trainer.seed, step, rnd)
        if partial is not None and queue is None:
            return generate_partial(run, partial, seed, timer, totals)
        with timer("data"):
            prompts = sampler.next_batch(P)
        return (prompts, *generate(run, prompts, seed, timer, totals))

    if queue is None:
        prompts, ro, rw = fresh_round(0)
    else:
        prompts, ro, stats["stale_groups_dropped"] = queue.take(step, timer)
        rw = rewards(run, prompts, ro, timer, totals)
    if not cfg.algo.dynamic_sampling:
        return ro, rw, torch.ones(P), stats
    keep, spare = [], []
    for rnd in range(cfg.algo.dynamic_sampling_max_rounds + 1):
        if rnd:
            prompts, ro, rw = fresh_round(rnd)
            stats["sampling_rounds"] += 1
        flat = zero_variance_groups(rw)
        for i in range(P):
            (spare if flat[i] else keep).append((ro.select(list(range(i * G, (i + 1) * G))), rw[i]))
        if len(keep) >= P:
            break
    stats["groups_dropped"] = float(len(spare))
    weight = torch.tensor([1.0] * min(len(keep), P) + [0.0] * max(P - len(keep), 0))
    chosen = (keep + spare)[:P]
    # rounds sample other weights (async: the queue's round is older) or carry answers of other
    # versions (partial rollouts): their batches hold several versions
    ro = RolloutBatch.concat([c[0] for c in chosen], mixed_versions=queue is not None or partial is not None)
    return ro, torch.stack([c[1] for c in chosen]), weight, stats


def mini_batches(batch: TrainBatch, weight: torch.Tensor, size: int | None, world: int,
                 live: torch.Tensor | None = None, micro_batch_size: int | None = None) -> list[list[MiniBatch]]:
    """Per learner rank, the rollout batch's mini-batches of `size` consecutive samples (None: one),
    each sharded over the ranks with its own loss denominators (over all ranks). live: [N] bool,
    the rows whose loss can move the weights (batching.gradient_rows; None: all): the others stay
    in the denominators but are not sent, save the few that keep every rank's micro-batch count
    equal (batching.shard_rows), whose loss mask is zeroed so they add to no sum."""
    size = size or len(batch)
    live = torch.ones(len(batch), dtype=torch.bool) if live is None else live
    out: list[list[MiniBatch]] = [[] for _ in range(world)]
    for lo in range(0, len(batch), size):
        part, w, ok = batch.rows(slice(lo, lo + size)), weight[lo:lo + size], live[lo:lo + size]
        tokens, seqs = float(part.loss_mask.sum()), float((w > 0).sum())
        if ok.all():
            for r in range(world):
                out[r].append(MiniBatch(part.shard(r, world), tokens, seqs))
            continue
        per_rank = len(part) // world
        rows, pads, m = shard_rows(ok, part.attention_mask.sum(dim=1), world, micro_batch_size or per_rank)
        trained_tokens, trained_seqs = float(part.loss_mask[ok].sum()), float((w[ok] > 0).sum())
        for r in range(world):
            mine = part.rows(rows[r])
            mine.loss_mask[len(rows[r]) - len(pads[r]):] = 0.0
            out[r].append(MiniBatch(mine, tokens, seqs, m, trained_tokens, trained_seqs))
    return out


def train_step(run: Run, counters: Counters, sampler: PromptSampler, step: int,
               queue: RolloutQueue | None = None, partial: PartialRollouts | None = None,
               checkpoint_due=lambda: False) -> StepRecord:
    """One step. Async: checkpoint_due() (asked at the refit) true holds the queue's next calls
    back until the loop has saved its checkpoint and called queue.fill()."""
    cfg, actors = run.cfg, run.actors
    timer, totals, t0 = StageTimer(), GenTotals(), time.perf_counter()
    ro, rw, group_weight, stats = collect_groups(run, sampler, step, timer, totals, queue, partial)
    stale = stats.pop("stale_groups_dropped")
    G = cfg.generation.num_generations_per_prompt
    if cfg.logging.save_rollouts:
        run.log.save_rollouts(step, ro.prompt_ids, ro.response_ids, rw.flatten().tolist(), G)
    with timer("prep"):
        adv = compute_advantages(cfg.algo.advantage, rw, cfg.algo.normalize_std).flatten()  # [N]
        weight = group_weight.repeat_interleave(G)  # [N]
        if cfg.algo.overlong_filter:
            weight = weight * overlong_mask(torch.tensor(ro.truncated))
        batch = build_train_batch(ro, adv, weight, run.tokenizer.pad_token_id)
    if cfg.algo.recompute_logprobs:
        with timer("logprob"):
            batch.old_logprobs, batch.ref_logprobs = wait(actors.logprobs.compute_logprobs(batch), actors.timeout_s,
                                                          abort=lambda: run.stop.preempt)
    draft_call = None
    if actors.draft_trainer is not None:
        # the features go from the log-prob workers to the DraftTrainer through the object store;
        # it trains while the learner does
        draft_call = actors.draft_trainer.update(cfg.speculation.online.steps_per_rl_step,
                                                 actors.logprobs.take_features())
    live = (gradient_rows(batch.advantages, weight, cfg.algo.loss, cfg.algo.kl_coef)
            if cfg.trainer.skip_zero_gradient_rows else torch.ones(len(batch), dtype=torch.bool))
    with timer("train"):
        parts = mini_batches(batch, weight, cfg.trainer.mini_batch_size, len(actors.learners), live,
                             cfg.trainer.micro_batch_size)
        per_rank = wait(actors.learners.train_step(parts, cfg.trainer.ppo_epochs), actors.timeout_s)
        metrics = {}
        for r in per_rank:  # partial sums over global denominators
            metrics = merge_weight_sums(metrics, r[0])
        metrics.update(per_rank[0][1])
        metrics["rows_skipped"] = 1.0 - float(live.float().mean())
    version = step
    if queue is not None:
        queue.before_refit(timer)
    with timer("train"):
        refit_t0 = time.perf_counter()
        to_generator, others = actors.refit.calls(version)
        if queue is None:
            wait([*to_generator, *others], actors.timeout_s)
        else:
            queue.refit(to_generator, others, fill=not checkpoint_due())
        refit_s = time.perf_counter() - refit_t0
    draft = {} if draft_call is None else online_draft(run, counters, draft_call, step, version, ro.policy_version,
                                                       timer)
    # every call counts its resumed, carried and new tokens; partial rollouts' are logged
    counts = {f"partial/{k}": float(v) for k, v in (totals.partial or {}).items()} if partial is not None else {}
    return step_record(step, version, ro, rw, timer, totals, metrics,
                       {**stats, **draft, "refit_seconds": refit_s, **counts}, time.perf_counter() - t0, stale)


def step_record(step: int, version: int, ro: RolloutBatch, rw: torch.Tensor, timer: StageTimer, totals: GenTotals,
                metrics: dict, extra: dict, step_s: float, stale: int) -> StepRecord:
    """The step's record (summary.json, wandb) from what its stages measured: the rollouts and
    their rewards rw [P, G], the stage times, the generation totals, the learners' summed metrics
    (their sampler-mismatch and importance-weight sums are folded here), and `extra` (the groups'
    statistics, the online draft's, the refit time)."""
    # sampler vs trainer log-probs of the sampled tokens, summed by the learners over their forward
    # passes (the current weights, which are also what a recompute would use)
    mismatch = metrics.pop("mismatch_sum", 0.0) / max(metrics.pop("mismatch_tokens", 0.0), 1.0)
    iw = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith("iw_")]}  # offpolicy.weight_sums
    spec = totals.spec
    exposed = timer.seconds["generation"]
    return StepRecord(
        step=step, policy_version=version, loss=metrics["loss"], reward_mean=rw.mean().item(),
        accuracy=(rw == 1).float().mean().item(), stage_seconds=dict(timer.seconds), step_seconds=step_s,
        generated_tokens=totals.tokens, tokens_per_second=totals.tokens / max(totals.seconds, 1e-9),
        logprob_mismatch=mismatch, engine_seconds=totals.seconds, exposed_generation_seconds=exposed,
        overlap_fraction=max(0.0, 1.0 - exposed / totals.seconds) if totals.seconds > 0 else 0.0,
        policy_lag_max=step - 1 - ro.policy_version, stale_groups_dropped=stale,
        importance_weight=weight_stats(iw) if iw else {},
        acceptance_length=None if spec is None else spec.acceptance_length,
        spec=None if spec is None else {"drafts": spec.drafts, "drafted_tokens": spec.draft_tokens,
                                        "accepted_tokens": spec.accepted_tokens,
                                        "acceptance_per_pos": spec.acceptance_per_pos,
                                        **{f"history_{k}": v for k, v in (totals.history or {}).items()},
                                        **({} if totals.draft_schedule is None else
                                           {"draft_schedule": totals.draft_schedule})},
        extra={**{f"train/{k}": v for k, v in metrics.items()}, **extra,
               "response_length": ro.num_tokens / len(ro.response_ids),
               **length_quantiles([len(r) for r in ro.response_ids]),
               "truncated_frac": sum(ro.truncated) / len(ro.truncated),
               "behaviour_version": float(ro.policy_version), **token_lag(step, ro),
               **({} if totals.step_rows is None else
                  {"engine_steps": totals.step_rows[0], "engine_step_rows": totals.step_rows[1]})},
        decode_step_moments=totals.decode_moments)


def token_lag(step: int, ro: RolloutBatch) -> dict[str, float]:
    """Policy lag per trained token (step - 1 - the version that sampled it), its mean; partial
    rollouts mix versions within an answer (the record's policy_lag_max is the oldest token's)."""
    lags = [step - 1 - v for vs in ro.versions() for v in vs]
    return {"policy_lag_mean": sum(lags) / len(lags) if lags else 0.0}


def length_quantiles(lengths: list[int]) -> dict[str, float]:
    """The step's response lengths in tokens: median, 90th percentile and longest (nearest rank)."""
    xs = sorted(lengths)
    at = lambda q: float(xs[min(len(xs) - 1, int(q * len(xs)))])  # noqa: E731
    return {"response_length_p50": at(0.5), "response_length_p90": at(0.9), "response_length_max": float(xs[-1])}


def online_draft(run: Run, counters: Counters, call: Call, step: int, version: int, rollout_version: int,
                 timer: StageTimer) -> dict:
    """Finish the DraftTrainer's step; every push_every steps push its head into the Generator.
    Metrics: draft/head_version (the head the Generator drafted this step's rollouts with: the
    step of its last push, 0 = the initial head), draft/staleness (policy versions between those
    rollouts and the newest data that head trained on), draft/pushed (a new head goes in after
    this step: this step's acceptance is the 'before', the next step's the 'after')."""
    o, actors = run.cfg.speculation.online, run.actors
    head_version, head_data = counters.draft_head_version, counters.draft_head_data_version
    t0 = time.perf_counter()
    with timer("train"):  # the draft trains beside the learner; what is left of it is exposed here
        st = wait(call, actors.timeout_s)
        pushed = step % o.push_every == 0 and bool(st)
        if pushed:
            actors.refit.draft(actors.draft_trainer, version)
            counters.draft_head_version, counters.draft_head_data_version = version, st["newest_version"]
    return {"draft/head_version": float(head_version), "draft/staleness": float(rollout_version - head_data),
            "draft/pushed": float(pushed), "draft/exposed_seconds": time.perf_counter() - t0,
            **{f"draft/{k}": float(v) for k, v in st.items() if k != "newest_version"}}
