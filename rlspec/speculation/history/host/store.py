"""The rollout-history store at the paper's scale: token arrays and hash chains in numpy, walked by
numba-compiled functions (no Python object per token).

Two arenas of int32 tokens:
- history: every stored response as one contiguous sequence [prompt tail | response | END], the
  prompt tail being the prompt's last max_match tokens (a match may start in the prompt). Per
  position p and key length m of prompt_keys a chain link to the previous position of the same
  prompt whose m tokens before it hash alike (the prompt's own history); under
  global_index=chains, for each global key length g, a link to the previous position of any prompt
  whose g tokens before it hash alike (the global source); and 32 bits of its prompt's identity (a
  chain's hash collisions are told apart). 8 + 4 x (key lengths) bytes per stored token, plus the
  chains' heads. By default the global source is instead a count table (counts.py, the
  device drafter's) over the newest stored answers.
- live (live.py): this call's running answers, and each prompt's tokens once (the row's own
  prompt), linked token to token because requests grow interleaved; an answer's first token links
  back to its prompt's copy, so a match runs on into the prompt as it does in the row.
A chain head is the most recent position, so walks go newest first.

Drafting, per request: the device drafter's rule (rlspec/speculation/history/device/store.py; the test
tests/speculation/test_backends.py drafts both on the same traces), read over chains instead of
buckets:
1. the prompt's own candidates, per key length m of prompt_keys, longest first: the newest
   max_candidates stored positions of the prompt whose m tokens before them hash as the context's
   last m (its chain), the latest position of the row itself (its answer, then its prompt) and of
   each sibling's answer (at most MAX_SIBLINGS - 1 siblings) whose m tokens equal the context's;
   each with its match length L (the common suffix of context and text before it, up to max_match,
   at least m). The first key length with any candidate decides (a shorter key finds only shorter
   matches, or the same positions). Of the longest L, the MAX_VOTERS of highest rank vote (the row
   itself, then its siblings by position, then the newest stored).
2. token by token, up to k: the voters' most common next token x (ties: the highest ranked); stop
   when x is END or less than min_prob of the voters follow it; the voters that follow x move one
   token on (a running answer's voter whose text ends drops out).
3. the global source: with the count table, its draft (counts.count_draft) where its match
   is longer than the own candidates' L and it drafts a token. With chains, for each key length g
   of global_keys, longest first: positions whose g tokens before them equal the context's last g
   (the running answers of this call's other prompts, newest first, then any prompt's history; up
   to max_candidates together), joining where longer than every own match (or where there is
   none); the first g that yields any decides; where their vote stops at once, the own candidates
   draft.
Drafts are deterministic (one-hot q): vLLM's rejection sampling keeps the target's distribution
whatever the store holds; a draft also stops before any id outside the model's vocabulary (a
store loaded from another model). Evicted sequences are overwritten with DEAD, which no context
holds, so a chain walk skips them until compaction rebuilds the arena without them. Where the
drafters part: the host store bounds what it keeps per prompt and walks chains (a walk reads
max_candidates links of a key's chain where the device reads the newest max_candidates entries of
its bucket), the device keeps a ring; within a call a row reads the siblings with the latest
matches here, a fixed share of its prompt's running and finished answers there (prompt_siblings).

The functions are compiled once per process (HistoryIndex.warm_up, at configure) and cached on
disk by numba: beside this file, in NUMBA_CACHE_DIR or the user's cache folder, and where none of
them can be written (a read-only install, an unwritable home), in a temporary folder.
"""
from __future__ import annotations

import numpy as np

from rlspec.speculation import GLOBAL, HISTORY, MAX_SIBLINGS, MAX_VOTERS, PROMPT, SIBLINGS
from rlspec.speculation.history.host.counts import count_draft
from rlspec.speculation.history.host.ops import _P, _mix, nb

END = -1   # a sequence's last token: the responses stopped here
DEAD = -2  # an evicted sequence's tokens until compaction
_SEED = np.uint64(0x9E3779B97F4A7C15)


@nb.njit(inline="always", cache=True)
def _key(tokens, end, m):
    """Hash of tokens[end - m : end]."""
    h = _SEED
    for j in range(end - m, end):
        h = _mix(h ^ np.uint64(tokens[j] + 3))
    return h


