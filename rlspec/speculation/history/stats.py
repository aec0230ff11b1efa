"""What a call of the history drafter measured: its counters (HistoryStats, what 'auto' reads
through per_pos), and for a call that drafted nothing the replay in shadow of what drafting would
have accepted (rlspec/speculation/adaptive.py plans from both)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from rlspec.speculation import SOURCES

@dataclass
class HistoryStats:
    """Per-call counters of the history drafter, both backends' (rows: a request at one engine
    step; the device drafter counts on the device and fills these at the call's end:
    device.call.CallStats)."""
    steps: int = 0             # engine steps the drafter was asked at
    rows: int = 0              # requests the drafter was asked for
    matched: int = 0           # ... that got a draft
    drafted: list[int] = field(default_factory=lambda: [0] * len(SOURCES))   # tokens by source
    accepted: list[int] = field(default_factory=lambda: [0] * len(SOURCES))  # attributed accepts by source
    drafted_pos: list[int] = field(default_factory=list)  # rows whose draft reached position i
    # a call that drafted nothing ('auto' switched it off), replayed in shadow: what k_max drafts
    # would have done, per emulated verification (shadow_rows) and position (drafted, accepted
    # with all before it)
    shadow_responses: int = 0  # the call's responses the shadow replayed
    shadow_rows: int = 0
    shadow_drafted_pos: list[int] = field(default_factory=list)
    shadow_accepted_pos: list[int] = field(default_factory=list)
    prompts: int = 0           # prompts with history at the call's start
    history_tokens: int = 0    # response tokens held over all prompts at the call's start
    # the drafter's own time inside vLLM's engine steps: per (running batch bin, k) [steps, seconds]
    # (bin b: batches of 2^b .. 2^(b+1)-1 rows), what 'auto' charges to drafting alone
    propose_timing: dict = field(default_factory=dict)
    propose_seconds: float = 0.0   # (the device drafter's time is inside the step on the device)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["drafted_tokens"] = sum(self.drafted)
        d["propose_timing"] = [[b, k, n, t] for (b, k), (n, t) in sorted(self.propose_timing.items())]
        for name in ("drafted", "accepted"):
            d.update({f"{name}_{s}": v for s, v in zip(SOURCES, d.pop(name))})
        for name, key in (("drafted_pos", "drafts_ge"), ("shadow_drafted_pos", "shadow_drafts_ge"),
                          ("shadow_accepted_pos", "shadow_accepted_ge")):
            d.update({f"{key}_{i + 1}": v for i, v in enumerate(d.pop(name))})
        return d


def per_pos(stats: dict, key: str, k_max: int) -> list[int]:
    """From a call's counters (as_dict), per position i < k_max: `key` 'drafts_ge' (rows that
    drafted past i), 'shadow_drafts_ge' or 'shadow_accepted_ge'."""
    return [stats.get(f"{key}_{i + 1}", 0) for i in range(k_max)]


def shadow_groups(prompt_ids: list[list[int]], max_rows: int) -> list[list[int]]:
    """The rows a shadow replay reads, by prompt: whole groups, evenly spread over the call, about
    max_rows responses."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompt_ids):
        groups.setdefault(tuple(p), []).append(i)
    keys = list(groups)
    if not keys or max_rows <= 0:
        return []
    per_group = max(1, len(prompt_ids) // len(keys))
    stride = max(1, round(len(keys) * per_group / max_rows))
    return [groups[key] for key in keys[::stride]]


# step(t, need [R] bool) -> (drafts [R, k], counts [R]): the drafts of the rows in `need`, every
# row holding its prompt and its first t + 1 response tokens (those past their end, all of theirs)
ShadowStep = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def replay_in_shadow(stats: HistoryStats, step: ShadowStep, responses: list[list[int]], k: int,
                     device="cpu") -> None:
    """A call that drafted nothing ('auto' switched speculation off): what drafting k tokens
    would have accepted, added to stats' shadow counters, for both backends (their `step` reads
    the store as it stood at the call's start: call before the call's responses are recorded).
    Without drafting every request gains one token per engine step, so the responses are replayed
    in lock step: at step t every response holds its first t + 1 tokens (what its siblings see),
    and token t is checked against the response's pending draft; a verification would have
    accepted the matching prefix and ended with the next token (the correction, or the bonus after
    a whole draft), where the next draft starts. Drafts are one-hot, so the probability a drafted
    token is sampled is the probability it is accepted: the counts are those drafting would have
    made, without its verification."""
    if not responses or k <= 0:
        return
    R, T = len(responses), max(map(len, responses))
    rlen = torch.tensor([len(r) for r in responses], dtype=torch.int64, device=device)
    tokens = torch.full((R, max(T, 1)), -1, dtype=torch.int64, device=device)
    for r, resp in enumerate(responses):
        tokens[r, : len(resp)] = torch.as_tensor(resp, dtype=torch.int64)
    at = torch.arange(k, device=device)
    draft = torch.full((R, k), -1, dtype=torch.int64, device=device)
    j = torch.zeros(R, dtype=torch.int64, device=device)
    verifications = torch.zeros((), dtype=torch.int64, device=device)
    drafted = torch.zeros(k, dtype=torch.int64, device=device)
    accepted = torch.zeros(k, dtype=torch.int64, device=device)
    for t in range(T):
        alive = t < rlen
        now = tokens[:, t]
        hit = alive & (j < k) & (draft.gather(1, j.clamp(max=k - 1)[:, None])[:, 0] == now)
        accepted += (hit[:, None] & (at[None] == j[:, None])).sum(0)
        j = torch.where(hit, j + 1, j)
        need = alive & ~hit
        d, c = step(t, need)
        c = torch.where(need, c.long(), 0)
        verifications += need.sum()
        drafted += (c[:, None] > at[None]).sum(0)
        draft = torch.where(need[:, None], torch.where(at[None] < c[:, None], d.long(), -1), draft)
        j = torch.where(need, 0, j)
    stats.shadow_responses += R
    stats.shadow_rows += int(verifications)
    for name, got in (("shadow_drafted_pos", drafted), ("shadow_accepted_pos", accepted)):
        have = getattr(stats, name) or [0] * k  # a bare HistoryStats() starts empty
        setattr(stats, name, [a + b for a, b in zip(have, got.tolist())])
