"""The device drafter's Triton kernels, no host sync, each tested in Triton's interpreter against
the torch code it stands for (tests/speculation/test_device_live.py, test_device_kernels.py):
live.py's LiveTable append, a step's live lookups (store.py's live_positions through the table),
the own draft (the candidates and their vote) and the count table's walk (counts.CountTable.draft),
each a program a row. Hashes in uint64 arithmetic, which wraps by definition in Triton and numpy alike,
as the torch code's int64 arithmetic wraps."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlspec.speculation.history.device.ops import Rows

BLOCK = 64
OWN_WARPS = 8   # _own_draft's: at 4, ptxas spills three times the bytes a thread


@triton.jit
def _mix(h):
    """ops.mix (murmur3's finaliser) on uint64."""
    h = h ^ (h >> 33)
    h = h * 0xFF51AFD7ED558CCD
    h = h ^ (h >> 33)
    h = h * 0xC4CEB9FE1A85EC53
    return h ^ (h >> 33)


@triton.jit
def _prefix(ctx_ptr, r, M: tl.constexpr, MB: tl.constexpr):
    """Row r's context (ctx [B, M], newest first) and pre [MB]: pre[c - 1] the polynomial of its
    newest c tokens, the newest at power 0 (ops.window_prints' fingerprint; uint64, wrapping)."""
    j = tl.arange(0, MB)
    ctx = tl.load(ctx_ptr + r * M + j, mask=j < M, other=-7)
    pw = tl.full([MB], 1, tl.uint64)
    for e in tl.static_range(MB - 1):
        pw = tl.where(j > e, pw * 0x100000001B3, pw)
    return ctx, pw, tl.cumsum((ctx.to(tl.uint64, bitcast=True) + 3) * pw, 0)


@triton.jit
def _newest(fp_ptr, used_ptr, head_ptr, prev_ptr, base, pbase, q, n, lo, go, H: tl.constexpr):
    """LiveTable.latest for a block of queries q (their tables at base, links at pbase; the lanes
    `go` look): the newest position c < n with print q, or -1 where it is below lo or absent."""
    h = (_mix(q.to(tl.uint64, bitcast=True)) & (H - 1)).to(tl.int64)
    at = h * 0 - 1
    active = go
    while tl.max(active.to(tl.int32), 0) > 0:
        used = tl.load(used_ptr + base + h, mask=active, other=0) != 0
        fp = tl.load(fp_ptr + base + h, mask=active, other=0)
        at = tl.where(active & used & (fp == q), h, at)
        active = active & used & (fp != q)
        h = (h + 1) & (H - 1)
    c = tl.load(head_ptr + base + tl.maximum(at, 0), mask=go & (at >= 0), other=-1).to(tl.int64)
    back = tl.load(prev_ptr + pbase + tl.maximum(c, 0), mask=go & (c >= n), other=-1).to(tl.int64)
    c = tl.where(c >= n, back, c)   # the row's own end: the position before
    return tl.where(go & (c >= lo) & (c >= 0), c, -1)


@triton.jit
def _append(fp_ptr, used_ptr, head_ptr, prev_ptr, tok_ptr, tok_stride, trow_ptr, slot_ptr, lo_ptr, hi_ptr, keys_ptr,
            dst_ptr, dst_stride, n_ptr, W, K: tl.constexpr, H: tl.constexpr, LP: tl.constexpr, COPY: tl.constexpr,
            TABLE: tl.constexpr, CB: tl.constexpr):
    """One program a row: its positions lo+1..hi linked in order, every key length, into its slot's
    table (its tokens: row trow of tok). With COPY, lo is the slot's length, hi the row's new length
    (at most W), and the tokens in [lo, hi) are first copied into the slot's row of dst, the
    slot's length set to hi (LiveRows._advance)."""
    r = tl.program_id(0)
    s = tl.load(slot_ptr + r).to(tl.int64)
    row = tok_ptr + tl.load(trow_ptr + r).to(tl.int64) * tok_stride
    if COPY:
        lo = tl.load(n_ptr + s)
        hi = tl.minimum(tl.load(hi_ptr + r).to(tl.int64), W)
        c0 = lo
        while c0 < hi:
            cols = c0 + tl.arange(0, CB)
            tl.store(dst_ptr + s * dst_stride + cols, tl.load(row + cols, mask=cols < hi, other=0), mask=cols < hi)
            c0 += CB
        tl.store(n_ptr + s, hi)
    else:
        lo = tl.load(lo_ptr + r).to(tl.int64)
        hi = tl.load(hi_ptr + r).to(tl.int64)
    if TABLE:
        for li in range(K):
            m = tl.load(keys_ptr + li).to(tl.int64)
            base = (s * K + li) * H
            pbase = (s * K + li) * LP
            c = tl.maximum(lo + 1, m)
            while c <= hi:
                q = tl.zeros((), dtype=tl.uint64)
                j = c - m
                while j < c:
                    q = q * 0x100000001B3 + (tl.load(row + j).to(tl.uint64) + 3)
                    j += 1
                q = (q << 1).to(tl.int64, bitcast=True)
                h = (_mix(q.to(tl.uint64, bitcast=True)) & (H - 1)).to(tl.int64)
                used = tl.load(used_ptr + base + h) != 0
                while used and tl.load(fp_ptr + base + h) != q:
                    h = (h + 1) & (H - 1)
                    used = tl.load(used_ptr + base + h) != 0
                if not used:
                    tl.store(used_ptr + base + h, 1)
                    tl.store(fp_ptr + base + h, q)
                tl.store(prev_ptr + pbase + c, tl.load(head_ptr + base + h, mask=used, other=-1))
                tl.store(head_ptr + base + h, c.to(tl.int32))
                c += 1


def _append_launch(table, slot, tok, trow, lo, hi, keys, dst=None, n=None) -> None:
    B = slot.shape[0]
    if B == 0:
        return
    copy = dst is not None
    dst, n = (dst, n) if copy else (tok, slot)   # (unread without COPY)
    tables = (table.fp, table.used, table.head, table.prev) if table is not None else (n,) * 4   # (unread)
    _append[(B,)](*tables, tok, tok.stride(0), trow, slot, lo, hi, keys, dst, dst.stride(0), n, dst.shape[1],
                  K=keys.shape[0], H=table.H if table is not None else 1,
                  LP=table.prev.shape[2] if table is not None else 1, COPY=copy, TABLE=table is not None, CB=8)


def append(table, slot: torch.Tensor, tokens: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """LiveTable.append in one launch: a program a row (tokens [slots, L], read at each row's slot)."""
    keys = torch.tensor(table.keys, dtype=torch.int64, device=tokens.device)
    _append_launch(table, slot.long(), tokens, slot.long(), lo.long(), hi.long(), keys)


def advance(live, slot: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor, lengths: torch.Tensor,
            keys: torch.Tensor) -> None:
    """LiveRows._advance in one launch, a program a row: each slot's tokens from its length to
    lengths (at most the rows' width) copied from row src_rows of the runner's buffer src, its
    length set, and with live's table its new positions linked (their tokens read from src)."""
    _append_launch(live.table, slot, src, src_rows, slot, lengths, keys, live.tok, live.n)


@triton.jit
def _count_walk(ctx_ptr, n_ptr, act_ptr, levels_ptr, key_ptr, tok_ptr, cnt_ptr, out_ptr, m_ptr, min_prob_ptr, vocab,
                NB, M: tl.constexpr, LV: tl.constexpr, K: tl.constexpr, W: tl.constexpr, MB: tl.constexpr,
                KB: tl.constexpr, WB: tl.constexpr):
    """One program a row: CountTable.draft's walk from every count length the row's context has
    counts for, the walk of highest score kept (ties: the longer)."""
    r = tl.program_id(0)
    min_prob = tl.load(min_prob_ptr)   # float64 (a Python float would reach the kernel as float32)
    n = tl.load(n_ptr + r)
    act = tl.load(act_ptr + r) != 0
    j = tl.arange(0, MB)
    _, pw, pre = _prefix(ctx_ptr, r, M, MB)   # pw[j] = P^j; pre[c - 1]: the context's newest c tokens
    i = tl.arange(0, KB)
    w = tl.arange(0, WB)
    best_score = tl.full([], -2.0, tl.float64)
    best = tl.full([KB], -1, tl.int64)
    best_m = tl.full([], 0, tl.int64)
    for li in range(LV):
        m = tl.load(levels_ptr + li)
        prob = tl.full([], 1.0, tl.float64)
        score = tl.full([], 0.0, tl.float64)
        go = act & (n >= m)
        xs = tl.full([KB], 0, tl.uint64)       # the walk's tokens so far, xs[t] its t-th
        drafts = tl.full([KB], -1, tl.int64)
        has = go
        for t in tl.static_range(K):
            # the longest count length at most m + t
            at = li
            for l2 in range(LV):
                at = tl.where(tl.load(levels_ptr + l2) <= m + t, l2, at)
            c = tl.load(levels_ptr + at)
            # the hash of the c newest tokens of [xs[t-1], ..., xs[0], ctx...]: the walk's newest
            # min(c, t) tokens, then P^t times the context's newest c - t
            back = tl.sum(tl.where(j[None, :] == (t - 1 - i)[:, None], pw[None, :], 0), 1)   # P^(t-1-i)
            d = tl.sum(tl.where((i < t) & (t - 1 - i < c), (xs + 3) * back, 0), 0)
            rest = tl.sum(tl.where(j == c - t - 1, pre, 0), 0)
            pt = tl.sum(tl.where(j == t, pw, 0), 0)
            h = d + tl.where(c > t, pt * rest, 0)
            h = h ^ (c.to(tl.uint64) * 0x9E3779B97F4A7C15)
            h = h ^ (h >> 33)
            h = h * 0xFF51AFD7ED558CCD
            h = h ^ (h >> 33)
            h = h * 0xC4CEB9FE1A85EC53
            h = h ^ (h >> 33)
            key = h.to(tl.int64, bitcast=True)
            b = key & (NB - 1)
            # a walk that stopped (or a row not drafting) reads nothing more: its later tokens are -1
            # whatever the token it carries on with
            live = (w < W) & (go.to(tl.int32) + tl.zeros([WB], tl.int32) != 0)
            ek = tl.load(key_ptr + b * W + w, mask=live, other=0)
            et = tl.load(tok_ptr + b * W + w, mask=live, other=0).to(tl.int64)
            ec = tl.where(live & (ek == key), tl.load(cnt_ptr + b * W + w, mask=live, other=0).to(tl.int64), 0)
            top = tl.max(ec, 0)
            tie = (ec == top) & (ec > 0)
            x = tl.min(tl.where(tie, et, 1 << 62), 0)
            votes = tl.where(tl.max(tie.to(tl.int32), 0) > 0, top, 0)
            x = tl.where(votes > 0, x, tl.sum(tl.where(w == 0, et, 0), 0))
            share = votes.to(tl.float64) / tl.maximum(tl.sum(ec, 0), 1).to(tl.float64)
            prob = prob * share
            if t == 0:
                has = has & (votes > 0)
            go = go & (votes > 0) & (x >= 0) & (x < vocab) & (prob >= min_prob)
            score = score + tl.where(go, prob, tl.full([], 0.0, tl.float64))
            drafts = tl.where(i == t, tl.where(go, x, -1), drafts)
            xs = tl.where(i == t, x.to(tl.uint64, bitcast=True), xs)
        score = tl.where(has, score, tl.full([], -1.0, tl.float64))
        take = score >= best_score
        best_score = tl.where(take, score, best_score)
        best = tl.where(take, drafts, best)
        best_m = tl.where(take & has, m, tl.where(take, 0, best_m))
    tl.store(out_ptr + r * K + i, best.to(tl.int32), mask=i < K)
    tl.store(m_ptr + r, best_m)


def count_walk(counts, ctx: torch.Tensor, n: torch.Tensor, k: int, active: torch.Tensor | None = None, out=None,
               min_prob: torch.Tensor | None = None):
    """CountTable.draft in one launch (a program a row); rows not active draft nothing. out: the
    drafts [B, k] int32 and lengths [B] to write (default new)."""
    B, M = ctx.shape
    out, m = out or (torch.empty((B, k), dtype=torch.int32, device=ctx.device),
                     torch.empty(B, dtype=torch.int64, device=ctx.device))
    act = torch.ones(B, dtype=torch.bool, device=ctx.device) if active is None else active
    if B == 0 or k == 0:
        return out, m.zero_()
    if min_prob is None:
        min_prob = torch.tensor([counts.min_prob], dtype=torch.float64, device=ctx.device)
    # no fused multiply-adds: the walk's products and sums round as the torch code's do
    _count_walk[(B,)](ctx.long().contiguous(), n.long().contiguous(), act.to(torch.int8).contiguous(), counts.levels,
                      counts.key, counts.tok, counts.cnt, out, m, min_prob, counts.vocab, counts.buckets, M=M,
                      LV=len(counts.keys), K=k, W=counts.width, MB=triton.next_power_of_2(max(M, k + 1)),
                      KB=triton.next_power_of_2(max(k, 2)), WB=triton.next_power_of_2(max(counts.width, 2)),
                      enable_fp_fusion=False)
    return out, m


@triton.jit
def _own_draft(ctx_ptr, n_ptr, salt_ptr, act_ptr, keys_ptr, ring_tok_ptr, ring_pid_ptr, table_ptr, written, oldest,
               cap, NB, p_ptr, row_ptr, at_ptr, rows_tok_ptr, rows_stride, L, min_prob_ptr, vocab, B,
               drafts_ptr, won_ptr, best_ptr, M: tl.constexpr, LP: tl.constexpr, W: tl.constexpr, GL: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, CB: tl.constexpr, MB: tl.constexpr, KB: tl.constexpr):
    """One program a row: store.py's own draft (its stored and live candidates, the longest
    match's voters and their vote), as DeviceHistory.source_drafts computes it in torch."""
    r = tl.program_id(0)
    n = tl.load(n_ptr + r)
    salt = tl.load(salt_ptr + r)
    act = tl.load(act_ptr + r) != 0
    min_prob = tl.load(min_prob_ptr)
    j = tl.arange(0, MB)
    ctx, _, pre = _prefix(ctx_ptr, r, M, MB)   # pre[m - 1]: the newest m tokens' polynomial
    c = tl.arange(0, CB)
    act_c = (tl.zeros([CB], tl.int32) + act.to(tl.int32)) != 0   # a block: the interpreter refuses scalar masks
    SW: tl.constexpr = LP * W
    G: tl.constexpr = GL // LP
    stored = c < SW
    live = (c >= SW) & (c < SW + GL)
    lvl = tl.where(stored, c // W, (c - SW) // G)
    m = tl.load(keys_ptr + lvl, mask=stored | live, other=1)
    # the stored candidates: the bucket entries of the row's key of each length, salted by its prompt
    h = tl.sum(tl.where(j[None, :] == (m - 1)[:, None], pre[None, :], 0), 1)
    h = _mix(h ^ (m.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15))
    h = _mix(h ^ salt.to(tl.uint64, bitcast=True))
    bucket = h.to(tl.int64, bitcast=True) & (NB - 1)
    # a row that drafts nothing (a finished answer) reads nothing: its candidates are all empty
    e = tl.load(table_ptr + bucket * W + c % W, mask=stored & (n >= m) & act_c, other=-1)
    pid = tl.load(ring_pid_ptr + tl.maximum(e, 0) % cap, mask=stored & (e >= 0), other=0)
    # the live candidates: positions p in rows `row` of the batch (slots at[row])
    lc = tl.where(live, c - SW, 0)
    p = tl.load(p_ptr + r * GL + lc, mask=live & act_c, other=-1)
    row = tl.load(row_ptr + r * GL + lc, mask=live, other=0)
    slot = tl.load(at_ptr + row, mask=live & (p >= 0), other=0)
    n_row = tl.load(n_ptr + row, mask=live & (p >= 0), other=0)
    # each candidate's tokens before it, against the row's context (newest first)
    back = tl.where(stored, e, p)[:, None] - 1 - j[None, :]
    jm = (j < M)[None, :]
    s_tok = tl.load(ring_tok_ptr + tl.maximum(back, 0) % cap, mask=stored[:, None] & jm & (back >= oldest),
                    other=-6).to(tl.int64)
    l_tok = tl.load(rows_tok_ptr + slot[:, None] * rows_stride + tl.maximum(back, 0),
                    mask=live[:, None] & jm & (back >= 0), other=-6).to(tl.int64)
    src = tl.where(stored[:, None], tl.where(back >= oldest, s_tok, -6), tl.where(back >= 0, l_tok, -6))
    eq = (src == ctx[None, :]) & jm
    length = tl.min(tl.where(eq | ~jm, M, j[None, :]), 1)     # the leading run of matches
    # and the k after it
    kk = tl.arange(0, KB)
    fwd = tl.where(stored, e, p)[:, None] + kk[None, :]
    km = (kk < K)[None, :]
    s_nxt = tl.load(ring_tok_ptr + tl.maximum(fwd, 0) % cap, mask=(stored & (e >= 0))[:, None] & km,
                    other=0).to(tl.int64)
    l_nxt = tl.load(rows_tok_ptr + slot[:, None] * rows_stride + tl.minimum(tl.maximum(fwd, 0), L - 1),
                    mask=(live & (p >= 0))[:, None] & km, other=0).to(tl.int64)
    nxt = tl.where(stored[:, None], tl.where(fwd < written, s_nxt, -2), tl.where(fwd < n_row[:, None], l_nxt, -2))
    valid = tl.where(stored, (e >= 0) & (e - m >= oldest) & (pid == salt), p >= 0) & (length >= m)
    rank = tl.where(stored, e, (1 << 42) + tl.where(row == r, 1 << 41, 0) + tl.maximum(p, 0) * B + row)
    # first_of: a candidate whose key an earlier valid one holds is dropped (stored: its position;
    # live: its row and position)
    key = tl.where(stored, e, (1 << 62) + row * (L + 1) + p)
    earlier = (c[None, :] < c[:, None]) & valid[None, :] & (key[None, :] == key[:, None])
    valid = valid & (tl.max(earlier.to(tl.int32), 1) == 0) & act
    best = tl.max(tl.where(valid, length, 0), 0)
    alive = valid & (length == best)
    # the max_voters of highest rank vote
    above = tl.sum((alive[None, :] & (rank[None, :] > rank[:, None])).to(tl.int32), 1)
    alive = alive & (above < V)
    go = best > 0
    drafts = tl.full([KB], -1, tl.int64)
    won = tl.full([KB], -1, tl.int64)
    for t in tl.static_range(K):
        x = tl.sum(tl.where(kk[None, :] == t, nxt, 0), 1)
        voters = alive & (x != -2)
        count = tl.sum(((x[None, :] == x[:, None]) & voters[None, :]).to(tl.int64), 1)
        score = tl.where(voters, count * (1 << 48) + rank, -1)
        top = tl.argmax(score, 0)
        tok = tl.sum(tl.where(c == top, x, 0), 0)
        votes = tl.sum(tl.where(c == top, count, 0), 0)
        share = votes.to(tl.float64) / tl.maximum(tl.sum(voters.to(tl.int64), 0), 1).to(tl.float64)
        go = go & (votes > 0) & (tok >= 0) & (tok < vocab) & (share >= min_prob)
        drafts = tl.where(kk == t, tl.where(go, tok, -1), drafts)
        won = tl.where(kk == t, tl.sum(tl.where(c == top, rank, 0), 0), won)
        alive = voters & (x == tok)
    tl.store(drafts_ptr + r * K + kk, drafts.to(tl.int32), mask=kk < K)
    tl.store(won_ptr + r * K + kk, won, mask=kk < K)
    tl.store(best_ptr + r, best)


def own_draft(h, rows, ctx: torch.Tensor, n: torch.Tensor, salt: torch.Tensor, p: torch.Tensor, row: torch.Tensor,
              k: int, active: torch.Tensor | None = None, out=None, consts=None):
    """DeviceHistory's own draft in one launch (a program for each of ctx's B rows, the first B
    of n's; the candidates' rows may be any of n's): the stored candidates of its
    buckets and the live ones at p in rows `row` (live_positions), checked, deduplicated, the
    longest match's max_voters of highest rank voting token by token -> drafts [B, k] int32,
    own_best [B] and each drafted token's top voter's rank [B, k] (its source). out: those three to
    write (default new); consts: the prompt key lengths and min_prob on the device (default made)."""
    B, M = ctx.shape
    dev = ctx.device
    drafts, best, won = out or (torch.empty((B, k), dtype=torch.int32, device=dev),
                                torch.empty(B, dtype=torch.int64, device=dev),
                                torch.empty((B, k), dtype=torch.int64, device=dev))
    if B == 0 or k == 0:
        return drafts, best.zero_(), won
    act = torch.ones(B, dtype=torch.bool, device=dev) if active is None else active
    R = n.shape[0]   # the rows the candidates are in (ctx's B first): the ranks' base
    at = torch.arange(R, device=dev) if rows.at is None else rows.at
    keys, min_prob = consts or (torch.tensor(h.prompt_keys, dtype=torch.int64, device=dev),
                                torch.tensor([h.min_prob], dtype=torch.float64, device=dev))
    written = h._written
    LP, GL = len(h.prompt_keys), p.shape[1]
    _own_draft[(B,)](ctx.long().contiguous(), n.long().contiguous(), salt.long().contiguous(),
                     act.to(torch.int8).contiguous(), keys, h.tok, h.pid, h.table, written,
                     max(written - h.capacity, 0), h.capacity, h.n_buckets, p.long().contiguous(),
                     row.long().contiguous(), at.long().contiguous(), rows.tok, rows.tok.stride(0), rows.tok.shape[1],
                     min_prob, h.vocab, R, drafts, won, best, M=M, LP=LP, W=h.width, GL=GL, K=k, V=h.max_voters,
                     CB=triton.next_power_of_2(LP * h.width + GL), MB=triton.next_power_of_2(max(M, 2)),
                     KB=triton.next_power_of_2(max(k, 2)), enable_fp_fusion=False, num_warps=OWN_WARPS)
    return drafts, best, won


@triton.jit
def _live_lookup(ctx_ptr, n_ptr, plen_ptr, at_ptr, sib_ptr, listed_ptr, keys_ptr, fp_ptr, used_ptr, head_ptr, prev_ptr,
                 p_ptr, row_ptr, M: tl.constexpr, LP: tl.constexpr, G: tl.constexpr, H: tl.constexpr,
                 LPREV: tl.constexpr, MB: tl.constexpr, GB: tl.constexpr):
    """One program a row: store.py's live_positions through the live table (its queries, each
    level's lookups in the row's siblings and in itself) -> p and row [B, G * LP]."""
    r = tl.program_id(0)
    n = tl.load(n_ptr + r)
    j = tl.arange(0, MB)
    _, _, pre = _prefix(ctx_ptr, r, M, MB)
    g = tl.arange(0, GB)
    is_sib = g < G - 1
    lane = g < G
    row = tl.where(is_sib, tl.load(sib_ptr + r * (G - 1) + g, mask=is_sib, other=0), r)
    listed = tl.where(is_sib, tl.load(listed_ptr + r * (G - 1) + g, mask=is_sib, other=0).to(tl.int32),
                      lane.to(tl.int32)) != 0
    slot = tl.load(at_ptr + row, mask=lane, other=0)
    n_row = tl.load(n_ptr + row, mask=lane, other=0)
    plen = tl.load(plen_ptr + row, mask=lane, other=0)
    for li in tl.static_range(LP):
        m = tl.load(keys_ptr + li)
        q = (tl.sum(tl.where(j == m - 1, pre, 0), 0) << 1).to(tl.int64, bitcast=True)   # window_prints << 1
        go = listed & ((tl.zeros([GB], tl.int64) + n) >= m)   # blocks: the interpreter refuses scalar masks
        lo = tl.where(is_sib, tl.maximum(plen, m), m)
        c = _newest(fp_ptr, used_ptr, head_ptr, prev_ptr, (slot * LP + li) * H, (slot * LP + li) * LPREV,
                    tl.zeros([GB], tl.int64) + q, n_row, lo, go, H)
        tl.store(p_ptr + r * G * LP + li * G + g, c, mask=lane)
        tl.store(row_ptr + r * G * LP + li * G + g, row, mask=lane)


def live_lookup(table, ctx: torch.Tensor, n: torch.Tensor, plen: torch.Tensor, at: torch.Tensor, sib: torch.Tensor,
                listed: torch.Tensor, out=None, keys: torch.Tensor | None = None):
    """DeviceHistory.live_positions with the live table in one launch (a program a row): p and row
    [B, G * levels], level-major, each level's G-1 siblings then the row itself (out: the two to
    write, default new; keys: the table's key lengths on the device, default made)."""
    B, M = ctx.shape
    G, LP = sib.shape[1] + 1, len(table.keys)
    p, row = out or (torch.empty((B, G * LP), dtype=torch.int64, device=ctx.device),
                     torch.empty((B, G * LP), dtype=torch.int64, device=ctx.device))
    if B == 0:
        return p, row
    if keys is None:
        keys = torch.tensor(table.keys, dtype=torch.int64, device=ctx.device)
    _live_lookup[(B,)](ctx.long().contiguous(), n.long().contiguous(), plen.long().contiguous(), at.long().contiguous(),
                       sib.long().contiguous(), listed.contiguous(), keys, table.fp, table.used,
                       table.head, table.prev, p, row, M=M, LP=LP, G=G, H=table.H, LPREV=table.prev.shape[2],
                       MB=triton.next_power_of_2(max(M, 2)), GB=triton.next_power_of_2(max(G, 2)))
    return p, row


@triton.jit
def _gather(at_ptr, done_ptr, B, active_ptr, tok_ptr, tok_stride, n_ptr, salt_ptr, plen_ptr, rows_ptr, n_out,
            salt_out, plen_out, act_out, ctx_out, M: tl.constexpr, MB: tl.constexpr):
    """One program a row of the step (the B running rows' slots at, then the finished answers'
    done): its slot, length, salt, prompt length, whether it drafts (running and active) and its
    context (its last M tokens, newest first, -5 before its start)."""
    r = tl.program_id(0)
    running = r < B
    slot = tl.where(running, tl.load(at_ptr + tl.minimum(r, B - 1)), tl.load(done_ptr + tl.maximum(r - B, 0)))
    n = tl.load(n_ptr + slot)
    tl.store(rows_ptr + r, slot)
    tl.store(n_out + r, n)
    tl.store(salt_out + r, tl.load(salt_ptr + slot))
    tl.store(plen_out + r, tl.load(plen_ptr + slot))
    tl.store(act_out + r, (running & (tl.load(active_ptr + tl.minimum(r, B - 1)) != 0)).to(tl.int8))
    j = tl.arange(0, MB)
    col = n - 1 - j
    got = tl.load(tok_ptr + slot * tok_stride + tl.maximum(col, 0), mask=(j < M) & (col >= 0), other=-5)
    tl.store(ctx_out + r * M + j, got.to(tl.int64), mask=j < M)


@triton.jit
def _choose(own_ptr, best_ptr, won_ptr, far_ptr, far_m_ptr, drafts_ptr, counts_ptr, src_ptr, K: tl.constexpr,
            KB: tl.constexpr, FAR: tl.constexpr, HISTORY: tl.constexpr, SIBLINGS: tl.constexpr,
            PROMPT: tl.constexpr, GLOBAL: tl.constexpr):
    """One program a row: store.py's propose from the sources' drafts: the global draft where its
    match is longer and it drafts a token, the own draft otherwise; the count drafted, and each
    token's source (the own draft's by its top voter's rank)."""
    r = tl.program_id(0)
    i = tl.arange(0, KB)
    km = i < K
    d = tl.load(own_ptr + r * K + i, mask=km, other=-1)
    won = tl.load(won_ptr + r * K + i, mask=km, other=-1)
    src = tl.where(won >= (1 << 42), tl.where(won - (1 << 42) >= (1 << 41), PROMPT, SIBLINGS), HISTORY)
    if FAR:
        far = tl.load(far_ptr + r * K + i, mask=km, other=-1)
        use = (tl.load(far_m_ptr + r) > tl.load(best_ptr + r)) & (tl.sum(tl.where(i == 0, far, 0), 0) >= 0)
        d = tl.where(use, far, d)
        src = tl.where(use, GLOBAL, src)
    tl.store(drafts_ptr + r * K + i, d, mask=km)
    tl.store(counts_ptr + r, tl.sum((km & (d >= 0)).to(tl.int32), 0))
    tl.store(src_ptr + r * K + i, tl.where(d < 0, -1, src).to(tl.int64), mask=km)


def gather(work, live, at: torch.Tensor, active: torch.Tensor, R: int) -> None:
    """_gather in one launch: the step's R rows (at's, then live's finished answers) into work."""
    M = work.ctx.shape[0] // work.rows.shape[0]
    _gather[(R,)](at, live.done_at, at.shape[0], active, live.tok, live.tok.stride(0), live.n, live.salt, live.plen,
                  work.rows, work.n, work.salt, work.plen, work.act, work.ctx, M=M, MB=triton.next_power_of_2(M))


def choose(work, B: int, k: int, far: bool) -> None:
    from rlspec.speculation import GLOBAL, HISTORY, PROMPT, SIBLINGS
    _choose[(B,)](work.own, work.own_best, work.won, work.far, work.far_m, work.drafts, work.counts, work.src, K=k,
                  KB=triton.next_power_of_2(max(k, 2)), FAR=far, HISTORY=HISTORY, SIBLINGS=SIBLINGS, PROMPT=PROMPT,
                  GLOBAL=GLOBAL)


class Workspace:
    """A step's working memory, allocated once for every slot of live (live.LiveRows) and k drafts
    a row, and the kernels' constants: the rows' slots, lengths, salts, prompt lengths, whether
    they draft and contexts; their live positions; each source's draft; the step's drafts, counts
    and sources. step() writes into views of them."""

    def __init__(self, h, live, k: int):
        S, dev = live.tok.shape[0], live.device
        LP, G = len(h.prompt_keys), min(h.max_siblings, S)

        def zeros(n, dtype=torch.int64):
            return torch.zeros(n, dtype=dtype, device=dev)
        self.rows, self.n, self.salt, self.plen, self.own_best, self.far_m = (zeros(S) for _ in range(6))
        self.act, self.counts = zeros(S, torch.int8), zeros(S, torch.int32)
        self.ctx = zeros(S * h.max_match)
        self.p, self.row = zeros(S * G * LP), zeros(S * G * LP)
        self.own, self.far, self.drafts = (zeros(S * k, torch.int32) for _ in range(3))
        self.won, self.src = zeros(S * k), zeros(S * k)
        self.keys = torch.tensor(h.prompt_keys, dtype=torch.int64, device=dev)
        self.min_prob = torch.tensor([h.min_prob], dtype=torch.float64, device=dev)
        self.count_min_prob = torch.tensor([h.counts.min_prob if h.counts else 0.0], dtype=torch.float64, device=dev)
        self.k = k

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, torch.Tensor))


def step(h, live, work: Workspace, at: torch.Tensor, active: torch.Tensor, k: int):
    """A step's drafts for the batch's rows (their slots at [B] in live, active [B]; the call's
    finished answers read after them) in kernels, into work: _gather, the live lookups
    (live_lookup, or under lookup=scan store.py's scan in torch), own_draft, count_walk and
    _choose. -> drafts [B, k] int32, counts [B] int32, sources [B, k] (views of work)."""
    B, D = at.shape[0], len(live.done)
    R = B + D
    if B == 0 or k == 0 or k > work.k:
        raise ValueError(f"device history: a kernel step needs rows and 1 <= k <= {work.k}, got {B} rows, k={k}")
    gather(work, live, at, active, R)
    rows, n, salt, plen, ctx = work.rows[:R], work.n[:R], work.salt[:R], work.plen[:R], work.ctx[: R * h.max_match]
    ctx = ctx.view(R, h.max_match)
    G = min(h.max_siblings, R)
    sib, reader, listed = live.siblings(rows, G)
    view = Rows(live.tok, rows)
    GL = G * len(h.prompt_keys)
    # the running rows' programs only: the finished answers draft nothing (they are read, by row)
    if live.table is not None:
        p, row = work.p[: B * GL].view(B, GL), work.row[: B * GL].view(B, GL)
        live_lookup(live.table, ctx[:B], n, plen, rows, sib[:B], listed[:B], out=(p, row), keys=work.keys)
    else:
        p, row = (x[:B] for x in h.live_positions(view, n, salt, plen, ctx, D, None, (sib, reader, listed)))
    act = work.act[:B]
    own = work.own[: B * k].view(B, k), work.own_best[:B], work.won[: B * k].view(B, k)
    own_draft(h, view, ctx[:B], n, salt[:B], p, row, k, act, out=own, consts=(work.keys, work.min_prob))
    if h.counts is not None:
        count_walk(h.counts, ctx[:B], n[:B], k, act, out=(work.far[: B * k].view(B, k), work.far_m[:B]),
                   min_prob=work.count_min_prob)
    choose(work, B, k, h.counts is not None)
    return work.drafts[: B * k].view(B, k), work.counts[:B], work.src[: B * k].view(B, k)


# Each kernel's argument types and compile-time constants at the 8B experiment's shapes (three
# prompt key lengths, rows 18,432 tokens wide, count lengths 1..16, k=5), and its warps: what
# Triton compiles for a GPU without one (tests/speculation/test_device_kernels.py,
# scripts/bench_device_history.py's registers and spills).
SIGNATURES = {
    "_append": ({"fp_ptr": "*i64", "used_ptr": "*i1", "head_ptr": "*i32", "prev_ptr": "*i32", "tok_ptr": "*i32",
                 "tok_stride": "i64", "trow_ptr": "*i64", "slot_ptr": "*i64", "lo_ptr": "*i64", "hi_ptr": "*i64",
                 "keys_ptr": "*i64", "dst_ptr": "*i32", "dst_stride": "i64", "n_ptr": "*i64", "W": "i64"},
                {"K": 3, "H": 65536, "LP": 18433, "COPY": True, "TABLE": True, "CB": 8}, 4),
    "_gather": ({"at_ptr": "*i64", "done_ptr": "*i64", "B": "i64", "active_ptr": "*i1", "tok_ptr": "*i32",
                 "tok_stride": "i64", "n_ptr": "*i64", "salt_ptr": "*i64", "plen_ptr": "*i64", "rows_ptr": "*i64",
                 "n_out": "*i64", "salt_out": "*i64", "plen_out": "*i64", "act_out": "*i8", "ctx_out": "*i64"},
                {"M": 16, "MB": 16}, 4),
    "_choose": ({"own_ptr": "*i32", "best_ptr": "*i64", "won_ptr": "*i64", "far_ptr": "*i32", "far_m_ptr": "*i64",
                 "drafts_ptr": "*i32", "counts_ptr": "*i32", "src_ptr": "*i64"},
                {"K": 5, "KB": 8, "FAR": True, "HISTORY": 0, "SIBLINGS": 1, "PROMPT": 2, "GLOBAL": 3}, 4),
    "_count_walk": ({"ctx_ptr": "*i64", "n_ptr": "*i64", "act_ptr": "*i8", "levels_ptr": "*i64", "key_ptr": "*i64",
                     "tok_ptr": "*i32", "cnt_ptr": "*i32", "out_ptr": "*i32", "m_ptr": "*i64",
                     "min_prob_ptr": "*fp64", "vocab": "i64", "NB": "i64"},
                    {"M": 16, "LV": 16, "K": 5, "W": 16, "MB": 16, "KB": 8, "WB": 16}, 4),
    "_live_lookup": ({"ctx_ptr": "*i64", "n_ptr": "*i64", "plen_ptr": "*i64", "at_ptr": "*i64", "sib_ptr": "*i64",
                      "listed_ptr": "*i1", "keys_ptr": "*i64", "fp_ptr": "*i64", "used_ptr": "*i1", "head_ptr": "*i32",
                      "prev_ptr": "*i32", "p_ptr": "*i64", "row_ptr": "*i64"},
                     {"M": 16, "LP": 3, "G": 16, "H": 65536, "LPREV": 18433, "MB": 16, "GB": 16}, 4),
    "_own_draft": ({"ctx_ptr": "*i64", "n_ptr": "*i64", "salt_ptr": "*i64", "act_ptr": "*i8", "keys_ptr": "*i64",
                    "ring_tok_ptr": "*i32", "ring_pid_ptr": "*i64", "table_ptr": "*i64", "written": "i64",
                    "oldest": "i64", "cap": "i64", "NB": "i64", "p_ptr": "*i64", "row_ptr": "*i64", "at_ptr": "*i64",
                    "rows_tok_ptr": "*i32", "rows_stride": "i64", "L": "i64", "min_prob_ptr": "*fp64", "vocab": "i64",
                    "B": "i64", "drafts_ptr": "*i32", "won_ptr": "*i64", "best_ptr": "*i64"},
                   {"M": 16, "LP": 3, "W": 64, "GL": 48, "K": 5, "V": 64, "CB": 256, "MB": 16, "KB": 8}, OWN_WARPS),
}
