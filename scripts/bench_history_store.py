"""History drafting at scale: rollouts replayed through a drafter alone (no model), side by side for
several stores, JSON out and a table printed.

Stores: rlspec's compiled store (rlspec/speculation/history/host/store.py, `rlspec`; `rlspec_chains`, only where
--stores names it: the cheaper rule, global_index=chains and prompt keys of 3 tokens), a dict-based store of
hashed n-gram continuation counts (scripts/history_dict_store.py, `dict`), and arctic-inference's
SuffixDecodingCache driven as vLLM's `suffix` method drives it (`suffix`: a suffix tree over each
request's prompt and its answer so far, and a global one over earlier responses of any prompt),
and the device-resident drafter (rlspec/speculation/history/device/store.py, `device`, on CPU tensors;
--device KEY=VALUE sets its arguments); only where --stores names them, `suffix_finished` (suffix
whose global tree reads finished answers only), `device_suffix` (a prototype: the device rule's
own sources with a suffix tree over finished answers as its global source) and `device_live` (the
device drafter through the engine proposer's path: rows kept by slot, the live table, with
--device kernels=True its Triton kernels).

The replay emulates an engine: a call's requests run in a persistent batch of up to --max-batch
rows (finished rows filled from the back, as vLLM does); at every step each running row asks the
drafter for k tokens, a verification accepts the draft's prefix that agrees with the recorded
response and emits one more token (the correction or the bonus), and the drafter sees those tokens
at the next step; a call's responses are recorded when it ends. One-hot drafts are accepted
exactly when they agree, so acceptance is exact for the recorded responses.

    # real rollouts (logging.save_rollouts=true writes rollouts.jsonl), every epoch replayed
    python scripts/bench_history_store.py replay --rollouts RUN/rollouts.jsonl --out docs/bench/X.json
    # every store's drafts at the states of each driver's replay (the rule apart from its trajectory)
    python scripts/bench_history_store.py crosscheck --rollouts RUN/rollouts.jsonl --drive device suffix_finished \
        --stores device suffix_finished rlspec --out docs/bench/history_crosscheck_default.json
    # the paper's shape, synthetic: the store filled to each size, then timed and replayed
    python scripts/bench_history_store.py scale --sizes 1e6 1e7 5e7 --out docs/bench/history_store_scale.json

Synthetic trace (the similarity model): 17,000 prompts of lognormal length (median 120 tokens);
each has 3 latent answers of lognormal length (median 700, clipped to 32..8192 tokens) over a
151,936-token vocabulary (Zipf 1.1 token frequencies, 30% of positions copying a 4-16 token span
from earlier in the answer); a latent drifts by 3% substituted positions an epoch; a response
picks a latent (probabilities 0.6 / 0.3 / 0.1) and edits it (8% substitutions, 1% insertions, 1%
deletions) to 0.8-1.2 x its length. Measured per store and size: bytes per stored token (RSS
growth over the fill; rlspec's also from its arrays), us per inserted token, us per row per
propose at running batch 1 / 64 / 512 with contexts of 512 to 8,192 tokens, tokens per
verification and the history hit rate (requests whose prompt has history when its call begins)
over calls of an epoch reshuffled after the fill.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import harness

ROOT = harness.ROOT

VOCAB, PROMPTS, GROUP = 151_936, 17_000, 16
STORES = ("rlspec", "rlspec_chains", "dict", "suffix", "suffix_finished", "device", "device_live", "device_suffix")


def rss() -> int:
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss


# -- the stores, behind one interface ------------------------------------------------------------------
HISTORY_SETTINGS: dict = {}  # --history KEY=VALUE: speculation.history settings of the rlspec store


class Rlspec:
    def __init__(self, k: int, max_tokens: int, **settings):
        from rlspec.config.speculation import history_config
        from rlspec.speculation.history.host.index import HistoryIndex

        self.h = HistoryIndex(history_config(**{"max_tokens": max_tokens, **HISTORY_SETTINGS, **settings}), k)
        warm = HistoryIndex(history_config(), k)   # compile the store's functions before anything is timed
        warm.record([[1, 2, 3]], [[4, 5, 6, 7]], wait=True)
        warm.begin_call()
        warm.propose([np.array([1, 2, 3, 4, 5], np.int32)], [[5]], k, prompt_lens=[3])

    def begin_call(self, prompts) -> None:
        self.h.begin_call()

    def step(self, ids, nums, new, keys, plens, k) -> list[list[int]]:
        return self.h.propose_rows(ids, nums, new, keys, plens, k)

    def record(self, prompts, responses) -> None:
        self.h.record(prompts, responses, wait=True)

    def finish(self, key, prompt, response) -> None:
        pass

    def end_call(self, prompts, responses) -> None:
        self.record(prompts, responses)

    def has_history(self, prompt) -> bool:
        from rlspec.speculation.history.host.store import prompt_salt

        a = np.asarray(prompt, np.int32)
        return int(prompt_salt(a, len(a))) in self.h.prompts

    def stored(self) -> int:
        return self.h.tokens()

    def nbytes(self) -> int:
        return self.h.nbytes


class Dict:
    def __init__(self, k: int, max_tokens: int):
        from history_dict_store import HistoryIndex

        from rlspec.config.speculation import history_config

        # its own settings: contexts of 2 to 8 tokens (a table entry per length and token)
        self.h = HistoryIndex(history_config(max_match=8, max_tokens=max_tokens), k, min_order=2)

    def begin_call(self, prompts) -> None:
        self.h.begin_call(prompts)

    def step(self, ids, nums, new, keys, plens, k) -> list[list[int]]:
        rows = [ids[i, : nums[i]] for i in range(len(keys))]
        return self.h.propose(rows, [list(ids[i, nums[i] - new[i]: nums[i]]) for i in range(len(keys))], k)

    def record(self, prompts, responses) -> None:
        self.h.record(prompts, responses)

    def finish(self, key, prompt, response) -> None:
        pass

    def end_call(self, prompts, responses) -> None:
        self.record(prompts, responses)

    def has_history(self, prompt) -> bool:
        return tuple(prompt) in self.h.prompts

    def stored(self) -> int:
        return self.h.tokens()

    def nbytes(self) -> int | None:
        return None


DEVICE_SETTINGS: dict = {}  # --device KEY=VALUE: DeviceHistory arguments of the device store
DEVICE_ARENA = 1 << 21  # the device store's ring, at most (its buckets grow with it)


class Device:
    """rlspec/speculation/history/device/store.py's drafter on CPU torch tensors: the batch's rows as
    the engine's token buffer, each row's prompt identity hashed from its row."""

    def __init__(self, k: int, max_tokens: int, **settings):
        import torch

        from rlspec.config import HistoryConfig
        from rlspec.speculation.history.device.store import DeviceHistory

        torch.set_num_threads(1)   # as the host store drafts: one core
        # the per-prompt bound a run gives it (speculation.history.max_rollouts_per_prompt), as the host store has
        self.h = DeviceHistory(**{"max_tokens": min(max_tokens, DEVICE_ARENA),
                                  "max_per_prompt": HistoryConfig().max_rollouts_per_prompt, **DEVICE_SETTINGS,
                                  **settings})
        self.prompts: set = set()
        self.done: list = []   # answers finished since the last step

    def begin_call(self, prompts) -> None:
        pass

    def step(self, ids, nums, new, keys, plens, k) -> list[list[int]]:
        import torch

        from rlspec.speculation.history.device.store import prompt_hash

        self._flush()
        t, pl = torch.from_numpy(ids), torch.as_tensor(np.asarray(plens, np.int64))
        drafts, valid = self.h.propose(t, torch.from_numpy(np.asarray(nums, np.int64)), prompt_hash(t, pl), pl, k,
                                       torch.from_numpy(np.asarray(new) > 0))
        return [d[:c] for d, c in zip(drafts.tolist(), valid.tolist())]

    def record(self, prompts, responses) -> None:
        self.h.insert(prompts, responses)
        self.prompts.update(tuple(p) for p, r in zip(prompts, responses) if len(r))

    def finish(self, key, prompt, response) -> None:
        """A finished answer joins the store before the next step (as suffix's tree takes it),
        where the rows of the batch no longer hold it."""
        self.done.append((prompt, response))

    def end_call(self, prompts, responses) -> None:
        self._flush()

    def _flush(self) -> None:
        if self.done:
            self.record(*zip(*self.done))
            self.done = []

    def has_history(self, prompt) -> bool:
        return tuple(prompt) in self.prompts   # inserted (the ring may have overwritten it since)

    def stored(self) -> int:
        return self.h.stored()

    def nbytes(self) -> int:
        return self.h.nbytes


class DeviceLive(Device):
    """The device drafter as the engine's proposer drives it: the batch's rows kept by slot
    (live.LiveRows: a row copied when it joins, then each step's new tokens; the table's lookups,
    lookup=table) and drafted by the proposer's draft_rows (with kernels=True in DeviceHistory's
    settings, kernels.step: Triton's interpreter on CPU). A finished answer joins the store
    before the next step, as `device`'s does: the same drafts as `device`, by another path."""

    def __init__(self, k: int, max_tokens: int, **settings):
        super().__init__(k, max_tokens, **settings)
        self.p, self.k = None, k

    def begin_call(self, prompts) -> None:
        if self.p is not None:
            self.p.live.clear()

    def step(self, ids, nums, new, keys, plens, k) -> list[list[int]]:
        import torch

        from rlspec.speculation.history.device.live import LiveRows
        from rlspec.speculation.history.device.proposer import draft_rows

        self._flush()
        B, W = ids.shape
        if self.p is None or self.p.live.tok.shape[1] < W or self.p.live.tok.shape[0] < B:
            rows = max(B, self.p.live.tok.shape[0] if self.p else 0)
            width = max(W, self.p.live.tok.shape[1] if self.p else 0)
            live = LiveRows(rows, 0, width, self.h.prompt_keys, "cpu", table=True, kernels=self.h.kernels)
            work = None
            if self.h.kernels:
                from rlspec.speculation.history.device.kernels import Workspace
                work = Workspace(self.h, live, self.k)
            self.p = SimpleNamespace(live=live, history=self.h, work=work)
        at = self.p.live.step([str(x) for x in keys], torch.from_numpy(ids), torch.arange(B),
                              torch.from_numpy(np.asarray(nums, np.int64)), lambda pos: [plens[i] for i in pos], k + 1)
        drafts, valid, _ = draft_rows(self.p, at, torch.from_numpy(np.asarray(new) > 0), k)
        return [d[:c] for d, c in zip(drafts.tolist(), valid.tolist())]

    def finish(self, key, prompt, response) -> None:
        super().finish(key, prompt, response)
        if self.p is not None:
            self.p.live.finish(str(key))


def cache_answer(cache, prompt, response) -> str:
    """A finished answer into a SuffixDecodingCache, as a request started, fed and stopped; its key."""
    key = f"fill-{next(_ids)}"
    cache.start_request(key, np.asarray(prompt, np.int32))
    cache.add_active_response(key, list(response))
    cache.stop_request(key)
    return key


class Suffix:
    """vLLM's suffix proposer's calls (vllm/v1/spec_decode/suffix_decoding.py), with its defaults:
    tree depth 24, max_spec_factor 1, min_token_prob 0.1; responses cached up to a token budget
    (max_cached_requests = budget / mean response length)."""
    depth, factor, min_prob = 24, 1.0, 0.1

    def __init__(self, k: int, max_tokens: int, mean_response: int = 700):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=self.depth,
                                         max_cached_requests=max(1, max_tokens // mean_response))
        self.active: set = set()
        self.tokens: dict = {}

    def begin_call(self, prompts) -> None:
        pass

    def step(self, ids, nums, new, keys, plens, k) -> list[list[int]]:
        out = []
        for i, key in enumerate(keys):
            n = int(nums[i])
            if key not in self.active:
                self.cache.start_request(key, ids[i, : plens[i]].copy())
                self.active.add(key)
                sampled = ids[i, plens[i]: n]
            else:
                sampled = ids[i, n - new[i]: n]
            self.cache.add_active_response(key, sampled.tolist())
            self.tokens[key] = self.tokens.get(key, 0) + len(sampled)
            out.append(self.speculate(key, ids[i, max(0, n - self.depth): n].copy(), k))
        return out

    def speculate(self, key, pattern, k: int) -> list[int]:
        return self.cache.speculate(key, pattern, max_spec_tokens=k, max_spec_factor=self.factor,
                                    min_token_prob=self.min_prob).token_ids

    def finish(self, key, prompt, response) -> None:
        if key in self.active:
            self.cache.stop_request(key)
            self.active.discard(key)

    def end_call(self, prompts, responses) -> None:
        pass   # the call's responses entered the cache as their requests stopped

    def record(self, prompts, responses) -> None:
        """Responses the replay did not run (the fill): inserted as vLLM would have, token by token."""
        for p, r in zip(prompts, responses):
            self.tokens[cache_answer(self.cache, p, r)] = len(r)

    def has_history(self, prompt) -> bool | None:
        return None

    def stored(self) -> int:
        return sum(self.tokens.get(k, 0) for k in self.cache.cached_requests)

    def nbytes(self) -> int | None:
        return None


_ids = iter(range(1 << 62))


class SuffixFinished(Suffix):
    """`suffix` whose global tree gets a response only when it finishes, as rlspec's stores do
    (vLLM's adds a running response's tokens to it as they are sampled, where every other request
    reads them): two caches, one holding the running requests' own trees (its global tree off), one
    the finished responses (read through an idle request of empty prompt); a row takes the draft
    of higher score, its own tree's on a tie, as SuffixDecodingCache.speculate does."""

    def __init__(self, k: int, max_tokens: int, mean_response: int = 700):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        super().__init__(k, max_tokens, mean_response)
        self.done = self.cache   # finished responses only
        self.cache = SuffixDecodingCache(max_tree_depth=self.depth, max_cached_requests=0)
        self.done.start_request("probe", [])

    def speculate(self, key, pattern, k: int) -> list[int]:
        mine, other = (c.speculate(r, pattern, max_spec_tokens=k, max_spec_factor=self.factor,
                                   min_token_prob=self.min_prob) for c, r in ((self.cache, key), (self.done, "probe")))
        return mine.token_ids if mine.score >= other.score else other.token_ids

    def finish(self, key, prompt, response) -> None:
        super().finish(key, prompt, response)
        self.record([prompt], [response])   # into the finished responses' cache

    def record(self, prompts, responses) -> None:
        saved, self.cache = self.cache, self.done
        try:
            super().record(prompts, responses)
        finally:
            self.cache = saved

    def stored(self) -> int:
        return sum(self.tokens.get(k, 0) for k in self.done.cached_requests)


class DeviceSuffix(Device):
    """A prototype: the device rule's own sources (the prompt's store, the row, its siblings) with
    a suffix tree over every finished answer as the global source in place of the count table (its
    draft up to k tokens, min_token_prob 0.1), taken where its match, capped at max_match, is longer
    than the own sources' longest and it drafts, as the device rule takes its global draft."""

    def __init__(self, k: int, max_tokens: int, mean_response: int = 700):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        super().__init__(k, max_tokens, global_source=False)
        self.tree = SuffixDecodingCache(max_tree_depth=Suffix.depth,
                                        max_cached_requests=max(1, max_tokens // mean_response))
        self.tree.start_request("probe", [])

    def step(self, ids, nums, new, keys, plens, k) -> list[list[int]]:
        import torch

        from rlspec.speculation.history.device.store import prompt_hash

        self._flush()
        t, pl, n = torch.from_numpy(ids), torch.as_tensor(np.asarray(plens, np.int64)), torch.as_tensor(nums)
        active = torch.from_numpy(np.asarray(new) > 0)
        own, own_best, _, _ = self.h.source_drafts(t, n, prompt_hash(t, pl), pl, k, active)
        out = []
        for i, (d, best) in enumerate(zip(own.tolist(), own_best.tolist())):
            g = self.tree.speculate("probe", ids[i, max(0, int(n[i]) - Suffix.depth): int(n[i])].copy(),
                                    max_spec_tokens=k, max_spec_factor=float(k), min_token_prob=Suffix.min_prob)
            c = sum(x >= 0 for x in d)
            far = g.token_ids and new[i] > 0 and (min(g.match_len, self.h.max_match) > best or c == 0)
            out.append(list(g.token_ids) if far else d[:c])
        return out

    def record(self, prompts, responses) -> None:
        super().record(prompts, responses)
        for p, r in zip(prompts, responses):
            if len(r):
                cache_answer(self.tree, p, r)


def make_store(name: str, k: int, max_tokens: int, mean_response: int = 700):
    if name == "suffix":
        return Suffix(k, max_tokens, mean_response)
    if name == "suffix_finished":
        return SuffixFinished(k, max_tokens, mean_response)
    if name == "device_suffix":
        return DeviceSuffix(k, max_tokens, mean_response)
    if name == "rlspec_chains":   # the cheaper rule: global chains, prompt keys of 3 tokens
        return Rlspec(k, max_tokens, global_index="chains", prompt_keys=[3])
    return {"rlspec": Rlspec, "dict": Dict, "device": Device, "device_live": DeviceLive}[name](k, max_tokens)


# -- the engine emulation -------------------------------------------------------------------------------
def accepted(draft, response, done: int) -> int:
    """The draft's tokens a verification accepts for a response with `done` tokens written (its
    last token is never drafted: the verification samples it)."""
    n = 0
    while n < len(draft) and n < len(response) - done - 1 and draft[n] == response[done + n]:
        n += 1
    return n


def call_epoch(visits: dict, groups) -> int:
    """Counts each group's prompt as visited once more; the call's epoch, its groups' commonest visit."""
    epochs = []
    for p, _ in groups:
        visits[tuple(p)] = visits.get(tuple(p), 0) + 1
        epochs.append(visits[tuple(p)])
    return max(set(epochs), key=epochs.count)


def replay_call(store, prompts: list[list[int]], responses: list[list[int]], k: int, max_batch: int,
                timing: list | None = None, written: list[int] | None = None, record: bool = True,
                drafted: list[int] | None = None) -> tuple[int, int]:
    """Run one call's requests through `store` as an engine would; (verifications, tokens emitted).
    drafted: its one entry grows by the draft tokens proposed for verification.
    written: how many of each response's tokens the request has written already (default 1: the
    prefill samples the first)."""
    n_req = len(responses)
    written = written or [1] * n_req
    width = max(len(p) + len(r) for p, r in zip(prompts, responses)) + k + 2
    rows = min(max_batch, n_req)
    ids = np.zeros((rows, width), np.int32)
    nums = np.zeros(rows, np.int64)
    new = np.zeros(rows, np.int64)
    req = [-1] * rows
    done = [0] * n_req
    waiting = list(range(n_req))[::-1]
    running = 0
    call = next(_ids)
    keys = [f"{call}-{r}" for r in range(n_req)]
    store.begin_call(prompts)
    verifications = emitted = 0

    def admit() -> None:
        nonlocal running
        while running < rows and waiting:
            r = waiting.pop()
            p, w = prompts[r], written[r]
            ids[running, : len(p)] = p
            ids[running, len(p): len(p) + w] = responses[r][:w]
            nums[running], new[running], req[running] = len(p) + w, 1, r
            done[r] = w
            running += 1

    admit()
    while running:
        t0 = time.perf_counter()
        drafts = store.step(ids[:running], nums[:running], new[:running], [keys[r] for r in req[:running]],
                            [len(prompts[r]) for r in req[:running]], k)
        if timing is not None:
            timing.append((running, time.perf_counter() - t0))
        finished = []
        for i in range(running):
            r, resp, d = req[i], responses[req[i]], drafts[i]
            left = len(resp) - done[r]
            if left <= 0:
                finished.append(i)
                continue
            step = min(accepted(d, resp, done[r]) + 1, left)
            ids[i, nums[i]: nums[i] + step] = resp[done[r]: done[r] + step]
            nums[i] += step
            new[i] = step
            done[r] += step
            verifications += 1
            emitted += step
            if drafted is not None:
                drafted[0] += min(len(d), max(left - 1, 0))
            if done[r] >= len(resp):
                finished.append(i)
        for i in sorted(finished, reverse=True):   # the last row fills the hole, as vLLM condenses
            store.finish(keys[req[i]], prompts[req[i]], responses[req[i]])
            last = running - 1
            if i != last:
                ids[i], nums[i], new[i], req[i] = ids[last], nums[last], new[last], req[last]
            running -= 1
        admit()
    if record:
        store.end_call(prompts, responses)
    return verifications, emitted


# -- real rollouts ----------------------------------------------------------------------------------------
def load_rollouts(path: Path) -> list[list[tuple[list[int], list[list[int]]]]]:
    """rollouts.jsonl -> steps, each a list of (prompt, responses) groups."""
    steps = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        steps.append([(g["prompt"], g["responses"]) for g in rec["groups"]])
    return steps


def replay_real(args) -> dict:
    steps = load_rollouts(Path(args.rollouts))[: args.steps]
    overrides = Path(args.rollouts).parent / ".hydra" / "overrides.yaml"   # the run that wrote the trace
    trace = ("python -m rlspec.train " + " ".join(x[2:].strip() for x in overrides.read_text().splitlines()
                                                 if x.startswith("- ") and "experiment=" not in x)
             if overrides.exists() else None)
    out = {"rollouts": args.rollouts, "trace_command": trace, "steps": len(steps), "k": args.k,
           "max_batch": args.max_batch, "max_tokens": args.max_tokens,
           "tokens": sum(len(r) for s in steps for _, rs in s for r in rs), "stores": {}}
    mean = int(np.mean([len(r) for s in steps for _, rs in s for r in rs]))
    for name in args.stores:
        store = make_store(name, args.k, args.max_tokens, mean)
        visits: dict[tuple, int] = {}
        by_epoch: dict[int, list] = {}
        timing: list = []
        base = rss()
        for groups in steps:
            ep = call_epoch(visits, groups)
            prompts = [p for p, rs in groups for _ in rs]
            responses = [r for _, rs in groups for r in rs]
            hits = [store.has_history(p) for p, _ in groups]
            d = [0]
            v, e = replay_call(store, prompts, responses, args.k, args.max_batch, timing, drafted=d)
            acc = by_epoch.setdefault(ep, [0, 0, 0, 0, 0])
            acc[0] += v
            acc[1] += e
            acc[4] += d[0]
            if hits[0] is not None:
                acc[2] += sum(hits)
                acc[3] += len(hits)
        rows = sum(n for n, _ in timing)
        out["stores"][name] = {
            "tokens_per_verification": {e: a[1] / a[0] for e, a in sorted(by_epoch.items())},
            # draft tokens sent for verification, per verification (what a wrong draft costs)
            "drafted_per_verification": {e: a[4] / a[0] for e, a in sorted(by_epoch.items())},
            "hit_rate": {e: (a[2] / a[3] if a[3] else None) for e, a in sorted(by_epoch.items())},
            "whole_run_tokens_per_verification": sum(a[1] for a in by_epoch.values()) / sum(
                a[0] for a in by_epoch.values()),
            "us_per_row_per_propose": 1e6 * sum(s for _, s in timing) / rows,
            "mean_running_batch": rows / len(timing), "rss_growth_bytes": rss() - base,
            "stored_tokens": store.stored(),
            # prompts with history at the end over prompts seen (None: no per-prompt history)
            "resident_share": (sum(bool(store.has_history(list(p))) for p in visits) / len(visits)
                               if store.has_history([0]) is not None else None)}
        print(f"{name:>7}: tokens/verification by epoch "
              + " ".join(f"{v:.3f}" for v in out["stores"][name]["tokens_per_verification"].values())
              + "; drafted/verification "
              + " ".join(f"{v:.2f}" for v in out["stores"][name]["drafted_per_verification"].values())
              + f"; {out['stores'][name]['us_per_row_per_propose']:.1f} us/row", flush=True)
    return out


# -- the synthetic trace with the paper's shape ------------------------------------------------------------
class Synthetic:
    def __init__(self, seed: int = 0, prompts: int = PROMPTS):
        g = np.random.default_rng(seed)
        self.seed, self.n = seed, prompts
        ranks = np.arange(1, VOCAB + 1, dtype=np.float64)
        self.zipf = np.cumsum(ranks ** -1.1)
        self.zipf /= self.zipf[-1]
        self.prompt_len = np.clip(g.lognormal(np.log(120), 0.6, prompts), 8, 1024).astype(int)
        self.latent_len = np.clip(g.lognormal(np.log(700), 0.9, (prompts, 3)), 32, 8192).astype(int)

    def tokens(self, g, n: int) -> np.ndarray:
        return np.searchsorted(self.zipf, g.random(n)).astype(np.int32)

    def prompt(self, p: int) -> list[int]:
        return self.tokens(np.random.default_rng((self.seed, p, 0)), self.prompt_len[p]).tolist()

    def latent(self, p: int, m: int, epoch: int) -> np.ndarray:
        g = np.random.default_rng((self.seed, p, 1, m))
        n = self.latent_len[p, m]
        out = self.tokens(g, n)
        copy = np.flatnonzero(g.random(n) < 0.3 / 10)   # span starts: about 30% of positions copied
        for s in copy:
            ln = int(g.integers(4, 17))
            if s > ln:
                src = int(g.integers(0, s - ln))
                out[s: s + ln] = out[src: src + ln][: len(out[s: s + ln])]
        for e in range(epoch):   # the policy drifts: 3% of positions an epoch
            d = np.random.default_rng((self.seed, p, 2, m, e))
            hit = d.random(n) < 0.03
            out[hit] = self.tokens(d, int(hit.sum()))
        return out

    def response(self, p: int, epoch: int, i: int) -> list[int]:
        g = np.random.default_rng((self.seed, p, 3, epoch, i))
        m = int(g.choice(3, p=[0.6, 0.3, 0.1]))
        base = self.latent(p, m, epoch)
        keep = g.random(len(base)) >= 0.01                                   # deletions
        r = base[keep].copy()
        sub = g.random(len(r)) < 0.08
        r[sub] = self.tokens(g, int(sub.sum()))
        ins = np.flatnonzero(g.random(len(r)) < 0.01)
        r = np.insert(r, ins, self.tokens(g, len(ins)))
        length = max(8, int(len(base) * g.uniform(0.8, 1.2)))
        if length > len(r):
            r = np.concatenate([r, self.tokens(g, length - len(r))])
        return r[:length].tolist()

    def group(self, p: int, epoch: int) -> tuple[list[int], list[list[int]]]:
        return self.prompt(p), [self.response(p, epoch, i) for i in range(GROUP)]


def scale_one(args) -> dict:
    """One store at one size, in its own process (RSS of its own)."""
    syn = Synthetic(args.seed)
    size, name, k = int(float(args.size)), args.store, args.k
    mean = int(np.mean([len(syn.response(p, 0, 0)) for p in range(0, PROMPTS, PROMPTS // 200)]))
    store = make_store(name, k, size, mean)   # suffix: its response budget from the mean length
    base = rss()
    inserted, insert_s, epoch = 0, 0.0, 0
    order = list(range(PROMPTS))
    while True:  # fill: epochs over reshuffled prompts until the store holds the size (or stops growing)
        random.Random(epoch).shuffle(order)
        for p in order:
            prompt, rs = syn.group(p, epoch)
            t0 = time.perf_counter()
            store.record([prompt] * len(rs), rs)
            insert_s += time.perf_counter() - t0
            inserted += sum(map(len, rs))
            if inserted >= 1.3 * size:
                break
        if inserted >= 1.3 * size:
            break
        epoch += 1
    held = store.stored()
    out = {"store": name, "size": size, "stored_tokens": held, "inserted_tokens": inserted, "fill_epochs": epoch + 1,
           "us_per_inserted_token": 1e6 * insert_s / inserted,
           "rss_bytes_per_stored_token": (rss() - base) / held}
    if store.nbytes() is not None:
        out["arrays_bytes_per_stored_token"] = store.nbytes() / held
    print(f"{name} {size:.0e}: {held:,} tokens held, {out['us_per_inserted_token']:.2f} us/inserted token, "
          f"{out['rss_bytes_per_stored_token']:.0f} B/token (RSS)", flush=True)
    # acceptance and hit rate: calls of a reshuffled epoch after the fill
    calls, v_all, e_all, hits, asked = 8, 0, 0, 0, 0
    next_epoch = epoch + 1
    random.Random(next_epoch).shuffle(order)
    if store.has_history(syn.prompt(0)) is not None:   # the resident share, over 2,000 prompts
        out["hit_rate_2000_prompts"] = sum(store.has_history(syn.prompt(p)) for p in order[:2000]) / 2000
    for c in range(calls):
        groups = [syn.group(p, next_epoch) for p in order[c * 4: (c + 1) * 4]]
        for pr, _ in groups:
            h = store.has_history(pr)
            if h is not None:
                hits += int(h)
                asked += 1
        v, e = replay_call(store, [p for p, rs in groups for _ in rs], [r for _, rs in groups for r in rs], k, 64)
        v_all += v
        e_all += e
    out["tokens_per_verification"] = e_all / v_all
    out["hit_rate"] = hits / asked if asked else None
    # propose at running batch 1 / 64 / 512, contexts of 512..8192 tokens, prompts that come back
    out["us_per_row_per_propose"] = {}
    g = random.Random(1)
    for batch in (1, 64, 512):
        timing: list = []
        prompts, responses, written = [], [], []
        for _ in range(batch):
            p = g.randrange(PROMPTS)
            prompt = syn.prompt(p)
            r, j = syn.response(p, next_epoch, g.randrange(GROUP)), GROUP
            while len(r) < 8192:   # long contexts: further answers of the same prompt after it
                r, j = r + syn.response(p, next_epoch, j), j + 1
            cut = g.randrange(512, 8192 - 64)
            prompts.append(prompt)
            written.append(cut)
            responses.append(r[: cut + 64])
        replay_call(store, prompts, responses, k, batch, timing, written, record=False)
        per_row = [s / n for n, s in timing if n == batch]
        out["us_per_row_per_propose"][batch] = 1e6 * float(np.median(per_row)) if per_row else None
    return out


def scale(args) -> dict:
    """Every (store, size) in a child process; a size past what the machine's memory holds for a
    store is skipped, said in the JSON."""
    import psutil

    results, notes = [], []
    budget = 0.85 * psutil.virtual_memory().total
    per_token = {}
    for size in args.sizes:
        for name in args.stores:
            n = int(float(size))
            if name in per_token and per_token[name] * n > budget:
                notes.append(f"{name} at {n:.0e} tokens skipped: at {per_token[name]:.0f} B/token it would need "
                             f"{per_token[name] * n / 2**30:.0f} GiB, over this machine's")
                print(notes[-1], flush=True)
                continue
            cmd = [sys.executable, __file__, "one", "--store", name, "--size", str(n), "--k", str(args.k),
                   "--seed", str(args.seed), "--history", *args.history, "--device", *args.device]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=6 * 3600)
            line = [x for x in p.stdout.splitlines() if x.startswith("{")]
            if p.returncode != 0 or not line:
                notes.append(f"{name} at {n:.0e} tokens failed: {p.stderr.strip().splitlines()[-1:]}")
                print(notes[-1], flush=True)
                continue
            r = json.loads(line[-1])
            per_token[name] = r["rss_bytes_per_stored_token"]
            results.append(r)
            print(json.dumps(r), flush=True)
    return {"rows": results, "notes": notes, "k": args.k, "seed": args.seed}


def variants(args) -> dict:
    """The device drafter's rule variants on one trace (each `NAME[:KEY=VALUE,...]` a replay of the
    device store with those DeviceHistory arguments, in a child process: --jobs at a time, one core
    each), beside --reference stores on the same trace; the history_rule_variants JSON."""
    from concurrent.futures import ThreadPoolExecutor

    def spec(v: str) -> tuple[str, list[str]]:
        name, _, kvs = v.partition(":")
        return name, [kv for kv in kvs.split(",") if kv]

    def one(stores: list[str], device: list[str], tmp: Path) -> dict:
        cmd = [sys.executable, __file__, "replay", "--rollouts", args.rollouts, "--k", str(args.k),
               *(["--steps", str(args.steps)] if args.steps else []),
               "--max-batch", str(args.max_batch), "--stores", *stores, "--device", *device, "--out", str(tmp)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3 * 3600)
        if p.returncode != 0:
            raise SystemExit(f"replay {' '.join(stores)} {' '.join(device)} failed: {p.stderr[-2000:]}")
        return json.loads(tmp.read_text())

    specs = [spec(v) for v in args.variant]
    if len({n for n, _ in specs}) != len(specs):
        raise SystemExit("--variant: two variants share a name")
    jobs = [(["device"], dev) for _, dev in specs] + ([(args.reference, [])] if args.reference else [])
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        done = list(pool.map(lambda ij: one(*ij[1], Path(tmp) / f"{ij[0]}.json"), enumerate(jobs)))
    keep = ("tokens_per_verification", "drafted_per_verification", "whole_run_tokens_per_verification",
            "us_per_row_per_propose")
    out = {"rollouts": args.rollouts, "trace_command": done[0]["trace_command"], "steps": done[0]["steps"],
           "k": args.k, "max_batch": args.max_batch, "variants": {}}
    for (name, dev), r in zip(specs, done):
        out["variants"][name] = {"device": dev, **{key: r["stores"]["device"][key] for key in keep}}
    if args.reference:
        out["reference"] = {s: {"tokens_per_verification": done[-1]["stores"][s]["tokens_per_verification"]}
                            for s in args.reference}
    return out


class Probe:
    """A replay driven by one store's drafts while every store drafts for the same states: at each
    of the driver's verifications, the tokens each store's draft would have had accepted."""

    def __init__(self, stores: dict, drive: str):
        self.stores, self.drive = stores, drive
        self.responses: list = []
        self.epoch = 0
        self.accepted: dict = {name: {} for name in stores}   # store -> epoch -> [accepted, verifications]

    def begin_call(self, prompts) -> None:
        for s in self.stores.values():
            s.begin_call(prompts)

    def step(self, ids, nums, new, keys, plens, k) -> list[list[int]]:
        drafts = {name: s.step(ids, nums, new, keys, plens, k) for name, s in self.stores.items()}
        for i, key in enumerate(keys):
            resp = self.responses[int(key.rsplit("-", 1)[1])]
            done = int(nums[i]) - plens[i]
            if done >= len(resp):
                continue
            for name, d in drafts.items():
                a = self.accepted[name].setdefault(self.epoch, [0, 0])
                a[0] += accepted(d[i], resp, done)
                a[1] += 1
        return drafts[self.drive]

    def finish(self, key, prompt, response) -> None:
        for s in self.stores.values():
            s.finish(key, prompt, response)

    def end_call(self, prompts, responses) -> None:
        for s in self.stores.values():
            s.end_call(prompts, responses)


def crosscheck(args) -> dict:
    """Each --drive store replays the trace, and at every one of its verifications every store of
    --stores drafts for the same state: tokens per verification (accepted + 1) of each store at each
    driver's states, by epoch. A rule's replay figure mixes how well it drafts with which states its
    own drafts lead the rows to; here the states are held fixed."""
    steps = load_rollouts(Path(args.rollouts))[: args.steps]
    mean = int(np.mean([len(r) for s in steps for _, rs in s for r in rs]))
    out = {"rollouts": args.rollouts, "steps": len(steps), "k": args.k, "max_batch": args.max_batch,
           "stores": args.stores, "drives": {}}
    for drive in args.drive:
        probe = Probe({name: make_store(name, args.k, args.max_tokens, mean)
                       for name in dict.fromkeys([drive, *args.stores])}, drive)
        visits: dict[tuple, int] = {}
        for groups in steps:
            probe.epoch = call_epoch(visits, groups)
            probe.responses = [r for _, rs in groups for r in rs]
            replay_call(probe, [p for p, rs in groups for _ in rs], probe.responses, args.k, args.max_batch)
        out["drives"][drive] = {name: {e: 1 + a / v for e, (a, v) in sorted(by.items())}
                                for name, by in probe.accepted.items()}
        print(f"driven by {drive}: " + "; ".join(
            f"{name} " + " ".join(f"{x:.3f}" for x in by.values()) for name, by in out["drives"][drive].items()),
            flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("replay")
    r.add_argument("--rollouts", required=True)
    r.add_argument("--max-tokens", type=int, default=50_000_000)
    s = sub.add_parser("scale")
    s.add_argument("--sizes", nargs="+", default=["1e6", "1e7", "5e7"])
    v = sub.add_parser("variants", help="the device drafter's rule variants on one trace")
    v.add_argument("--rollouts", required=True)
    v.add_argument("--variant", nargs="+", required=True, metavar="NAME[:KEY=VALUE,...]",
                   help="a name and its DeviceHistory arguments (none: the default rule)")
    v.add_argument("--reference", nargs="*", default=["rlspec", "suffix"], choices=STORES,
                   help="other stores replayed on the same trace")
    v.add_argument("--jobs", type=int, default=1, help="replays at a time (each on one core)")
    v.add_argument("--out", type=Path)
    c = sub.add_parser("crosscheck", help="every store's drafts at the states of each driver's replay")
    c.add_argument("--rollouts", required=True)
    c.add_argument("--drive", nargs="+", required=True, choices=STORES)
    c.add_argument("--stores", nargs="+", required=True, choices=STORES)
    c.add_argument("--max-tokens", type=int, default=50_000_000)
    c.add_argument("--out", type=Path)
    o = sub.add_parser("one")
    o.add_argument("--store", choices=STORES, required=True)
    o.add_argument("--size", required=True)
    for x in (r, s, o, v, c):
        x.add_argument("--k", type=int, default=5)
        x.add_argument("--seed", type=int, default=0)
    for x in (r, s, o):
        x.add_argument("--history", nargs="*", default=[], metavar="KEY=VALUE",
                       help="speculation.history settings of the rlspec store")
    for x in (r, s, o, c):
        x.add_argument("--device", nargs="*", default=[], metavar="KEY=VALUE",
                       help="DeviceHistory arguments of the device store")
    for x in (r, s):
        # suffix_finished and device_suffix only where asked for: the one explains suffix's figures,
        # the other is a prototype of the device rule's next global source
        x.add_argument("--stores", nargs="+", choices=STORES,
                       default=[s for s in STORES if s not in ("suffix_finished", "device_suffix", "rlspec_chains",
                                                               "device_live")])
        x.add_argument("--out", type=Path)
    for x in (r, v, c):
        x.add_argument("--max-batch", type=int, default=256)
        x.add_argument("--steps", type=int, default=None, help="the trace's first calls only (default: all)")
    args = ap.parse_args()
    import yaml

    for kv in getattr(args, "history", []):  # values as Hydra reads them: 3, 0.5, true, [8,4,1]
        key, value = kv.split("=", 1)
        HISTORY_SETTINGS[key] = yaml.safe_load(value)
    for kv in getattr(args, "device", []):
        key, value = kv.split("=", 1)
        DEVICE_SETTINGS[key] = yaml.safe_load(value)
    if args.mode == "one":
        print(json.dumps(scale_one(args)), flush=True)
        return
    modes = {"replay": replay_real, "scale": scale, "variants": variants, "crosscheck": crosscheck}
    result = {**harness.stamp(), **modes[args.mode](args)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
