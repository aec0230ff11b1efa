"""The rollout-history store at the paper's scale: token arrays and hash chains in numpy, walked by
numba-compiled functions (no Python object per token).

Two arenas of int32 tokens:
- history: every stored response as one contiguous sequence [prompt tail | response | END], the
  prompt tail being the prompt's last max_match tokens (a match may start in the prompt). Per
  position p chain links: to the previous position of the same prompt whose min_match tokens
  before it hash alike (the prompt's own history), and under global_index=chains for each global
  key length g to the previous position of any prompt whose g tokens before it hash alike (the
  global source); and 32 bits of its prompt's identity (a chain's hash collisions are told apart).
  12 + 4 x (global key lengths) bytes per stored token, plus the chains' heads (about 2 bytes per
  token of capacity per chain of more than one token). By default the global source is instead
  a count table (store_counts.py, the device drafter's) over the newest stored answers.
- live: this call's running requests (each [prompt tail | tokens so far]) and each prompt's own
  tokens (prompt lookup), linked token to token because requests grow interleaved; answers' tokens
  are chained per prompt and globally, as the history is.
A chain head is the most recent position, so walks go newest first.

Drafting, per request (the draft rule; `ReferenceDrafter` in the tests is a plain reading of it):
1. candidates: positions whose preceding min_match tokens equal the context's last ones, newest
   first, up to max_candidates from the request's live group (its siblings, its own answer, its
   prompt) and as many from the prompt's history; each with its match length L, the common suffix
   of context and stored text up to max_match. With a count table, its draft (store_counts.
   count_draft) is taken where its match is longer than every own one and it drafts a token, and
   steps 2 and 3 below are the own candidates' otherwise. With chains, the global matches, for each key length g of
   global_keys, longest first: positions whose g tokens before them equal the context's last g (the
   running answers of this call's other prompts, newest first, then any prompt's history; up to
   max_candidates together), joining where longer than every match of the prompt's own sources (or
   where those have none); the first g that yields any decides, shorter ones are not read, nor
   are they after a g of at most own + 1 (every longer match ends in those g tokens). The walks
   over all key lengths together follow at most 2 x max_candidates links, a key shorter than
   min_match an eighth of that. Only the candidates of the largest L are kept.
2. token by token, up to k: the candidates' most common next token x (ties: the newest
   candidate's); stop when x is END or fewer than min_prob of the candidates follow it; the
   candidates that do follow x move one token on.
3. where global matches joined and their draft stopped at its first token, the prompt's own
   candidates (step 1 over them alone) draft instead, as the device drafter falls back.
Drafts are deterministic (one-hot q): vLLM's rejection sampling keeps the target's distribution
whatever the store holds; a draft also stops before any id outside the model's vocabulary (a
store loaded from another model). Evicted sequences are overwritten with DEAD, which no context
holds, so a chain walk skips them until compaction rebuilds the arena without them.

The functions are compiled once per process (HistoryIndex.warm_up, at configure) and cached on
disk by numba: beside this file, in NUMBA_CACHE_DIR or the user's cache folder, and where none of
them can be written (a read-only install, an unwritable home), in a temporary folder.
"""
from __future__ import annotations

import numpy as np

from rlspec.speculation import GLOBAL, HISTORY, PROMPT, SIBLINGS
from rlspec.speculation.store_counts import count_draft
from rlspec.speculation.store_ops import _P, _mix, nb

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


@nb.njit(nogil=True, cache=True)
def prompt_salt(tokens, n):
    """A prompt's 64-bit identity: the hash of its n tokens (never 0)."""
    h = _key(tokens, n, n)
    return h if h != np.uint64(0) else np.uint64(1)


