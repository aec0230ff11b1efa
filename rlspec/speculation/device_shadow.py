"""The device history drafter's shadow replay (rlspec/speculation/device_history.py): for a call
that drafted nothing, what drafting would have accepted, measured on the device as the host
drafter's replay_in_shadow (rlspec/speculation/history_stats.py) measures it."""
from __future__ import annotations

import torch

from rlspec.speculation.device_history import DeviceHistory, prompt_hash


def replay_in_shadow(history: DeviceHistory, prompts, responses, max_rows: int, k: int) -> dict:
    """A call that drafted nothing ('auto' ran it without): what k-token drafts would have
    accepted, from the finished responses of whole groups evenly spread over the call (about
    max_rows responses), as the host drafter's shadow replay measures it
    (history_stats.replay_in_shadow). The groups run in lock step: at step t each response
    holds its first t+1 tokens (what its siblings see); a pending draft's next token equal to
    token t is accepted, and otherwise a verification ends there and the next draft is read
    from the store as it stood at the call's start (call before recording the call), the
    group and the row. Counters as HistoryStats.as_dict names them."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    keys = list(groups)
    out = {"shadow_responses": 0, "shadow_rows": 0,
           **{f"shadow_{name}_{i + 1}": 0 for name in ("drafts_ge", "accepted_ge") for i in range(k)}}
    if not keys or max_rows <= 0 or k <= 0:
        return out
    per_group = max(1, len(prompts) // len(keys))
    stride = max(1, round(len(keys) * per_group / max_rows))
    rows = [i for key in keys[::stride] for i in groups[key]]
    dev, R = history.device, len(rows)
    plen = torch.tensor([len(prompts[i]) for i in rows], dtype=torch.int64, device=dev)
    rlen = torch.tensor([len(responses[i]) for i in rows], dtype=torch.int64, device=dev)
    tokens = torch.zeros(R, int((plen + rlen).max()) + 1, dtype=torch.int64, device=dev)
    for r, i in enumerate(rows):
        seq = list(prompts[i]) + list(responses[i])
        tokens[r, : len(seq)] = torch.tensor(seq, dtype=torch.int64, device=dev)
    salts = prompt_hash(tokens, plen)
    at, idx = torch.arange(k, device=dev), torch.arange(R, device=dev)
    draft = torch.full((R, k), -1, dtype=torch.int64, device=dev)
    j = torch.zeros(R, dtype=torch.int64, device=dev)
    verifications = torch.zeros((), dtype=torch.int64, device=dev)
    drafted, accepted = torch.zeros(k, dtype=torch.int64, device=dev), torch.zeros(k, dtype=torch.int64, device=dev)
    for t in range(int(rlen.max())):
        alive = t < rlen
        now = tokens[idx, (plen + t).clamp(max=tokens.shape[1] - 1)]
        hit = alive & (draft.gather(1, j.clamp(max=k - 1)[:, None])[:, 0] == now) & (j < k)
        accepted += (hit[:, None] & (at[None] == j[:, None])).sum(0)
        j = torch.where(hit, j + 1, j)
        need = alive & ~hit
        lengths = plen + torch.minimum(rlen, torch.tensor(t + 1, device=dev))
        d, c = history.propose(tokens, lengths, salts, plen, k, need)
        verifications += need.sum()
        drafted += (need[:, None] & (c.long()[:, None] > at[None])).sum(0)
        draft = torch.where(need[:, None], d.long(), draft)
        j = torch.where(need, 0, j)
    out.update({"shadow_responses": R, "shadow_rows": int(verifications)})
    out.update({f"shadow_drafts_ge_{i + 1}": int(v) for i, v in enumerate(drafted.tolist())})
    out.update({f"shadow_accepted_ge_{i + 1}": int(v) for i, v in enumerate(accepted.tolist())})
    return out
