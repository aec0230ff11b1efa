"""Fixed-shape tensor helpers of the device history drafter (rlspec/speculation/device_history.py):
no host sync, no loop over rows."""
from __future__ import annotations

import torch


def last_true(hit_reversed: torch.Tensor, L: int) -> torch.Tensor:
    """The last True along a last dim of L+1 given reversed ([..., L+1] bool, -1 where none): an
    argmax over bytes, which returns the first maximum."""
    first = hit_reversed.view(torch.uint8).argmax(-1, keepdim=True)
    return torch.where(hit_reversed.gather(-1, first), L - first, -1)[..., 0]


def last_n_true(hit: torch.Tensor, n: int) -> torch.Tensor:
    """The last n Trues along the last dim ([..., L+1] bool -> [..., n] indices, newest first, -1
    past the ones there are); n=1 through last_true's argmax."""
    if n == 1:
        return last_true(hit.flip(-1), hit.shape[-1] - 1)[..., None]
    cols = torch.arange(hit.shape[-1], device=hit.device)
    return torch.where(hit, cols, -1).topk(min(n, hit.shape[-1]), -1).values


def leading_run(eq: torch.Tensor) -> torch.Tensor:
    """Leading run of True along the last dim."""
    return eq.long().cumprod(-1).sum(-1)


def first_of(valid: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """valid, less every candidate whose key (>= -1) an earlier valid one holds: [B, C]."""
    C = key.shape[1]
    k = torch.where(valid, key, -2 - torch.arange(C, device=key.device))   # invalid ones: all distinct
    sk, order = torch.sort(k, dim=1, stable=True)
    dup = torch.cat([torch.zeros_like(sk[:, :1], dtype=torch.bool), sk[:, 1:] == sk[:, :-1]], 1)
    return valid & ~torch.zeros_like(valid).scatter(1, order, dup)


def prompt_siblings(salt: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the first G rows (in row order) of its prompt: [B, G] rows and which exist, and
    the row's own place among its prompt's rows [B]."""
    B = salt.shape[0]
    order = torch.sort(salt, stable=True)
    first = torch.searchsorted(order.values, salt)                            # start of the row's group
    at = first[:, None] + torch.arange(G, device=salt.device)
    ok = at < B
    at = at.clamp(max=B - 1)
    place = torch.empty_like(first).scatter_(0, order.indices, torch.arange(B, device=salt.device))
    return order.indices[at], ok & (order.values[at] == salt[:, None]), place - first
