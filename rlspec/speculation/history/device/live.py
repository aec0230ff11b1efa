"""The device drafter's own rows of a call, kept incrementally (LiveRows), and the lookup over
them (LiveTable).

LiveRows: a slot per running request and per finished answer the call keeps; a request's row is
copied whole once, when it enters the batch (its prefill, or back after preemption), and after
that each step copies only its new tokens (the accepted drafts and the bonus token). Its prompt's
salt is hashed then too. The drafter reads rows by slot, never the runner's buffers whole.

LiveTable: per slot and prompt key length m, the latest position c < n of the slot's row whose m
tokens before it have a given fingerprint, found without reading the row: an open-addressed table
per (slot, m) from fingerprint to its newest position, and `prev` links between the positions of
one fingerprint. A row's new tokens are linked in order (`append`); a row that joins is linked
from its start. `latest` answers what store.py's whole-row scan finds (`window_prints << 1`
compared, positions in [lo, n)), reading O(probes) entries a query.

The torch methods loop until every probe resolves (host syncs): the reference, run on CPU. Where
the drafter runs kernels (a CUDA device), the table is linked by kernels.append and read by
kernels.live_lookup, which loop in the kernel."""
from __future__ import annotations

import torch

from rlspec.speculation.history.device.ops import _P, mix, prompt_hash, prompt_siblings