@nb.njit(nogil=True, cache=True)
def insert_sequences(tok, psalt, chain, gchain, phead, ghead, seqs, offsets, salts, starts, min_match, gkeys):
    """Copy sequence i (seqs[offsets[i]:offsets[i+1]]) to tok[starts[i]:...] and link its positions
    into the prompt chains (salted by salts[i], whose low 32 bits each position keeps) and the
    global chains (one per key length in gkeys)."""
    mask = np.uint64(phead.shape[0] - 1)
    for i in range(offsets.shape[0] - 1):
        lo, hi, s = offsets[i], offsets[i + 1], starts[i]
        tag = np.uint32(salts[i] & np.uint64(0xFFFFFFFF))
        for j in range(hi - lo):
            tok[s + j] = seqs[lo + j]
            psalt[s + j] = tag
        for j in range(hi - lo):
            p = s + j
            if j >= min_match:
                b = np.int64(_mix(_key(tok, p, min_match) ^ salts[i]) & mask)
                chain[p] = phead[b]
                phead[b] = p
            for g in range(gkeys.shape[0]):
                if j >= gkeys[g] and ghead.shape[1] > 0:
                    b = _gslot(_gkey(tok, p, gkeys[g]), gkeys[g], ghead.shape[1])
                    gchain[g, p] = ghead[g, b]
                    ghead[g, b] = p
                else:
                    gchain[g, p] = -1


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


@nb.njit(cache=True)
def _scratch(max_candidates, k_walk):
    """Candidate arrays for _draft: positions, match lengths, sources, live flags, next tokens (room
    for the prompt's own sources' 2 x max_candidates, the global source's max_candidates, and a copy
    of the own ones to fall back to); the count table's walk's draft and scratch."""
    c = 5 * max_candidates
    return (np.empty(c, np.int64), np.empty(c, np.int64), np.empty(c, np.int64), np.empty(c, np.bool_),
            np.empty(c, np.int64), np.empty((2, k_walk), np.int64))


