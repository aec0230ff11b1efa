"""A bounded cache of what the draft trains on during RL: per rollout, the policy's hidden states
at the EAGLE-3 layers and its top-k next-token log-probs, as the LogprobWorker's forward pass
produced them. Oldest sequences are evicted first so the bytes held never exceed `max_bytes`;
each entry remembers the policy version that produced it (draft staleness is measured from it).
A sequence longer than `max_positions`, or than a quarter of the cache holds, keeps one window of
consecutive positions that reaches into its response, at a random offset (an 18k-token reasoning
rollout's features are about 450 MB at Qwen3-8B width); training places it at its own positions."""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class CachedSequence:
    ids: torch.Tensor          # [T] int32 tokens (prompt + response)
    aux_hidden: torch.Tensor   # [T, A] bfloat16
    topk_ids: torch.Tensor     # [T, K] int32
    topk_logp: torch.Tensor    # [T, K] float16
    loss_from: int             # first response position (in the window)
    policy_version: int
    start: int = 0             # position of ids[0] in the rollout (a window of a long one)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.aux_hidden, self.topk_ids, self.topk_logp))


class FeatureCache:
    def __init__(self, max_bytes: int, max_positions: int | None = None, seed: int = 0):
        if max_bytes <= 0:
            raise ValueError(f"feature cache bound must be positive, got {max_bytes} bytes")
        self.max_bytes, self.bytes, self.evicted, self.cropped = int(max_bytes), 0, 0, 0
        self.max_positions = max_positions
        self.rng = random.Random(seed)
        self.items: deque[CachedSequence] = deque()

    def window(self, n: int, loss_from: int, bytes_per_position: int) -> tuple[int, int]:
        """(start, length) of what a sequence of n positions keeps: all of it, or a window of at
        most max_positions and a quarter of the cache, ending past loss_from + 1."""
        w = min(n, self.max_positions or n, self.max_bytes // 4 // bytes_per_position)
        if w < 2:
            raise ValueError(f"one position needs {bytes_per_position} bytes: a quarter of the cache bound "
                             f"{self.max_bytes} holds less than two, more than the cache bound allows")
        if w == n:
            return 0, n
        lo, hi = max(0, loss_from + 2 - w), n - w
        return self.rng.randint(min(lo, hi), hi), w

    def __len__(self) -> int:
        return len(self.items)

    def add_batch(self, ids: torch.Tensor, mask: torch.Tensor, aux_hidden: torch.Tensor, topk_ids: torch.Tensor,
                  topk_logp: torch.Tensor, loss_from: list[int], policy_version: int) -> None:
        """Right-padded batch [B, T, ...] -> one compact entry per sequence, padding dropped (and
        long sequences cut to a window)."""
        per_position = 4 + 2 * aux_hidden.shape[-1] + 6 * topk_ids.shape[-1]  # int32, bf16, int32 + fp16
        for b in range(ids.shape[0]):
            n = int(mask[b].sum())
            s, w = self.window(n, int(loss_from[b]), per_position)
            self.cropped += w < n
            cut = slice(s, s + w)
            self.add(CachedSequence(ids[b, cut].to(torch.int32).clone(), aux_hidden[b, cut].to(torch.bfloat16).clone(),
                                    topk_ids[b, cut].to(torch.int32).clone(),
                                    topk_logp[b, cut].to(torch.float16).clone(),
                                    max(int(loss_from[b]) - s, 0), policy_version, s))

    def add(self, item: CachedSequence) -> None:
        if item.nbytes > self.max_bytes:
            raise ValueError(f"one sequence needs {item.nbytes} bytes, more than the cache bound {self.max_bytes}")
        self.items.append(item)
        self.bytes += item.nbytes
        while self.bytes > self.max_bytes:
            self.bytes -= self.items.popleft().nbytes
            self.evicted += 1

    def sample(self, n: int, rng: random.Random) -> list[CachedSequence]:
        return rng.sample(list(self.items), min(n, len(self.items)))

    def oldest_version(self) -> int | None:
        return self.items[0].policy_version if self.items else None