SHORT_KEY_SLOTS = 1 << 18  # chain heads of a one-token global key (a vocabulary's worth, cache-sized)


@nb.njit(inline="always", cache=True)
def _gkey(tokens, end, m):
    """Hash of tokens[end - m : end] for the global chains: a polynomial over the tokens, mixed
    once (a key of up to 8 tokens per level and position, so cheaper than _key)."""
    h = np.uint64(0)
    for j in range(end - m, end):
        h = h * _P + np.uint64(tokens[j] + 3)
    return _mix(h ^ _SEED)


@nb.njit(inline="always", cache=True)
def _gslot(h, g, width):
    """Chain-head slot of global key hash h of length g in a head row of `width` slots."""
    n = min(width, SHORT_KEY_SLOTS) if g == 1 else width
    return np.int64(h & np.uint64(n - 1))


@nb.njit(inline="always", cache=True)
def chain_salt(salt):
    """What a prompt chain's key hash is salted with: the prompt's identity mixed once more (a
    prompt of m tokens would otherwise salt its own m-token key hash to zero, and all such prompts
    would share one chain)."""
    return _mix(salt ^ _SEED)


@nb.njit(nogil=True, cache=True)
def prompt_salt(tokens, n):
    """A prompt's 64-bit identity: the hash of its n tokens (never 0)."""
    h = _key(tokens, n, n)
    return h if h != np.uint64(0) else np.uint64(1)


@nb.njit(inline="always", cache=True)
def link(text, end, since, p, pkeys, csalt, chain, head, gkeys, gchain, ghead, glinked):
    """Link position p, whose text ends at text[end] with `since` tokens of its sequence before it,
    into the prompt chain of each key length of pkeys (salted by csalt) and, where glinked, into
    the global chain of each key length of gkeys."""
    mask = np.uint64(head.shape[1] - 1)
    for li in range(pkeys.shape[0]):
        if since >= pkeys[li] and head.shape[1] > 0:
            b = np.int64(_mix(_key(text, end, pkeys[li]) ^ csalt) & mask)
            chain[li, p] = head[li, b]
            head[li, b] = p
        else:
            chain[li, p] = -1
    for g in range(gkeys.shape[0]):
        if glinked and since >= gkeys[g] and ghead.shape[1] > 0:
            b = _gslot(_gkey(text, end, gkeys[g]), gkeys[g], ghead.shape[1])
            gchain[g, p] = ghead[g, b]
            ghead[g, b] = p
        else:
            gchain[g, p] = -1


@nb.njit(nogil=True, cache=True)
def insert_sequences(tok, psalt, chain, gchain, phead, ghead, seqs, offsets, salts, starts, pkeys, gkeys):
    """Copy sequence i (seqs[offsets[i]:offsets[i+1]]) to tok[starts[i]:...] and link its positions
    into the prompt chains (one per key length in pkeys, salted by salts[i], whose low 32 bits each
    position keeps) and the global chains (one per key length in gkeys)."""
    for i in range(offsets.shape[0] - 1):
        lo, hi, s = offsets[i], offsets[i + 1], starts[i]
        tag = np.uint32(salts[i] & np.uint64(0xFFFFFFFF))
        csalt = chain_salt(salts[i])
        for j in range(hi - lo):
            tok[s + j] = seqs[lo + j]
            psalt[s + j] = tag
        for j in range(hi - lo):
            link(tok, s + j, j, s + j, pkeys, csalt, chain, phead, gkeys, gchain, ghead, True)


@nb.njit(nogil=True, cache=True)
def kill_sequences(tok, starts, lengths):
    for i in range(starts.shape[0]):
        for j in range(starts[i], starts[i] + lengths[i]):
            tok[j] = DEAD


@nb.njit(inline="always", cache=True)
def _match_flat(tok, p, ctx, n, min_match, max_match):
    """Match length of the context ending at n against the stored text before position p (0: the
    min_match tokens differ)."""
    if p < min_match:
        return 0
    for j in range(1, min_match + 1):
        if tok[p - j] != ctx[n - j]:
            return 0
    length = min_match
    while length < max_match and p - length - 1 >= 0 and n - length - 1 >= 0 \
            and tok[p - length - 1] == ctx[n - length - 1]:
        length += 1
    return length


