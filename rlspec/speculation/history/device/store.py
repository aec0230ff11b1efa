"""Rollout-history drafting on the engine's device: the store's arrays are torch tensors, and a
draft for every running row is a fixed sequence of tensor operations with fixed shapes (no host
sync, no Python loop over rows: CUDA-graph safe), reading the rows' tokens from the runner's buffer.

The numba store (rlspec/speculation/history/host/store.py) drafts by this rule over hash chains
(tests/speculation/test_backends.py: the same tokens on random traces). How the structures part:
- candidates come from fixed-width hashed buckets (the newest `width` positions per key of each
  length in `prompt_keys`, salted by the prompt), not from chain walks (the store reads `width`
  links of a key's chain). The running group is read from the batch itself: per sibling row (the row
  itself included: prompt lookup) and key length, the latest position whose window has the row's
  suffix's fingerprint. A finished answer of the call stays readable until the call ends, as in the
  store: the engine's drafter keeps the finished rows and passes them after the running ones
  (propose's `done` rows, which draft nothing; the replay inserts an answer when it finishes).
- the global source is a count table over the stored answers (see DeviceHistory), the same table
  host/store.py drafts from by default (its global_index=chains walks chains of any prompt's positions
  instead).
- every candidate's match is checked token by token (a hash collision never drafts); then, as in
  host/store.py, the candidates of the longest match decide by their counts (at most max_voters of
  them, highest rank first): at each position the most frequent next token among those agreeing
  with the draft so far (ties: the highest rank), while its share is at least min_prob. The prompt's
  own sources (its store, the row, its siblings) and the global source each vote so; the global
  draft is taken where its match is longer and it drafts at least one token, the own draft
  otherwise (a global walk that stops at once falls back to the own sources).
- eviction is a ring: the oldest stored tokens are overwritten, their bucket entries dropped by a
  position check; past max_per_prompt answers of a prompt its oldest are blanked in place (their
  tokens no longer match, their bucket entries go when the ring comes round), as the store drops
  them. The ring has no min_rollouts_per_prompt (it cannot keep an old answer without copying it)
  and no resident set of prompts (the store's max_tokens policy).

The rule's measured alternatives (docs/bench/history_rule_variants_default.json, the default run's
replay at k=5, scripts/bench_history_store.py's `variants` mode) are in that file, not here: the
global source as hashed buckets voting as the prompt's own do, suffix decoding's selection per
source and match length, all sources voting together, and every recent match in the running rows
all drafted fewer tokens accepted than this rule.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlspec.speculation import GLOBAL, HISTORY, MAX_SIBLINGS, MAX_VOTERS, PROMPT, SIBLINGS
from rlspec.speculation.history.device.counts import MIN_PROB, WIDTH, CountTable
from rlspec.speculation.history.device.memory import count_buckets as default_count_buckets
from rlspec.speculation.history.device.memory import ring_buckets
from rlspec.speculation.history.device.ops import (_P, Rows, first_of, fold, last_true, leading_run, prompt_hash,
                                                   prompt_siblings, salted, window_keys, window_prints)
from rlspec.speculation.history.device.ring import EMPTY, END, RingSequences
from rlspec.speculation.history.device.state import RingCheckpoint
from rlspec.speculation.history.stats import replay_in_shadow, shadow_groups

UNKNOWN = -2  # past a running row's last token: not yet written
_LIVE = 1 << 42   # ranks: a running row's position outranks any stored one; the row itself the others
_SELF = 1 << 41
_COUNT = 1 << 48  # a vote's score: count first, rank second


@dataclass
class Candidates:
    """Per row, C candidates: where their next token is (a stored position, or row and column of
    the batch), whether the match checked out, its length and rank, and next tokens [B, C, k]."""
    valid: torch.Tensor    # [B, C] bool
    length: torch.Tensor   # [B, C] int64
    rank: torch.Tensor     # [B, C] int64
    nxt: torch.Tensor      # [B, C, k] int64 (END, UNKNOWN where nothing follows)


class DeviceHistory(RingCheckpoint):
    """The store (a ring arena of [prompt tail | response | END] sequences and hashed buckets of
    their positions) and the drafter over it, on `device`.

    max_tokens: arena tokens (responses, their prompt tails and END marks); buckets: bucket count
    (a power of two; default the arena's entries at one per key, over the width); width: entries
    per bucket (numba's max_candidates: the matches one key reads); max_siblings: rows of the
    batch read per prompt (the row itself included); max_voters: candidates of the longest match
    that vote, the highest ranked (the row itself, its siblings, then the newest stored);
    max_per_prompt: stored answers a prompt
    keeps, the newest (None: as many as the ring holds).

    global_source: whether there is a global draft: a count table over the stored answers
    (rlspec/speculation/history/device/counts.py: contexts of count_keys tokens, default 1..max_match, in
    count_buckets buckets of count_width entries, default four entries per ring token; a draft
    while the product of the shares is at least count_min_prob, from the context length of highest
    score), which follows the ring: an overwritten answer is counted out."""

    def __init__(self, device="cpu", max_tokens: int = 1 << 22, buckets: int | None = None, width: int = 64,
                 max_match: int = 16, prompt_keys=(8, 3, 1), min_prob: float = 0.5,
                 max_siblings: int = MAX_SIBLINGS, max_voters: int = MAX_VOTERS, vocab_size: int | None = None,
                 global_source: bool = True, count_keys=None, count_width: int = WIDTH,
                 count_buckets: int | None = None, count_min_prob: float = MIN_PROB,
                 max_per_prompt: int | None = None, kernels: bool | None = None):
        if not isinstance(global_source, bool):
            raise ValueError(f"device history: global_source must be true or false, got {global_source!r}")
        self.device = torch.device(device)
        # kernels.py's Triton kernels where it has them (default: on a CUDA device; elsewhere
        # Triton's interpreter runs them); the torch code otherwise, their reference
        self.kernels = self.device.type == "cuda" if kernels is None else bool(kernels)
        self.capacity, self.width = int(max_tokens), int(width)
        self.max_match = int(max_match)
        self.prompt_keys = tuple(int(m) for m in prompt_keys)
        if min(self.prompt_keys, default=1) < 1 or max(self.prompt_keys) > self.max_match:
            raise ValueError("device history: key lengths must be in 1..max_match")
        n = buckets or ring_buckets(self.capacity, len(self.prompt_keys), self.width)
        if n & (n - 1):
            raise ValueError(f"device history: buckets must be a power of two, got {n}")
        self.n_buckets = n
        self.min_prob, self.max_siblings, self.max_voters = float(min_prob), int(max_siblings), int(max_voters)
        self.vocab = int(vocab_size or (1 << 31) - 1)
        self.tok = torch.full((self.capacity,), EMPTY, dtype=torch.int32, device=self.device)
        self.pid = torch.zeros(self.capacity, dtype=torch.int64, device=self.device)
        self.table = torch.full((n, self.width), -1, dtype=torch.int64, device=self.device)
        self.fill = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.written = torch.zeros((), dtype=torch.int64, device=self.device)  # tokens ever written
        self._written = 0  # the same on the host: inserts are planned there
        self._ring = RingSequences()  # the ring's whole sequences, on the host
        if max_per_prompt is not None and int(max_per_prompt) < 1:
            raise ValueError(f"device history: max_per_prompt must be at least 1, got {max_per_prompt}")
        self.max_per_prompt = None if max_per_prompt is None else int(max_per_prompt)
        self.counts = None
        if global_source:
            keys = sorted({int(c) for c in count_keys or range(1, self.max_match + 1) if 1 <= int(c) <= self.max_match})
            self.counts = CountTable(self.device, keys, count_width,
                                     count_buckets or default_count_buckets(self.capacity, count_width), count_min_prob,
                                     self.vocab)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tok, self.pid, self.table, self.fill)) + \
            (self.counts.nbytes if self.counts else 0)

    def stored(self) -> int:
        return min(self._written, self.capacity)

    def prompts(self) -> int:
        """Prompts with an answer in the ring."""
        return len(self._ring.by_prompt)

    def shadow(self, stats, prompt_ids, response_ids, max_rows: int, k: int) -> None:
        """What drafting k tokens would have accepted in a call that drafted nothing, on up to
        about max_rows of its responses, into stats (history.stats.replay_in_shadow): the rows
        in one batch, at step t each holding its first t + 1 response tokens."""
        idx = [i for g in shadow_groups(prompt_ids, max_rows) for i in g]
        if not idx:
            return
        dev, R = self.device, len(idx)
        plen = torch.tensor([len(prompt_ids[i]) for i in idx], dtype=torch.int64, device=dev)
        rlen = torch.tensor([len(response_ids[i]) for i in idx], dtype=torch.int64, device=dev)
        tokens = torch.zeros(R, int((plen + rlen).max()) + 1, dtype=torch.int64, device=dev)
        for r, i in enumerate(idx):
            seq = list(prompt_ids[i]) + list(response_ids[i])
            tokens[r, : len(seq)] = torch.tensor(seq, dtype=torch.int64, device=dev)
        salts = prompt_hash(tokens, plen)

        def step(t: int, need: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.propose(tokens, plen + rlen.clamp(max=t + 1), salts, plen, k, need)
        replay_in_shadow(stats, step, [response_ids[i] for i in idx], k, dev)

    # -- insert (between calls) ------------------------------------------------------------------------
    def insert(self, prompts, responses) -> None:
        """Finished rollouts join the ring: each as [the prompt's last max_match tokens | response |
        END], each position p with m tokens of its sequence before it entering the bucket of its key
        for every key length m (salted by its prompt), the newest `width` kept."""
        pairs = [(np.asarray(p, np.int64), np.asarray(r, np.int64)) for p, r in zip(prompts, responses) if len(r)]
        if not pairs:
            return
        dev = self.device
        plen = torch.tensor([len(p) for p, _ in pairs], device=dev)
        pad = torch.zeros(len(pairs), int(plen.max()), dtype=torch.int64, device=dev)
        for i, (p, _) in enumerate(pairs):
            pad[i, : len(p)] = torch.from_numpy(p)
        self._insert(prompt_hash(pad, plen),
                     [np.concatenate([p[max(0, len(p) - self.max_match):], r, [END]]) for p, r in pairs],
                     [min(len(p), self.max_match) for p, _ in pairs])

    def _insert(self, salts: torch.Tensor, bodies: list[np.ndarray], heads: list[int]) -> None:
        """Sequences ([prompt tail | response | END], their prompts' salts, their tails' lengths)
        into the ring."""
        dev = self.device
        sizes = torch.tensor([len(b) for b in bodies], device=dev)
        body = torch.from_numpy(np.concatenate(bodies)).to(dev)
        total = body.numel()
        start = torch.cumsum(sizes, 0) - sizes
        j = torch.arange(total, device=dev) - torch.repeat_interleave(start, sizes)  # index within its sequence
        salt = torch.repeat_interleave(salts, sizes)
        pos = self._written + torch.arange(total, device=dev)
        new_written = self._written + total
        keep = pos >= new_written - self.capacity   # a batch over the ring writes its last tokens only
        self._track_sequences(body, sizes, torch.tensor(heads, device=dev), start, new_written, salts)
        self.tok[pos[keep] % self.capacity] = body[keep].int()
        self.pid[pos[keep] % self.capacity] = salt[keep]
        keys, ok = [], []
        for m in self.prompt_keys:
            keys.append(salted(window_keys(body[None], m)[0][:total], salt))
            ok.append(keep & (j >= m))
        key = torch.stack(keys, 1).reshape(-1)           # position-major, level-minor: insertion order
        ok = torch.stack(ok, 1).reshape(-1)
        at = pos.repeat_interleave(len(keys))[ok]
        self._add_entries(key[ok] & (self.n_buckets - 1), at)
        self._written = new_written
        self.written.fill_(new_written)
        self._bound_prompts()

    def _track_sequences(self, body, sizes, heads, start, new_written: int, salts) -> None:
        """The ring's whole sequences on the host, and the count table (global_source=counts) with
        them: sequences whose start the write overwrites leave (read before the write), the new
        ones that fit whole join. Call before the ring is written."""
        oldest = new_written - self.capacity
        self._count_out(self._ring.starting_before(oldest))
        first = self._written + start
        whole = first >= oldest
        for a, n, h, salt in zip(first[whole].tolist(), sizes[whole].tolist(), heads[whole].tolist(),
                                 salts[whole].tolist()):
            self._ring.add(a, n, h, salt)
        if self.counts is not None and bool(whole.any()):
            self.counts.add(body[torch.repeat_interleave(whole, sizes)], sizes[whole], heads[whole], 1)

    def _count_out(self, seqs: list[tuple[int, int, int]]) -> None:
        """Sequences (start, size, head) still in the ring leave the count table."""
        if self.counts is not None and seqs:
            self.counts.add(self.tok[self._positions(seqs)].long(),
                            *(torch.tensor(x, device=self.device) for x in list(zip(*seqs))[1:]), -1)

    def _positions(self, seqs) -> torch.Tensor:
        """The ring positions of sequences (start, size, ...), one after another."""
        return torch.cat([torch.zeros(0, dtype=torch.int64, device=self.device)] + [
            torch.arange(a, a + n, device=self.device) for a, n, *_ in seqs]) % self.capacity

    def _bound_prompts(self) -> None:
        """Past max_per_prompt answers a prompt's oldest leave: counted out, their tokens blanked
        (EMPTY matches no context: their bucket entries draft nothing until the ring overwrites them)."""
        if self.max_per_prompt is None:
            return
        drop = self._ring.over_bound(self.max_per_prompt)
        if drop:
            self._count_out(drop)
            self.tok[self._positions(drop)] = EMPTY

    def _add_entries(self, bucket: torch.Tensor, pos: torch.Tensor) -> None:
        """Append positions to their buckets in the given order; a bucket keeps its newest `width`."""
        if bucket.numel() == 0:
            return
        b, order = torch.sort(bucket, stable=True)
        p = pos[order]
        count = torch.bincount(b, minlength=self.n_buckets)
        first = torch.searchsorted(b, b, right=False)
        rank = torch.arange(b.numel(), device=b.device) - first
        keep = rank >= count[b] - self.width
        slot = (self.fill[b] + rank) % self.width
        self.table[b[keep], slot[keep]] = p[keep]
        self.fill += count

    # -- propose (every engine step) ------------------------------------------------------------------
    def propose(self, token_ids: torch.Tensor, lengths: torch.Tensor, prompt_ids: torch.Tensor,
                prompt_lens: torch.Tensor, k: int, active: torch.Tensor | None = None, sources: bool = False,
                done: int = 0, at: torch.Tensor | None = None, table=None,
                siblings: tuple | None = None) -> tuple[torch.Tensor, ...]:
        """Drafts for every row: token_ids [B, L] (row i's first lengths[i] tokens, prompt_lens[i]
        of them its prompt, prompt_ids[i] its prompt_hash), active [B] (rows to draft for; default
        all) -> drafts [B, k] int32 (-1: none), and their leading valid counts [B] int32; with
        sources, each drafted token's source [B, k] too (speculation.SOURCES'
        index, -1 past the draft). The last `done` rows are answers of the call that finished: their
        running siblings read them (prompt_siblings), nothing drafts for them.

        With at [B], row i is token_ids[at[i]] (the drafter's slots, live.LiveRows), and with
        table (their live.LiveTable) the rows' own and siblings' matches are looked up in it
        instead of scanned: the same drafts, reading no row whole. siblings: the rows'
        ops.prompt_siblings, where the caller keeps them (live.LiveRows.siblings)."""
        n = lengths.long()
        if done:
            keep = torch.arange(n.shape[0], device=n.device) < n.shape[0] - done
            active = keep if active is None else active & keep
        got = self.source_drafts(token_ids, lengths, prompt_ids, prompt_lens, k, active, sources=sources, done=done,
                                 at=at, table=table, siblings=siblings)
        own, own_best, far, far_best = got[:4]
        use_far = (far_best > own_best) & (far[:, 0] >= 0)
        drafts = torch.where(use_far[:, None], far, own)
        if not sources:
            return drafts, (drafts >= 0).sum(1).int()
        src = torch.where(drafts < 0, -1, torch.where(use_far[:, None], GLOBAL, got[4]))
        return drafts, (drafts >= 0).sum(1).int(), src

    def source_drafts(self, token_ids, lengths, prompt_ids, prompt_lens, k: int, active=None, sources=False, done=0,
                      at=None, table=None, siblings=None):
        """Each source's draft and match length: the prompt's own sources (its store, the row, its
        siblings; their longest match votes) and the global one (the count table's walk; none
        without a global source) -> own [B, k], own_best [B], far [B, k], far_best [B] (drafts
        int32, -1: none); with sources, also each own token's source [B, k] (its highest-ranked
        voter's: HISTORY, SIBLINGS or PROMPT, the row itself). at, table, siblings: as propose's."""
        n = lengths.long()
        rows = Rows(token_ids, at)
        ctx = self._context(rows, n)                                             # [B, M]
        p, row = self.live_positions(rows, n, prompt_ids.long(), prompt_lens.long(), ctx, done, table, siblings)
        if self.kernels:   # the candidates, their longest match and its vote in one kernel
            from rlspec.speculation.history.device.kernels import own_draft
            drafts, own_best, won = own_draft(self, rows, ctx, n, prompt_ids.long(), p, row, k, active)
            own_best = own_best[:, None]
        else:
            hist = self._stored_candidates(n, prompt_ids.long(), ctx, k)
            live = self._live_candidates(rows, n, ctx, p, row, k)
            valid, length, rank, nxt = (torch.cat([a, b], 1) for a, b in (
                (hist.valid, live.valid), (hist.length, live.length), (hist.rank, live.rank), (hist.nxt, live.nxt)))
            if active is not None:
                valid = valid & active[:, None]
            own_best = torch.where(valid, length, 0).amax(1, keepdim=True)
            drafts, won = self._vote(*self._voters(valid & (length == own_best), rank, nxt, k), k, ranks=True)
        if self.counts is not None and self.kernels:   # (an inactive row's match length is 0: it drafts nothing)
            from rlspec.speculation.history.device.kernels import count_walk
            far_draft, far_len = count_walk(self.counts, ctx, n, k, active)
        elif self.counts is not None:
            far_draft, far_len = self.counts.draft(ctx, n, k)
            if active is not None:
                far_draft = torch.where(active[:, None], far_draft, -1)
        else:
            far_draft, far_len = torch.full_like(drafts, -1), torch.zeros_like(own_best[:, 0])
        out = drafts, own_best[:, 0], far_draft, far_len
        if not sources:
            return out
        live = won >= _LIVE
        return *out, torch.where(live, torch.where(won - _LIVE >= _SELF, PROMPT, SIBLINGS), HISTORY)

    def _voters(self, alive, rank, nxt, k):
        """The max_voters of highest rank among the alive candidates [B, C]: alive, rank [B, V],
        nxt [B, V, k]."""
        top = torch.where(alive, rank, -1).topk(min(self.max_voters, alive.shape[1]), 1)
        return top.values >= 0, top.values, nxt.gather(1, top.indices[:, :, None].expand(-1, -1, k))

    def _context(self, rows: "Rows", n: torch.Tensor) -> torch.Tensor:
        """The rows' last max_match tokens, newest first: [B, M] (-5 before a row's start)."""
        back = n[:, None] - 1 - torch.arange(self.max_match, device=n.device)
        got = rows.read(torch.arange(n.shape[0], device=n.device)[:, None], back.clamp(min=0)).long()
        return torch.where(back >= 0, got, -5)

    def _stored_candidates(self, n, salt, ctx, k) -> Candidates:
        """The bucket entries of the rows' keys, per prompt key length (salted): [B, levels * width]
        candidates."""
        dev, W = n.device, self.width
        entries, needs = [], []
        for m in self.prompt_keys:
            e = self.table[salted(fold(ctx[:, :m].flip(1), m), salt) & (self.n_buckets - 1)]   # [B, W]
            entries.append(torch.where((n >= m)[:, None], e, -1))
            needs.append(torch.full((W,), m, device=dev))
        pos = torch.cat(entries, 1)                                              # [B, C]
        need = torch.cat(needs)[None]
        oldest = (self.written - self.capacity).clamp(min=0)
        valid = (pos >= 0) & (pos - need >= oldest)
        valid = valid & (self.pid[pos.clamp(min=0) % self.capacity] == salt[:, None])
        back = pos[:, :, None] - 1 - torch.arange(self.max_match, device=dev)
        src = torch.where(back >= oldest, self.tok[back.clamp(min=0) % self.capacity].long(), -6)
        length = leading_run(src == ctx[:, None, :])
        valid = valid & (length >= need)
        fwd = pos[:, :, None] + torch.arange(k, device=dev)
        nxt = self.tok[fwd.clamp(min=0) % self.capacity].long()
        nxt = torch.where(fwd < self.written, nxt, UNKNOWN)
        return Candidates(first_of(valid, pos), length, pos, nxt)

    def live_positions(self, rows: "Rows", n, salt, plen, ctx, done=0, table=None, siblings=None):
        """Per prompt key length m, the latest position p whose m tokens before it have the row's
        last m tokens' fingerprint: in the row itself (any position), and in each of its
        max_siblings - 1 siblings (an answer position), the rows of its prompt that follow it in the
        group's order, cyclically (prompt_siblings: every row of a group larger than max_siblings
        reads as many siblings as the host store's walk takes; the call's finished answers, the last
        `done` rows, spread among the running ones). Found by _scan_matches, or with table by its
        lookups (_table_matches). -> p [B, G * levels] (-1: none), level-major, each level's G-1
        siblings then the row itself, and the rows they are in, row [B, G * levels]."""
        B = n.shape[0]
        dev, G = n.device, min(self.max_siblings, B)
        sib, reader, listed = siblings or prompt_siblings(salt, G, done)            # [B, G-1] each
        idx = torch.arange(B, device=dev)
        find = self._scan_matches if table is None else self._table_matches
        cands, levels = [], self.prompt_keys
        for li, m in enumerate(levels):
            p_sib, p_self = find(rows, n, plen, ctx, sib, reader, li, m, table)
            ok = torch.cat([listed, listed.new_ones(B, 1)], 1) & (n >= m)[:, None]
            cands.append(torch.where(ok, torch.cat([p_sib, p_self[:, None]], 1), -1))
        return torch.cat(cands, 1), torch.cat([sib, idx[:, None]], 1).repeat(1, len(levels))

    def _live_candidates(self, rows: "Rows", n, ctx, p, row, k) -> Candidates:
        """The candidates at the live positions p in rows `row` (live_positions): the match checked
        token by token, the next k tokens, ranked the row itself first, then the latest."""
        B, L = n.shape[0], rows.tok.shape[1]
        dev, G = n.device, p.shape[1] // len(self.prompt_keys)
        idx = torch.arange(B, device=dev)
        need = torch.cat([torch.full((G,), m, device=dev) for m in self.prompt_keys])[None]   # no host copy
        is_self = row == idx[:, None]
        back = p[:, :, None] - 1 - torch.arange(self.max_match, device=dev)
        src = rows.read(row[:, :, None], back.clamp(min=0)).long()
        length = leading_run(torch.where(back >= 0, src, -6) == ctx[:, None, :])
        valid = (p >= 0) & (length >= need)
        fwd = p[:, :, None] + torch.arange(k, device=dev)
        nxt = rows.read(row[:, :, None], fwd.clamp(min=0, max=L - 1)).long()
        nxt = torch.where(fwd < n[row][:, :, None], nxt, UNKNOWN)
        rank = _LIVE + is_self * _SELF + p.clamp(min=0) * B + row
        valid = first_of(valid, row * (L + 1) + p)
        return Candidates(valid, length, rank, nxt)

    @staticmethod
    def _scan_matches(rows, n, plen, ctx, sib, reader, li, m, table):
        """Each row's window fingerprints compared with the queries of the rows that read it:
        [B, G-1, L+1], no gather of rows (but every row read whole). p_sib [B, G-1] (row i's match
        in sib[i, g]) and p_self [B]."""
        tokens = rows.whole()
        B, L = tokens.shape
        cols = torch.arange(L + 1, device=n.device)
        before_end = cols < n[:, None]
        win = window_prints(tokens, m) << 1                                      # [B, L+1], low bit: may match
        query = win.gather(1, n[:, None].clamp(max=L)) | 1                       # [B, 1]
        as_sibling = win | (before_end & (cols >= plen[:, None].clamp(min=m)))
        as_self = win | (before_end & (cols >= m))
        # in row j, the latest match of the query of reader[j, g], whose g-th sibling j is
        hit = as_sibling[:, None, :] == query[:, 0][reader][:, :, None]          # [B, G-1, L+1]
        found = last_true(hit)                                                   # [B, G-1]
        p_sib = found[sib, torch.arange(sib.shape[1], device=n.device)[None]]    # [B, G-1]: row i's in sib[i, g]
        return p_sib, last_true(as_self == query)

    @staticmethod
    def _table_matches(rows, n, plen, ctx, sib, reader, li, m, table):
        """_scan_matches' answer from the rows' live table: a lookup per row and sibling."""
        q = torch.zeros_like(n)
        for j in range(m):   # the row's last m tokens, oldest first, as window_prints folds them
            q = q * _P + (ctx[:, m - 1 - j] + 3)
        q = q << 1
        B, S = sib.shape
        p_sib = table.latest(rows.at[sib].reshape(-1), li, q[:, None].expand(B, S).reshape(-1),
                             n[sib].reshape(-1), plen[sib].clamp(min=m).reshape(-1)).view(B, S)
        return p_sib, table.latest(rows.at, li, q, n, torch.full_like(n, m))

    def _vote(self, alive, rank, nxt, k, ranks: bool = False):
        """Token by token: the most frequent next token among the candidates still agreeing (ties:
        the highest rank), kept while its share is at least min_prob and it is a token. alive,
        rank [B, V], nxt [B, V, k] -> drafts [B, k] int32 (-1: none). With ranks: each token's
        highest-ranked voter's rank [B, k] returned too (its source)."""
        B = alive.shape[0]
        drafts = torch.full((B, k), -1, dtype=torch.int32, device=alive.device)
        won = torch.full((B, k), -1, dtype=torch.int64, device=alive.device) if ranks else None
        go = torch.ones(B, dtype=torch.bool, device=alive.device)
        for t in range(k):
            x = nxt[:, :, t]
            voters = alive & (x != UNKNOWN)
            count = ((x[:, :, None] == x[:, None, :]) & voters[:, None, :]).sum(2)   # [B, V]
            best = torch.where(voters, count * _COUNT + rank, -1).argmax(1, keepdim=True)
            tok, votes = x.gather(1, best)[:, 0], count.gather(1, best)[:, 0]
            share = votes.double() / voters.sum(1).clamp(min=1).double()
            go = go & (votes > 0) & (tok >= 0) & (tok < self.vocab) & (share >= self.min_prob)
            drafts[:, t] = torch.where(go, tok, -1).int()
            if ranks:
                won[:, t] = rank.gather(1, best)[:, 0]
            alive = voters & (x == tok[:, None])
        return (drafts, won) if ranks else drafts
