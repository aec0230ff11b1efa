"""A plain reading of rlspec/speculation/history/device/store.py's rule, row by row in Python ints: the
same hashes (mod 2^64), the same ring and buckets, candidates and vote."""
from __future__ import annotations

from collections import deque

MASK = (1 << 64) - 1
P = 0x100000001B3
C1 = 0x9E3779B97F4A7C15
M1 = 0xFF51AFD7ED558CCD
M2 = 0xC4CEB9FE1A85EC53
END, UNKNOWN = -1, -2
LIVE, SELF = 1 << 42, 1 << 41


def mix(h: int) -> int:
    h ^= h >> 33
    h = h * M1 & MASK
    h ^= h >> 33
    h = h * M2 & MASK
    return h ^ (h >> 33)


def fold(tokens) -> int:
    h = 0
    for t in tokens:
        h = (h * P + t + 3) & MASK
    return mix(h ^ (len(tokens) * C1 & MASK))


def fingerprint(tokens) -> int:
    """The live rows' window fingerprint: the unmixed polynomial, its top bit dropped."""
    h = 0
    for t in tokens:
        h = (h * P + t + 3) & MASK
    return (h << 1) & MASK


def signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def prompt_hash(prompt) -> int:
    s = 0
    for j, t in enumerate(prompt):
        s = (s + (t + 3) * pow(P, j, 1 << 64)) & MASK
    h = mix(s ^ mix(len(prompt) + 1))
    return h or 1


class Reference:
    def __init__(self, max_tokens, n_buckets, width, max_match, prompt_keys, min_prob, max_siblings, max_voters,
                 vocab=(1 << 31) - 1, counts=None):
        """counts: the count table's (keys, width, buckets, min_prob, select); None: no global source."""
        self.A, self.NB, self.W = max_tokens, n_buckets, width
        self.max_match, self.prompt_keys = max_match, list(prompt_keys)
        self.min_prob, self.G, self.V, self.vocab = min_prob, max_siblings, max_voters, vocab
        self.counts = CountReference(max_tokens, *counts, vocab) if counts else None
        self.tok, self.pid = {}, {}       # absolute position -> token, prompt hash
        self.buckets: dict[int, deque] = {}
        self.written = 0

    def insert(self, prompts, responses):
        seqs = []
        for p, r in zip(prompts, responses):
            if len(r):
                seqs.append((prompt_hash(p), list(p)[max(0, len(p) - self.max_match):] + list(r) + [END],
                             min(len(p), self.max_match)))
        total = sum(len(b) for _, b, _ in seqs)
        end = self.written + total
        pos = self.written
        if self.counts:
            self.counts.insert([(body, head) for _, body, head in seqs])
        for salt, body, _ in seqs:
            for j in range(len(body)):
                if pos >= end - self.A:
                    self.tok[pos], self.pid[pos] = body[j], salt
                    for m in self.prompt_keys:
                        if j >= m:
                            key = mix(fold(body[j - m: j]) ^ salt)
                            self.buckets.setdefault(key & (self.NB - 1), deque(maxlen=self.W)).append(pos)
                pos += 1
        self.written = end

    def _stored(self, at):
        return self.tok[at] if at >= self.written - self.A and at in self.tok else None

    def _match(self, ctx, before) -> int:
        """Common suffix of ctx and what `before(j)` reads j tokens back, up to max_match."""
        n = 0
        while n < self.max_match and n < len(ctx) and before(n) is not None and before(n) == ctx[-1 - n]:
            n += 1
        return n

    def draft(self, rows, plens, k):
        salts = [prompt_hash(r[:pl]) for r, pl in zip(rows, plens)]
        return [self._draft_row(i, rows, plens, salts, k) for i in range(len(rows))]

    def _draft_row(self, i, rows, plens, salts, k):
        ctx, n, salt = rows[i], len(rows[i]), salts[i]
        cands = {}   # key -> [length, rank, next-token function]
        for m in self.prompt_keys:
            if n < m:
                continue
            key = mix(fold(ctx[n - m:]) ^ salt)
            for pos in self.buckets.get(key & (self.NB - 1), ()):
                if pos - m < self.written - self.A or self.pid.get(pos) != salt:
                    continue
                length = self._match(ctx, lambda j, pos=pos: self._stored(pos - 1 - j))
                if length < m or ("h", pos) in cands:
                    continue
                cands[("h", pos)] = [length, pos, lambda t, pos=pos: self.tok[pos + t]
                                     if pos + t < self.written else UNKNOWN]
        group = [j for j in range(len(rows)) if salts[j] == salt]   # the rows following it, cyclically
        sibs = [group[(group.index(i) + g) % len(group)] for g in range(1, min(self.G, len(rows), len(group)))]
        for m in self.prompt_keys:
            if n < m:
                continue
            for j in sibs + [i]:
                row = rows[j]
                lo = m if j == i else max(plens[j], m)
                hits = [p for p in range(lo, len(row)) if fingerprint(row[p - m: p]) == fingerprint(ctx[n - m:])]
                for p in hits[-1:]:
                    length = self._match(ctx, lambda q, row=row, p=p: row[p - 1 - q] if p - 1 - q >= 0 else None)
                    if length < m or ("l", j, p) in cands:
                        continue
                    cands[("l", j, p)] = [length, LIVE + (j == i) * SELF + p * len(rows) + j,
                                          lambda t, row=row, p=p: row[p + t] if p + t < len(row) else UNKNOWN]
        own = max((c[0] for c in cands.values()), default=0)
        alive = sorted((c for c in cands.values() if c[0] == own), key=lambda c: -c[1])
        mine = self._vote(alive[: self.V], k)
        theirs, far = self.counts.walk(ctx, k) if self.counts else ([], 0)
        return theirs if far > own and theirs else mine

    def _vote(self, alive, k):
        """Token by token the most frequent next token of the candidates still agreeing (ties: the
        highest rank), while its share is at least min_prob."""
        out = []
        for t in range(k):
            voters = [(c, c[2](t)) for c in alive if c[2](t) != UNKNOWN]
            if not voters:
                break
            count = {}
            for _, x in voters:
                count[x] = count.get(x, 0) + 1
            _, _, x = max((count[x], c[1], x) for c, x in voters)
            if x < 0 or x >= self.vocab or count[x] / len(voters) < self.min_prob:
                break
            out.append(x)
            alive = [c for c, y in voters if y == x]
        return out


