"""Several engines behind one interface: how a call's work is split and its results joined."""
from __future__ import annotations

import torch

from rlspec.messages import RolloutBatch, add_moments


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of n items over `parts` workers, contiguous, sizes differing by at most 1."""
    return [(p * n // parts, (p + 1) * n // parts) for p in range(parts)]


def by_prompt(prompt_ids: list[list[int]], parts: int) -> list[list[int]]:
    """Prompt indices per engine, each prompt always on the same engine (a hash of its tokens):
    history drafting finds a prompt's earlier rollouts where they were generated. Stateless, so a
    resumed run routes as before; the price is per-call imbalance (binomial in the prompt count)."""
    import zlib

    out: list[list[int]] = [[] for _ in range(parts)]
    for i, p in enumerate(prompt_ids):
        out[zlib.crc32(torch.tensor(p, dtype=torch.int64).numpy().tobytes()) % parts].append(i)
    return out


def shares(needed: int | None, sizes: list[int]) -> list[int | None]:
    """`needed` complete groups spread over engines holding `sizes` groups, in proportion (largest
    remainders first, none above its size); None: all of each."""
    if needed is None:
        return [None] * len(sizes)
    total = sum(sizes)
    exact = [needed * s / total for s in sizes]
    out = [int(x) for x in exact]
    for i in sorted(range(len(sizes)), key=lambda i: out[i] - exact[i])[:needed - sum(out)]:
        out[i] += 1
    return [min(k, s) for k, s in zip(out, sizes)]


def merge_groups(parts: list[RolloutBatch], order: list[int] | None = None) -> RolloutBatch:
    """Engines' outputs of one call (VLLMEngine.generate_groups) in engine order: rows, tags and
    carried groups joined, counts added; with `order` (every group's tag), its groups' rows put in
    that order."""
    out = merge_rollouts(parts, mixed_versions=True)
    out.tags = [t for p in parts for t in p.tags]
    out.carry = [g for p in parts for g in p.carry]
    out.partial = {k: sum(p.partial[k] for p in parts) for k in parts[0].partial}
    if order is None:
        return out
    first, row = {}, 0   # a group's answers are consecutive rows
    for p in parts:
        n = len(p.response_ids) // len(p.tags)
        for i, t in enumerate(p.tags):
            first[t] = (row + i * n, n)
        row += len(p.response_ids)
    picked = out.select([r for t in order for r in range(first[t][0], first[t][0] + first[t][1])])
    picked.tags, picked.carry, picked.partial = list(order), out.carry, out.partial
    return picked


def merge_rollouts(parts: list[RolloutBatch], mixed_versions: bool = False) -> RolloutBatch:
    """Engine outputs in prompt order. Engines run in parallel: the call took the slowest one's
    time; speculation counters add up."""
    out = RolloutBatch.concat(parts, mixed_versions)
    out.seconds = max(p.seconds for p in parts)
    specs = [p.spec for p in parts if p.spec is not None]
    out.spec = sum(specs[1:], specs[0]) if specs else None
    out.draft_schedule = parts[0].draft_schedule
    hist = [p.history for p in parts if p.history is not None]
    out.history = {k: sum(h[k] for h in hist) for k in hist[0]} if hist else None
    for p in parts:
        out.decode_moments = add_moments(out.decode_moments, p.decode_moments)
        out.step_rows = add_moments(out.step_rows, p.step_rows)
    return out


def merge_logprobs(parts: list[tuple[torch.Tensor, torch.Tensor | None]]):
    """([N, T] current, [N, T] reference or None) from row shards; shards are padded to the same T
    (the whole batch's), so rows concatenate."""
    cur = torch.cat([p[0] for p in parts])
    ref = None if parts[0][1] is None else torch.cat([p[1] for p in parts])
    return cur, ref
