"""A dict-based rollout-history store: for every context of min_order .. max_match tokens, the
counts of the tokens that followed it, in Python dicts keyed by the context's hash, per prompt
(its responses), per call (the group's live answers) and per prompt (its own tokens); rows are
told apart by their prompt prefix. The baseline that scripts/bench_history_store.py compares
rlspec's compiled store (rlspec/speculation/history/host/store.py) against: the same sources and draft rule
family, at about 1 KB and 5 us a stored token."""
from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from rlspec.config import HistoryConfig
from rlspec.speculation.history.host.index import HistoryStats  # its counters; it drafts from the first three sources


class Table:
    """Continuation counts: for every context of min_order .. max_match tokens seen, how often
    each next token followed it (contexts keyed by their hash: a collision can only cost
    acceptance, never correctness, since every draft is verified)."""

    def __init__(self, orders: range):
        self.orders = orders
        self.next: dict[int, dict[int, int]] = {}

    def add(self, seq: list[int], start: int, sign: int = 1) -> None:
        """Count the continuations at positions start .. len(seq)-1 (sign -1 takes them back)."""
        for p in range(max(start, self.orders.start), len(seq)):
            t = seq[p]
            for j in self.orders:
                if j > p:
                    break
                key = hash(tuple(seq[p - j:p]))
                d = self.next.get(key)
                if d is None:
                    if sign > 0:
                        self.next[key] = {t: 1}
                    continue
                c = d.get(t, 0) + sign
                if c > 0:
                    d[t] = c
                else:
                    d.pop(t, None)
                    if not d:
                        del self.next[key]

    def __len__(self) -> int:
        return len(self.next)


class PromptHistory:
    """A prompt's most recent responses and their continuation table (each response counted
    behind the prompt's last tokens, so a match may start in the prompt)."""

    def __init__(self, prompt: list[int], cap: int, orders: range):
        self.prompt, self.cap = prompt, cap
        self.responses: deque[list[int]] = deque()
        self.table = Table(orders)
        self.tokens = 0

    def _seq(self, response: list[int]) -> tuple[list[int], int]:
        """The response behind the prompt's last tokens, and -1 where it ended."""
        head = self.prompt[-(self.table.orders.stop - 1):]
        return head + response + [-1], len(head)

    def add(self, response: list[int]) -> None:
        if len(self.responses) == self.cap:
            self.drop_oldest()
        self.responses.append(response)
        self.table.add(*self._seq(response))
        self.tokens += len(response)

    def drop_oldest(self) -> int:
        """Forget the oldest response (its counts taken back); its token count."""
        old = self.responses.popleft()
        self.table.add(*self._seq(old), sign=-1)
        self.tokens -= len(old)
        return len(old)


