"""One drafting rule in both backends: the host store (rlspec/speculation/history/host/store.py, numba over chains)
and the device drafter (history/device/store.py, torch over buckets) fed the same random traces draft the
same tokens, whole drafts, from every source (the prompt's stored answers, the row itself, its
siblings, the count table); each backend's saved state loads, alone or merged with another, to the
drafts of the store it came from.

Where the two may part by design, the traces stay inside both: nothing is evicted by size (the
ring and the count table hold every token; the per-prompt bound bites, in both), chain heads and
buckets enough that no key shares one with a full one (a key overflows its own bucket: both read its
newest max_candidates positions), groups have at most MAX_SIBLINGS rows, and a finished answer stays
in the batch (drafting nothing) until the call ends, when both store it."""
import random
from collections import Counter

import numpy as np
import pytest
import torch

from rlspec.config import HistoryConfig
from rlspec.speculation import SOURCES
from rlspec.speculation.history.device.store import DeviceHistory, prompt_hash
from rlspec.speculation.history.host.arena import HistoryArena
from rlspec.speculation.history.host.index import HistoryIndex
from rlspec.speculation.history.state import merge_states
from rlspec.config.speculation import history_config

K = 5
RING = 1 << 14


def drafters(rng: random.Random):
    max_match = rng.choice([4, 8, 16])
    keys = [m for m in rng.choice([[8, 3, 1], [3, 1], [4, 2], [2], [1]]) if m <= max_match]
    counts = rng.random() < 0.75
    cfg = history_config(prompt_keys=keys, max_match=max_match, min_prob=rng.choice([0.25, 0.5]),
                        max_candidates=rng.choice([2, 4, 64]),
                        global_source=counts, count_tokens=RING, max_rollouts_per_prompt=rng.choice([2, 5, 1 << 10]),
                        max_tokens=1 << 20)
    host, device = stores(cfg)
    return cfg, host, device


def stores(cfg: HistoryConfig) -> tuple[HistoryIndex, DeviceHistory]:
    """Empty host and device stores of cfg's settings."""
    host = HistoryIndex(cfg, k_max=K)
    host.walk = 1 << 30   # the live walks read every match (the device reads every row)
    # chain heads and buckets enough that no key shares a slot with another's full one
    host.arena = HistoryArena(len(host.pkeys), len(host.gkeys), 1 << 16, heads=1 << 20)
    device = DeviceHistory(max_tokens=RING, max_match=cfg.max_match, prompt_keys=tuple(cfg.prompt_keys),
                           min_prob=cfg.min_prob, width=cfg.max_candidates, buckets=1 << 16,
                           max_per_prompt=cfg.max_rollouts_per_prompt, global_source=cfg.global_source,
                           **({"count_buckets": host.count_table.table.buckets} if cfg.global_source else {}))
    return host, device


def one_step(store, rows, plens):
    """Every row's draft at one engine step, each row a request of its own (nothing running before)."""
    if isinstance(store, DeviceHistory):
        return device_step(store, rows, plens, [True] * len(rows))[0]
    store.begin_call()
    return store.propose([np.asarray(r, np.int32) for r in rows], [[0]] * len(rows), K,
                         keys=[f"q{i}" for i in range(len(rows))], prompt_lens=plens)


