"""Fixed-shape tensor helpers of the device history drafter (rlspec/speculation/history/device/store.py)
and its keys' hashes (64-bit, in wrapping int64 arithmetic): no host sync, no loop over rows."""
from __future__ import annotations

import torch

_P = 0x100000001B3
_C1 = 0x9E3779B97F4A7C15
_M1 = 0xFF51AFD7ED558CCD - (1 << 64)
_M2 = 0xC4CEB9FE1A85EC53 - (1 << 64)


def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(h: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (h >> s) & ((1 << (64 - s)) - 1)


def mix(h: torch.Tensor) -> torch.Tensor:
    """A 64-bit finaliser (murmur3's) in wrapping int64 arithmetic."""
    h = h ^ _shr(h, 33)
    h = h * _M1
    h = h ^ _shr(h, 33)
    h = h * _M2
    return h ^ _shr(h, 33)


def fold(windows: torch.Tensor, m: int) -> torch.Tensor:
    """Key hash of windows [..., m] of token ids (a key of each length hashes apart)."""
    h = torch.zeros(windows.shape[:-1], dtype=torch.int64, device=windows.device)
    for j in range(m):
        h = h * _P + (windows[..., j].long() + 3)
    return mix(h ^ _signed(m * _C1))


def window_prints(tokens: torch.Tensor, m: int) -> torch.Tensor:
    """A fingerprint (unmixed polynomial) of tokens[:, p-m:p] for every p in 0..L ([B, L] ->
    [B, L+1]; garbage where p < m)."""
    pad = torch.nn.functional.pad(tokens.long(), (m, 1))
    span = tokens.shape[1] + 1
    h = torch.zeros(tokens.shape[0], span, dtype=torch.int64, device=tokens.device)
    for j in range(m):
        h = h * _P + (pad[:, j: j + span] + 3)
    return h


def window_keys(tokens: torch.Tensor, m: int) -> torch.Tensor:
    """fold of tokens[:, p-m:p] for every p in 0..L ([B, L] -> [B, L+1]; garbage where p < m)."""
    return mix(window_prints(tokens, m) ^ _signed(m * _C1))


def salted(key: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    return mix(key ^ salt)


def prompt_hash(token_ids: torch.Tensor, prompt_lens: torch.Tensor) -> torch.Tensor:
    """A prompt's identity from its row: [B, L] tokens, [B] prompt lengths -> [B] int64 (never 0)."""
    L = token_ids.shape[1]
    cols = torch.arange(L, device=token_ids.device)
    pw = _powers(L, token_ids.device)
    terms = torch.where(cols < prompt_lens[:, None], (token_ids.long() + 3) * pw, 0)
    h = mix(terms.sum(-1) ^ mix(prompt_lens.long() + 1))
    return torch.where(h == 0, 1, h)


def _powers(n: int, device) -> torch.Tensor:
    """P^j mod 2^64 for j < n, as int64 (by squaring, on the device)."""
    j = torch.arange(n, device=device)
    out = torch.ones(n, dtype=torch.int64, device=device)
    base = _P
    for bit in range(max(1, n - 1).bit_length()):
        out = torch.where((j >> bit) & 1 == 1, out * _signed(base), out)
        base = base * base
    return out


def last_true(hit: torch.Tensor) -> torch.Tensor:
    """The last True along the last dim ([..., L+1] bool -> [...] indices, -1 where none): an
    argmax over the reversed bytes, which returns the first maximum."""
    rev = hit.flip(-1)
    first = rev.view(torch.uint8).argmax(-1, keepdim=True)
    return torch.where(rev.gather(-1, first), hit.shape[-1] - 1 - first, -1)[..., 0]


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


def prompt_siblings(salt: torch.Tensor, G: int, done: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the G - 1 rows of its prompt that follow it in the group's order, cyclically (a group
    of any size: every row reads min(G, group) - 1 siblings, and each row is read by as many):
    sib [B, G-1] (row i's (g+1)-th follower), reader [B, G-1] (the row whose (g+1)-th follower row i
    is) and ok [B, G-1] (g+1 < the group's size: distinct siblings). The group's order is row order,
    its last `done` rows (finished answers) spread evenly among the running ones: a running row's
    followers are its prompt's running and finished answers in proportion."""
    B = salt.shape[0]
    spread = torch.cat([_place_in_group(salt[: B - done], 0.0), _place_in_group(salt[B - done:], 0.5)])
    by_place = torch.sort(spread, stable=True).indices
    order_idx = by_place[torch.sort(salt[by_place], stable=True).indices]
    values = salt[order_idx]
    first = torch.searchsorted(values, salt)                                  # start of the row's group
    size = torch.searchsorted(values, salt, right=True) - first
    place = torch.empty_like(first).scatter_(0, order_idx, torch.arange(B, device=salt.device)) - first
    g = torch.arange(1, max(G, 1), device=salt.device)[None]                  # [1, G-1]
    sib = order_idx[first[:, None] + (place[:, None] + g) % size[:, None]]
    reader = order_idx[first[:, None] + (place[:, None] - g) % size[:, None]]
    return sib, reader, g < size[:, None]


def _place_in_group(salt: torch.Tensor, offset: float) -> torch.Tensor:
    """Each row's place among the rows of its salt, in row order, as a fraction of their number:
    (rank + offset) / size, in [0, 1)."""
    order = torch.sort(salt, stable=True)
    first = torch.searchsorted(order.values, salt)
    size = torch.searchsorted(order.values, salt, right=True) - first
    rank = torch.empty_like(first).scatter_(0, order.indices, torch.arange(salt.shape[0], device=salt.device)) - first
    return (rank.double() + offset) / size.clamp(min=1).double()


class Rows:
    """The rows a step drafts for: token_ids' rows, or with at, its rows at[i]."""

    def __init__(self, tok: torch.Tensor, at: torch.Tensor | None):
        self.tok, self.at = tok, at

    def read(self, row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        return self.tok[row if self.at is None else self.at[row], col]

    def whole(self) -> torch.Tensor:
        return self.tok if self.at is None else self.tok[self.at]
