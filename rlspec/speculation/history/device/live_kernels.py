"""live.py's LiveTable on a CUDA device: its lookup (a program per block of queries, each probing
its slot's table in a loop) and its append (a program a row) as Triton kernels, no host sync;
tested in Triton's interpreter against the torch methods (tests/speculation/test_device_live.py).
Hashes in uint64 arithmetic, which wraps by definition in Triton and numpy alike."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64


@triton.jit
def _mix(h):
    """ops.mix (murmur3's finaliser) on uint64."""
    h = h ^ (h >> 33)
    h = h * 0xFF51AFD7ED558CCD
    h = h ^ (h >> 33)
    h = h * 0xC4CEB9FE1A85EC53
    return h ^ (h >> 33)


@triton.jit
def _latest(fp_ptr, used_ptr, head_ptr, prev_ptr, slot_ptr, q_ptr, n_ptr, lo_ptr, out_ptr, N, li, K: tl.constexpr,
            H: tl.constexpr, LP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    s = tl.load(slot_ptr + offs, mask=mask, other=0).to(tl.int64)
    q = tl.load(q_ptr + offs, mask=mask, other=0)
    n = tl.load(n_ptr + offs, mask=mask, other=0)
    lo = tl.load(lo_ptr + offs, mask=mask, other=0)
    h = (_mix(q.to(tl.uint64, bitcast=True)) & (H - 1)).to(tl.int64)
    base = (s * K + li) * H
    at = tl.full([BLOCK], -1, tl.int64)
    active = mask
    while tl.max(active.to(tl.int32), 0) > 0:
        used = tl.load(used_ptr + base + h, mask=active, other=0) != 0
        fp = tl.load(fp_ptr + base + h, mask=active, other=0)
        hit = active & used & (fp == q)
        at = tl.where(hit, h, at)
        active = active & used & (fp != q)
        h = (h + 1) & (H - 1)
    c = tl.load(head_ptr + base + tl.maximum(at, 0), mask=mask & (at >= 0), other=-1).to(tl.int64)
    pbase = (s * K + li) * LP
    back = tl.load(prev_ptr + pbase + tl.maximum(c, 0), mask=mask & (c >= n), other=-1).to(tl.int64)
    c = tl.where(c >= n, back, c)
    tl.store(out_ptr + offs, tl.where((c >= lo) & (c >= 0), c, -1), mask=mask)


def latest(table, slot: torch.Tensor, li: int, q: torch.Tensor, n: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """LiveTable.latest in one launch: ceil(N / BLOCK) programs."""
    N = q.shape[0]
    out = torch.empty(N, dtype=torch.int64, device=q.device)
    K, H, LP = table.fp.shape[1], table.H, table.prev.shape[2]
    _latest[(triton.cdiv(N, BLOCK),)](table.fp, table.used, table.head, table.prev, slot.long(), q, n.long(),
                                      lo.long(), out, N, li, K=K, H=H, LP=LP, BLOCK=BLOCK)
    return out


@triton.jit
def _append(fp_ptr, used_ptr, head_ptr, prev_ptr, tok_ptr, tok_stride, slot_ptr, lo_ptr, hi_ptr, keys_ptr,
            K: tl.constexpr, H: tl.constexpr, LP: tl.constexpr):
    """One program a row: its positions lo+1..hi linked in order, every key length, into its slot
    (its tokens: the slot's row of tok)."""
    r = tl.program_id(0)
    s = tl.load(slot_ptr + r).to(tl.int64)
    lo = tl.load(lo_ptr + r).to(tl.int64)
    hi = tl.load(hi_ptr + r).to(tl.int64)
    row = tok_ptr + s * tok_stride
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


def append(table, slot: torch.Tensor, tokens: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """LiveTable.append in one launch: a program a row (tokens [slots, L], read at each row's slot)."""
    B = slot.shape[0]
    if B == 0:
        return
    keys = torch.tensor(table.keys, dtype=torch.int64, device=tokens.device)
    _append[(B,)](table.fp, table.used, table.head, table.prev, tokens, tokens.stride(0), slot.long(), lo.long(),
                  hi.long(), keys, K=len(table.keys), H=table.H, LP=table.prev.shape[2])