@pytest.mark.parametrize("backend", ["host", "device"])
@pytest.mark.parametrize("seed", range(4))
def test_a_store_saved_and_merged_drafts_as_the_stores_it_came_from(backend, seed):
    """Either backend: answers recorded call by call (the per-prompt bound biting, keys past their
    buckets' width) and saved load into an empty store of the same settings that drafts every query
    as the saved one did; two stores' states merged (history.state.merge_states, both backends' one
    merge) draft as one store that recorded both's answers."""
    rng = random.Random(seed)
    V = rng.choice([3, 5])
    cfg = history_config(prompt_keys=[3, 1], max_match=8, max_candidates=rng.choice([2, 64]), count_tokens=RING,
                        max_rollouts_per_prompt=rng.choice([2, 1 << 10]), max_tokens=1 << 20)
    pick = 0 if backend == "host" else 1
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(2, 8))] for _ in range(3)]
    calls = [[(p, [rng.randrange(V) for _ in range(rng.randrange(3, 30))]) for p in prompts for _ in range(3)]
             for _ in range(4)]
    def record(store, call):
        ps, rs = [p for p, _ in call], [r for _, r in call]
        store.record(ps, rs, wait=True) if backend == "host" else store.insert(ps, rs)

    whole, halves, parts = stores(cfg)[pick], [stores(cfg)[pick], stores(cfg)[pick]], stores(cfg)[pick]
    for i, call in enumerate(calls):
        record(whole, call)
        record(halves[i % 2], call)
    for call in calls[0::2] + calls[1::2]:   # the merged state's order: one store's answers, then the other's
        record(parts, call)
    queries = [p + r[: rng.randrange(1, 6)] for call in calls for p, r in call][::3]
    plens = [len(p) for call in calls for p, _ in call][::3]
    want = one_step(whole, queries, plens)
    assert sum(map(len, want)) > 10, want
    loaded = stores(cfg)[pick]
    loaded.load_state_dict(whole.state_dict())
    assert one_step(loaded, queries, plens) == want
    merged = stores(cfg)[pick]
    merged.load_state_dict(merge_states([h.state_dict() for h in halves]))
    assert one_step(merged, queries, plens) == one_step(parts, queries, plens)
    if backend == "device" and cfg.max_candidates == 2:
        assert bool((whole.fill > whole.width).any())


def device_step(device, rows, plens, active):
    L = max(len(r) for r in rows) + K + 1
    ids = torch.tensor([list(r) + [0] * (L - len(r)) for r in rows], dtype=torch.int32)
    n, pl = torch.tensor([len(r) for r in rows]), torch.tensor(plens)
    drafts, valid, src = device.propose(ids, n, prompt_hash(ids, pl), pl, K, torch.tensor(active), sources=True)
    out = [d[:c] for d, c in zip(drafts.tolist(), valid.tolist())]
    return out, torch.bincount(src[src >= 0].long(), minlength=len(SOURCES)).tolist()


@pytest.mark.parametrize("seed", range(12))
def test_the_host_store_and_the_device_drafter_draft_the_same_tokens(seed):
    """Calls over a few prompts (small vocabularies: many matches of every length), groups growing
    by 0 to K+1 tokens a step in a batch order reshuffled every step; every row's draft at every
    step is the same in both backends, and so are a call's drafted tokens by source."""
    rng = random.Random(seed)
    V = rng.choice([3, 5, 8])
    cfg, host, device = drafters(rng)
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(2, 12))] for _ in range(4)]
    checked, by_source = 0, [0] * len(SOURCES)
    for call in range(5):
        host.begin_call()
        group = [(f"{call}-{j}-{i}", p) for j, p in enumerate(rng.sample(prompts, rng.randrange(1, 4)))
                 for i in range(rng.randrange(1, 7))]
        answers = {key: [rng.randrange(V) for _ in range(rng.randrange(3, 40))] for key, _ in group}
        done = {key: 0 for key, _ in group}
        drafted = [0] * len(SOURCES)
        while any(done[key] < len(answers[key]) for key, _ in group):
            order = list(group)
            rng.shuffle(order)
            rows, news = [], []
            for key, p in order:
                new = min(rng.randrange(0, K + 2), len(answers[key]) - done[key]) if done[key] else 1
                done[key] += new
                rows.append(p + answers[key][: done[key]])
                news.append(new)
            keys, plens = [key for key, _ in order], [len(p) for _, p in order]
            want, src = device_step(device, rows, plens, [n > 0 for n in news])
            got = host.propose([np.asarray(r, np.int32) for r in rows], [[0] * n for n in news], K, keys=keys,
                               prompt_lens=plens)
            assert got == want, (call, rows, got, want)
            drafted = [a + b for a, b in zip(drafted, src)]
            checked += sum(map(len, want))
        assert host.stats.drafted == drafted, (host.stats.drafted, drafted)
        by_source = [a + b for a, b in zip(by_source, drafted)]
        ps, rs = [p for _, p in group], [answers[key] for key, _ in group]
        host.record(ps, rs, wait=True)
        device.insert(ps, rs)
        # both hold the same number of answers per prompt: at most the bound, the newest
        held = Counter(device.state_dict()["salt"].tolist())
        assert sorted(held.values()) == sorted(len(r.seqs) for r in host.prompts.values()), held
        assert max(held.values()) <= cfg.max_rollouts_per_prompt
    assert checked > 100, checked
    assert sum(x > 0 for x in by_source) >= 3, by_source
    if device.width <= 4:   # keys past their bucket's width: the newest `width` drafted, as the chains' walk reads
        assert bool((device.fill > device.width).any())