class CountReference:
    """The count table (rlspec/speculation/history/device/counts.py) over a ring of max_tokens tokens: whole
    sequences counted in, and out once the ring overwrites their start (the host store's count
    table counts the same newest sequences)."""

    def __init__(self, max_tokens, count_keys, count_width, count_buckets, count_min_prob, vocab):
        self.A, self.count_keys, self.CW, self.NC = max_tokens, list(count_keys), count_width, count_buckets
        self.count_min_prob, self.vocab = count_min_prob, vocab
        self.table: dict[int, list] = {}   # count bucket -> [(key, token, count)], highest count first
        self.seqs: deque = deque()         # (start, (body, head)) of the sequences counted
        self.written = 0

    def insert(self, seqs):
        """Sequences [(body [prompt tail | answer | END], its tail's length)] written after the others."""
        end = self.written + sum(len(b) for b, _ in seqs)
        gone = []
        while self.seqs and self.seqs[0][0] < end - self.A:
            gone.append(self.seqs.popleft()[1])
        self._count(gone, -1)
        at, whole = self.written, []
        for body, head in seqs:
            if at >= end - self.A:
                self.seqs.append((at, (body, head)))
                whole.append((body, head))
            at += len(body)
        self._count(whole, 1)
        self.written = end

    def _count(self, bodies, delta):
        """Sequences' (context, next token) pairs counted in or out of the count table at once
        (a bucket keeps its count_width of highest count after the whole batch)."""
        add = {}
        for body, head in bodies:   # contexts within the answer
            for c in self.count_keys:
                for j in range(head + c, len(body)):
                    key = fold(body[j - c: j])
                    add[key, body[j]] = add.get((key, body[j]), 0) + delta
        for b in {key & (self.NC - 1) for key, _ in add}:
            merged = {(key, x): n for key, x, n in self.table.get(b, [])}
            for (key, x), n in add.items():
                if key & (self.NC - 1) == b:
                    merged[key, x] = merged.get((key, x), 0) + n
            kept = sorted(((key, x, n) for (key, x), n in merged.items() if n > 0),
                          key=lambda e: (-e[2], signed(e[0]), e[1]))
            self.table[b] = kept[: self.CW]

    def walk(self, ctx, k):
        """(draft, match length) of the count table for a row whose tokens are ctx: the walk of
        highest score from any count key with counts, ties to the longer."""
        def hits(seq, c):
            key = fold(seq[len(seq) - c:])
            return {x: n for kk, x, n in self.table.get(key & (self.NC - 1), []) if kk == key}

        def walk(m):
            out, prob, score, seq = [], 1.0, 0.0, list(ctx)
            for t in range(k):
                got = hits(seq, max(c for c in self.count_keys if c <= m + t))
                if not got:
                    break
                n, x = max((n, -x) for x, n in got.items())
                prob *= n / sum(got.values())
                if -x < 0 or -x >= self.vocab or prob < self.count_min_prob:
                    break
                out.append(-x)
                score += prob
                seq.append(-x)
            return out, score

        starts = [c for c in self.count_keys if c <= len(ctx) and hits(ctx, c)]
        if not starts:
            return [], 0
        best = max((walk(m)[1], m) for m in starts)[1]
        return walk(best)[0], best
