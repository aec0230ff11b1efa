"""Group-relative advantage estimators (GRPO, DeepSeekMath arXiv 2402.03300).

Departures from the textbook: rewards arrive as a [num_groups, G] tensor (G samples of one prompt
per row); `normalize_std=False` gives Dr. GRPO's unscaled advantages; 'loo' uses the mean of the
other G-1 samples as the baseline (RLOO), optionally scaled by the group std as NeMo RL does.
A group whose rewards all agree (max - min within a tolerance) gets advantage exactly 0 for every
sample, whatever the reward values (float noise in the mean would otherwise be divided by ~eps).
"""
from __future__ import annotations

from typing import Callable

import torch

from rlspec.algo.filters import zero_variance_groups

AdvantageFn = Callable[[torch.Tensor, bool, float], torch.Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str):
    def deco(fn: AdvantageFn) -> AdvantageFn:
        ADVANTAGES[name] = fn
        return fn
    return deco


@register_advantage("grpo")
def grpo_advantage(rewards: torch.Tensor, normalize_std: bool, eps: float) -> torch.Tensor:
    """A_i = (R_i - mean(R)) / (std(R) + eps) within each group. rewards: [num_groups, G]."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)


@register_advantage("loo")
def leave_one_out_advantage(rewards: torch.Tensor, normalize_std: bool, eps: float) -> torch.Tensor:
    """A_i = R_i - mean_{j != i} R_j, optionally divided by the group std. rewards: [num_groups, G]."""
    g = rewards.shape[1]
    baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1)
    adv = rewards - baseline
    if not normalize_std:
        return adv
    return adv / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)


def compute_advantages(name: str, rewards: torch.Tensor, normalize_std: bool = True,
                       eps: float = 1e-6) -> torch.Tensor:
    """rewards [num_groups, G] -> advantages [num_groups, G] with the registered estimator."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [num_groups, G>=2], got {tuple(rewards.shape)}")
    rewards = rewards.float()
    return ADVANTAGES[name](rewards, normalize_std, eps).masked_fill(zero_variance_groups(rewards)[:, None], 0.0)
