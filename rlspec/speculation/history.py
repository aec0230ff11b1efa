"""Rollout-history drafting (`speculation=history`): drafts that cost no model, read from what RL
already generated. RL samples G answers per prompt and returns to the same prompts every epoch;
RhymeRL (arXiv 2508.18588) drafts from a prompt's earlier answers, Seer (arXiv 2511.14617) from
the siblings of its group, SuffixDecoding (vLLM's `suffix`) from earlier answers to any prompt.
Four sources serve each request, in rlspec/speculation/store.py's arrays and compiled walks:

- history: the prompt's stored responses (the most recent max_rollouts_per_prompt),
- siblings: this call's responses to the same prompt as far as they got (the request's own
  answer so far included),
- prompt: the prompt's own tokens (prompt lookup),
- global: stored responses to any prompt, where they match the context further back than the
  first three do (a prompt seen for the first time has only these).

The draft rule is store.py's: the longest context match decides, the candidates' majority token
goes on while at least min_prob of them agree, and a draft stops where the responses it follows
ended. Drafts are deterministic (one-hot q), so vLLM's rejection sampling keeps the target's
distribution whatever the history holds.

The store is bounded by max_tokens. Over it, the prompts holding the most responses drop their
oldest first, down to min_rollouts_per_prompt; then whole prompts go, those whose identity hashes
highest first, and a prompt hashing above the last one evicted is no longer admitted. The prompts
kept are a fixed subset (a resident set) that every reshuffled epoch comes back to, where evicting
the least recently seen would drop exactly the prompts the epoch has yet to revisit. Finished
responses join the store in a background thread, while the learner trains; the next call waits
for it.

vLLM hosts the drafter as a custom proposer (rlspec/speculation/history_proposer.py; Model
Runner V1 runs it: on a GPU vLLM falls back to V1 for it); the Generator tells it through
collective_rpc when a call begins (`begin_call`) and which responses the call returned (`record`)."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from rlspec.config import HistoryConfig
from rlspec.speculation import store as S
from rlspec.speculation.store import SOURCES, LiveArena

WALK = 4  # chain links a lookup follows per candidate it may take (hash collisions and evicted text)
SLACK = 0.95  # over max_tokens, the store is cut to this share of it
GROWTH = 1.5  # a rebuilt arena's room: this times what it holds and must take


@dataclass
class HistoryStats:
    """Per-call counters of the history drafter (rows: a request at one engine step)."""
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
    propose_seconds: float = 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
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


class Seq:
    """A stored response: its arena start (-1 until placed), stored length (tail, response, END)
    and response tokens; `alive` False once evicted."""
    __slots__ = ("start", "stored", "tokens", "alive")

    def __init__(self, stored: int, tokens: int):
        self.start, self.stored, self.tokens, self.alive = -1, stored, tokens, True


@dataclass
class PromptRecord:
    rank: int                                    # the resident set keeps the lowest ranks
    seqs: deque = field(default_factory=deque)   # its Seq, oldest first


class HistoryIndex:
    """The store (every prompt's recent responses, in a history arena) and the drafting over it,
    free of vLLM."""

    def __init__(self, cfg: HistoryConfig, k_max: int):
        self.cfg, self.k_max = cfg, k_max
        self.tail = cfg.max_match  # prompt tokens kept in front of each stored response
        self.walk = WALK * cfg.max_candidates  # chain links a source's lookup follows at most
        self.gkeys = np.array(cfg.global_keys, np.int64)  # the global chains' key lengths, longest first
        self.global_walk = 2 * cfg.max_candidates  # ... and the global chains', all key lengths together
        self._alloc(1 << 16)
        self.used = 0              # arena positions written (live and dead)
        self.dead = 0              # ... of them evicted, until compaction
        self.total = 0             # response tokens held over all prompts
        self.prompts: dict[int, PromptRecord] = {}
        self.admit_below = 1 << 64  # prompts ranking at or above it are not stored
        self.live = LiveArena(levels=len(self.gkeys))
        self.no_live = LiveArena.empty(len(self.gkeys))  # draft_context without a call's live requests
        self.slots: dict = {}       # this call's request key -> (slot, salt)
        self.slot_salt: list[int] = []
        self.live_prompts: set[int] = set()
        self.pend = np.zeros((256, max(k_max, 1)), np.int64)
        self.pend_len = np.zeros(256, np.int64)
        self.pend_src = np.zeros((256, max(k_max, 1)), np.int64)
        self.counts = np.zeros(2 * len(SOURCES) + k_max, np.int64)  # drafted, accepted by source; per position
        self.stats = self._new_stats()
        self.drafting = True       # False: this call drafts nothing (validation)
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- the history arena ---------------------------------------------------------------------------
    def _alloc(self, capacity: int) -> None:
        self.tok = np.full(capacity, S.DEAD, np.int32)
        self.psalt = np.zeros(capacity, np.uint32)
        self.chain = np.full(capacity, -1, np.int32)
        self.gchain = np.full((len(self.gkeys), capacity), -1, np.int32)
        self.phead = np.full(S.pow2(capacity // 2), -1, np.int32)   # chains average up to two links a slot
        self.ghead = np.full((len(self.gkeys), S.pow2(capacity // 2)), -1, np.int32)

    def _grow(self, capacity: int) -> None:
        """The arena's arrays with room for `capacity` positions, the first `used` kept as they are."""
        used = self.used
        for name, fill in (("tok", S.DEAD), ("psalt", 0), ("chain", -1), ("gchain", -1)):
            old = getattr(self, name)
            new = np.full((*old.shape[:-1], capacity), fill, old.dtype)
            new[..., :used] = old[..., :used]
            setattr(self, name, new)

    @property
    def nbytes(self) -> int:
        """Bytes the store's arrays hold (history arena and its chain heads; the live arena apart)."""
        return sum(a.nbytes for a in (self.tok, self.psalt, self.chain, self.gchain, self.phead, self.ghead))

    def _insert(self, items: list[tuple[int, Seq, np.ndarray]]) -> None:
        """Place sequences (salt, its Seq, [tail | response | END]) at the arena's end."""
        if not items:
            return
        need = sum(len(a) for _, _, a in items)
        if self.used + need > self.tok.shape[0]:
            self._rebuild(need)
        lengths = np.array([len(a) for _, _, a in items], np.int64)
        starts = self.used + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        S.insert_sequences(self.tok, self.psalt, self.chain, self.gchain, self.phead, self.ghead,
                           np.concatenate([a for _, _, a in items]), offsets, np.array([x for x, _, _ in items],
                                                                                       np.uint64),
                           starts, self.cfg.min_match, self.gkeys)
        for (_, seq, _), start in zip(items, starts):
            seq.start = int(start)
        self.used += need

    def _rebuild(self, need: int = 0) -> None:
        """A fresh arena holding the stored sequences in their order (positions move, recency
        stays), sized for `need` more tokens with room to grow: compaction and growth. Where
        nothing was evicted and the chain heads still number a quarter of the new room, the arrays
        only grow (positions and links stay): the relinking, an insert's whole cost again, comes
        at every other growth."""
        if self.dead == 0 and 4 * self.phead.shape[0] >= GROWTH * (self.used + need):
            self._grow(max(1 << 16, int(GROWTH * (self.used + need))))
            return
        placed = sorted(((seq.start, salt, seq) for salt, rec in self.prompts.items() for seq in rec.seqs
                         if seq.start >= 0), key=lambda x: x[0])
        live = sum(seq.stored for _, _, seq in placed)
        tok = self.tok
        self._alloc(max(1 << 16, int(GROWTH * (live + need))))
        self.used, self.dead = 0, 0
        self._insert([(salt, seq, tok[start: start + seq.stored].copy()) for start, salt, seq in placed])

    def _drop(self, seq: Seq, victims: list[Seq]) -> None:
        seq.alive = False
        self.total -= seq.tokens
        if seq.start >= 0:
            victims.append(seq)

    def _fit(self, victims: list[Seq]) -> None:
        """Bring the store under max_tokens (the policy in the module docstring)."""
        limit, floor = self.cfg.max_tokens, self.cfg.min_rollouts_per_prompt
        if self.total <= limit or not self.prompts:
            return
        limit = int(SLACK * limit)  # a pass frees a little more than it must, so that passes are few
        recs = list(self.prompts.values())
        most = max(len(r.seqs) for r in recs)
        if most > floor:  # the prompts holding the most drop their oldest: the highest level that frees enough
            newest_first = np.zeros((len(recs), most), np.int64)
            for p, r in enumerate(recs):
                newest_first[p, : len(r.seqs)] = [seq.tokens for seq in reversed(r.seqs)]
            freed = np.cumsum(newest_first.sum(0)[::-1])[::-1]   # freed[c]: every prompt trimmed to c
            level = next((c for c in range(most - 1, floor - 1, -1) if self.total - freed[c] <= limit), floor)
            for r in recs:
                while len(r.seqs) > level:
                    self._drop(r.seqs.popleft(), victims)
        for salt, r in sorted(self.prompts.items(), key=lambda kv: -kv[1].rank):
            if self.total <= limit:  # whole prompts, highest rank first; they are not admitted again
                break
            for seq in r.seqs:
                self._drop(seq, victims)
            self.admit_below = min(self.admit_below, r.rank)
            del self.prompts[salt]

    def _kill(self, victims: list[Seq]) -> None:
        if victims:
            S.kill_sequences(self.tok, np.array([v.start for v in victims], np.int64),
                             np.array([v.stored for v in victims], np.int64))
            self.dead += sum(v.stored for v in victims)

    # -- what the Generator tells it -----------------------------------------------------------------
    def record(self, prompt_ids: list[list[int]], response_ids: list[list[int]], wait: bool = False) -> None:
        """Finished rollouts join their prompt's history, in a background thread (`flush` waits
        for it; every call begins with one) unless `wait`."""
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
        items, victims = [], []
        for prompt, response in work:
            arr = np.asarray(prompt, np.int32)
            salt = int(S.prompt_salt(arr, len(arr)))
            rec = self.prompts.get(salt)
            if rec is None:
                if salt >= self.admit_below:  # the prompt's rank: its hash, uniform and fixed
                    continue
                rec = self.prompts[salt] = PromptRecord(salt)
            body = np.concatenate([arr[-self.tail:] if self.tail else arr[:0], np.asarray(response, np.int32),
                                   [S.END]]).astype(np.int32)
            seq = Seq(len(body), len(response))
            rec.seqs.append(seq)
            items.append((salt, seq, body))
            self.total += seq.tokens
            while len(rec.seqs) > self.cfg.max_rollouts_per_prompt:
                self._drop(rec.seqs.popleft(), victims)
        self._fit(victims)
        self._kill(victims)
        items = [x for x in items if x[1].alive]
        if self.dead > self.used // 4:
            self._rebuild(sum(len(a) for _, _, a in items))
        self._insert(items)

    def flush(self) -> None:
        """Wait for the responses being recorded (and raise what recording raised)."""
        if self._worker is not None:
            self._worker.join()
            self._worker = None
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
        self.slots, self.slot_salt, self.live_prompts = {}, [], set()
        self.stats = self._new_stats()

    def _new_stats(self) -> HistoryStats:
        z = [0] * self.k_max
        self.counts[:] = 0
        return HistoryStats(drafted_pos=list(z), shadow_drafted_pos=list(z), shadow_accepted_pos=list(z),
                            prompts=len(self.prompts), history_tokens=self.total)

    def state_dict(self) -> dict:
        """Every stored prompt's sequences, oldest first: [salt, [[response tokens, stored
        sequence], ...]], prompts in the order they were first stored."""
        self.flush()
        return {"version": 2, "admit_below": str(self.admit_below),
                "prompts": [[str(salt), [[seq.tokens, self.tok[seq.start: seq.start + seq.stored].tolist()]
                                         for seq in rec.seqs]] for salt, rec in self.prompts.items()]}

    def load_state_dict(self, state: dict) -> None:
        """A stored state (the merged states of several engines too), bounds applied. Stores from
        before version 2 ([prompt, [responses]] per prompt) are recorded afresh."""
        self.flush()
        self.__init__(self.cfg, self.k_max)
        if state.get("version") != 2:
            self._record([(p, r) for p, rs in state["prompts"] for r in rs if len(r)])
            return
        self.admit_below = int(state.get("admit_below", 1 << 64))
        items = []
        for salt, seqs in state["prompts"]:
            salt = int(salt)
            rec = self.prompts.setdefault(salt, PromptRecord(salt))
            for tokens, body in seqs:
                seq = Seq(len(body), int(tokens))
                rec.seqs.append(seq)
                items.append((salt, seq, np.asarray(body, np.int32)))
                self.total += seq.tokens
        victims: list[Seq] = []
        self._fit(victims)
        self._insert([x for x in items if x[1].alive])

    # -- drafting --------------------------------------------------------------------------------------
    def propose_rows(self, token_ids: np.ndarray, nums, sampled_lens, keys, prompt_lens, k: int) -> list[list[int]]:
        """Drafts (at most k tokens each) for the rows of one engine step: row i holds request
        keys[i] (any hashable id; a new key is a new request), its first nums[i] tokens of
        token_ids[i] (prompt_lens[i] of them its prompt), the last sampled_lens[i] of them sampled
        by the last step (0: a prefill chunk, nothing to draft)."""
        rows = len(keys)
        nums = np.asarray(nums, np.int64)[:rows]
        new = np.asarray(sampled_lens, np.int64)[:rows]
        plen = np.asarray(prompt_lens, np.int64)[:rows]
        slots = np.empty(rows, np.int64)
        salts = np.empty(rows, np.uint64)
        fresh = np.zeros(rows, np.bool_)
        fresh_prompt = np.zeros(rows, np.bool_)
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
                    self.live_prompts.add(salt)
                    fresh_prompt[i] = True
                    grow += int(plen[i])
            slots[i], salts[i] = got
            grow += int(new[i])
        self.live.reserve(grow, len(self.slot_salt))
        self._reserve_slots(len(self.slot_salt))
        out = np.zeros((rows, max(k, 1)), np.int64)
        out_len = np.zeros(rows, np.int64)
        started = slots >= 0
        if not started.all():  # rows not started are left out of the compiled step
            idx = np.flatnonzero(started)
            sub = self._step(token_ids[idx], nums[idx], new[idx], slots[idx], salts[idx], plen[idx], fresh[idx],
                             fresh_prompt[idx], k)
            out_len[idx] = sub[1]
            out[idx] = sub[0]
        else:
            out, out_len = self._step(token_ids[:rows], nums, new, slots, salts, plen, fresh, fresh_prompt, k)
        asked = int(((new > 0) & started).sum()) if self.drafting and k > 0 else 0
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
            b = np.zeros(n, np.int64)
            b[: self.pend_len.shape[0]] = self.pend_len
            self.pend_len = b

    def _step(self, token_ids, nums, new, slots, salts, plen, fresh, fresh_prompt, k):
        c, live = self.cfg, self.live
        rows = token_ids.shape[0]
        out = np.zeros((rows, max(k, 1)), np.int64)
        out_len = np.zeros(rows, np.int64)
        n_src = len(SOURCES)
        drafted, accepted = self.counts[:n_src], self.counts[n_src: 2 * n_src]
        pos = self.counts[2 * n_src:]
        ghead, lghead = self._global_heads(live)
        live.used = S.propose_rows(
            np.ascontiguousarray(token_ids), nums, new, slots, salts, plen, fresh, fresh_prompt,
            self.tok, self.psalt, self.chain, self.gchain, self.phead, ghead,
            live.tok, live.salt, live.prev, live.next, live.chain, live.head, live.src, live.gchain, lghead, live.last,
            live.used,
            self.pend, self.pend_len, self.pend_src, drafted, accepted, pos,
            c.min_match, self.gkeys, c.max_match, c.max_candidates, self.walk, self.global_walk,
            min(k, self.k_max),
            c.min_prob, self.drafting and k > 0, out, out_len)
        self.stats.drafted = drafted.tolist()
        self.stats.accepted = accepted.tolist()
        self.stats.drafted_pos = pos.tolist()
        return out, out_len

    def _global_heads(self, live: LiveArena) -> tuple[np.ndarray, np.ndarray]:
        """The global chains' heads of the store and of `live`; with no global source, none (a
        walk over no slots finds nothing)."""
        if self.cfg.global_source:
            return self.ghead, live.ghead
        return self.ghead[:, :0], live.ghead[:, :0]

    def propose(self, rows: list, sampled: list[list[int]], k: int, keys=None, prompt_lens=None) -> list[list[int]]:
        """propose_rows over a list of token rows (tests and the scale benchmark)."""
        width = max(len(r) for r in rows) if rows else 0
        ids = np.zeros((len(rows), max(width, 1)), np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
        return self.propose_rows(ids, [len(r) for r in rows], [len(s) for s in sampled],
                                 list(range(len(rows))) if keys is None else keys,
                                 prompt_lens if prompt_lens is not None else [0] * len(rows), k)

    def draft_context(self, ctx, salt: int, k: int, live: LiveArena | None = None) -> tuple[list[int], list[int]]:
        """One draft for a context (its tokens, its prompt's salt) against the store and a live
        arena (by default none): the tokens and their sources."""
        c = self.cfg
        live = live or self.no_live
        out = np.zeros(max(k, 1), np.int64)
        src = np.zeros(max(k, 1), np.int64)
        ctx = np.ascontiguousarray(ctx, np.int32)
        ghead, lghead = self._global_heads(live)
        got = S.draft_one(ctx, len(ctx), np.uint64(salt), self.tok, self.psalt, self.chain, self.gchain, self.phead,
                          ghead, live.tok, live.salt, live.prev, live.next, live.chain, live.head, live.src,
                          live.gchain, lghead,
                          c.min_match, self.gkeys, c.max_match, c.max_candidates, self.walk, self.global_walk,
                          k, c.min_prob, out, src)
        return out[:got].tolist(), src[:got].tolist()

    def shadow(self, prompt_ids: list[list[int]], response_ids: list[list[int]], max_rows: int) -> None:
        """A call that drafted nothing ('auto' switched speculation off): measure what drafting
        k_max tokens would have accepted, from the finished responses of some of its groups (whole
        groups, evenly spread over the call, about max_rows responses). Without drafting every
        request gains one token per engine step, so the call is replayed in lock step: at step t
        each response's token t joins its group's live sequences (what its siblings see) and is
        checked against the response's pending shadow draft; a verification would have accepted
        the matching prefix and ended with the next token (the correction, or the bonus after a
        whole draft), where the next shadow draft starts, read from the prompt's history as at the
        call's start, the group and the prompt. Drafts are one-hot, so the probability a drafted
        token is sampled is the probability it is accepted: the counts are those drafting would
        have made, without its verification. Call before `record`."""
        self.flush()
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(prompt_ids):
            groups.setdefault(tuple(p), []).append(i)
        keys = list(groups)
        if not keys or max_rows <= 0:
            return
        per_group = max(1, len(prompt_ids) // len(keys))
        stride = max(1, round(len(keys) * per_group / max_rows))
        st, c = self.stats, self.cfg
        for key in keys[::stride]:
            rows = groups[key]
            st.shadow_responses += len(rows)
            prompt = np.asarray(key, np.int32)
            salt = np.uint64(S.prompt_salt(prompt, len(prompt)))
            live = LiveArena(capacity=len(prompt) * (len(rows) + 1) + sum(len(response_ids[i]) for i in rows) + 16,
                             slots=len(rows) + 1, head_bits=14, levels=len(self.gkeys))
            seqs = {i: np.concatenate([prompt, np.asarray(response_ids[i], np.int32)]) for i in rows}
            tail = max(0, len(prompt) - c.max_match)
            live.append(len(rows), S.PROMPT, prompt, 0, len(prompt), 0, salt, c.min_match, self.gkeys)
            for slot, i in enumerate(rows):
                live.append(slot, S.PROMPT, seqs[i], tail, len(prompt), tail, salt, c.min_match, self.gkeys)
            pending: dict[int, tuple[list[int], int]] = {}
            for t in range(max(len(response_ids[i]) for i in rows)):
                for slot, i in enumerate(rows):
                    r = response_ids[i]
                    if t >= len(r):
                        continue
                    n = len(prompt) + t + 1
                    live.append(slot, S.SIBLINGS, seqs[i], n - 1, n, tail, salt, c.min_match, self.gkeys)
                    got = pending.pop(i, None)
                    if got is not None:
                        draft, j = got
                        if j < len(draft) and int(r[t]) == draft[j]:
                            st.shadow_accepted_pos[j] += 1
                            pending[i] = (draft, j + 1)
                            continue
                    # a verification ends with this token (or none was pending): the next draft
                    st.shadow_rows += 1
                    draft, _ = self.draft_context(seqs[i][:n], int(salt), self.k_max, live)
                    for j in range(len(draft)):
                        st.shadow_drafted_pos[j] += 1
                    if draft:
                        pending[i] = (draft, 0)


def merge_states(states: list[dict]) -> dict:
    """Several engines' saved stores as one state HistoryIndex.load_state_dict takes (their prompts
    in order, the most permissive admission limit); every state must be of one format version."""
    versions = {s.get("version") for s in states}
    if len(versions) > 1:
        raise ValueError(f"history stores of different format versions {sorted(map(str, versions))} cannot merge")
    out = {"prompts": [x for s in states for x in s["prompts"]]}
    if versions != {None}:
        out["version"] = versions.pop()
        out["admit_below"] = str(max((int(s.get("admit_below", 1 << 64)) for s in states), default=1 << 64))
    return out