@nb.njit(nogil=True, cache=True)
def _draft(ctx, n, salt, tok, psalt, chain, gchain, phead, ghead, ltok, lsalt, lprev, lnext, lchain, lhead, lsrc,
           lgchain, lghead, min_match, gkeys, max_match, max_candidates, max_walk, global_walk, k, min_prob, vocab,
           counts, k_walk, out, out_src, scratch):
    """Draft up to k tokens for the context ctx[:n] of a request of prompt `salt` (the rule in the
    module docstring; with a count table, counts = HostCounts.arrays(), its global draft walked k_walk
    tokens as the device drafter walks the call's k); returns how many were written to out (and their
    sources to out_src)."""
    if k <= 0:
        return 0
    c_pos, c_len, c_src, c_live, nxt, c_out = scratch
    tag = np.uint32(salt & np.uint64(0xFFFFFFFF))
    m = 0
    if n < min_match:  # no own match: only the count table may draft
        return _count_draft(ctx, n, 0, counts, k_walk, k, vocab, c_out, out, out_src)
    h = _key(ctx, n, min_match)
    salted = _mix(h ^ salt)
    # the live group: siblings, the request's own answer, its prompt
    if lhead.shape[0] > 0:
        p = lhead[np.int64(salted & np.uint64(lhead.shape[0] - 1))]
        walked, found = 0, 0
        while p >= 0 and walked < max_walk and found < max_candidates:
            walked += 1
            length = _match_linked(ltok, lprev, p, ctx, n, min_match, max_match) if lsalt[p] == tag else 0
            if length > 0:
                c_pos[m], c_len[m], c_src[m], c_live[m] = p, length, lsrc[p], True
                m += 1
                found += 1
            p = lchain[p]
    # the prompt's history
    if phead.shape[0] > 0:
        p = phead[np.int64(salted & np.uint64(phead.shape[0] - 1))]
        walked, found = 0, 0
        while p >= 0 and walked < max_walk and found < max_candidates:
            walked += 1
            length = _match_flat(tok, p, ctx, n, min_match, max_match) if psalt[p] == tag else 0
            if length > 0:
                c_pos[m], c_len[m], c_src[m], c_live[m] = p, length, HISTORY, False
                m += 1
                found += 1
            p = chain[p]
    own = 0
    for i in range(m):
        own = max(own, c_len[i])
    m_own = m
    if counts[0].shape[0] > 0:   # the count table's draft where its match is longer and it drafts
        got = _count_draft(ctx, n, own, counts, k_walk, k, vocab, c_out, out, out_src)
        if got > 0:
            return got
        return _extend(c_pos, c_len, c_src, c_live, nxt, m, tok, ltok, lnext, k, min_prob, vocab, out, out_src)
    walked = 0
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
        # a key shorter than min_match matches almost anywhere: its newest few links (8 by default)
        budget = global_walk if gm >= min_match else min(global_walk, walked + max(global_walk // 8, 1))
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
        return _extend(c_pos, c_len, c_src, c_live, nxt, m, tok, ltok, lnext, k, min_prob, vocab, out, out_src)
    # the global matches decide where they draft; where their vote stops at once, the own ones do
    b = c_pos.shape[0] - 2 * max_candidates
    c_pos[b:b + m_own], c_len[b:b + m_own] = c_pos[:m_own], c_len[:m_own]
    c_src[b:b + m_own], c_live[b:b + m_own] = c_src[:m_own], c_live[:m_own]
    count = _extend(c_pos, c_len, c_src, c_live, nxt, m, tok, ltok, lnext, k, min_prob, vocab, out, out_src)
    if count > 0:
        return count
    return _extend(c_pos[b:], c_len[b:], c_src[b:], c_live[b:], nxt[b:], m_own, tok, ltok, lnext, k, min_prob, vocab,
                   out, out_src)


@nb.njit(nogil=True, cache=True)
def _count_draft(ctx, n, own, counts, k_walk, k, vocab, c_out, out, out_src):
    """The count table's draft (k_walk tokens walked, the first k kept) where its match is longer
    than own, the longest of the prompt's own sources; else none."""
    key, ctok, cnt, levels, salts, min_prob, score_select = counts
    if key.shape[0] == 0 or own >= levels[levels.shape[0] - 1]:
        return 0
    got, m = count_draft(ctx, n, key, ctok, cnt, levels, salts, k_walk, min_prob, score_select, vocab, c_out[0],
                         c_out[1])
    if m <= own:
        return 0
    got = min(got, k)
    for j in range(got):
        out[j] = c_out[0, j]
        out_src[j] = GLOBAL
    return got


@nb.njit(nogil=True, cache=True)
def _extend(c_pos, c_len, c_src, c_live, nxt, m, tok, ltok, lnext, k, min_prob, vocab, out, out_src):
    """Steps 1 (largest L only) and 2 of the draft rule over m candidates (ids at or past `vocab`
    end a draft, as END does)."""
    if m == 0:
        return 0
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
        if x < 0 or x >= vocab or votes < min_prob * m:
            break
        out[count] = x
        out_src[count] = c_src[best]
        count += 1
        keep = 0
        for i in range(m):
            if nxt[i] == x:
                q = lnext[c_pos[i]] if c_live[i] else c_pos[i] + 1
                if q >= 0:
                    c_pos[keep], c_src[keep], c_live[keep] = q, c_src[i], c_live[i]
                    keep += 1
        m = keep
    return count


@nb.njit(nogil=True, cache=True)
def _live_append(ltok, lsalt, lprev, lnext, lchain, lhead, lsrc, lgchain, lghead, llast, lused, slot, src, row, lo,
                 hi, seq_start, salt, min_match, gkeys):
    """Append row[lo:hi] to live sequence `slot` (its first token at row index seq_start), linking
    every token with min_match tokens of its sequence before it into the prompt's chain, and an
    answer's (src SIBLINGS) with g tokens before it into global chain g. Returns the new lused."""
    mask = np.uint64(lhead.shape[0] - 1)
    tag = np.uint32(salt & np.uint64(0xFFFFFFFF))
    for j in range(lo, hi):
        p = lused
        lused += 1
        ltok[p] = row[j]
        lsalt[p] = tag
        lsrc[p] = src
        lprev[p] = llast[slot]
        lnext[p] = -1
        if llast[slot] >= 0:
            lnext[llast[slot]] = p
        llast[slot] = p
        if j - min_match >= seq_start:
            b = np.int64(_mix(_key(row, j, min_match) ^ salt) & mask)
            lchain[p] = lhead[b]
            lhead[b] = p
        else:
            lchain[p] = -1
        for g in range(gkeys.shape[0]):
            if src == SIBLINGS and j - gkeys[g] >= seq_start and lghead.shape[1] > 0:
                b = _gslot(_gkey(row, j, gkeys[g]), gkeys[g], lghead.shape[1])
                lgchain[g, p] = lghead[g, b]
                lghead[g, b] = p
            else:
                lgchain[g, p] = -1
    return lused


@nb.njit(nogil=True, cache=True)
def propose_rows(token_ids, nums, new_counts, slots, salts, prompt_lens, fresh, fresh_prompt,
                 tok, psalt, chain, gchain, phead, ghead,
                 ltok, lsalt, lprev, lnext, lchain, lhead, lsrc, lgchain, lghead, llast, lused,
                 pend, pend_len, pend_src, appended, stats_drafted, stats_accepted, stats_pos,
                 min_match, gkeys, max_match, max_candidates, max_walk, global_walk, k, min_prob, vocab, counts,
                 max_len, drafting, out, out_len):
    """One engine step: every row's tokens not yet in its live sequence join it (a fresh row's
    prompt tail and answer so far, and for the first request of a prompt the prompt itself; then
    whatever came since the row's last call, steps vLLM drafted nothing at included), the draft
    pending since is settled against them, and each row that sampled drafts up to k tokens into
    out[i], fewer where a draft of k would take the row past max_len tokens (vLLM verifies no
    more). Rows of slot -1 (not started: in prefill) are passed over. Returns the live arena's new
    fill."""
    scratch = _scratch(max_candidates, max(k, 1))
    for i in range(token_ids.shape[0]):
        out_len[i] = 0
        n, s, row, salt = nums[i], slots[i], token_ids[i], salts[i]
        if s < 0:
            continue
        plen = prompt_lens[i]
        tail = max(0, plen - max_match)
        if fresh_prompt[i]:
            llast[s] = -1
            lused = _live_append(ltok, lsalt, lprev, lnext, lchain, lhead, lsrc, lgchain, lghead, llast, lused, s,
                                 PROMPT, row, 0, plen, 0, salt, min_match, gkeys)
        if fresh[i]:  # [prompt tail | answer so far]: the tail drafts as the prompt, the answer as a sibling
            llast[s] = -1
            pend_len[s] = 0
            lused = _live_append(ltok, lsalt, lprev, lnext, lchain, lhead, lsrc, lgchain, lghead, llast, lused, s,
                                 PROMPT, row, tail, plen, tail, salt, min_match, gkeys)
            lused = _live_append(ltok, lsalt, lprev, lnext, lchain, lhead, lsrc, lgchain, lghead, llast, lused, s,
                                 SIBLINGS, row, plen, n, tail, salt, min_match, gkeys)
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
            lused = _live_append(ltok, lsalt, lprev, lnext, lchain, lhead, lsrc, lgchain, lghead, llast, lused, s,
                                 SIBLINGS, row, lo, n, tail, salt, min_match, gkeys)
            appended[s] = n
        pend_len[s] = 0
        if not drafting or (new_counts[i] <= 0 and not fresh[i]):
            continue
        got = _draft(row, n, salt, tok, psalt, chain, gchain, phead, ghead, ltok, lsalt, lprev, lnext, lchain, lhead,
                     lsrc, lgchain, lghead, min_match, gkeys, max_match, max_candidates, max_walk, global_walk,
                     min(k, max_len - n - 1), min_prob, vocab, counts, k, out[i], pend_src[s], scratch)
        out_len[i] = got
        for j in range(got):
            pend[s, j] = out[i, j]
            stats_drafted[pend_src[s, j]] += 1
            stats_pos[j] += 1
        pend_len[s] = got
    return lused


@nb.njit(nogil=True, cache=True)
def draft_one(ctx, n, salt, tok, psalt, chain, gchain, phead, ghead, ltok, lsalt, lprev, lnext, lchain, lhead, lsrc,
              lgchain, lghead, min_match, gkeys, max_match, max_candidates, max_walk, global_walk, k, min_prob, vocab,
              counts, out, out_src):
    """_draft for one context (the shadow replay calls it row by row)."""
    return _draft(ctx, n, salt, tok, psalt, chain, gchain, phead, ghead, ltok, lsalt, lprev, lnext, lchain, lhead,
                  lsrc, lgchain, lghead, min_match, gkeys, max_match, max_candidates, max_walk, global_walk, k,
                  min_prob, vocab, counts, k, out, out_src, _scratch(max_candidates, max(k, 1)))

