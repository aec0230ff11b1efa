"""What a call of the history drafter measured: its counters (HistoryStats, what 'auto' reads
through per_pos), and for a call that drafted nothing the replay in shadow of what drafting would
have accepted (rlspec/speculation/adaptive.py plans from both)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from rlspec.speculation import store as S
from rlspec.speculation.arena import LiveArena
from rlspec.speculation import SOURCES

if TYPE_CHECKING:
    from rlspec.speculation.history import HistoryIndex

@dataclass
class HistoryStats:
    """Per-call counters of the history drafter, both backends' (rows: a request at one engine
    step; the device drafter counts on the device and fills these at the call's end:
    device_call.CallStats)."""
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


def replay_in_shadow(index: HistoryIndex, prompt_ids: list[list[int]], response_ids: list[list[int]],
                     max_rows: int) -> None:
    """A call that drafted nothing ('auto' switched speculation off): measure what drafting k_max
    tokens would have accepted, into index.stats, from the finished responses of some of its groups
    (whole groups, evenly spread over the call, about max_rows responses). Without drafting every
    request gains one token per engine step, so the call is replayed in lock step: at step t each
    response's token t joins its group's live sequences (what its siblings see) and is checked
    against the response's pending shadow draft; a verification would have accepted the matching
    prefix and ended with the next token (the correction, or the bonus after a whole draft), where
    the next shadow draft starts, read from the prompt's history as at the call's start, the group
    and the prompt. Drafts are one-hot, so the probability a drafted token is sampled is the
    probability it is accepted: the counts are those drafting would have made, without its
    verification. Call before the call's responses are recorded."""
    index.flush()
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompt_ids):
        groups.setdefault(tuple(p), []).append(i)
    keys = list(groups)
    if not keys or max_rows <= 0:
        return
    per_group = max(1, len(prompt_ids) // len(keys))
    stride = max(1, round(len(keys) * per_group / max_rows))
    st = index.stats
    for key in keys[::stride]:
        rows = groups[key]
        st.shadow_responses += len(rows)
        prompt = np.asarray(key, np.int32)
        salt = np.uint64(S.prompt_salt(prompt, len(prompt)))
        live = LiveArena(capacity=len(prompt) + sum(len(response_ids[i]) for i in rows) + 16, slots=len(rows),
                         head_bits=14, levels=len(index.gkeys), plevels=len(index.pkeys))
        seqs = {i: np.concatenate([prompt, np.asarray(response_ids[i], np.int32)]) for i in rows}
        live.append(0, -1, prompt, 0, len(prompt), salt, index.pkeys, index.gkeys)   # the prompt's copy
        live.last[: len(rows)] = live.copy[: len(rows)] = live.last[0]
        live.row[: len(rows)] = np.arange(len(rows))
        pending: dict[int, tuple[list[int], int]] = {}
        for t in range(max(len(response_ids[i]) for i in rows)):
            for slot, i in enumerate(rows):
                r = response_ids[i]
                if t >= len(r):
                    continue
                n = len(prompt) + t + 1
                live.append(slot, slot, seqs[i], n - 1, n, salt, index.pkeys, index.gkeys)
                got = pending.pop(i, None)
                if got is not None:
                    draft, j = got
                    if j < len(draft) and int(r[t]) == draft[j]:
                        st.shadow_accepted_pos[j] += 1
                        pending[i] = (draft, j + 1)
                        continue
                # a verification ends with this token (or none was pending): the next draft
                st.shadow_rows += 1
                draft, _ = index.draft_context(seqs[i][:n], int(salt), index.k_max, live, slot, len(rows))
                for j in range(len(draft)):
                    st.shadow_drafted_pos[j] += 1
                if draft:
                    pending[i] = (draft, 0)
