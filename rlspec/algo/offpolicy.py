"""Off-policy correction for rollouts sampled by older weights (async GRPO, policy lag >= 1).

Three policies meet in a lagged update: pi_behav sampled the tokens (its log-probs come from the
Generator, exact under lossless speculation), pi_prox is the learner's policy when the step begins
(the LogprobWorker's recompute, `old_logprobs`), and pi_theta is the one being optimised. The PPO
ratio is always pi_theta / pi_prox (losses.py); this module gives the per-token behaviour weight
w = pi_prox / pi_behav that multiplies the policy-gradient term:

- decoupled_ppo (AReaL, arXiv 2505.24298): w as is; tokens with w > cap carry no loss.
- tis (truncated importance sampling): min(w, cap); every token keeps its loss.
- none: w = 1 (plain PPO against pi_prox).
"""
from __future__ import annotations

import torch

CORRECTIONS = ("none", "decoupled_ppo", "tis")


def importance_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor) -> torch.Tensor:
    """[B, T] pi_prox / pi_behav of each sampled token (log-ratio clamped to +-20)."""
    return torch.exp((prox_logp - behav_logp).clamp(-20.0, 20.0))


def behaviour_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                      method: str, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [B, T], mask [B, T]): the factor on each token's policy-gradient term and the
    tokens that keep their loss. Both are zero off `mask`."""
    m = mask.float()
    if method == "none":
        return m, m
    w = importance_weights(prox_logp, behav_logp) * m
    if method == "decoupled_ppo":
        keep = m * (w <= cap).float()
        return w * keep, keep
    if method == "tis":
        return w.clamp(max=cap), m
    raise ValueError(f"unknown off-policy correction {method!r}; choose from {CORRECTIONS}")


def weight_stats(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                 cap: float) -> dict[str, float]:
    """Importance-weight figures over the loss-carrying tokens: mean, max, fraction above cap."""
    sel = mask != 0
    if not sel.any():
        return {"mean": 1.0, "max": 1.0, "capped_frac": 0.0}
    w = importance_weights(prox_logp, behav_logp)[sel]
    return {"mean": w.mean().item(), "max": w.max().item(), "capped_frac": (w > cap).float().mean().item()}
