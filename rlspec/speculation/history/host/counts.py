"""The history store's global source (rlspec/speculation/history/host/index.py, global_index=counts): the device
drafter's count table (rlspec/speculation/history/device/counts.py's CountTable) held on the host's CPU,
filled and walked by numba functions over its numpy views that count and draft as the table's
torch code does, so that both backends hold the same table and draft the same global tokens from
the same answers (tests/speculation/test_counts.py: entry for entry, token for token).

It counts the newest stored sequences up to max_tokens tokens, whole sequences in and out, as the
device ring holds them: a sequence leaves when the store evicts it or when newer ones push it past
the bound. About 64 bytes per counted token at the defaults (four 16-byte entries), whatever the
store holds: the store's own bound (speculation.history.host.max_tokens) is larger."""
from __future__ import annotations

from collections import deque

import numpy as np

from rlspec.speculation.history.device.counts import MIN_PROB, WIDTH, CountTable
from rlspec.speculation.history.device.memory import count_buckets
from rlspec.speculation.history.host.ops import _P, _mix, nb


@nb.njit(inline="always", cache=True)
def _context_key(ctx, n, drafted, t, c, salt):
    """The count key of the last c tokens of ctx[:n] followed by drafted[:t] (CountTable._keys: the
    newest token at power 0)."""
    h, power = np.uint64(0), np.uint64(1)
    for j in range(c):
        p = n + t - 1 - j
        x = drafted[p - n] if p >= n else ctx[p]
        h += np.uint64(x + 3) * power
        power *= _P
    return _mix(h ^ salt)


@nb.njit(nogil=True, cache=True)
def _walk(ctx, n, m, key, tok, cnt, levels, salts, k, min_prob, vocab, out):
    """CountTable._walk for one row from match length m: the draft's length (its tokens in out)
    and its score."""
    mask = np.uint64(key.shape[0] - 1)
    prob, score, count = 1.0, 0.0, 0
    li = levels.shape[0] - 1
    for t in range(k):
        while levels[li] > m + t:
            li -= 1
        while li + 1 < levels.shape[0] and levels[li + 1] <= m + t:
            li += 1
        h = _context_key(ctx, n, out, t, levels[li], salts[li])
        b = np.int64(h & mask)
        total, votes, x = 0, 0, 0
        for w in range(key.shape[1]):
            c = cnt[b, w]
            if c > 0 and key[b, w] == h:
                total += c
                if c > votes or (c == votes and tok[b, w] < x):
                    votes, x = c, tok[b, w]
        if votes == 0:
            break
        prob *= votes / total
        if x < 0 or x >= vocab or prob < min_prob:
            break
        score += prob
        out[count] = x
        count += 1
    return count, score


@nb.njit(nogil=True, cache=True)
def count_draft(ctx, n, key, tok, cnt, levels, salts, k, min_prob, vocab, out, scratch):
    """CountTable.draft for one row (its tokens ctx[:n]): up to k tokens into out; returns their
    count and the match length walked from (0: no context of a count length has counts). Lengths
    are tried longest first; a shorter one is walked only where it could score above the best so
    far (a walk's score is at most k times its first share: ties go to the
    longer), so a long context that drafts all k tokens with certainty is the only walk."""
    mask = np.uint64(key.shape[0] - 1)
    best, best_m, best_count = -1.0, 0, 0
    for li in range(levels.shape[0] - 1, -1, -1):
        c = levels[li]
        if n < c:
            continue
        h = _context_key(ctx, n, out, 0, c, salts[li])
        b = np.int64(h & mask)
        total, votes = 0, 0
        for w in range(key.shape[1]):
            if cnt[b, w] > 0 and key[b, w] == h:
                total += cnt[b, w]
                votes = max(votes, cnt[b, w])
        if votes == 0:
            continue
        if best >= 0.0:
            first, bound = 1.0 * (votes / total), 0.0
            for _ in range(k):   # summed as a walk sums: no walk from here scores above it
                bound += first
            if best >= bound:
                continue
        got, score = _walk(ctx, n, c, key, tok, cnt, levels, salts, k, min_prob, vocab, scratch)
        if score > best:   # ties: the longer, walked first
            best, best_m, best_count = score, c, got
            out[:got] = scratch[:got]
    return best_count, best_m