@nb.njit(inline="always", cache=True)
def _match_linked(ltok, lprev, p, ctx, n, min_match, max_match):
    q = lprev[p]
    length = 0
    while q >= 0 and length < max_match and n - length - 1 >= 0 and ltok[q] == ctx[n - length - 1]:
        length += 1
        q = lprev[q]
    return length if length >= min_match else 0


@nb.njit(nogil=True, cache=True)
def _vote(cand_tok, m):
    """(index of the most common token among cand_tok[:m], its count); ties: the earliest."""
    best, best_count = 0, 0
    for i in range(m):
        t = cand_tok[i]
        seen = False
        for j in range(i):
            if cand_tok[j] == t:
                seen = True
                break
        if seen:
            continue
        c = 1
        for j in range(i + 1, m):
            if cand_tok[j] == t:
                c += 1
        if c > best_count:
            best, best_count = i, c
    return best, best_count


_LIVE = np.int64(1) << np.int64(42)  # ranks, as the device drafter's: a running answer outranks any stored
_SELF = np.int64(1) << np.int64(41)  # position, the row itself its siblings


@nb.njit(cache=True)
def _scratch(max_candidates, k_walk):
    """Candidate arrays for _draft: positions, match lengths, sources, live flags, ranks, next tokens
    (room for the own sources' max_candidates + MAX_SIBLINGS, the global source's max_candidates,
    and a copy of the own ones to fall back to); the siblings listed; the count table's walk's draft
    and scratch."""
    c = 3 * (max_candidates + MAX_SIBLINGS)
    return (np.empty(c, np.int64), np.empty(c, np.int64), np.empty(c, np.int64), np.empty(c, np.bool_),
            np.empty(c, np.int64), np.empty(c, np.int64), np.empty(MAX_SIBLINGS, np.int64),
            np.empty((2, k_walk), np.int64))


@nb.njit(nogil=True, cache=True)
def _own(ctx, n, salt, me, stored, live, pkeys, max_match, max_candidates, max_walk, scratch):
    """Step 1 of the rule for the context ctx[:n] of prompt `salt`; me = (the row's slot, its batch
    row, the batch's rows); returns how many candidates it wrote, highest rank first."""
    tok, psalt, chain, phead = stored[0], stored[1], stored[2], stored[4]
    ltok, lsalt, lprev, lchain, lhead = live[0], live[1], live[2], live[4], live[5]
    lslot, lpos, lrow = live[6], live[7], live[8]
    c_pos, c_len, c_src, c_live, c_rank, sibs = scratch[0], scratch[1], scratch[2], scratch[3], scratch[4], scratch[6]
    slot, row, rows = me
    tag, csalt = np.uint32(salt & np.uint64(0xFFFFFFFF)), chain_salt(salt)
    m = 0
    for li in range(pkeys.shape[0]):
        key = pkeys[li]
        if n < key:
            continue
        salted = _mix(_key(ctx, n, key) ^ csalt)
        if lhead.shape[1] > 0:  # the row's latest match (answer, then prompt), each sibling's latest
            p = lhead[li, np.int64(salted & np.uint64(lhead.shape[1] - 1))]
            walked, mine, n_sib = 0, False, 0
            while p >= 0 and walked < max_walk and not (mine and n_sib == MAX_SIBLINGS - 1):
                walked += 1
                if lsalt[p] == tag:
                    owner = lslot[p]
                    own_row = owner == slot or owner < 0
                    take = not mine if own_row else n_sib < MAX_SIBLINGS - 1
                    for j in range(n_sib):
                        take = take and (own_row or sibs[j] != owner)
                    length = _match_linked(ltok, lprev, p, ctx, n, key, max_match) if take else 0
                    if length > 0:
                        c_pos[m], c_len[m], c_live[m] = p, length, True
                        if own_row:
                            c_src[m], c_rank[m] = PROMPT, _LIVE + _SELF + lpos[p] * rows + row
                            mine = True
                        else:
                            c_src[m], c_rank[m] = SIBLINGS, _LIVE + lpos[p] * rows + lrow[owner]
                            sibs[n_sib] = owner
                            n_sib += 1
                        m += 1
                p = lchain[li, p]
            for i in range(1, m):  # at most MAX_SIBLINGS: highest rank first
                j = i
                while j > 0 and c_rank[j] > c_rank[j - 1]:
                    for a in (c_pos, c_len, c_src, c_rank):
                        a[j], a[j - 1] = a[j - 1], a[j]
                    j -= 1
        if phead.shape[1] > 0:  # the newest max_candidates positions of the key's chain
            p = phead[li, np.int64(salted & np.uint64(phead.shape[1] - 1))]
            walked = 0
            while p >= 0 and walked < max_candidates:
                walked += 1
                length = _match_flat(tok, p, ctx, n, key, max_match) if psalt[p] == tag else 0
                if length > 0:
                    c_pos[m], c_len[m], c_src[m], c_live[m], c_rank[m] = p, length, HISTORY, False, p
                    m += 1
                p = chain[li, p]
        if m > 0:
            break
    return m


