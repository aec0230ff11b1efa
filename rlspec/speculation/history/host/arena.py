"""The history store's arrays (rlspec/speculation/history/host/store.py walks them): the history arena of stored
responses and the live arena of a call's running requests. Positions are int32: neither arena
grows past MAX_POSITIONS."""
from __future__ import annotations

import numpy as np
import torch

from rlspec.speculation.history.host import store as S
from rlspec.speculation.history.host import live as L

MAX_LIVE_HEAD_BITS = 22  # the live arena's chain heads: at most 4M slots per chain
MAX_POSITIONS = (1 << 31) - 1  # arena positions and chain links are int32


def pow2(n: int) -> int:
    """The power of two at or above n (at least 16): a chain-head table's size."""
    return 1 << max(4, int(n - 1).bit_length())


class HistoryArena:
    """Stored sequences [prompt tail | response | END] at positions [0, used): per position its
    token, its prompt's 32-bit tag and its links (a prompt chain per prompt key length, a global
    chain per global key length), with the chains' heads; `dead` of the positions hold evicted
    sequences (DEAD) until a rebuild.
    Sequences go in at the end (`insert`); a larger arena is a new object (`grown`, or a fresh one
    for a rebuild), so that an insert that cannot allocate leaves this one as it was."""

    def __init__(self, plevels: int, levels: int, capacity: int = 1 << 16, heads: int | None = None):
        if capacity > MAX_POSITIONS:
            raise OverflowError(f"the history store needs {capacity} arena positions, past int32's {MAX_POSITIONS}: "
                                f"lower speculation.history.host.max_tokens")
        self.tok = np.full(capacity, S.DEAD, np.int32)
        self.psalt = np.zeros(capacity, np.uint32)
        self.chain = np.full((plevels, capacity), -1, np.int32)
        self.gchain = np.full((levels, capacity), -1, np.int32)
        n = heads or pow2(capacity // 2)  # chains average up to two links a slot
        self.phead = np.full((plevels, n), -1, np.int32)
        self.ghead = np.full((levels, n), -1, np.int32)
        self.used = 0
        self.dead = 0

    @property
    def capacity(self) -> int:
        return self.tok.shape[0]

    @property
    def heads(self) -> int:
        return self.phead.shape[1]

    def grown(self, capacity: int) -> "HistoryArena":
        """A larger arena holding the same positions and links, sharing these heads (the one of the
        two that is kept takes the next insert)."""
        new = HistoryArena(self.chain.shape[0], self.gchain.shape[0], capacity, heads=1)
        for name in ("tok", "psalt", "chain", "gchain"):
            getattr(new, name)[..., : self.used] = getattr(self, name)[..., : self.used]
        new.phead, new.ghead = self.phead, self.ghead
        new.used, new.dead = self.used, self.dead
        return new

    def insert(self, salts: np.ndarray, body: np.ndarray, offsets: np.ndarray, pkeys: np.ndarray,
               gkeys: np.ndarray) -> np.ndarray:
        """Sequence i, body[offsets[i]:offsets[i+1]] of prompt salts[i], at the end (room checked by
        the caller); returns the starts."""
        starts = self.used + offsets[:-1]
        S.insert_sequences(self.tok, self.psalt, self.chain, self.gchain, self.phead, self.ghead, body, offsets,
                           salts, starts, pkeys, gkeys)
        self.used += int(offsets[-1])
        return starts

    def kill(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        S.kill_sequences(self.tok, starts, lengths)
        self.dead += int(lengths.sum())

    def arrays(self) -> tuple:
        """What a walk reads: tokens, prompt tags, chains, heads."""
        return self.tok, self.psalt, self.chain, self.gchain, self.phead, self.ghead

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


class LiveArena:
    """Requests of one call, each its answer so far, and each prompt's tokens once, linked token to
    token (requests grow interleaved), with per-prompt chains (one per prompt key length) and
    global ones; per position its owner slot (-1: a prompt's copy) and row position; per slot its
    last position, its batch row, its prompt copy's last position and its first answer position."""

    def __init__(self, capacity: int = 1 << 14, slots: int = 256, head_bits: int = 16, levels: int = 1,
                 plevels: int = 1):
        self.levels, self.plevels, self.min_heads = levels, plevels, 1 << head_bits
        self._heads(self.min_heads)
        self._alloc(capacity)
        self.last, self.row, self.copy, self.ans = (np.full(slots, -1, np.int64) for _ in range(4))
        self.used = 0

    def _alloc(self, capacity: int) -> None:
        old = getattr(self, "tok", None)
        arrays = ([np.empty(capacity, np.int32) for _ in range(3)] + [np.empty((self.plevels, capacity), np.int32)]
                  + [np.empty((self.levels, capacity), np.int32), np.empty(capacity, np.uint32),
                     np.empty(capacity, np.int32), np.empty(capacity, np.int32)])
        if old is not None:
            for new, cur in zip(arrays, self.arrays()):
                new[..., : self.used] = cur[..., : self.used]
        self.tok, self.prev, self.next, self.chain, self.gchain, self.salt, self.slot, self.pos = arrays

    def arrays(self) -> tuple:
        return self.tok, self.prev, self.next, self.chain, self.gchain, self.salt, self.slot, self.pos

    def walk(self, ghead: np.ndarray | None = None) -> tuple:
        """What store.py's walks read (ghead: the global heads to walk, default this arena's)."""
        return (self.tok, self.salt, self.prev, self.next, self.chain, self.head, self.slot, self.pos, self.row,
                self.gchain, self.ghead if ghead is None else ghead, self.last)

    def append(self, seq: int, owner: int, row: np.ndarray, lo: int, hi: int, salt, pkeys: np.ndarray,
               gkeys: np.ndarray) -> None:
        """row[lo:hi] onto live sequence `seq`, owned by slot `owner` (live.live_append)."""
        self.used = L.live_append(self.walk(), seq, owner, row, lo, hi, salt, pkeys, gkeys, self.used, self.ans)

    def _heads(self, n: int) -> None:
        self.head = np.full((self.plevels, n), -1, np.int32)
        self.ghead = np.full((self.levels, n), -1, np.int32)

    def _fit_heads(self, tokens: int) -> bool:
        """Chain heads for about `tokens` live tokens, a slot per two (within [min, 2^22]): chains
        of unrelated tokens sharing a slot cost a lookup a memory read each. Grows only."""
        n = min(max(self.min_heads, pow2(tokens // 2)), 1 << MAX_LIVE_HEAD_BITS)
        if n <= self.head.shape[1]:
            return False
        self._heads(n)
        return True

    def reset(self) -> None:
        """Empty, with heads for the largest call so far."""
        if not self._fit_heads(self.tok.shape[0]):
            self.head.fill(-1)
            self.ghead.fill(-1)
        for a in (self.last, self.row, self.copy, self.ans):
            a.fill(-1)
        self.used = 0

    def reserve(self, tokens: int, slots: int) -> None:
        """Room for `tokens` more tokens and slot ids below `slots` (positions stay: links hold; a
        call's first tokens size the heads)."""
        if self.used + tokens > MAX_POSITIONS:
            raise OverflowError(f"a call's live requests need {self.used + tokens} positions, past int32's "
                                f"{MAX_POSITIONS}")
        if self.used == 0:
            self._fit_heads(tokens)
        if self.used + tokens > self.tok.shape[0]:
            self._alloc(min(max(2 * self.tok.shape[0], self.used + tokens), MAX_POSITIONS))
        old = self.last.shape[0]
        if slots > old:
            for name in ("last", "row", "copy", "ans"):
                a = np.full(max(2 * old, slots), -1, np.int64)
                a[:old] = getattr(self, name)
                setattr(self, name, a)

    @classmethod
    def empty(cls, levels: int, plevels: int) -> "LiveArena":
        """An arena with no chain heads: a walk over it finds nothing."""
        arena = cls(capacity=1, slots=1, head_bits=0, levels=levels, plevels=plevels)
        arena.head = np.empty((plevels, 0), np.int32)
        arena.ghead = np.empty((levels, 0), np.int32)
        return arena

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.arrays(), self.head, self.ghead, self.last, self.row, self.copy,
                                      self.ans))


def shadow_step(index, prompt_ids: list[list[int]], response_ids: list[list[int]], groups: list[list[int]]):
    """The host store's drafts for a shadow replay of `groups`' rows, in that order
    (history.stats.ShadowStep; index: a HistoryIndex): each group's rows live in an arena of their
    own, each row's token t appended before any row drafts at step t."""
    k, rows = index.k_max, []
    for members in groups:
        prompt = np.asarray(prompt_ids[members[0]], np.int32)
        salt = np.uint64(S.prompt_salt(prompt, len(prompt)))
        n = len(members)
        live = LiveArena(capacity=len(prompt) + sum(len(response_ids[r]) for r in members) + 16, slots=n,
                         head_bits=14, levels=len(index.gkeys), plevels=len(index.pkeys))
        live.append(0, -1, prompt, 0, len(prompt), salt, index.pkeys, index.gkeys)   # the prompt's copy
        live.last[:n] = live.copy[:n] = live.last[0]
        live.row[:n] = np.arange(n)
        for slot, r in enumerate(members):
            seq = np.concatenate([prompt, np.asarray(response_ids[r], np.int32)])
            rows.append((live, slot, n, salt, len(prompt), len(response_ids[r]), seq))

    def step(t: int, need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for live, slot, _, salt, plen, rlen, seq in rows:
            if t < rlen:
                live.append(slot, slot, seq, plen + t, plen + t + 1, salt, index.pkeys, index.gkeys)
        drafts = torch.full((len(rows), k), -1, dtype=torch.int64)
        counts = torch.zeros(len(rows), dtype=torch.int64)
        for r in need.nonzero()[:, 0].tolist():
            live, slot, n_slots, salt, plen, _, seq = rows[r]
            draft, _ = index.draft_context(seq[: plen + t + 1], int(salt), k, live, slot, n_slots)
            drafts[r, : len(draft)] = torch.as_tensor(draft, dtype=torch.int64)
            counts[r] = len(draft)
        return drafts, counts
    return step