@nb.njit(nogil=True, cache=True)
def _count_pairs(body, sizes, heads, levels, salts):
    """CountTable._pairs: (context key, next token) of every answer position with c answer tokens
    before it, per count length c in levels, for sequences body[...] of sizes and prompt tails of
    heads tokens; keys as the table's int64."""
    L, top = levels.shape[0], levels[levels.shape[0] - 1]
    n = 0
    for i in range(sizes.shape[0]):
        for a in range(sizes[i] - heads[i]):
            for li in range(L):
                n += a >= levels[li]
    keys, toks = np.empty(n, np.int64), np.empty(n, np.int64)
    m, at = 0, 0
    for i in range(sizes.shape[0]):
        for j in range(heads[i], sizes[i]):
            h, power, li = np.uint64(0), np.uint64(1), 0
            for c in range(1, min(j - heads[i], top) + 1):
                h += np.uint64(body[at + j - c] + 3) * power
                power *= _P
                if li < L and c == levels[li]:
                    keys[m] = np.int64(_mix(h ^ salts[li]))
                    toks[m] = body[at + j]
                    m += 1
                    li += 1
        at += sizes[i]
    return keys, toks


@nb.njit(inline="always", cache=True)
def _sort_by(first, second, third, m):
    """Sort the first m of three arrays by (first, second) ascending (insertion sort: a bucket's
    list is short; past 32, numpy's stable sorts)."""
    if m > 32:
        order = np.argsort(second[:m], kind="mergesort")
        order = order[np.argsort(first[:m][order], kind="mergesort")]
        first[:m], second[:m], third[:m] = first[:m][order], second[:m][order], third[:m][order]
        return
    for q in range(1, m):
        a, b, c = first[q], second[q], third[q]
        r = q - 1
        while r >= 0 and (first[r] > a or (first[r] == a and second[r] > b)):
            first[r + 1], second[r + 1], third[r + 1] = first[r], second[r], third[r]
            r -= 1
        first[r + 1], second[r + 1], third[r + 1] = a, b, c


@nb.njit(nogil=True, cache=True)
def _merge_pairs(tkey, ttok, tcnt, keys, toks, delta):
    """CountTable._merge on the table's numpy views: per touched bucket, its held entries and the
    pairs summed per (key, token), those above 0 kept, the bucket's W of highest count (ties: the
    lower key, then token) written from slot 0 after the held entries' counts are zeroed."""
    NB, W = tkey.shape
    n = keys.shape[0]
    mask = np.int64(NB - 1)
    start = np.zeros(NB + 1, np.int64)   # the pairs by bucket: a counting sort
    for i in range(n):
        start[(keys[i] & mask) + 1] += 1
    biggest = 0
    for b in range(NB):
        biggest = max(biggest, start[b + 1])
        start[b + 1] += start[b]
    fill = start[:-1].copy()
    order = np.empty(n, np.int64)
    for i in range(n):
        b = keys[i] & mask
        order[fill[b]] = i
        fill[b] += 1
    lk, lt, lc = np.empty(biggest + W, np.int64), np.empty(biggest + W, np.int64), np.empty(biggest + W, np.int64)
    neg, rank, dummy = np.empty(biggest + W, np.int64), np.empty(biggest + W, np.int64), np.empty(biggest + W, np.int64)
    for b in range(NB):
        if start[b] == start[b + 1]:
            continue
        m = 0
        for w in range(W):
            if tcnt[b, w] > 0:
                lk[m], lt[m], lc[m] = tkey[b, w], ttok[b, w], tcnt[b, w]
                tcnt[b, w] = 0
                m += 1
        for q in range(start[b], start[b + 1]):
            lk[m], lt[m], lc[m] = keys[order[q]], toks[order[q]], delta
            m += 1
        _sort_by(lk, lt, lc, m)
        g, q = 0, 0
        while q < m:   # sum each (key, token)'s run
            k0, t0, total = lk[q], lt[q], 0
            while q < m and lk[q] == k0 and lt[q] == t0:
                total += lc[q]
                q += 1
            if total > 0:
                lk[g], lt[g], lc[g] = k0, t0, total
                g += 1
        for q in range(g):   # count down, stable: ties keep the (key, token) order
            rank[q], neg[q] = q, -lc[q]
        _sort_by(neg, rank, dummy, g)   # by (count down, place in the key order)
        for r in range(min(g, W)):
            tkey[b, r], ttok[b, r], tcnt[b, r] = lk[rank[r]], lt[rank[r]], lc[rank[r]]


