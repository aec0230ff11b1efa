"""The device drafter's state within one generate call (rlspec/speculation/history/device/proposer.py),
beside its rows (live.py): each row's pending draft until its verification, the call's counters,
and the write of newly sampled tokens into the runner's token rows. All on the engine's device;
nothing here syncs with the host before finish_call reads the counters."""
from __future__ import annotations

import torch

from rlspec.speculation import SOURCES
from rlspec.speculation.history.stats import HistoryStats


class Pending:
    """Per row (V1: a batch row, V2: a request state) the sources of its last draft's tokens and
    how many it drafted, on the device, until the next step's verification settles it."""

    def __init__(self, rows: int, k: int, device):
        self.src = torch.full((rows, max(k, 1)), -1, dtype=torch.int64, device=device)
        self.n = torch.zeros(rows, dtype=torch.int64, device=device)

    def rows(self, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending drafts of rows `at` (-1: none): their sources [B, k] and lengths [B]."""
        got = at.clamp(min=0)
        return self.src[got], torch.where(at >= 0, self.n[got], 0)

    def put(self, at: torch.Tensor, src: torch.Tensor, counts: torch.Tensor) -> None:
        self.src[at, : src.shape[1]] = src.long()
        self.n[at] = counts.long()


class CallStats:
    """A call's counts, kept on the device until finish_call reads them (no sync per step): rows
    asked, rows drafted for, tokens drafted (and by source: drafted_<source>, each token's source
    its highest-ranked voter's, or the count table's), tokens accepted by source (accepted_<source>:
    a verification accepts its draft's first tokens, as many as it sampled less one, the bonus or
    the correction; a request's last verification is counted before vLLM cuts its tokens at a stop),
    and per position i the rows whose draft reached it (drafts_ge_{i+1}: what 'auto' plans from);
    reported as the host drafter reports its own (finish: HistoryStats)."""

    def __init__(self, k: int = 0, device="cpu"):
        self.steps = 0
        self.rows: torch.Tensor | int = 0
        self.matched: torch.Tensor | int = 0
        self.pos = torch.zeros(k, dtype=torch.int64, device=device)
        self.by_source = torch.zeros(len(SOURCES), dtype=torch.int64, device=device)
        self.accepted = torch.zeros(len(SOURCES), dtype=torch.int64, device=device)
        # a call that drafted nothing: what drafting would have accepted (DeviceHistory.shadow)
        self.shadow = HistoryStats(shadow_drafted_pos=[0] * k, shadow_accepted_pos=[0] * k)

    def accept(self, src: torch.Tensor, drafted: torch.Tensor, sampled: torch.Tensor) -> None:
        """Credit the tokens each row's verification accepted (its draft's first sampled - 1, at most
        the drafted) to their sources (src [B, k])."""
        n = torch.minimum((sampled.long() - 1).clamp(min=0), drafted)
        take = (torch.arange(src.shape[1], device=src.device)[None] < n[:, None]) & (src >= 0)
        self.accepted.scatter_add_(0, src.clamp(min=0).flatten(), take.flatten().long())

    def add(self, active: torch.Tensor, counts: torch.Tensor, src: torch.Tensor) -> None:
        self.steps += 1
        self.rows = self.rows + active.sum()
        self.matched = self.matched + (counts > 0).sum()
        at = torch.arange(self.pos.shape[0], device=counts.device)
        self.pos += (counts.long()[:, None] > at[None]).sum(0)
        drafted = (counts.long()[:, None] > torch.arange(src.shape[1], device=src.device)[None]) & (src >= 0)
        self.by_source.scatter_add_(0, src.clamp(min=0).flatten(), drafted.flatten().long())

    def finish(self, prompts: int, history_tokens: int) -> HistoryStats:
        """The call's counters in the schema both drafters report (one sync, at the call's end)."""
        sh = self.shadow
        return HistoryStats(steps=self.steps, rows=int(self.rows), matched=int(self.matched),
                            drafted=self.by_source.tolist(), accepted=self.accepted.tolist(),
                            drafted_pos=self.pos.tolist(), prompts=prompts, history_tokens=history_tokens,
                            shadow_responses=sh.shadow_responses, shadow_rows=sh.shadow_rows,
                            shadow_drafted_pos=sh.shadow_drafted_pos, shadow_accepted_pos=sh.shadow_accepted_pos)


def append_sampled(token_ids: torch.Tensor, lengths: torch.Tensor, sampled: torch.Tensor,
                   count: torch.Tensor) -> torch.Tensor:
    """Write each row's newly sampled tokens (sampled [B, k+1], its first count[i] valid, -1 the
    rest) after its first lengths[i] tokens, in place, as vLLM's n-gram drafter does; the new
    lengths [B]. Positions past the buffer's width are not written."""
    width = token_ids.shape[1]
    offsets = torch.arange(sampled.shape[1], device=token_ids.device)
    at = lengths.long()[:, None] + offsets[None]
    write = (offsets[None] < count[:, None]) & (sampled != -1) & (at < width)
    # a position past the buffer rewrites the row's last token with itself: one slot that no write
    # targets (clamping them all to the buffer's end would race a write there)
    at = torch.where(at < width, at, (lengths.long() - 1).clamp(min=0)[:, None])
    token_ids.scatter_(1, at, torch.where(write, sampled.to(token_ids.dtype), token_ids.gather(1, at)))
    return (lengths + count).to(torch.int32)
