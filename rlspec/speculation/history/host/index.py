"""Rollout-history drafting (`speculation=history`): drafts that cost no model, read from what RL
already generated. RL samples G answers per prompt and returns to the same prompts every epoch;
RhymeRL (arXiv 2508.18588) drafts from a prompt's earlier answers, Seer (arXiv 2511.14617) from
the siblings of its group, SuffixDecoding (vLLM's `suffix`) from earlier answers to any prompt.
Four sources serve each request, in rlspec/speculation/history/host/arena.py's arrays, walked by store.py's
compiled functions:

- history: the prompt's stored responses (the most recent max_rollouts_per_prompt),
- siblings: this call's other responses to the same prompt as far as they got,
- prompt: the request's own row, its prompt and its answer so far (prompt lookup),
- global: stored responses to any prompt, where they match the context further back than the
  first three do (a prompt seen for the first time has only these).

The draft rule is store.py's, the device drafter's (history/device/store.py) read over chains: the
longest context match decides, the candidates' majority token goes on while at least min_prob of
them agree, and a draft stops where the responses it follows ended. Drafts are deterministic
(one-hot q), so vLLM's rejection sampling keeps the target's distribution whatever the history
holds.

The store is bounded by max_tokens. Over it, the prompts holding the most responses drop their
oldest first, down to min_rollouts_per_prompt; then whole prompts go, those whose identity hashes
highest first, and a prompt hashing above the last one evicted is no longer admitted. The prompts
kept are a fixed subset (a resident set) that every reshuffled epoch comes back to, where evicting
the least recently seen would drop exactly the prompts the epoch has yet to revisit. A store far
under max_tokens (answers got shorter, or a resumed run raised the bound) raises that limit
again, in proportion. Finished responses join the store in a background thread, while the learner
trains; the next engine step waits for it. A record that fails (a bad id, no memory) leaves the
store as it was.

vLLM hosts the drafter as a custom proposer (rlspec/speculation/history/host/proposer.py; Model
Runner V1 runs it: on a GPU vLLM falls back to V1 for it); the Generator tells it through
collective_rpc when a call begins (`begin_call`) and which responses the call returned (`record`)."""
from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np

from rlspec.config import HistoryConfig
from rlspec.speculation.history.host import store as S
from rlspec.speculation.history.host import live as L
from rlspec.speculation.history.host.arena import HistoryArena, LiveArena, shadow_step
from rlspec.speculation.history.host.records import MAX_ID, PromptRecord, Seq, insert_batch, as_ids, Undo
from rlspec.speculation.history.state import STATE_VERSION, loadable
from rlspec.speculation.history.stats import HistoryStats, replay_in_shadow, shadow_groups
from rlspec.speculation.history.host.counts import NO_COUNTS, HostCounts
from rlspec.speculation import SOURCES

WALK = 4  # chain links a lookup follows per candidate it may take (hash collisions and evicted text)
SLACK = 0.95  # over max_tokens, the store is cut to this share of it
RISE = 0.5  # under this share of max_tokens, the admission limit rises again
GROWTH = 1.5  # a rebuilt arena's room: this times what it holds and must take


