"""Policy losses: the PPO clipped surrogate as GRPO/DAPO use it.

Departures from the textbook PPO: the clip range is asymmetric (clip-higher, DAPO arXiv 2503.14476:
ratio clipped to [1 - clip_low, 1 + clip_high]); the loss is averaged over every response token of
the whole batch ('token_mean', DAPO) rather than per sequence, and the denominator is the *global*
token count passed in, so micro-batches add up to exactly the full-batch loss; the optional KL to a
reference policy uses the k3 estimator pi_ref/pi - log(pi_ref/pi) - 1 inside the loss; dual-clip
(Ye et al. 2020, verl's clip_ratio_c) bounds a negative advantage's term at clip_ratio_c * |A|,
which PPO's clip leaves unbounded when the ratio is far above 1 (off-policy tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

LOSSES: dict[str, Callable] = {}
LOSS_AGGREGATIONS: dict[str, Callable] = {}
# Losses whose every term has zero gradient where the advantage is 0 or the loss mask is (without
# the KL term): such a row cannot move the weights, so the learner may leave it out
# (trainer.skip_zero_gradient_rows).
INERT_AT_ZERO_ADVANTAGE: set[str] = set()


def register_loss(name: str, inert_at_zero_advantage: bool = False):
    """inert_at_zero_advantage: declare that a row with advantage 0, or loss mask 0 everywhere,
    gets zero gradient from this loss when kl_coef is 0."""
    def deco(fn):
        LOSSES[name] = fn
        (INERT_AT_ZERO_ADVANTAGE.add if inert_at_zero_advantage else INERT_AT_ZERO_ADVANTAGE.discard)(name)
        return fn
    return deco


def register_aggregation(name: str):
    def deco(fn):
        LOSS_AGGREGATIONS[name] = fn
        return fn
    return deco


@register_aggregation("token_mean")
def token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: float, num_seqs: float) -> torch.Tensor:
    """sum over all masked tokens / the batch's token count. values, mask: [B, T]."""
    return (values * mask).sum() / max(num_tokens, 1.0)


@register_aggregation("seq_mean")
def seq_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: float, num_seqs: float) -> torch.Tensor:
    """Per-sequence token mean, then sum / the batch's sequence count (original GRPO)."""
    per_seq = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # [B]
    return per_seq.sum() / max(num_seqs, 1.0)


def aggregate(name: str, values: torch.Tensor, mask: torch.Tensor, num_tokens: float, num_seqs: float):
    return LOSS_AGGREGATIONS[name](values, mask, num_tokens, num_seqs)


K3_MAX = 10.0  # verl's bound on a token's k3 value (its low_var_kl)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1 >= 0, at most
    K3_MAX, as verl bounds it: a token the reference finds far likelier than the policy (the
    log-ratio at its clamp of 20 gives 4.9e8) would otherwise outweigh the whole batch's loss. A
    token at the bound gets no KL gradient."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(max=K3_MAX)


@dataclass
class LossInputs:
    logp: torch.Tensor        # [B, T] current policy log-probs of the sampled tokens
    old_logp: torch.Tensor    # [B, T] log-probs of the policy that the ratio is taken against
    advantages: torch.Tensor  # [B] per-sample advantage
    mask: torch.Tensor        # [B, T] 1 for response tokens that carry loss
    ref_logp: torch.Tensor | None = None  # [B, T] reference policy, when kl_coef > 0
    # [B, T] behaviour weight on each token's policy-gradient term (off-policy correction,
    # offpolicy.py); None means 1.
    weight: torch.Tensor | None = None


@register_loss("grpo", inert_at_zero_advantage=True)
def ppo_clip_loss(x: LossInputs, clip_low: float, clip_high: float, kl_coef: float, agg: str,
                  num_tokens: float, num_seqs: float,
                  clip_ratio_c: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with clip-higher, dual-clip (clip_ratio_c; None: off) and optional
    k3 KL; returns (loss, metrics)."""
    ratio = torch.exp((x.logp - x.old_logp).clamp(-20.0, 20.0))  # [B, T]
    adv = x.advantages.unsqueeze(1)  # [B, 1]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if clip_ratio_c is not None:
        bound = -adv * clip_ratio_c  # > 0 where adv < 0
        dual = (adv < 0) & (per_token > bound)
        per_token = torch.where(dual, bound, per_token)
    if x.weight is not None:
        per_token = per_token * x.weight
    m = x.mask.float()
    metrics = {
        "pg_loss": aggregate(agg, per_token, m, num_tokens, num_seqs).detach(),
        "clip_frac": aggregate(agg, (clipped > unclipped).float(), m, num_tokens, num_seqs).detach(),
        "dual_clip_frac": aggregate(agg, dual.float(), m, num_tokens, num_seqs).detach(),
        "ratio_mean": aggregate(agg, ratio.detach(), m, num_tokens, num_seqs),
    }
    if kl_coef > 0:
        if x.ref_logp is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        kl = k3_kl(x.logp, x.ref_logp)
        per_token = per_token + kl_coef * kl
        metrics["kl"] = aggregate(agg, kl.detach(), m, num_tokens, num_seqs)
    return aggregate(agg, per_token, m, num_tokens, num_seqs), metrics


def policy_loss(name: str, x: LossInputs, *, clip_low: float, clip_high: float, kl_coef: float,
                agg: str, num_tokens: float, num_seqs: float, clip_ratio_c: float | None = None):
    return LOSSES[name](x, clip_low, clip_high, kl_coef, agg, num_tokens, num_seqs, clip_ratio_c)
