"""A bounded cache of what the draft trains on during RL: per rollout, the policy's hidden states
at the EAGLE-3 layers and its top-k next-token log-probs, as the LogprobWorker's forward pass
produced them. Oldest sequences are evicted first so the bytes held never exceed `max_bytes`;
each entry remembers the policy version that produced it (draft staleness is measured from it)."""
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
    loss_from: int             # first response position
    policy_version: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.aux_hidden, self.topk_ids, self.topk_logp))


class FeatureCache:
    def __init__(self, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"feature cache bound must be positive, got {max_bytes} bytes")
        self.max_bytes, self.bytes, self.evicted = int(max_bytes), 0, 0
        self.items: deque[CachedSequence] = deque()

    def __len__(self) -> int:
        return len(self.items)

    def add_batch(self, ids: torch.Tensor, mask: torch.Tensor, aux_hidden: torch.Tensor, topk_ids: torch.Tensor,
                  topk_logp: torch.Tensor, loss_from: list[int], policy_version: int) -> None:
        """Right-padded batch [B, T, ...] -> one compact entry per sequence, padding dropped."""
        for b in range(ids.shape[0]):
            n = int(mask[b].sum())
            self.add(CachedSequence(ids[b, :n].to(torch.int32).clone(), aux_hidden[b, :n].to(torch.bfloat16).clone(),
                                    topk_ids[b, :n].to(torch.int32).clone(), topk_logp[b, :n].to(torch.float16).clone(),
                                    int(loss_from[b]), policy_version))

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