def test_every_row_of_a_group_larger_than_max_siblings_drafts_from_its_siblings():
    """A group of 2 x MAX_SIBLINGS rows after a refit: the store holds the old policy's answer, the
    running siblings agree on the new one. Every row, the last of the group included, drafts the
    siblings' continuation in both backends (the device drafter read siblings for the first
    MAX_SIBLINGS rows of a prompt only, and the rest drafted the stale answer)."""
    from rlspec.speculation import MAX_SIBLINGS

    cfg = history_config(prompt_keys=[3, 1], max_match=8, global_source=False, max_tokens=1 << 20)
    host = HistoryIndex(cfg, k_max=K)
    device = DeviceHistory(max_tokens=RING, max_match=8, prompt_keys=(3, 1), width=cfg.max_candidates,
                           buckets=1 << 16, global_source=False)
    p, old, new = [1, 2, 3, 4, 5], [30, 31, 40, 41, 42, 43], [30, 31, 32, 33, 34, 35]
    host.record([p], [old], wait=True)
    device.insert([p], [old])
    host.begin_call()
    G = 2 * MAX_SIBLINGS
    rows = [p + new] * (G - 1) + [p + new[:2]]   # the siblings ran ahead; the last row is at 30 31
    keys, plens = [f"r{i}" for i in range(G)], [len(p)] * G
    # the siblings' tokens join the host's live arena in an earlier step, as an engine's would
    host.propose([np.asarray(r[:len(p) + 1], np.int32) for r in rows], [[0]] * G, K, keys=keys, prompt_lens=plens)
    got = host.propose([np.asarray(r, np.int32) for r in rows], [[0] * (len(r) - len(p) - 1) or [0] for r in rows],
                       K, keys=keys, prompt_lens=plens)
    want, _ = device_step(device, rows, plens, [True] * G)
    assert got[-1] == [32, 33, 34, 35], got[-1]
    assert want[-1] == got[-1], (want[-1], got[-1])


@pytest.mark.parametrize("seed", range(6))
def test_both_backends_replay_a_call_in_shadow_to_the_same_counts(seed):
    """One shadow replay (history.stats.replay_in_shadow) over either backend's drafts: a call that
    drafted nothing, replayed in lock step against stores that recorded earlier calls (the
    per-prompt bound biting), gives the same verifications, drafts and accepts per position in
    both, siblings' tokens seen at the same step."""
    from rlspec.speculation.history.stats import HistoryStats

    rng = random.Random(300 + seed)
    V = rng.choice([3, 5, 8])
    cfg, host, device = drafters(rng)
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(2, 12))] for _ in range(4)]
    calls = []
    for _ in range(4):
        ps = [p for p in rng.sample(prompts, rng.randrange(1, 4)) for _ in range(rng.randrange(1, 7))]
        calls.append((ps, [[rng.randrange(V) for _ in range(rng.randrange(3, 40))] for _ in ps]))
    for ps, rs in calls[:-1]:
        host.record(ps, rs, wait=True)
        device.insert(ps, rs)
    ps, rs = calls[-1]
    max_rows = rng.choice([4, 64])
    host.begin_call()
    host.shadow(ps, rs, max_rows)
    dev = HistoryStats()
    device.shadow(dev, ps, rs, max_rows, K)
    got = [(st.shadow_responses, st.shadow_rows, st.shadow_drafted_pos, st.shadow_accepted_pos)
           for st in (host.stats, dev)]
    assert got[0] == got[1], got
    assert got[0][1] > 0 and sum(got[0][3]) > 0, got
