"""Cost model of one GRPO step: five stages (data, prep, generation, logprob, train) plus the weight
refit, each from shapes, datasheet figures and a few measured efficiencies.

How it departs from the textbook speedup (1 - a^(k+1)) / ((1 - a)(kc + 1)):
- every forward is priced by a roofline (max of memory and compute time) at the batch it really
  runs, so a verification of k+1 tokens costs more than a decode step once the batch is
  compute-bound, and on an MoE it reads more experts than one token does;
- the KV cache is read once per verification whatever k is, which makes drafts relatively cheap
  on long contexts;
- a synchronous step waits for its longest rollout: the batch drains as sequences finish, and the
  tail runs at low occupancy, where speculation helps most;
- async mode overlaps generation with training (policy lag L) and, for L >= 2, refills finished
  slots from the next batch instead of waiting for the tail.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from rlspec.sim.config import EfficiencyConfig, GPUSpec, ModelShape, SimClusterConfig, SimConfig, SimSpeculationConfig
from rlspec.sim.shapes import (active_params, attn_flops, kv_bytes_per_token, sequence_flops, total_params,
                               weight_bytes_read)

STAGES = ("data", "prep", "generation", "logprob", "train", "refit")


# ---------------------------------------------------------------------------------------------
# Acceptance


def acceptance_per_pos(s: SimSpeculationConfig) -> list[float]:
    """[k] probability that draft position i (1-based) is accepted in a verification (vLLM's
    per-position acceptance: cumulative, since acceptance stops at the first rejection)."""
    if s.method == "none" or s.k == 0:
        return []
    p = list(s.acceptance_per_pos)[: s.k]
    if not p:
        return [s.acceptance_rate ** i for i in range(1, s.k + 1)]
    ratio = p[-1] / p[-2] if len(p) >= 2 and p[-2] > 0 else p[0]
    while len(p) < s.k:
        p.append(p[-1] * ratio)
    return p


def tokens_per_verification(s: SimSpeculationConfig) -> float:
    """Expected tokens a verification emits: accepted drafts plus the target's own token."""
    return 1.0 + sum(acceptance_per_pos(s))


def textbook_speedup(a: float, k: int, c: float) -> float:
    """Leviathan et al.: (1 - a^(k+1)) / ((1 - a)(k c + 1)), a verification costing one target step."""
    tau = k + 1.0 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    return tau / (k * c + 1)


def implied_acceptance_rate(speedup: float, k: int, c: float) -> float:
    """The per-token acceptance a for which the textbook formula gives `speedup` (bisection)."""
    lo, hi = 0.0, 1.0 - 1e-12
    if not textbook_speedup(lo, k, c) <= speedup <= textbook_speedup(hi, k, c):
        raise ValueError(f"speedup {speedup} is out of the textbook range for k={k}, c={c:.3f}")
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if textbook_speedup(mid, k, c) < speedup else (lo, mid)
    return (lo + hi) / 2


def draft_cost_ratio(target: ModelShape, draft: ModelShape | None) -> float:
    """c of the textbook formula in its memory-bound reading: bytes one draft step streams over
    bytes one target step streams, at batch 1."""
    return 0.0 if draft is None else weight_bytes_read(draft, 1) / weight_bytes_read(target, 1)


# ---------------------------------------------------------------------------------------------
# Response lengths


@lru_cache(maxsize=256)
def _lengths(n: int, mean: float, cv: float, cap: int) -> tuple[float, ...]:
    """n lengths, descending, at quantiles (i + 0.5)/n of a lognormal with the given cv, capped at
    `cap`, its median chosen so the capped lengths average `mean`."""
    if cv == 0:
        return tuple([float(min(mean, cap))] * n)
    sigma = math.sqrt(math.log(1 + cv * cv))
    nd = NormalDist()
    sz = sigma * np.array([nd.inv_cdf(1 - (i + 0.5) / n) for i in range(n)])
    capped = lambda log_m: np.minimum(cap, np.exp(log_m + sz))  # noqa: E731
    lo, hi = -10.0, math.log(cap) + 10 * sigma
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if capped(mid).mean() < mean else (lo, mid)
    return tuple(capped(lo).tolist())


