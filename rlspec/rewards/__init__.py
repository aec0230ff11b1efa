"""Reward registry: `data.reward` names a batch scorer (responses, ground truths) -> [N] floats in [0, 1]."""
from __future__ import annotations

from typing import Callable

from rlspec.rewards.code import code_rewards
from rlspec.rewards.math import math_reward

RewardFn = Callable[[list[str], list[str]], list[float]]
REWARDS: dict[str, RewardFn] = {
    "math": lambda responses, truths: [math_reward(r, t) for r, t in zip(responses, truths)],
    "code": code_rewards,
}