@nb.njit(nogil=True, cache=True)
def _voters(scratch, m, max_voters):
    """The candidates of the longest match, at most max_voters, first (they are in rank order);
    returns how many."""
    c_pos, c_len, c_src, c_live = scratch[0], scratch[1], scratch[2], scratch[3]
    longest = 0
    for i in range(m):
        longest = max(longest, c_len[i])
    keep = 0
    for i in range(m):
        if c_len[i] == longest and keep < max_voters:
            c_pos[keep], c_len[keep], c_src[keep], c_live[keep] = c_pos[i], c_len[i], c_src[i], c_live[i]
            keep += 1
    return keep


@nb.njit(nogil=True, cache=True)
def _draft(ctx, n, salt, me, jump, stored, live, pkeys, gkeys, max_match, max_candidates, max_walk, global_walk,
           k, min_prob, vocab, counts, k_walk, out, out_src, scratch):
    """Draft up to k tokens for the context ctx[:n] of a request of prompt `salt` (the rule in the
    module docstring; me: the row's slot, batch row and the batch's rows; jump: (the last position
    of the prompt's live copy, the row's first answer position), where a match in the prompt runs
    on; with a count table, counts = HostCounts.arrays(), its global draft walked k_walk tokens as
    the device drafter walks the call's k); returns how many were written to out (and their sources
    to out_src)."""
    if k <= 0:
        return 0
    c_pos, c_len, c_src, c_live, nxt = scratch[0], scratch[1], scratch[2], scratch[3], scratch[5]
    m = _voters(scratch, _own(ctx, n, salt, me, stored, live, pkeys, max_match, max_candidates, max_walk, scratch),
                MAX_VOTERS)
    own = c_len[0] if m > 0 else 0
    if counts[0].shape[0] > 0:   # the count table's draft where its match is longer and it drafts
        got = _count_draft(ctx, n, own, counts, k_walk, k, vocab, scratch[7], out, out_src)
        if got > 0:
            return got
        return _extend(c_pos, c_len, c_src, c_live, nxt, m, stored[0], live, jump, k, min_prob, vocab, out, out_src)
    tok, gchain, ghead = stored[0], stored[3], stored[5]
    ltok, lsalt, lprev, lgchain, lghead = live[0], live[1], live[2], live[9], live[10]
    tag = np.uint32(salt & np.uint64(0xFFFFFFFF))
    m_own, walked = m, 0
    for lv in range(gkeys.shape[0]):
        # other prompts' running answers, then any prompt's history: their matches join where they
        # are longer than every match of the prompt's own sources (so they decide alone), or where
        # those have none; one shorter walk over all levels, since these chains run through every
        # prompt
        gm = gkeys[lv]
        if own >= max_match or n < gm:
            continue
        g = _gkey(ctx, n, gm)
        found = 0
        # a key shorter than the shortest prompt key matches almost anywhere: its newest few links
        short = gm < pkeys[pkeys.shape[0] - 1]
        budget = min(global_walk, walked + max(global_walk // 8, 1)) if short else global_walk
        if lghead.shape[1] > 0:
            p = lghead[lv, _gslot(g, gm, lghead.shape[1])]
            while p >= 0 and walked < budget and found < max_candidates:
                walked += 1
                length = _match_linked(ltok, lprev, p, ctx, n, gm, max_match) if lsalt[p] != tag else 0
                if length > own:
                    c_pos[m], c_len[m], c_src[m], c_live[m] = p, length, GLOBAL, True
                    m += 1
                    found += 1
                p = lgchain[lv, p]
        if ghead.shape[1] > 0:
            p = ghead[lv, _gslot(g, gm, ghead.shape[1])]
            while p >= 0 and walked < budget and found < max_candidates:
                walked += 1
                length = _match_flat(tok, p, ctx, n, gm, max_match)
                if length > own:
                    c_pos[m], c_len[m], c_src[m], c_live[m] = p, length, GLOBAL, False
                    m += 1
                    found += 1
                p = gchain[lv, p]
        # every match longer than own ends in the gm tokens of the key when gm <= own + 1: a
        # shorter key's chain holds no other
        if found > 0 or gm <= own + 1:
            break
    if m == m_own or m_own == 0:
        return _extend(c_pos, c_len, c_src, c_live, nxt, m, tok, live, jump, k, min_prob, vocab, out, out_src)
    # the global matches decide where they draft; where their vote stops at once, the own ones do
    b = c_pos.shape[0] - m_own
    c_pos[b:], c_len[b:], c_src[b:], c_live[b:] = c_pos[:m_own], c_len[:m_own], c_src[:m_own], c_live[:m_own]
    count = _extend(c_pos[m_own:], c_len[m_own:], c_src[m_own:], c_live[m_own:], nxt, m - m_own, tok, live, jump, k,
                    min_prob, vocab, out, out_src)
    if count > 0:
        return count
    return _extend(c_pos[b:], c_len[b:], c_src[b:], c_live[b:], nxt, m_own, tok, live, jump, k, min_prob, vocab, out,
                   out_src)


@nb.njit(nogil=True, cache=True)
def _count_draft(ctx, n, own, counts, k_walk, k, vocab, c_out, out, out_src):
    """The count table's draft (k_walk tokens walked, the first k kept) where its match is longer
    than own, the longest of the prompt's own sources; else none."""
    key, ctok, cnt, levels, salts, min_prob = counts
    if key.shape[0] == 0 or own >= levels[levels.shape[0] - 1]:
        return 0
    got, m = count_draft(ctx, n, key, ctok, cnt, levels, salts, k_walk, min_prob, vocab, c_out[0], c_out[1])
    if m <= own:
        return 0
    got = min(got, k)
    for j in range(got):
        out[j] = c_out[0, j]
        out_src[j] = GLOBAL
    return got


@nb.njit(nogil=True, cache=True)
def _extend(c_pos, c_len, c_src, c_live, nxt, m, tok, live, jump, k, min_prob, vocab, out, out_src):
    """Step 2 of the draft rule over the m candidates of the longest match, highest rank first
    (ids at or past `vocab` end a draft, as END does); a live candidate at the end of the prompt's
    copy (jump[0]) runs on at the row's first answer token (jump[1])."""
    ltok, lnext = live[0], live[3]
    longest = 0
    for i in range(m):
        longest = max(longest, c_len[i])
    keep = 0
    for i in range(m):
        if c_len[i] == longest:
            c_pos[keep], c_src[keep], c_live[keep] = c_pos[i], c_src[i], c_live[i]
            keep += 1
    m = keep
    count = 0
    while count < k and m > 0:
        for i in range(m):
            nxt[i] = ltok[c_pos[i]] if c_live[i] else tok[c_pos[i]]
        best, votes = _vote(nxt, m)
        x = nxt[best]
        if x < 0 or x >= vocab or votes / m < min_prob:
            break
        out[count] = x
        out_src[count] = c_src[best]
        count += 1
        keep = 0
        for i in range(m):
            if nxt[i] == x:
                q = c_pos[i] + 1
                if c_live[i]:
                    q = lnext[c_pos[i]]
                    if q < 0 and c_pos[i] == jump[0]:
                        q = jump[1]
                if q >= 0:
                    c_pos[keep], c_src[keep], c_live[keep] = q, c_src[i], c_live[i]
                    keep += 1
        m = keep
    return count