# No count table (global_index=chains, or no global source): what the store's walks get instead
NO_COUNTS = (np.zeros((0, 1), np.uint64), np.zeros((0, 1), np.int32), np.zeros((0, 1), np.int32), np.ones(1, np.int64),
             np.zeros(1, np.uint64), 1.0)


class HostCounts:
    """A CountTable on the CPU over the newest stored sequences (objects with `start`, `stored`,
    `tokens` and `counted`, as history.Seq): `update` counts a record's changes in, `arrays` is what
    the store's walks read."""

    def __init__(self, max_match: int, max_tokens: int, vocab: int, width: int = WIDTH, buckets: int | None = None,
                 min_prob: float = MIN_PROB):
        self.max_tokens = int(max_tokens)
        buckets = buckets or count_buckets(self.max_tokens, width)
        self.table = CountTable("cpu", range(1, max_match + 1), width, buckets, min_prob, vocab)
        self.seqs: deque = deque()   # counted, oldest first
        self.total = 0               # their stored tokens
        t = self.table
        self._arrays = (t.key.numpy().view(np.uint64), t.tok.numpy(), t.cnt.numpy(), t.levels.numpy(),
                        t.level_salt.numpy().view(np.uint64), t.min_prob)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def arrays(self) -> tuple:
        """(keys as uint64, tokens, counts, count lengths, their salts, min_prob)."""
        return self._arrays

    def update(self, read, gone: list, new: list) -> None:
        """A record's change: `gone` sequences evicted from the store (counted or not), `new` ones
        [(seq, its stored tokens)] in insertion order; read(seq) gives a stored sequence's tokens.
        Counted out: the gone ones and, oldest first, those that the new ones push past max_tokens;
        counted in: the new ones that fit whole (a batch over the bound counts its newest). Where
        counting fails, the table is emptied (nothing counted) before the error goes on."""
        gone_ids = {id(s) for s in gone if s.counted}
        kept = [s for s in self.seqs if id(s) not in gone_ids]
        total = sum(s.stored for s in kept)
        batch = sum(len(b) for _, b in new)
        out = [s for s in self.seqs if id(s) in gone_ids]
        first = 0   # the oldest kept ones leave while the batch does not fit
        while first < len(kept) and total + batch > self.max_tokens:
            total -= kept[first].stored
            first += 1
        out += kept[:first]
        kept = kept[first:]
        fit, room = [], self.max_tokens
        for s, body in reversed(new):
            room -= len(body)
            if room < 0:
                break
            fit.append((s, body))
        fit.reverse()
        try:
            if out:
                self._add([read(s) for s in out], [s.stored - s.tokens - 1 for s in out], -1)
            if fit:
                self._add([b for _, b in fit], [s.stored - s.tokens - 1 for s, _ in fit], 1)
        except BaseException:
            self.clear()
            raise
        for s in out:
            s.counted = False
        for s, _ in fit:
            s.counted = True
        self.seqs = deque(kept + [s for s, _ in fit])
        self.total = total + sum(len(b) for _, b in fit)

    def _add(self, bodies: list[np.ndarray], heads: list[int], delta: int) -> None:
        """CountTable.add, compiled: the same pairs, the same merge, the same table."""
        t = self.table
        keys, toks = _count_pairs(np.concatenate(bodies).astype(np.int64), np.array([len(b) for b in bodies], np.int64),
                                  np.array(heads, np.int64), self._arrays[3], self._arrays[4])
        _merge_pairs(t.key.numpy(), t.tok.numpy(), t.cnt.numpy(), keys, toks, delta)

    def clear(self) -> None:
        for s in self.seqs:
            s.counted = False
        self.seqs, self.total = deque(), 0
        self.table.clear()

    def settings(self) -> str:
        """What decides the table's layout and contents (a saved table loads only into its like)."""
        t = self.table
        return repr((self.max_tokens, t.keys, t.width, t.buckets, t.min_prob, t.vocab))

    def state(self) -> dict:
        """The table's held entries as they are: a full bucket kept its highest counts as each
        record came, which counting the stored sequences afresh in one merge does not repeat."""
        return {"settings": self.settings(), **self.table.held()}

    def load(self, state: dict, counted: list) -> None:
        """A saved table (state) over the stored sequences `counted` (oldest first, as history.Seq)."""
        self.clear()
        self.table.load_held(state)
        for s in counted:
            s.counted = True
        self.seqs, self.total = deque(counted), sum(s.stored for s in counted)