class HistoryIndex:
    """The store (every prompt's recent responses, in a history arena) and the drafting over it,
    free of vLLM."""

    def __init__(self, cfg: HistoryConfig, k_max: int, vocab_size: int | None = None):
        self.cfg, self.k_max = cfg, k_max
        self.vocab = vocab_size or MAX_ID + 1  # drafts hold ids below it
        self.min_prob = float(cfg.min_prob)
        self.tail = cfg.max_match  # prompt tokens kept in front of each stored response
        self.walk = WALK * cfg.max_candidates  # chain links a source's lookup follows at most
        counts = cfg.global_source and cfg.host.global_index == "counts"
        self.count_table = HostCounts(cfg.max_match, cfg.host.count_tokens, self.vocab) if counts else None
        # the global chains' key lengths, longest first (none: the count table is the global source)
        self.gkeys = np.array([] if counts else cfg.host.global_keys, np.int64)
        self.pkeys = np.array(cfg.prompt_keys, np.int64)  # the prompt's own chains' key lengths, longest first
        self.global_walk = 2 * cfg.max_candidates  # ... and the global chains', all key lengths together
        self.arena = HistoryArena(len(self.pkeys), len(self.gkeys))
        self.total = 0             # response tokens held over all prompts
        self.prompts: dict[int, PromptRecord] = {}
        self.admit_below = 1 << 64  # prompts ranking at or above it are not stored
        self.live = LiveArena(levels=len(self.gkeys), plevels=len(self.pkeys))
        self.no_live = LiveArena.empty(len(self.gkeys), len(self.pkeys))  # draft_context without a call's rows
        self.slots: dict = {}       # this call's request key -> (slot, salt)
        self.slot_salt: list[int] = []
        self.live_prompts: dict[int, int] = {}  # this call's prompts: the slot whose row made the prompt's copy
        self.pend, self.pend_src = (np.zeros((256, max(k_max, 1)), np.int64) for _ in range(2))
        self.pend_len = np.zeros(256, np.int64)
        self.appended = np.zeros(256, np.int64)  # per slot: the row's tokens in its live sequence
        self.counts = np.zeros(2 * len(SOURCES) + k_max, np.int64)  # drafted, accepted by source; per position
        self.stats = self._new_stats()
        self.drafting = True       # False: this call drafts nothing (validation)
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None

    @classmethod
    def warm_up(cls, cfg: HistoryConfig, k_max: int) -> None:
        """Compile (or load from numba's cache) every store function a run calls, on a throwaway
        store of these settings: seconds that no engine step, and so no drafting time, pays."""
        small = replace(cfg.host, max_tokens=1 << 10, count_tokens=1 << 10)
        h = cls(replace(cfg, max_rollouts_per_prompt=2, host=small), max(k_max, 1))
        p, q, r = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
        h.record([p, p, q, q, r, r], [[9, 10, 11, 12, 13]] * 6, wait=True)
        h.record([p], [[9, 10, 11]], wait=True)   # p's oldest evicted in place
        h.record([q], [[9, 10, 11]], wait=True)   # ... then q's: the arena is rebuilt
        h.begin_call()
        ids = np.zeros((2, 16), np.int32)
        ids[:, :4] = p
        ids[0, 4:7] = [9, 10, 11]
        h.propose_rows(ids, [7, 4], [1, 0], ["a", "b"], [4, 4], k_max)   # a row sampling, one in prefill
        h.shadow([p], [[9, 10, 11]], 1)
        h.load_state_dict(h.state_dict())

    @property
    def nbytes(self) -> int:
        """Bytes the store's arrays hold (history arena and its chain heads, the count table; the live
        arena apart)."""
        return self.arena.nbytes + (self.count_table.nbytes if self.count_table else 0)

    # -- the history arena ---------------------------------------------------------------------------
    def _store(self, items: list[tuple[int, Seq, np.ndarray]], undo: Undo) -> None:
        """Place new sequences (salt, Seq, [tail | response | END]) at the arena's end and evict
        the dropped ones: first every allocation (a larger or rebuilt arena, the insert's arrays),
        then the writes, which cannot fail."""
        a = self.arena
        victims = [q for q in undo.dropped if q.start >= 0]
        kill = (np.array([q.start for q in victims], np.int64), np.array([q.stored for q in victims], np.int64))
        salts, body, offsets = insert_batch(items)
        need, dead = len(body), a.dead + int(kill[1].sum())
        moved: list[tuple[Seq, int]] | None = None   # a rebuilt arena: the stored sequences' new starts
        arena = a
        if dead > a.used // 4:
            arena, moved = self._rebuilt(need)
        elif a.used + need > a.capacity:
            # nothing evicted and heads at least a quarter of the room: the arrays only grow
            # (positions and links stay); the relinking, an insert's whole cost again, comes at
            # every other growth
            if dead == 0 and 4 * a.heads >= GROWTH * (a.used + need):
                arena = a.grown(max(1 << 16, int(GROWTH * (a.used + need))))
            else:
                arena, moved = self._rebuilt(need)
        if self.count_table is not None:   # may fail: the arena is not written yet
            old = self.arena
            self.count_table.update(lambda q: old.tok[q.start: q.start + q.stored], victims,
                                    [(seq, b) for _, seq, b in items])
        starts = arena.insert(salts, body, offsets, self.pkeys, self.gkeys)
        if moved is None:
            arena.kill(*kill)
        for seq, start in moved or []:
            seq.start = start
        for (_, seq, _), start in zip(items, starts.tolist()):
            seq.start = start
        self.arena = arena

    def _rebuilt(self, need: int) -> tuple[HistoryArena, list[tuple[Seq, int]]]:
        """A fresh arena holding the placed sequences still stored, in their order (positions move,
        recency stays), with room for `need` more and to grow: compaction and growth."""
        placed = sorted(((seq.start, salt, seq) for salt, rec in self.prompts.items() for seq in rec.seqs
                         if seq.start >= 0), key=lambda x: x[0])
        tok = self.arena.tok
        salts, body, offsets = insert_batch([(salt, seq, tok[start: start + seq.stored])
                                             for start, salt, seq in placed])
        arena = HistoryArena(len(self.pkeys), len(self.gkeys), max(1 << 16, int(GROWTH * (len(body) + need))))
        starts = arena.insert(salts, body, offsets, self.pkeys, self.gkeys)
        return arena, [(seq, start) for (_, _, seq), start in zip(placed, starts.tolist())]

    def _drop(self, seq: Seq, undo: Undo) -> None:
        seq.alive = False
        self.total -= seq.tokens
        undo.dropped.append(seq)

    def _admit(self, salt: int, seq: Seq, undo: Undo) -> None:
        """A response joins its prompt's history (none where the prompt ranks at or above the
        admission limit), whose oldest go past max_rollouts_per_prompt."""
        undo.touch(salt)
        rec = self.prompts.get(salt)
        if rec is None:
            if salt >= self.admit_below:  # the prompt's rank: its hash, uniform and fixed
                seq.alive = False
                return
            rec = self.prompts[salt] = PromptRecord(salt)
        rec.seqs.append(seq)
        self.total += seq.tokens
        while len(rec.seqs) > self.cfg.max_rollouts_per_prompt:
            self._drop(rec.seqs.popleft(), undo)

    def _fit(self, undo: Undo) -> None:
        """Bring the store under max_tokens (the policy in the module docstring), or where far
        under it, raise the admission limit."""
        limit, floor = self.cfg.host.max_tokens, self.cfg.host.min_rollouts_per_prompt
        if self.total < RISE * limit and self.admit_below < 1 << 64:
            # prompts hash uniformly: the tokens held grow in proportion to the limit
            self.admit_below = min(1 << 64, self.admit_below * int(SLACK * limit) // max(self.total, 1))
        if self.total <= limit or not self.prompts:
            return
        limit = int(SLACK * limit)  # a pass frees a little more than it must, so that passes are few
        recs = list(self.prompts.items())
        most = max(len(r.seqs) for _, r in recs)
        if most > floor:  # the prompts holding the most drop their oldest: the highest level that frees enough
            newest_first = np.zeros((len(recs), most), np.int64)
            for p, (_, r) in enumerate(recs):
                newest_first[p, : len(r.seqs)] = [seq.tokens for seq in reversed(r.seqs)]
            freed = np.cumsum(newest_first.sum(0)[::-1])[::-1]   # freed[c]: every prompt trimmed to c
            level = next((c for c in range(most - 1, floor - 1, -1) if self.total - freed[c] <= limit), floor)
            for salt, r in recs:
                if len(r.seqs) > level:
                    undo.touch(salt)
                while len(r.seqs) > level:
                    self._drop(r.seqs.popleft(), undo)
        for salt, r in sorted(self.prompts.items(), key=lambda kv: -kv[1].rank):
            if self.total <= limit:  # whole prompts, highest rank first; they are not admitted again
                break
            undo.touch(salt)
            for seq in r.seqs:
                self._drop(seq, undo)
            self.admit_below = min(self.admit_below, r.rank)
            del self.prompts[salt]

    # -- what the Generator tells it -----------------------------------------------------------------
    def record(self, prompt_ids: list[list[int]], response_ids: list[list[int]], wait: bool = False) -> None:
        """Finished rollouts join their prompt's history, in a background thread (`flush` waits
        for it and raises what it raised; every call and every engine step waits for it) unless
        `wait`."""
        self.flush()
        work = [(p, r) for p, r in zip(prompt_ids, response_ids) if len(r)]
        if wait:
            self._record(work)
            return
        self._worker = threading.Thread(target=self._record_guarded, args=(work,), daemon=True,
                                        name="rlspec-history-insert")
        self._worker.start()

    def _record_guarded(self, work) -> None:
        try:
            self._record(work)
        except BaseException as e:  # surfaced by the next flush
            self._error = e

    def _record(self, work) -> None:
        """Store responses (the bounds applied): nothing changes where an id is bad or the insert
        cannot allocate."""
        items = []
        for prompt, response in work:  # a bad id raises here, before any change
            p, r = as_ids(prompt), as_ids(response)
            body = np.concatenate([p[max(0, len(p) - self.tail):], r, np.array([S.END], np.int32)])
            items.append((int(S.prompt_salt(p, len(p))), Seq(len(body), len(r)), body))
        undo = Undo(self)
        try:
            for salt, seq, _ in items:
                self._admit(salt, seq, undo)
            self._fit(undo)
            self._store([x for x in items if x[1].alive], undo)
        except BaseException:
            undo.restore()
            raise

    def _join(self) -> None:
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def flush(self) -> None:
        """Wait for the responses being recorded (and raise what recording raised)."""
        self._join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def tokens(self) -> int:
        self.flush()
        return self.total

    def begin_call(self, draft: bool = True) -> None:
        """A generate call begins: the live arena empties, the counters restart."""
        self.flush()
        self.drafting = draft
        self.live.reset()
        self.slots, self.slot_salt, self.live_prompts = {}, [], {}
        self.stats = self._new_stats()

    def _new_stats(self) -> HistoryStats:
        z = [0] * self.k_max
        self.counts[:] = 0
        return HistoryStats(drafted_pos=list(z), shadow_drafted_pos=list(z), shadow_accepted_pos=list(z),
                            prompts=len(self.prompts), history_tokens=self.total)

    def state_dict(self) -> dict:
        """The stored sequences in arena order (oldest first) as numpy arrays: per sequence its
        prompt's identity (salt), response tokens and stored length ([tail | response | END]),
        the sequences themselves concatenated (arena); the chain-head count and the admission
        limit."""
        self.flush()
        a = self.arena
        placed = sorted(((seq.start, salt, seq) for salt, rec in self.prompts.items() for seq in rec.seqs),
                        key=lambda x: x[0])
        written = a.tok[: a.used]
        body = written[written != S.DEAD]   # evicted sequences hold DEAD, stored ones never do
        out = {"version": STATE_VERSION, "admit_below": str(self.admit_below), "heads": a.heads,
               "salt": np.array([salt for _, salt, _ in placed], np.uint64),
               "tokens": np.array([seq.tokens for _, _, seq in placed], np.int64),
               "stored": np.array([seq.stored for _, _, seq in placed], np.int64), "arena": body}
        if self.count_table is not None:   # the table as held, and which stored sequences it counts
            out["counts"] = {**self.count_table.state(),
                             "counted": np.array([seq.counted for _, _, seq in placed], np.bool_)}
        return out

    def load_state_dict(self, state: dict) -> None:
        """A saved state (history/state.py; several: merge_states), every bound applied, relinked
        with its chain-head count, and its count table as it was held where the settings are the
        same and no sequence is dropped: then every draft is as before. A state that fails to
        load leaves the store as it was."""
        self.flush()
        fresh = HistoryIndex(self.cfg, self.k_max, self.vocab)
        arrays = loadable(state)
        if arrays is None:
            fresh._record([(p, r) for p, rs in state["prompts"] for r in rs if len(r)])
        else:
            fresh._load(state, *arrays)
        self.arena, self.prompts, self.count_table = fresh.arena, fresh.prompts, fresh.count_table
        self.total, self.admit_below = fresh.total, fresh.admit_below

    def _load(self, state: dict, salts, tokens, stored, body) -> None:
        self.admit_below = int(state.get("admit_below", 1 << 64))
        undo = Undo(self)
        seqs = [Seq(n, t) for n, t in zip(stored.tolist(), tokens.tolist())]
        for salt, seq in zip(salts.tolist(), seqs):
            rec = self.prompts.get(salt)
            if rec is None:
                rec = self.prompts[salt] = PromptRecord(salt)
            rec.seqs.append(seq)
            self.total += seq.tokens
            while len(rec.seqs) > self.cfg.max_rollouts_per_prompt:
                self._drop(rec.seqs.popleft(), undo)
        self._fit(undo)
        keep = np.array([seq.alive for seq in seqs], np.bool_)
        if not keep.all():
            body, salts, stored = body[np.repeat(keep, stored)], salts[keep], stored[keep]
            seqs = [seq for seq in seqs if seq.alive]
        heads = int(state.get("heads") or 0)
        self.arena = HistoryArena(len(self.pkeys), len(self.gkeys), max(1 << 16, int(GROWTH * body.size)),
                                  heads if heads >= 16 and heads & (heads - 1) == 0 else None)
        offsets = np.zeros(len(seqs) + 1, np.int64)
        np.cumsum(stored, out=offsets[1:])
        starts = self.arena.insert(salts, body, offsets, self.pkeys, self.gkeys)
        for seq, start in zip(seqs, starts.tolist()):
            seq.start = start
        if self.count_table is None:
            return
        saved = state.get("counts")
        if saved is not None and keep.all() and saved["settings"] == self.count_table.settings():
            # the table as the run held it (a full bucket's entries depend on the order of inserts)
            self.count_table.load(saved, [seq for seq, c in zip(seqs, np.asarray(saved["counted"])) if c])
        else:   # other bounds or settings, or merged stores: counted afresh
            self.count_table.update(None, [], [(seq, body[a:b]) for seq, a, b in zip(seqs, offsets[:-1], offsets[1:])])

    # -- drafting --------------------------------------------------------------------------------------
    def propose_rows(self, token_ids: np.ndarray, nums, sampled_lens, keys, prompt_lens, k: int,
                     max_len: int = MAX_ID) -> list[list[int]]:
        """Drafts (at most k tokens each, none taking a row past max_len tokens) for the rows of
        one engine step: row i holds request keys[i] (any hashable id; a new key is a new request),
        its first nums[i] tokens of token_ids[i] (prompt_lens[i] of them its prompt), the last
        sampled_lens[i] of them sampled by the last step (0: a prefill chunk, nothing to draft).
        token_ids may be vLLM's whole token array (max_num_reqs x max_model_len, int32): its rows
        are read where they are. Responses being recorded are waited for first."""
        self._join()
        rows = len(keys)
        token_ids = np.ascontiguousarray(token_ids[:rows], np.int32)  # a view of vLLM's rows
        nums = np.asarray(nums, np.int64)[:rows]
        new = np.asarray(sampled_lens, np.int64)[:rows]
        plen = np.asarray(prompt_lens, np.int64)[:rows]
        slots = np.empty(rows, np.int64)
        salts = np.empty(rows, np.uint64)
        fresh = np.zeros(rows, np.bool_)
        fresh_prompt = np.zeros(rows, np.bool_)
        copy_of = np.zeros(rows, np.int64)
        grow = 0
        for i, key in enumerate(keys):
            got = self.slots.get(key)
            if got is None:
                if new[i] <= 0:   # not started yet: it joins the live arena once it has sampled
                    slots[i], salts[i] = -1, 0
                    continue
                salt = int(S.prompt_salt(token_ids[i], int(plen[i])))
                got = self.slots[key] = (len(self.slot_salt), salt)
                self.slot_salt.append(salt)
                fresh[i] = True
                grow += int(nums[i])
                if salt not in self.live_prompts:
                    self.live_prompts[salt] = got[0]
                    fresh_prompt[i] = True
                    grow += int(plen[i])
                copy_of[i] = self.live_prompts[salt]
            slots[i], salts[i] = got
            grow += int(new[i])
        self.live.reserve(grow, len(self.slot_salt))
        self._reserve_slots(len(self.slot_salt))
        out, out_len = self._step(token_ids, nums, new, slots, salts, plen, fresh, fresh_prompt, copy_of, k, max_len)
        asked = int(((new > 0) & (slots >= 0)).sum()) if self.drafting and k > 0 else 0
        self.stats.steps += 1
        self.stats.rows += asked
        self.stats.matched += int((out_len > 0).sum())
        return [out[i, : out_len[i]].tolist() for i in range(rows)]

    def _reserve_slots(self, slots: int) -> None:
        if slots > self.pend_len.shape[0]:
            n = max(2 * self.pend_len.shape[0], slots)
            for name in ("pend", "pend_src"):
                a = getattr(self, name)
                b = np.zeros((n, a.shape[1]), np.int64)
                b[: a.shape[0]] = a
                setattr(self, name, b)
            for name in ("pend_len", "appended"):
                a = getattr(self, name)
                b = np.zeros(n, np.int64)
                b[: a.shape[0]] = a
                setattr(self, name, b)

    def _step(self, token_ids, nums, new, slots, salts, plen, fresh, fresh_prompt, copy_of, k, max_len):
        c, live = self.cfg, self.live
        rows = token_ids.shape[0]
        out = np.zeros((rows, max(k, 1)), np.int64)
        out_len = np.zeros(rows, np.int64)
        n_src = len(SOURCES)
        drafted, accepted = self.counts[:n_src], self.counts[n_src: 2 * n_src]
        pos = self.counts[2 * n_src:]
        ghead, lghead = self._global_heads(live)
        tok, psalt, chain, gchain, phead, _ = self.arena.arrays()
        live.used = L.propose_rows(
            token_ids, nums, new, slots, salts, plen, fresh, fresh_prompt, copy_of,
            (tok, psalt, chain, gchain, phead, ghead), live.walk(lghead), live.used, live.copy, live.ans,
            self.pend, self.pend_len, self.pend_src, self.appended, drafted, accepted, pos,
            self.pkeys, self.gkeys, c.max_match, c.max_candidates, self.walk, self.global_walk,
            min(k, self.k_max), self.min_prob, self.vocab, self._counts(), max_len, self.drafting and k > 0, out,
            out_len)
        self.stats.drafted = drafted.tolist()
        self.stats.accepted = accepted.tolist()
        self.stats.drafted_pos = pos.tolist()
        return out, out_len

    def _global_heads(self, live: LiveArena) -> tuple[np.ndarray, np.ndarray]:
        """The global chains' heads of the store and of `live`; with no global source, none (a
        walk over no slots finds nothing)."""
        ghead = self.arena.ghead
        if self.cfg.global_source:
            return ghead, live.ghead
        return ghead[:, :0], live.ghead[:, :0]

    def _counts(self) -> tuple:
        return self.count_table.arrays() if self.count_table is not None else NO_COUNTS

    def propose(self, rows: list, sampled: list[list[int]], k: int, keys=None, prompt_lens=None) -> list[list[int]]:
        """propose_rows over a list of token rows (tests and the scale benchmark)."""
        width = max(len(r) for r in rows) if rows else 0
        ids = np.zeros((len(rows), max(width, 1)), np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        return self.propose_rows(ids, [len(r) for r in rows], [len(s) for s in sampled],
                                 list(range(len(rows))) if keys is None else keys,
                                 prompt_lens if prompt_lens is not None else [0] * len(rows), k)

    def draft_context(self, ctx, salt: int, k: int, live: LiveArena | None = None, slot: int = -1,
                      rows: int = 1) -> tuple[list[int], list[int]]:
        """One draft for a context (its tokens, its prompt's salt) against the store and a live
        arena (by default none; slot: the context's own slot in it, its row among `rows`): the
        tokens and their sources."""
        self._join()
        c = self.cfg
        live = live or self.no_live
        out = np.zeros(max(k, 1), np.int64)
        src = np.zeros(max(k, 1), np.int64)
        ctx = np.ascontiguousarray(ctx, np.int32)
        ghead, lghead = self._global_heads(live)
        tok, psalt, chain, gchain, phead, _ = self.arena.arrays()
        jump = (int(live.copy[slot]), int(live.ans[slot])) if slot >= 0 else (-1, -1)
        got = L.draft_one(ctx, len(ctx), np.uint64(salt), (slot, max(slot, 0), rows), jump,
                          (tok, psalt, chain, gchain, phead, ghead), live.walk(lghead), self.pkeys, self.gkeys,
                          c.max_match, c.max_candidates, self.walk, self.global_walk, k, self.min_prob, self.vocab,
                          self._counts(), out, src)
        return out[:got].tolist(), src[:got].tolist()

    def shadow(self, prompt_ids: list[list[int]], response_ids: list[list[int]], max_rows: int) -> None:
        """What drafting would have accepted in a call that drafted nothing, on up to about
        max_rows of its responses (history.stats.replay_in_shadow)."""
        self.flush()
        groups = shadow_groups(prompt_ids, max_rows)
        rows = [i for g in groups for i in g]
        replay_in_shadow(self.stats, shadow_step(self, prompt_ids, response_ids, groups),
                         [response_ids[i] for i in rows], self.k_max)
