"""Sample filters from DAPO: dynamic sampling and overlong filtering, as plain functions."""
from __future__ import annotations

import torch


def zero_variance_groups(rewards: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """[num_groups, G] rewards -> [num_groups] bool, True where every sample got the same reward,
    up to `tol` relative to the rewards' scale (such a group has zero advantage everywhere and
    only dilutes the batch)."""
    spread = rewards.max(dim=1).values - rewards.min(dim=1).values
    return spread <= tol * rewards.abs().max(dim=1).values.clamp(min=1.0)


def overlong_mask(truncated: torch.Tensor) -> torch.Tensor:
    """[N] bool (hit the length limit) -> [N] float loss weight: truncated samples get no loss."""
    return (~truncated).float()