def response_lengths(cfg: SimConfig) -> tuple[float, ...]:
    """The step's N response lengths, longest first."""
    w = cfg.workload
    return _lengths(w.num_prompts_per_step * w.num_generations_per_prompt, float(w.mean_response_tokens),
                    float(w.response_length_cv), int(w.max_new_tokens))


# ---------------------------------------------------------------------------------------------
# One forward


def comm_seconds(m: ModelShape, gpu: GPUSpec, g: int, tokens: float) -> float:
    """Tensor/expert-parallel collectives of one forward over an engine of g GPUs: per layer an
    all-reduce after attention and, after the MLP, an all-reduce (dense) or dispatch + combine
    all-to-alls (MoE)."""
    if g <= 1:
        return 0.0
    bw = gpu.nvlink_bandwidth if g <= gpu.nvlink_domain else gpu.network_bandwidth
    msg = tokens * m.hidden_size * m.bytes_per_param
    all_reduce = gpu.collective_latency_s + 2 * (g - 1) / g * msg / bw
    if m.num_experts:
        all_to_all = gpu.collective_latency_s + m.experts_per_token * msg * (g - 1) / g / g / bw
        return m.num_layers * (all_reduce + 2 * all_to_all)
    return m.num_layers * 2 * all_reduce


def forward_seconds(m: ModelShape, gpu: GPUSpec, eff: EfficiencyConfig, g: int, seqs: float, q: float,
                    context: float) -> float:
    """One engine forward: `seqs` sequences x `q` new tokens each, attending to `context` cached
    tokens on average, on an engine of g GPUs (weights and KV split over them)."""
    if seqs <= 0:
        return 0.0
    tokens = seqs * q
    kv_replicas = max(1.0, g / m.num_kv_heads)  # TP wider than the KV heads replicates them
    mem = (weight_bytes_read(m, tokens) + seqs * context * kv_bytes_per_token(m) * kv_replicas) / g
    flops = tokens * (2.0 * active_params(m) + attn_flops(m, context)) / g
    roofline = max(mem / (gpu.hbm_bandwidth * eff.hbm), flops / (gpu.peak_flops * eff.decode_flops))
    return roofline + comm_seconds(m, gpu, g, tokens) + eff.forward_overhead_s


def verification_seconds(cfg: SimConfig, seqs: float, context: float, tau: float) -> float:
    """One speculative step for `seqs` sequences: k draft forwards (the first over the tokens the
    last verification emitted) and one target forward over k+1 tokens. k=0: a decode step."""
    s, m, g = cfg.spec, cfg.model, cfg.cluster.gen_tp
    k = s.k if s.method != "none" else 0
    t = forward_seconds(m.target, cfg.gpu, cfg.eff, g, seqs, k + 1, context)
    if k and s.method in ("eagle3", "mtp", "draft_model"):
        t += forward_seconds(m.draft, cfg.gpu, cfg.eff, g, seqs, tau, context)
        t += (k - 1) * forward_seconds(m.draft, cfg.gpu, cfg.eff, g, seqs, 1, context)
    return t


# ---------------------------------------------------------------------------------------------
# Generation


@dataclass
class RolloutEstimate:
    seconds: float
    verifications: float          # engine steps of the slowest engine (or per batch, continuous)
    tokens_per_verification: float
    mean_occupancy: float         # active sequences per engine step, averaged over steps
    seqs_per_engine: float
    kv_peak_bytes: float          # per GPU
    warnings: list[str] = field(default_factory=list)


