"""Several engines behind one interface: how a call's work is split and its results joined."""
from __future__ import annotations

import torch

from rlspec.messages import RolloutBatch, add_moments


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of n items over `parts` workers, contiguous, sizes differing by at most 1."""
    return [(p * n // parts, (p + 1) * n // parts) for p in range(parts)]


def merge_rollouts(parts: list[RolloutBatch]) -> RolloutBatch:
    """Engine outputs in prompt order. Engines run in parallel: the call took the slowest one's
    time; speculation counters add up."""
    out = RolloutBatch.concat(parts)
    out.seconds = max(p.seconds for p in parts)
    specs = [p.spec for p in parts if p.spec is not None]
    out.spec = sum(specs[1:], specs[0]) if specs else None
    out.draft_schedule = parts[0].draft_schedule
    for p in parts:
        out.decode_moments = add_moments(out.decode_moments, p.decode_moments)
    return out


def merge_logprobs(parts: list[tuple[torch.Tensor, torch.Tensor | None]]):
    """([N, T] current, [N, T] reference or None) from row shards; shards are padded to the same T
    (the whole batch's), so rows concatenate."""
    cur = torch.cat([p[0] for p in parts])
    ref = None if parts[0][1] is None else torch.cat([p[1] for p in parts])
    return cur, ref
