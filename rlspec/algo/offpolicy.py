"""Off-policy correction for rollouts sampled by older weights (async GRPO, policy lag >= 1).

Three policies meet in a lagged update: pi_behav sampled the tokens (its log-probs come from the
Generator, exact under lossless speculation), pi_prox is the learner's policy when the step begins
(the learner's own forward pass, detached, or the LogprobWorker's recompute, `old_logprobs`,
when one runs), and pi_theta is the one being optimised. The PPO
ratio is always pi_theta / pi_prox (losses.py); this module gives the per-token behaviour weight
w = pi_prox / pi_behav that multiplies the policy-gradient term:

- decoupled_ppo (AReaL, arXiv 2505.24298): w as is; tokens with w > cap carry no loss.
- tis (truncated importance sampling): min(w, cap); every token keeps its loss.
- none: w = 1 (plain PPO against pi_prox).

behaviour_ppo takes the ratio against pi_behav instead (`ratio_reference`), with weight 1: the
ratio then starts at pi_prox / pi_behav, and PPO's clip stops pushing a token further once the
weights since the sampler have already moved it past the clip range in its advantage's
direction, a trust region measured from the policy that sampled the batch.
"""
from __future__ import annotations

import torch

CORRECTIONS = ("none", "decoupled_ppo", "tis", "behaviour_ppo")


def importance_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor) -> torch.Tensor:
    """[B, T] pi_prox / pi_behav of each sampled token (log-ratio clamped to +-20)."""
    return torch.exp((prox_logp - behav_logp).clamp(-20.0, 20.0))


def ratio_reference(prox_logp: torch.Tensor, behav_logp: torch.Tensor, method: str) -> torch.Tensor:
    """[B, T] log-probs the PPO ratio is taken against: pi_behav for behaviour_ppo, else pi_prox."""
    return behav_logp if method == "behaviour_ppo" else prox_logp


def behaviour_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                      method: str, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [B, T], mask [B, T]): the factor on each token's policy-gradient term and the
    tokens that keep their loss. Both are zero off `mask`."""
    m = mask.float()
    if method in ("none", "behaviour_ppo"):
        return m, m
    w = importance_weights(prox_logp, behav_logp) * m
    if method == "decoupled_ppo":
        keep = m * (w <= cap).float()
        return w * keep, keep
    if method == "tis":
        return w.clamp(max=cap), m
    raise ValueError(f"unknown off-policy correction {method!r}; choose from {CORRECTIONS}")


def weight_sums(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                cap: float) -> dict[str, float]:
    """Partial importance-weight figures over the loss-carrying tokens of one micro-batch, to be
    added up (iw_max: maxed) over micro-batches and ranks, then given to weight_stats."""
    w, m = importance_weights(prox_logp, behav_logp), mask != 0  # masked reductions: no device sync to index
    n = float(m.sum())
    return {"iw_sum": float(w.masked_fill(~m, 0.0).sum()),
            "iw_max": float(w.masked_fill(~m, float("-inf")).max()) if n else 0.0,
            "iw_capped": float(((w > cap) & m).sum()), "iw_tokens": n}


def merge_weight_sums(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: max(a.get(k, 0.0), v) if k == "iw_max" else a.get(k, 0.0) + v for k, v in b.items()}


def weight_stats(sums: dict[str, float]) -> dict[str, float]:
    """Mean, max and fraction above the cap of pi_prox / pi_behav, from merged weight_sums."""
    n = sums.get("iw_tokens", 0.0)
    if not n:
        return {"mean": 1.0, "max": 1.0, "capped_frac": 0.0}
    return {"mean": sums["iw_sum"] / n, "max": sums["iw_max"], "capped_frac": sums["iw_capped"] / n}