def prints_at(tokens: torch.Tensor, c: torch.Tensor, m: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """window_prints(tokens, m) << 1 at column c of each row ([B, L] tokens, [B, ...] columns,
    c >= m; with rows [B], of tokens' rows `rows`)."""
    h = torch.zeros(c.shape, dtype=torch.int64, device=tokens.device)
    if rows is None:
        rows = torch.arange(c.shape[0], device=tokens.device)
    rows = rows.view(-1, *([1] * (c.dim() - 1)))
    for j in range(m):
        h = h * _P + (tokens[rows, (c - m + j).clamp(min=0)].long() + 3)
    return h << 1


class LiveTable:
    """Per slot and key length: fingerprint -> newest position (open addressing, `buckets` a
    power of two at least twice the positions a row holds), and prev links per position."""

    def __init__(self, slots: int, max_len: int, keys: tuple[int, ...], device="cpu"):
        self.keys, self.max_len = tuple(keys), max_len
        K = len(self.keys)
        self.H = 1 << max(4, (2 * (max_len + 1) - 1).bit_length())
        self.fp = torch.zeros(slots, K, self.H, dtype=torch.int64, device=device)
        self.used = torch.zeros(slots, K, self.H, dtype=torch.bool, device=device)
        self.head = torch.full((slots, K, self.H), -1, dtype=torch.int32, device=device)
        self.prev = torch.full((slots, K, max_len + 1), -1, dtype=torch.int32, device=device)

    def _find(self, slot: torch.Tensor, li: int, q: torch.Tensor, insert: bool) -> torch.Tensor:
        """Each query's table index in its slot (q [N] fingerprints): where q is, else (insert) the
        first free index probed, claimed for q, else -1. Queries of one slot hold distinct prints."""
        at = torch.full_like(q, -1)
        h = mix(q) & (self.H - 1)
        todo = torch.ones_like(q, dtype=torch.bool)
        for _ in range(self.H):   # a table is at most half full: every probe sequence ends
            if not todo.any():
                break
            i = todo.nonzero()[:, 0]
            s, hi = slot[i], h[i]
            used = self.used[s, li, hi]
            hit = used & (self.fp[s, li, hi] == q[i])
            at[i[hit]] = hi[hit]
            todo[i[hit]] = False
            if insert:   # a free entry: the lowest query wanting it claims it, the others look again
                f = i[~used]
                if len(f):
                    flat = slot[f] * self.H + h[f]
                    claim = torch.full((self.fp.shape[0] * self.H,), len(q), dtype=torch.int64, device=q.device)
                    claim.scatter_reduce_(0, flat, f, "amin")
                    w = f[claim[flat] == f]
                    self.used[slot[w], li, h[w]] = True
                    self.fp[slot[w], li, h[w]] = q[w]
                    at[w] = h[w]
                    todo[w] = False
            else:
                todo[i[~used]] = False   # absent
            move = i[used & ~hit]
            h[move] = (h[move] + 1) & (self.H - 1)
        return at

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.fp, self.used, self.head, self.prev))

    def append(self, slot: torch.Tensor, tokens: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Link positions c in (lo, hi] of each slot's row (tokens [slots, L], slot [B]) in order:
        c's m tokens before it are tokens[slot, c-m:c]; c < m are never linked."""
        steps = int((hi - lo).max().clamp(min=0)) if len(slot) else 0
        for t in range(1, steps + 1):
            c = lo + t
            for li, m in enumerate(self.keys):
                go = (c <= hi) & (c >= m)
                if not go.any():
                    continue
                r = go.nonzero()[:, 0]
                q = prints_at(tokens, c[r], m, slot[r])
                at = self._find(slot[r], li, q, insert=True)
                s = slot[r]
                self.prev[s, li, c[r]] = self.head[s, li, at]
                self.head[s, li, at] = c[r].int()

    def reset(self, slot: torch.Tensor) -> None:
        """Slots whose rows join: emptied (their positions are linked by append from 0)."""
        self.used[slot] = False
        self.head[slot] = -1
        self.prev[slot] = -1

    def latest(self, slot: torch.Tensor, li: int, q: torch.Tensor, n: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        """The newest position c of slot's row with print q, c < n (the row's length), or -1 where
        it is below lo or absent."""
        at = self._find(slot, li, q, insert=False)
        c = torch.where(at >= 0, self.head[slot, li, at.clamp(min=0)].long(), -1)
        c = torch.where(c >= n, self.prev[slot, li, c.clamp(min=0)].long(), c)   # the row's own end
        return torch.where((c >= lo) & (c >= 0), c, -1)


class LiveRows:
    """A call's rows on the device, by slot: `running` slots for the batch's requests and
    `finished` for the call's finished answers its running siblings still read (the newest
    `finished`, a ring), each a token row max_len wide, its length, its own prompt's length and its
    prompt's salt (ops.prompt_hash); with table, the LiveTable over them. All allocated at
    construction, before vLLM sizes its KV cache. The slots' bookkeeping is on the host (request
    ids); nothing here syncs with the device."""

    def __init__(self, running: int, finished: int, max_len: int, keys: tuple[int, ...], device, table: bool,
                 kernels: bool = False):
        S = running + finished
        self.tok = torch.zeros((S, max_len), dtype=torch.int32, device=device)
        self.n = torch.zeros(S, dtype=torch.int64, device=device)
        self.plen = torch.zeros(S, dtype=torch.int64, device=device)
        self.salt = torch.zeros(S, dtype=torch.int64, device=device)
        self.done_at = torch.zeros(max(finished, 1), dtype=torch.int64, device=device)   # `done` on the device
        self.table = LiveTable(S, max_len, keys, device) if table else None
        # the rows' advance and the table's append as kernels.py's kernels (the drafter's
        # DeviceHistory.kernels)
        self.kernels = kernels
        self.keys = torch.tensor(keys, dtype=torch.int64, device=device)
        self.device, self.finished = torch.device(device), finished
        self.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tok, self.n, self.plen, self.salt, self.done_at,
                                                          self.keys)) + \
            (self.table.nbytes if self.table is not None else 0)

    def clear(self) -> None:
        """A new call: every slot free."""
        self.free = list(range(self.tok.shape[0]))[::-1]
        self.slot_of: dict[str, int] = {}    # the batch's requests at the last step
        self.done: list[int] = []            # the finished answers' slots, in ring order
        self.next = 0
        self._ids: list[str] = []
        self._at = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._siblings: tuple | None = None   # (G, prompt_siblings of the rows) until the rows change

    def finish(self, req_id: str) -> None:
        """A request of the batch finished: its slot joins the finished answers (the oldest one's
        slot freed once `finished` are kept)."""
        slot = self.slot_of.pop(req_id, None)
        if slot is None:
            return
        self._ids = []   # the batch changed: the next step maps its rows anew
        if not self.finished:
            self.free.append(slot)
        elif len(self.done) < self.finished:
            self.done_at[len(self.done)] = slot
            self.done.append(slot)
        else:
            self.free.append(self.done[self.next])
            self.done[self.next] = slot
            self.done_at[self.next] = slot
        self.next = (self.next + 1) % max(self.finished, 1)

    def rows(self, at: torch.Tensor) -> torch.Tensor:
        """The running rows' slots `at`, the finished answers' after them (ring order): [B + done]."""
        return torch.cat([at, self.done_at[: len(self.done)]]) if self.done else at

    def siblings(self, rows: torch.Tensor, G: int) -> tuple:
        """ops.prompt_siblings of `rows` (self.rows(at)) for groups of G, computed again only when
        the batch or the finished answers change."""
        if self._siblings is None or self._siblings[0] != G:
            self._siblings = G, prompt_siblings(self.salt[rows], G, len(self.done))
        return self._siblings[1]

    def step(self, ids: list[str], src: torch.Tensor, src_rows: torch.Tensor, lengths: torch.Tensor,
             prompt_lens, width: int) -> torch.Tensor:
        """The batch's rows after this step's tokens: ids [B] (request ids), src the runner's token
        buffer, src_rows [B] each row's index in it, lengths [B] the rows' lengths now,
        prompt_lens(positions) the own prompt lengths of the batch positions given (a host list,
        asked for the rows that join), width the most tokens a row gains in a step. A request not
        in the last step's batch joins (its row copied, its prompt hashed, its table built); a
        request that left without finishing (preempted, unscheduled) frees its slot. Returns the
        rows' slots [B]."""
        if ids != self._ids:
            self._map(ids, src, src_rows, lengths, prompt_lens)
        else:
            self._advance(self._at, src, src_rows, lengths, width)
        return self._at

    def _map(self, ids, src, src_rows, lengths, prompt_lens) -> None:
        here = set(ids)
        for r in [r for r in self.slot_of if r not in here]:
            self.free.append(self.slot_of.pop(r))
        new = [i for i, r in enumerate(ids) if r not in self.slot_of]
        for i in new:
            self.slot_of[ids[i]] = self.free.pop()
        dev = self.device
        at = torch.as_tensor([self.slot_of[r] for r in ids], dtype=torch.int64).to(dev, non_blocking=True)
        old = torch.ones(len(ids), dtype=torch.bool)
        old[new] = False
        if not bool(old.all()):
            j = torch.as_tensor(new, dtype=torch.int64).to(dev, non_blocking=True)
            self._join(at[j], src, src_rows[j], lengths[j], prompt_lens(new))
        if bool(old.any()):
            o = old.nonzero()[:, 0].to(dev, non_blocking=True)
            self._advance(at[o], src, src_rows[o], lengths[o], None)
        self._ids, self._at, self._siblings = list(ids), at, None

    def _join(self, slot, src, src_rows, lengths, prompt_lens) -> None:
        W = min(src.shape[1], self.tok.shape[1])
        self.tok[slot, :W] = src[src_rows, :W].to(self.tok.dtype)
        n = lengths.long().clamp(max=W)
        self.n[slot] = n
        plen = torch.as_tensor(prompt_lens, dtype=torch.int64).to(self.device, non_blocking=True)
        self.plen[slot] = plen
        self.salt[slot] = prompt_hash(self.tok[slot], plen)
        if self.table is not None:
            self.table.reset(slot)
            self._link(slot, torch.zeros_like(n), n)

    def _advance(self, slot, src, src_rows, lengths, width: int | None) -> None:
        """Copy each row's tokens from its last length to `lengths` (at most width of them, None:
        as many as any row gained) and link them."""
        if self.kernels:   # all of it in one launch
            from rlspec.speculation.history.device import kernels
            return kernels.advance(self, slot, src, src_rows.long(), lengths, self.keys)
        W = self.tok.shape[1]
        old, new = self.n[slot], lengths.long().clamp(max=W)
        if width is None:
            width = int((new - old).max().clamp(min=0)) if len(slot) else 0
        if width:
            cols = old[:, None] + torch.arange(width, device=self.device)
            write = cols < new[:, None]
            # a column not written rewrites the row's token before `old` with itself (no write targets it)
            cols = torch.where(write, cols, (old - 1).clamp(min=0)[:, None])
            got = src[src_rows[:, None], cols].to(self.tok.dtype)
            self.tok[slot[:, None], cols] = torch.where(write, got, self.tok[slot[:, None], cols])
        if self.table is not None:
            self._link(slot, old, new)
        self.n[slot] = new

    def _link(self, slot, lo, hi) -> None:
        if self.kernels:
            from rlspec.speculation.history.device import kernels
            kernels.append(self.table, slot, self.tok, lo, hi)
        else:
            self.table.append(slot, self.tok, lo, hi)