def _engines(cfg: SimConfig) -> int:
    c = cfg.cluster
    gpus = c.gen_gpus if c.mode == "async" else c.num_gpus
    return max(1, gpus // c.gen_tp)


def rollout_tail(cfg: SimConfig) -> RolloutEstimate:
    """A batch generated to completion: the slowest engine (it holds the longest rollout) runs
    prefill, then decodes while its batch drains as sequences finish."""
    w, m, g = cfg.workload, cfg.model.target, cfg.cluster.gen_tp
    tau = tokens_per_verification(cfg.spec)
    lengths = response_lengths(cfg)[:: _engines(cfg)]  # engine 0's share, longest first
    P, B = float(w.prompt_tokens), len(lengths)
    t = forward_seconds(m, cfg.gpu, cfg.eff, g, B, P, P / 2)  # prefill
    steps = occupancy = done = 0.0
    active, kv_peak = B, 0.0
    for length in reversed(lengths):  # shortest first: each boundary retires one sequence
        if length > done:
            n = (length - done) / tau
            t += n * verification_seconds(cfg, active, P + (done + length) / 2, tau)
            steps, occupancy = steps + n, occupancy + n * active
        kv_peak = max(kv_peak, active * (P + length))
        done, active = max(done, length), active - 1
    kv_per_gpu = kv_peak * kv_bytes_per_token(m) / g
    return _finish(cfg, t, steps, tau, occupancy / max(steps, 1e-9), B, kv_per_gpu)


def rollout_continuous(cfg: SimConfig) -> RolloutEstimate:
    """Async with lag L >= 2: every engine keeps its slots full by starting later batches'
    prompts as sequences finish, so a batch costs its share of steady-state throughput. This is
    NeMo RL's async collector (the paper's system): it admits num_prompts_per_step x
    max_trajectory_age_steps groups, so up to L batches are in flight, and when generation is the
    slower side the engines stay at that cap, each holding L x (batch / engines) sequences.
    rlspec's own queue generates one whole batch per call, which is the lag-1 model at any lag."""
    w, m, g = cfg.workload, cfg.model.target, cfg.cluster.gen_tp
    tau = tokens_per_verification(cfg.spec)
    lengths = response_lengths(cfg)
    L = cfg.cluster.policy_lag
    B = len(lengths) / _engines(cfg)  # one batch's sequences per engine
    mean = sum(lengths) / len(lengths)
    # A slot's context at a random step is length-biased: E[l^2] / (2 E[l]) generated tokens on average.
    age = sum(x * x for x in lengths) / len(lengths) / (2 * mean)
    P = float(w.prompt_tokens)
    # Each step advances L*B slots by tau tokens: a batch's B*mean tokens take mean / (tau L) steps.
    steps = mean / (tau * L)
    t = steps * verification_seconds(cfg, L * B, P + age, tau)
    t += forward_seconds(m, cfg.gpu, cfg.eff, g, B, P, P / 2)  # the batch's prefills
    kv_per_gpu = L * B * (P + 2 * age) * kv_bytes_per_token(m) / g
    return _finish(cfg, t, steps, tau, L * B, B, kv_per_gpu)


def rollout_partial(cfg: SimConfig, calls: int = 12, warm_up: int = 4, seed: int = 0) -> RolloutEstimate:
    """Partial rollouts on one engine (its share of the step's groups, P_e): every call holds
    ceil(over_provision x P_e) groups, carried ones first, and returns once P_e groups are complete
    (a group when all its answers are); the unfinished answers are resumed by the next call, whose
    prefill covers prompt + answer so far. With workload.partial_refill each group completed before
    the P_e-th starts a new one at once (its prompts prefilled). Between completions every running
    answer advances tau tokens a verification, at the running batch's cost. Lengths are drawn
    (seeded) from the step's length distribution (`response_lengths`); the estimate is the mean of
    calls after `warm_up`."""
    w, m, g = cfg.workload, cfg.model.target, cfg.cluster.gen_tp
    tau = tokens_per_verification(cfg.spec)
    G, P = w.num_generations_per_prompt, float(w.prompt_tokens)
    need = max(1, round(w.num_prompts_per_step / _engines(cfg)))
    hold = max(need, math.ceil(need * w.partial_over_provision))
    pool = np.array(response_lengths(cfg))
    rng = np.random.default_rng(seed)
    groups: list[tuple[np.ndarray, np.ndarray]] = []  # per group: target lengths [G], tokens so far [G]
    seconds, steps, occupancy, kv_peak = [], [], [], 0.0
    for c in range(calls):
        while len(groups) < hold:
            groups.append((rng.choice(pool, G), np.zeros(G)))
        total = np.concatenate([t for t, _ in groups])
        done = np.concatenate([d for _, d in groups])
        gid = np.repeat(np.arange(len(groups)), G)
        so_far = done[done < total]  # every unfinished answer is prefilled: its prompt and answer so far
        q = P + (so_far.mean() if len(so_far) else 0.0)
        t = forward_seconds(m, cfg.gpu, cfg.eff, g, len(so_far), q, q / 2)
        n_steps = occ = 0.0
        complete = np.array([bool((d >= tt).all()) for tt, d in groups])
        while complete.sum() < need:
            run = done < total
            left = (total - done)[run]
            adv = left.min()  # tokens until the next answer ends
            n = adv / tau
            active = int(run.sum())
            t += n * verification_seconds(cfg, active, P + done[run].mean() + adv / 2, tau)
            n_steps, occ = n_steps + n, occ + n * active
            kv_peak = max(kv_peak, float((P + np.minimum(done + adv, total))[run].sum()))
            done = np.where(run, np.minimum(done + adv, total), done)
            ended = np.bincount(gid, weights=(done >= total), minlength=len(groups))
            was, complete = int(complete.sum()), ended >= G
            for _ in range(min(int(complete.sum()) - was, need - int(complete.sum())) if w.partial_refill else 0):
                groups.append((rng.choice(pool, G), np.zeros(G)))
                total, done = np.concatenate([total, groups[-1][0]]), np.concatenate([done, groups[-1][1]])
                gid = np.concatenate([gid, np.full(G, len(groups) - 1)])
                complete = np.append(complete, False)
                t += forward_seconds(m, cfg.gpu, cfg.eff, g, G, P, P / 2)
        returned = set(np.flatnonzero(complete)[:need].tolist())
        groups = [(tt, done[i * G:(i + 1) * G]) for i, (tt, _) in enumerate(groups) if i not in returned]
        if c >= warm_up:
            seconds.append(t)
            steps.append(n_steps)
            occupancy.append(occ / max(n_steps, 1e-9))
    kv_per_gpu = kv_peak * kv_bytes_per_token(m) / g
    return _finish(cfg, float(np.mean(seconds)), float(np.mean(steps)), tau, float(np.mean(occupancy)),
                   float(hold * G), kv_per_gpu)


def _finish(cfg, seconds, steps, tau, occupancy, seqs, kv_per_gpu) -> RolloutEstimate:
    est = RolloutEstimate(seconds, steps, tau, occupancy, seqs, kv_per_gpu)
    room = cfg.gpu.hbm_capacity - total_params(cfg.model.target) * cfg.model.target.bytes_per_param / cfg.cluster.gen_tp
    if kv_per_gpu > 0.9 * room:
        est.warnings.append(f"KV cache peak {kv_per_gpu / 2**30:.0f} GiB/GPU exceeds the "
                            f"{0.9 * room / 2**30:.0f} GiB left after weights: engines would preempt")
    return est


def rollout(cfg: SimConfig) -> RolloutEstimate:
    c = cfg.cluster
    if cfg.workload.partial_over_provision >= 1:
        return rollout_partial(cfg)
    return rollout_continuous(cfg) if c.mode == "async" and c.policy_lag >= 2 else rollout_tail(cfg)


# ---------------------------------------------------------------------------------------------
# Log-prob recompute, training, refit


def _train_gpus(c: SimClusterConfig) -> int:
    return c.num_gpus - c.gen_gpus if c.mode == "async" else c.num_gpus


def batch_flops(cfg: SimConfig) -> float:
    """Forward FLOPs over the step's N prompt+response sequences, packed or padded."""
    w, m = cfg.workload, cfg.model.target
    lengths = response_lengths(cfg)
    P = float(w.prompt_tokens)
    if w.padded:  # every row as long as the longest
        longest = P + lengths[0]
        return len(lengths) * sequence_flops(m, longest, longest * longest)
    mean = P + sum(lengths) / len(lengths)
    mean_sq = sum((P + x) ** 2 for x in lengths) / len(lengths)
    return len(lengths) * sequence_flops(m, mean, mean_sq)


def logprob_seconds(cfg: SimConfig) -> float:
    if not cfg.workload.recompute_logprobs:
        return 0.0
    passes = 2 if cfg.workload.kl_reference else 1
    return passes * batch_flops(cfg) / (_train_gpus(cfg.cluster) * cfg.gpu.peak_flops * cfg.eff.logprob_mfu)


def train_seconds(cfg: SimConfig) -> float:
    """Forward + backward: 3x the forward FLOPs."""
    return 3 * batch_flops(cfg) / (_train_gpus(cfg.cluster) * cfg.gpu.peak_flops * cfg.eff.train_mfu)


def refit_seconds(cfg: SimConfig) -> float:
    """Every generation GPU receives its 1/gen_tp shard of the new weights. Colocated (sync) the
    copy stays on the NVLink domain; async pools wider than one domain go over the network."""
    c, m, g = cfg.cluster, cfg.model, cfg.gpu
    params = total_params(m.target) * m.target.bytes_per_param
    if cfg.spec.refit_draft and m.draft is not None and cfg.spec.method != "none":
        params += total_params(m.draft) * m.draft.bytes_per_param
    over_network = c.mode == "async" and c.num_gpus > g.nvlink_domain
    bw = g.network_bandwidth if over_network else g.nvlink_bandwidth
    return params / c.gen_tp / (bw * cfg.eff.link) + cfg.eff.refit_overhead_s


# ---------------------------------------------------------------------------------------------
# One step


@dataclass
class StepEstimate:
    stage_seconds: dict[str, float]
    step_seconds: float
    # Generation time the step waits for beyond the trainer's work (= generation when sync).
    exposed_generation: float
    rollout: RolloutEstimate


def step(cfg: SimConfig) -> StepEstimate:
    n = cfg.workload.num_prompts_per_step * cfg.workload.num_generations_per_prompt
    ro = rollout(cfg)
    st = {"data": 0.0, "prep": n * cfg.eff.prep_s_per_sample, "generation": ro.seconds,
          "logprob": logprob_seconds(cfg), "train": train_seconds(cfg), "refit": refit_seconds(cfg)}
    if cfg.cluster.mode == "sync":
        total = sum(st.values())
        return StepEstimate(st, total, st["generation"], ro)
    gen_side = st["generation"] + st["refit"]  # engines pause while new weights load
    train_side = st["data"] + st["prep"] + st["logprob"] + st["train"]
    return StepEstimate(st, max(gen_side, train_side), max(0.0, gen_side - train_side), ro)


def without_speculation(cfg: SimConfig) -> SimConfig:
    return replace(cfg, spec=replace(cfg.spec, method="none", k=0))


@dataclass
class Comparison:
    baseline: StepEstimate
    speculative: StepEstimate

    @property
    def rollout_speedup(self) -> float:
        return self.baseline.rollout.seconds / self.speculative.rollout.seconds

    @property
    def step_speedup(self) -> float:
        return self.baseline.step_seconds / self.speculative.step_seconds


def compare(cfg: SimConfig) -> Comparison:
    return Comparison(step(without_speculation(cfg)), step(cfg))


def infer_mean_response(cfg: SimConfig, generation_seconds: float) -> float:
    """The mean response length for which the baseline (no speculation) generation stage takes
    `generation_seconds`: how a scenario's workload is read off a measured baseline when the
    lengths themselves were not reported."""
    base = without_speculation(cfg)
    gen = lambda mean: step(replace(base, workload=replace(base.workload, mean_response_tokens=mean))  # noqa: E731
                            ).stage_seconds["generation"]
    lo, hi = 1.0, float(cfg.workload.max_new_tokens)
    if not gen(lo) <= generation_seconds <= gen(hi):
        raise ValueError(f"{generation_seconds}s is outside [{gen(lo):.1f}, {gen(hi):.1f}]s for this config")
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gen(mid) < generation_seconds else (lo, mid)
    return (lo + hi) / 2
