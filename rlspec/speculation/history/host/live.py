"""The history store's live arena (rlspec/speculation/history/host/arena.py's LiveArena): a call's running answers
and each prompt's tokens once, linked token to token, walked by store.py's rule; and one engine
step over it (propose_rows): every row's new tokens in, then every row's draft, so that each row
reads what all its siblings wrote by this step, as the device drafter reads the batch."""
from __future__ import annotations

import numpy as np

from rlspec.speculation.history.host.store import _draft, _scratch, chain_salt, link
from rlspec.speculation.history.host.ops import nb


@nb.njit(nogil=True, cache=True)
def live_append(live, seq, owner, row, lo, hi, salt, pkeys, gkeys, lused, lans):
    """Append row[lo:hi] (row positions lo..hi-1) to live sequence `seq` (continuing from
    live[11][seq], its last position: a prompt's copy for an answer's first token), its positions
    owned by slot `owner` (-1: a prompt's copy, else an answer, whose first position lans[owner]
    records), linking every position j >= m into the prompt's chain of key length m, and an
    answer's with j >= g into global chain g. Returns the new fill."""
    ltok, lsalt, lprev, lnext, lchain, lhead = live[0], live[1], live[2], live[3], live[4], live[5]
    lslot, lpos, lgchain, lghead, llast = live[6], live[7], live[9], live[10], live[11]
    tag, csalt = np.uint32(salt & np.uint64(0xFFFFFFFF)), chain_salt(salt)
    if owner >= 0 and hi > lo and lans[owner] < 0:
        lans[owner] = lused
    for j in range(lo, hi):
        p = lused
        lused += 1
        ltok[p], lsalt[p], lslot[p], lpos[p] = row[j], tag, owner, j
        last = llast[seq]
        lprev[p] = last
        lnext[p] = -1
        if last >= 0 and lslot[last] == owner:  # a prompt's copy runs on into no one answer
            lnext[last] = p
        llast[seq] = p
        link(row, j, j, p, pkeys, csalt, lchain, lhead, gkeys, lgchain, lghead, owner >= 0)
    return lused


@nb.njit(nogil=True, cache=True)
def propose_rows(token_ids, nums, new_counts, slots, salts, prompt_lens, fresh, fresh_prompt, copy_of, stored, live,
                 lused, lcopy, lans, pend, pend_len, pend_src, appended, stats_drafted, stats_accepted, stats_pos,
                 pkeys, gkeys, max_match, max_candidates, max_walk, global_walk, k, min_prob, vocab, counts, max_len,
                 drafting, out, out_len):
    """One engine step. First every row's tokens not yet in its live sequence join it (for the
    first request of a prompt the prompt's copy, for a fresh row its answer so far, then whatever
    came since the row's last call, steps vLLM drafted nothing at included), the draft pending since
    settled against them; then each row that sampled drafts up to k tokens into out[i], fewer where
    a draft of k would take the row past max_len tokens (vLLM verifies no more). Rows of slot -1
    (not started: in prefill) are passed over. copy_of[i]: the slot whose row made its prompt's
    copy; lcopy, lans: per slot, its prompt copy's last position and its first answer position.
    Returns the live arena's new fill."""
    rows = token_ids.shape[0]
    llast, lrow = live[11], live[8]
    for i in range(rows):
        out_len[i] = 0
        n, s, row, salt = nums[i], slots[i], token_ids[i], salts[i]
        if s < 0:
            continue
        lrow[s] = i
        plen = prompt_lens[i]
        if fresh_prompt[i]:
            llast[s] = -1
            lused = live_append(live, s, -1, row, 0, plen, salt, pkeys, gkeys, lused, lans)
            lcopy[s] = llast[s]
        if fresh[i]:
            lcopy[s] = lcopy[copy_of[i]]
            llast[s] = lcopy[s]
            pend_len[s] = 0
            lans[s] = -1
            lused = live_append(live, s, s, row, plen, n, salt, pkeys, gkeys, lused, lans)
            appended[s] = n
        elif n > appended[s]:
            lo = appended[s]
            # settle the pending draft, made when the row ended at lo: accepted are the tokens that
            # followed in agreement with it; the verification's last token (a correction, which a
            # one-hot draft never equals, or the bonus) ends the run
            for j in range(min(pend_len[s], n - lo - 1)):
                if row[lo + j] != pend[s, j]:
                    break
                stats_accepted[pend_src[s, j]] += 1
            lused = live_append(live, s, s, row, lo, n, salt, pkeys, gkeys, lused, lans)
            appended[s] = n
        pend_len[s] = 0
    if not drafting:
        return lused
    scratch = _scratch(max_candidates, max(k, 1))
    for i in range(rows):
        s = slots[i]
        if s < 0 or (new_counts[i] <= 0 and not fresh[i]):
            continue
        n = nums[i]
        got = _draft(token_ids[i], n, salts[i], (s, i, rows), (lcopy[s], lans[s]), stored, live, pkeys, gkeys,
                     max_match, max_candidates, max_walk, global_walk, min(k, max_len - n - 1), min_prob, vocab,
                     counts, k, out[i], pend_src[s], scratch)
        out_len[i] = got
        for j in range(got):
            pend[s, j] = out[i, j]
            stats_drafted[pend_src[s, j]] += 1
            stats_pos[j] += 1
        pend_len[s] = got
    return lused


@nb.njit(nogil=True, cache=True)
def draft_one(ctx, n, salt, me, jump, stored, live, pkeys, gkeys, max_match, max_candidates, max_walk, global_walk, k,
              min_prob, vocab, counts, out, out_src):
    """_draft for one context (the shadow replay calls it row by row)."""
    return _draft(ctx, n, salt, me, jump, stored, live, pkeys, gkeys, max_match, max_candidates, max_walk,
                  global_walk, k, min_prob, vocab, counts, k, out, out_src, _scratch(max_candidates, max(k, 1)))
