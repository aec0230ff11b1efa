"""The history store's bookkeeping on the Python side (rlspec/speculation/history/host/index.py): a stored
response's record, a prompt's, and what a record changes, put back where its insert fails."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rlspec.speculation.history.host.index import HistoryIndex

MAX_ID = (1 << 31) - 1  # token ids are stored as int32; negative ones would read as END or DEAD


class Seq:
    """A stored response: its arena start (-1 until placed), stored length (tail, response, END)
    and response tokens; `alive` False once evicted."""
    __slots__ = ("start", "stored", "tokens", "alive", "counted")

    def __init__(self, stored: int, tokens: int):
        self.start, self.stored, self.tokens, self.alive = -1, stored, tokens, True
        self.counted = False   # in the global count table (counts.HostCounts)


@dataclass
class PromptRecord:
    rank: int                                    # the resident set keeps the lowest ranks
    seqs: deque = field(default_factory=deque)   # its Seq, oldest first


class Undo:
    """What a record changes of the store's Python side (prompts, token total, admission limit),
    put back where its insert fails."""

    def __init__(self, index: "HistoryIndex"):
        self.index, self.total, self.admit_below = index, index.total, index.admit_below
        self.recs: dict[int, tuple[PromptRecord | None, list[Seq]]] = {}  # salt -> its record and sequences before
        self.dropped: list[Seq] = []

    def touch(self, salt: int) -> None:
        if salt not in self.recs:
            rec = self.index.prompts.get(salt)
            self.recs[salt] = (rec, [] if rec is None else list(rec.seqs))

    def restore(self) -> None:
        ix = self.index
        ix.total, ix.admit_below = self.total, self.admit_below
        for seq in self.dropped:
            seq.alive = True
        for salt, (rec, seqs) in self.recs.items():
            if rec is None:
                ix.prompts.pop(salt, None)
            else:
                rec.seqs = deque(seqs)
                ix.prompts[salt] = rec


def as_ids(tokens) -> np.ndarray:
    a = np.asarray(tokens, np.int64)
    if a.ndim != 1 or (a.size and (a.min() < 0 or a.max() > MAX_ID)):
        raise ValueError(f"history: token ids must be ids in [0, 2^31), got {a.tolist()[:16]}")
    return a.astype(np.int32)


def insert_batch(items: list[tuple[int, Seq, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sequences (salt, Seq, tokens) as one insert's arrays: salts, tokens concatenated, offsets."""
    offsets = np.zeros(len(items) + 1, np.int64)
    np.cumsum([len(b) for _, _, b in items], out=offsets[1:])
    body = np.concatenate([b for _, _, b in items]) if items else np.zeros(0, np.int32)
    return np.array([salt for salt, _, _ in items], np.uint64), body, offsets
