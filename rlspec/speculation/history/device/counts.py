"""The device drafter's global source (rlspec/speculation/history/device/store.py): a count table over the
stored answers, as suffix decoding's global tree counts continuations, in fixed-shape tensors.

Per context of each length in `keys` within an answer, its next tokens (the answer's END among
them) with their counts, in hashed buckets of `width` (key, token, count) entries; a full bucket
keeps its highest counts. A key is the context's 64-bit hash, not its tokens: a collision (about
2^-64 a pair) may draft a wrong token, which the verification rejects. Inserts and removals run
between calls; a draft is a fixed sequence of gathers (no host sync, no loop over rows)."""
from __future__ import annotations

import numpy as np
import torch

from rlspec.speculation.history.device.memory import COUNT_WIDTH
from rlspec.speculation.history.device.ops import _C1, _P, _powers, _signed, mix

# The defaults both backends count and draft with (the host store's count table is this one:
# rlspec/speculation/history/host/counts.py)
WIDTH, MIN_PROB = COUNT_WIDTH, 0.1


class CountTable:
    """keys: context lengths counted (ascending); width: entries per bucket; buckets: their count
    (a power of two); min_prob: a draft goes on while the product of its tokens' shares is at least
    this, walked from every context length with counts, the draft of highest score (the sum of
    those products, ties to the longer: suffix decoding's choice) kept; vocab: ids at or past it
    end a draft. (The walk from the longest context alone drafted less: the count_select=longest
    row of docs/bench/history_rule_variants_counts.json.)"""

    def __init__(self, device, keys, width: int, buckets: int, min_prob: float, vocab: int):
        if buckets & (buckets - 1) or not 1 <= buckets <= 1 << 30:
            raise ValueError(f"device history: count_buckets must be a power of two up to 2^30, got {buckets}")
        if not keys:
            raise ValueError("device history: count_keys must hold a length in 1..max_match")
        self.device, self.keys, self.width, self.buckets = device, tuple(keys), int(width), int(buckets)
        self.min_prob, self.vocab = float(min_prob), int(vocab)
        self.key = torch.zeros((self.buckets, self.width), dtype=torch.int64, device=device)
        self.tok = torch.zeros((self.buckets, self.width), dtype=torch.int32, device=device)
        self.cnt = torch.zeros((self.buckets, self.width), dtype=torch.int32, device=device)
        self.levels = torch.tensor(self.keys, device=device)
        self.level_salt = torch.tensor([_signed(c * _C1) for c in self.keys], device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.key, self.tok, self.cnt))

    def clear(self) -> None:
        for t in (self.key, self.tok, self.cnt):
            t.zero_()

    def held(self) -> dict:
        """The held entries (count > 0) as they are, on the host: flat slots, keys, tokens, counts.
        A full bucket kept its highest counts as each insert came; counting the same sequences
        afresh in one merge keeps others, so an exact resume loads these."""
        at = torch.nonzero(self.cnt.view(-1) > 0)[:, 0]
        return {"at": at.cpu().numpy(), **{k: getattr(self, k).view(-1)[at].cpu().numpy()
                                           for k in ("key", "tok", "cnt")}}

    def load_held(self, held: dict) -> None:
        self.clear()
        at = torch.from_numpy(np.asarray(held["at"], np.int64)).to(self.device)
        for k in ("key", "tok", "cnt"):
            view = getattr(self, k).view(-1)
            view[at] = torch.from_numpy(np.asarray(held[k])).to(device=self.device, dtype=view.dtype)

    # -- insert and remove (between calls) ------------------------------------------------------------
    def add(self, body: torch.Tensor, sizes: torch.Tensor, heads: torch.Tensor, delta: int) -> None:
        """Sequences ([prompt tail of heads[i] tokens | answer | END], concatenated in body) counted
        in (delta 1) or out (-1) at once."""
        self._merge(*self._pairs(body, sizes, heads), delta)

    def _pairs(self, body, sizes, heads) -> tuple[torch.Tensor, torch.Tensor]:
        """(context key, next token) of every answer position with c answer tokens before it, per
        count length c (contexts lie within answers, as in suffix decoding's global tree)."""
        total, top = body.numel(), max(self.keys)
        j = torch.arange(total, device=body.device) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
        j = j - torch.repeat_interleave(heads, sizes)
        pad = torch.nn.functional.pad(body.long(), (top, 0))
        poly = torch.zeros(total, dtype=torch.int64, device=body.device)
        keys, toks, power = [], [], 1
        for c in range(1, top + 1):   # window_keys' hash of body[p-c:p], one token further back a pass
            poly = poly + (pad[top - c: top - c + total] + 3) * _signed(power)
            power = power * _P % (1 << 64)
            if c in self.keys:
                ok = j >= c
                keys.append(mix(poly[ok] ^ _signed(c * _C1)))
                toks.append(body[ok])
        return torch.cat(keys), torch.cat(toks)

    def _merge(self, key: torch.Tensor, tok: torch.Tensor, delta: int) -> None:
        """The touched buckets' entries and the pairs summed per (key, token); each bucket keeps
        its `width` of highest count (ties: the lower key, then token, as signed int64)."""
        if key.numel() == 0:
            return
        NC, W = self.buckets, self.width
        touched = torch.unique(key & (NC - 1))
        at = (touched[:, None] * W + torch.arange(W, device=key.device))[self.cnt[touched] > 0]   # held entries
        flat_key, flat_tok, flat_cnt = self.key.view(-1), self.tok.view(-1), self.cnt.view(-1)
        keys = torch.cat([flat_key[at], key])
        toks = torch.cat([flat_tok[at].long(), tok.long()])
        cnts = torch.cat([flat_cnt[at].long(), torch.full_like(key, delta)])
        order = torch.sort(toks, stable=True).indices                            # by key, then token
        order = order[torch.sort(keys[order], stable=True).indices]
        keys, toks, cnts = keys[order], toks[order], cnts[order]
        first = torch.ones_like(keys, dtype=torch.bool)
        first[1:] = (keys[1:] != keys[:-1]) | (toks[1:] != toks[:-1])
        group = torch.cumsum(first, 0) - 1
        pairs = torch.stack([keys[first], toks[first]], 1)
        cnt = torch.zeros_like(keys).index_add_(0, group, cnts)[: len(pairs)]
        pairs, cnt = pairs[cnt > 0], cnt[cnt > 0]
        # by bucket, then count down (pairs are in key, token order already: the ties')
        order = torch.sort((pairs[:, 0] & (NC - 1)) * (1 << 32) + ((1 << 32) - 1 - cnt), stable=True).indices
        pairs, cnt = pairs[order], cnt[order]
        b = pairs[:, 0] & (NC - 1)
        rank = torch.arange(len(b), device=b.device) - torch.searchsorted(b, b)
        keep = rank < W
        flat_cnt[at] = 0   # an entry of count 0 is empty: its key and token are never read
        self.key[b[keep], rank[keep]] = pairs[keep, 0]
        self.tok[b[keep], rank[keep]] = pairs[keep, 1].int()
        self.cnt[b[keep], rank[keep]] = cnt[keep].int()

    # -- draft (every engine step) --------------------------------------------------------------------
    def draft(self, ctx: torch.Tensor, n: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """From each match length m (a count length the row's context has counts for), token by token
        the most frequent next token of the context of the longest count length at most m + t
        (ties: the lower token), while the product of the shares is at least min_prob and it is a
        token; the walk of highest score kept. ctx [B, M] the rows' last tokens newest first, n [B]
        their lengths -> drafts [B, k] int32 (-1: none), m [B] (0: no context has counts)."""
        B, dev = ctx.shape[0], ctx.device
        levels, top, Lv = self.levels, max(self.keys), len(self.keys)
        seq, pw = ctx[:, :top], _powers(top, dev)
        k0 = self._keys(seq, pw)
        total = self._look(k0)[0].sum(-1)                                        # [B, Lv]
        has = (total > 0) & (n[:, None] >= levels)
        # every match length at once: rows level-major [Lv * B]
        m = levels.repeat_interleave(B)
        drafts, score = self._walk(seq.repeat(Lv, 1), k0.repeat(Lv, 1), m, has.T.reshape(-1), k, pw)
        score = torch.where(has.T.reshape(-1), score, -1.0).view(Lv, B)
        pick = Lv - 1 - score.flip(0).argmax(0)                                  # ties: the longer
        best = drafts.view(Lv, B, k).gather(0, pick[None, :, None].expand(1, B, k))[0]
        return best, torch.where(has.any(1), levels[pick], 0)

    def _keys(self, seq: torch.Tensor, pw: torch.Tensor) -> torch.Tensor:
        """[R, top] tokens newest first -> the keys of every count length [R, Lv] (window_keys' hash:
        the newest token at power 0; pw the powers of _P)."""
        return mix(torch.cumsum((seq + 3) * pw, 1)[:, self.levels - 1] ^ self.level_salt)

    def _look(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [...] -> per bucket slot: counts (0 where another key) and tokens [..., W]."""
        b = key & (self.buckets - 1)
        return torch.where(self.key[b] == key[..., None], self.cnt[b].long(), 0), self.tok[b].long()

    def _walk(self, seq, k0, m, go, k, pw) -> tuple[torch.Tensor, torch.Tensor]:
        """Walks from match lengths m [R] (rows where go): drafts [R, k] int32, scores [R]."""
        R, dev = seq.shape[0], seq.device
        drafts = torch.full((R, k), -1, dtype=torch.int32, device=dev)
        prob = torch.ones(R, dtype=torch.float64, device=dev)
        score = torch.zeros(R, dtype=torch.float64, device=dev)
        for t in range(k):
            at = torch.searchsorted(self.levels, m + t, right=True) - 1
            key = (k0 if t == 0 else self._keys(seq, pw)).gather(1, at.clamp(min=0)[:, None])[:, 0]
            cnt, tok = self._look(key)
            # the highest count, ties to the lower token: two reductions (a packed count * 2^s - token
            # key would wrap for counts the ring reaches)
            top = cnt.amax(1, keepdim=True)
            best = torch.where((cnt == top) & (cnt > 0), tok, 1 << 62).argmin(1, keepdim=True)
            x, votes = tok.gather(1, best)[:, 0], cnt.gather(1, best)[:, 0]
            share = votes.double() / cnt.sum(1).clamp(min=1).double()
            prob = prob * share   # the share first, as the host's walk and the reference
            go = go & (votes > 0) & (x >= 0) & (x < self.vocab) & (prob >= self.min_prob)
            score = score + torch.where(go, prob, 0.0)
            drafts[:, t] = torch.where(go, x, -1).int()
            seq = torch.cat([x[:, None], seq[:, :-1]], 1)
        return drafts, score


