"""Reward registry: `data.reward` names a batch scorer (responses, ground truths) -> [N] floats in [0, 1].
A scorer imports its checker on first use (math-verify pulls in sympy), so checking a
config's reward name costs nothing; `preload` imports it ahead, off the critical path."""
from __future__ import annotations

import importlib
from typing import Callable

RewardFn = Callable[[list[str], list[str]], list[float]]
MODULES = {"math": "rlspec.rewards.math", "code": "rlspec.rewards.code"}


def _math(responses: list[str], truths: list[str]) -> list[float]:
    from rlspec.rewards.math import math_reward
    return [math_reward(r, t) for r, t in zip(responses, truths)]


def _code(responses: list[str], truths: list[str]) -> list[float]:
    from rlspec.rewards.code import code_rewards
    return code_rewards(responses, truths)


REWARDS: dict[str, RewardFn] = {"math": _math, "code": _code}


def preload(name: str) -> None:
    importlib.import_module(MODULES[name])