class HistoryIndex:
    """The store (per prompt: its recent responses) and the drafting over it, free of vLLM."""

    def __init__(self, cfg: HistoryConfig, k_max: int, min_order: int = 2):
        self.cfg, self.k_max = cfg, k_max
        self.orders = range(min_order, cfg.max_match + 1)
        self.prompts: OrderedDict[tuple, PromptHistory] = OrderedDict()  # least recently seen first
        self.total = 0  # tokens held over all prompts
        self.live: dict[tuple, tuple[Table, Table]] = {}  # this call's prompts: (siblings, prompt) tables
        self.by_head: dict[tuple, list[tuple]] = {}       # first head_len tokens -> live prompts
        self.head_len = 0
        self.rows: dict[int, tuple[int, tuple | None]] = {}  # row -> (tokens, prompt) at the last step
        self.pending: dict[int, tuple[list[int], list[int]]] = {}  # row -> (draft, sources)
        self.stats = self._new_stats()
        self.drafting = True  # False: this call drafts nothing (validation)

    # -- what the Generator tells it --------------------------------------------------------------
    def begin_call(self, prompt_ids: list[list[int]], draft: bool = True) -> None:
        self.drafting = draft
        self.live = {}
        for p in prompt_ids:
            key = tuple(p)
            if key not in self.live:
                prompt_table = Table(self.orders)
                prompt_table.add(list(p), 0)
                self.live[key] = (Table(self.orders), prompt_table)
            if key in self.prompts:
                self.prompts.move_to_end(key)
        self.head_len = min((len(p) for p in self.live), default=0)
        self.by_head = {}
        for key in self.live:
            self.by_head.setdefault(key[: self.head_len], []).append(key)
        self.rows, self.pending = {}, {}
        self.stats = self._new_stats()

    def _new_stats(self) -> HistoryStats:
        z = [0] * self.k_max
        return HistoryStats(drafted_pos=list(z), shadow_drafted_pos=list(z), shadow_accepted_pos=list(z),
                            prompts=len(self.prompts), history_tokens=self.total)

    def record(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> None:
        """Finished rollouts join their prompt's history, then the store is cut to max_tokens (`_fit`)."""
        for p, r in zip(prompt_ids, response_ids):
            key = tuple(p)
            h = self.prompts.get(key)
            if h is None:
                h = self.prompts[key] = PromptHistory(list(p), self.cfg.max_rollouts_per_prompt, self.orders)
            self.prompts.move_to_end(key)
            if len(r):
                self.total -= h.tokens
                h.add(list(r))
                self.total += h.tokens
        self._fit()

    def _fit(self) -> None:
        """Over max_tokens, the prompts holding the most responses drop their oldest first (least
        recently seen first among equals); whole prompts go, least recently seen first, only once
        every prompt is down to one response. RL visits each prompt once an epoch: evicting whole
        prompts by recency would drop exactly those the epoch has yet to bring back, while what
        each prompt keeps are its latest answers, the nearest to the policy its drafts serve."""
        limit = self.cfg.host.max_tokens
        while self.total > limit:
            most = max((len(h.responses) for h in self.prompts.values()), default=0)
            if most <= 1:
                break
            for h in self.prompts.values():
                if len(h.responses) == most:
                    self.total -= h.drop_oldest()
                    if self.total <= limit:
                        return
        while self.total > limit and self.prompts:
            self.total -= self.prompts.popitem(last=False)[1].tokens

    def tokens(self) -> int:
        return self.total

    def state_dict(self) -> dict:
        return {"prompts": [[h.prompt, [list(r) for r in h.responses]] for h in self.prompts.values()]}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.clear()
        self.total = 0
        for p, rs in state["prompts"]:
            self.record([p] * max(1, len(rs)), rs or [[]])

    # -- drafting ---------------------------------------------------------------------------------
    def prompt_of(self, row: np.ndarray) -> tuple | None:
        if not self.live or len(row) < self.head_len:
            return None
        for key in self.by_head.get(tuple(row[: self.head_len].tolist()), ()):
            if len(row) >= len(key) and tuple(row[: len(key)].tolist()) == key:
                return key
        return None

    def propose(self, rows: list[np.ndarray], sampled: list[list[int]], k: int) -> list[list[int]]:
        """Drafts (at most k tokens each) for the running requests, given each one's tokens so far
        (prompt and output) and the tokens the last step appended to it."""
        if not self.drafting:
            return [[] for _ in rows]
        tail = self.cfg.max_match + self.k_max + 1
        seen, out = {}, []
        for i, (row, s) in enumerate(zip(rows, sampled)):
            n = len(row)
            last = self.rows.get(i)
            grew = last is not None and bool(s) and n == last[0] + len(s)
            key = last[1] if grew else self.prompt_of(row)
            seen[i] = (n, key)
            ctx = row[max(0, n - tail):].tolist()
            if grew:
                self._settle(i, s)
            else:  # another request now (or this one moved): the last draft here is not its
                self.pending.pop(i, None)
            tables = self.live.get(key) if key is not None else None
            if tables is not None and s:  # the new tokens join the group's table (not the prompt's)
                tables[0].add(ctx, len(ctx) - min(len(s), n - len(key)))
            if not s or k <= 0:
                out.append([])
                continue
            self.stats.rows += 1
            hist = self.prompts.get(key) if key is not None else None
            sources = (hist.table if hist is not None else None,
                       tables[0] if tables is not None else None,
                       tables[1] if tables is not None else None)
            draft, srcs = self._draft(ctx, sources, k)
            if draft:
                self.stats.matched += 1
                for j, src in enumerate(srcs):
                    self.stats.drafted[src] += 1
                    self.stats.drafted_pos[j] += 1
                self.pending[i] = (draft, srcs)
            out.append(draft)
        self.rows = seen
        self.pending = {i: v for i, v in self.pending.items() if i in seen}
        return out

    def _draft(self, ctx: list[int], tables, k: int) -> tuple[list[int], list[int]]:
        """Token by token: the continuation of the longest context suffix any source has seen,
        with the counts of all sources at that length summed; stop below min_prob."""
        live = [(src, t.next) for src, t in enumerate(tables) if t is not None and t.next]
        ctx = list(ctx)
        draft, srcs = [], []
        lo, hi = self.orders.start, min(self.orders.stop - 1, len(ctx))
        for _ in range(k):
            found = None
            for j in range(hi, lo - 1, -1):
                key = hash(tuple(ctx[-j:]))
                found = [(src, d) for src, d in ((src, nxt.get(key)) for src, nxt in live) if d]
                if found:
                    break
            if not found:
                break
            total = dict(found[0][1])
            for _, d in found[1:]:
                for t, c in d.items():
                    total[t] = total.get(t, 0) + c
            tok, c = max(total.items(), key=lambda x: x[1])
            if tok < 0 or c < self.cfg.min_prob * sum(total.values()):  # -1: the responses ended here
                break
            draft.append(tok)
            srcs.append(max(found, key=lambda x: x[1].get(tok, 0))[0])
            ctx.append(tok)
            # a context one longer than this match was never seen, unless this one was too
            hi = min(j + 1, self.orders.stop - 1)
        return draft, srcs

    def _settle(self, i: int, sampled: list[int]) -> None:
        """Attribute row i's accepted draft tokens (the last step's draft, as far as the sampled
        tokens agree with it) to their sources."""
        got = self.pending.pop(i, None)
        if got is None:
            return
        draft, srcs = got
        for j in range(min(len(sampled) - 1, len(draft))):
            if sampled[j] != draft[j]:
                break
            self.stats.accepted[srcs[j]] += 1
