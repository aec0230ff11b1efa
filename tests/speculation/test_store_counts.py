"""The history store's count table (rlspec/speculation/history/host/counts.py) against the device drafter's
(rlspec/speculation/history/device/counts.py): the same answers counted give the same table, entry for entry,
and the numba walk drafts what the torch walk drafts, token for token, on random traces."""
import random

import numpy as np
import pytest
import torch

from rlspec.config import HistoryConfig
from rlspec.speculation import GLOBAL
from rlspec.speculation.history.device.counts import CountTable
from rlspec.speculation.history.device.store import DeviceHistory
from rlspec.speculation.history.host.index import HistoryIndex
from rlspec.speculation.history.host.store import prompt_salt
from rlspec.speculation.history.host import counts as store_counts
from rlspec.speculation.history.host.counts import HostCounts, count_draft
from rlspec.config.speculation import history_config

from helpers.states import same_state


class Seq:
    __slots__ = ("start", "stored", "tokens", "counted")

    def __init__(self, stored, tokens):
        self.start, self.stored, self.tokens, self.counted = -1, stored, tokens, False


def torch_draft(table: CountTable, ctx: list[int], k: int) -> tuple[list[int], int]:
    """CountTable.draft for one row of tokens ctx."""
    top = max(table.keys)
    row = torch.full((1, top), -5, dtype=torch.int64)
    newest = torch.tensor(ctx[::-1][:top], dtype=torch.int64)
    row[0, : len(newest)] = newest
    drafts, m = table.draft(row, torch.tensor([len(ctx)]), k)
    return [x for x in drafts[0].tolist() if x >= 0], int(m[0])


def numba_draft(counts: HostCounts, ctx: list[int], k: int, vocab: int) -> tuple[list[int], int]:
    key, tok, cnt, levels, salts, min_prob = counts.arrays()
    out, scratch = np.zeros(k, np.int64), np.zeros(k, np.int64)
    got, m = count_draft(np.array(ctx, np.int32), len(ctx), key, tok, cnt, levels, salts, k, min_prob, vocab,
                         out, scratch)
    return out[:got].tolist(), int(m)


@pytest.mark.parametrize("seed", range(8))
def test_the_numba_walk_drafts_what_the_torch_walk_drafts(seed):
    """Random answers over a small vocabulary counted into tables of few buckets and entries (so
    buckets fill and prune), some with a vocabulary bound: every context's
    draft and match length are the torch walk's."""
    rng = random.Random(seed)
    V, max_match = rng.choice([3, 5, 8]), rng.choice([4, 8, 16])
    vocab = V - 1 if seed % 3 == 0 else 1 << 30
    counts = HostCounts(max_match, 400, vocab, width=rng.choice([2, 4, 16]), buckets=rng.choice([1, 8, 64]),
                        min_prob=rng.choice([0.1, 0.3]))
    bodies = {}
    for _ in range(6):
        new = []
        for _ in range(rng.randrange(1, 6)):
            head, answer = rng.randrange(max_match + 1), [rng.randrange(V) for _ in range(rng.randrange(1, 60))]
            body = np.array([rng.randrange(V) for _ in range(head)] + answer + [-1], np.int32)
            seq = Seq(len(body), len(answer))
            bodies[id(seq)] = body
            new.append((seq, body))
        counts.update(lambda s: bodies[id(s)], [], new)
    drafted = 0
    for _ in range(200):
        ctx = [rng.randrange(V) for _ in range(rng.randrange(1, 30))]
        want = torch_draft(counts.table, ctx, 5)
        assert numba_draft(counts, ctx, 5, vocab) == want, (ctx, want)
        drafted += len(want[0])
    assert drafted > 100


def history_settings(count_tokens: int) -> HistoryConfig:
    return history_config(prompt_keys=[2], max_match=8, count_tokens=count_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_the_store_and_the_device_drafter_count_alike_and_draft_the_same_global_tokens(seed):
    """Records of random answers to a few prompts into the host store (count table over its newest
    count_tokens tokens) and the device drafter (a ring of as many tokens, the table of the same
    size): after every record the two tables are equal entry for entry (the ring wraps: answers are
    counted out), and a prompt never seen drafts, through the store's whole rule, the device
    table's global draft, token for token."""
    rng = random.Random(seed)
    V, ring = 5, rng.choice([300, 2000])
    host = HistoryIndex(history_settings(ring), k_max=5)
    device = DeviceHistory(max_tokens=ring, max_match=8, count_buckets=host.count_table.table.buckets)
    assert host.count_table.table.buckets == device.counts.buckets
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(2, 12))] for _ in range(5)]
    unseen = [9, 9, 9]
    drafted = 0
    for _ in range(8):
        ps = [rng.choice(prompts) for _ in range(rng.randrange(1, 8))]
        rs = [[rng.randrange(V) for _ in range(rng.randrange(1, 50))] for _ in ps]
        host.record(ps, rs, wait=True)
        device.insert(ps, rs)
        for name in ("key", "tok", "cnt"):
            assert torch.equal(getattr(host.count_table.table, name), getattr(device.counts, name)), name
        for _ in range(30):
            ctx = unseen + [rng.randrange(V) for _ in range(rng.randrange(1, 12))]
            want, m = torch_draft(device.counts, ctx, 5)
            got, src = host.draft_context(ctx, int(prompt_salt(np.array(unseen, np.int32), 3)), 5)
            assert got == (want if m > 0 else []) and set(src) <= {GLOBAL}, (ctx, got, want)
            drafted += len(got)
    assert drafted > 50 and host.count_table.total <= ring


def test_the_count_table_follows_the_stores_evictions():
    """Answers evicted by the store's bounds (per prompt, then whole prompts) and pushed past
    count_tokens leave the table: it equals a table that counts the sequences still counted at
    once, and every one of them is stored."""
    rng = random.Random(3)
    h = HistoryIndex(history_config(prompt_keys=[2], max_match=8, max_rollouts_per_prompt=3, max_tokens=1500,
                                   count_tokens=1200), k_max=5)
    h.count_table = HostCounts(8, 1200, h.vocab, buckets=1 << 12)   # no bucket fills: no pruning
    prompts = [[rng.randrange(50) for _ in range(4)] for _ in range(12)]
    for _ in range(10):
        ps = [rng.choice(prompts) for _ in range(6)]
        h.record(ps, [[rng.randrange(6) for _ in range(rng.randrange(5, 60))] for _ in ps], wait=True)
    c = h.count_table
    stored = {id(seq) for rec in h.prompts.values() for seq in rec.seqs}
    assert all(id(s) in stored and s.counted for s in c.seqs) and 0 < len(c.seqs) < len(stored) < 60   # both bounds bit
    assert c.total == sum(s.stored for s in c.seqs) <= 1200
    fresh = HostCounts(8, 1200, h.vocab, buckets=1 << 12)
    fresh.update(lambda s: h.arena.tok[s.start: s.start + s.stored], [], [
        (Seq(s.stored, s.tokens), h.arena.tok[s.start: s.start + s.stored]) for s in c.seqs])
    held, held_fresh = c.table.cnt > 0, fresh.table.cnt > 0   # an entry of count 0 is empty: never read
    for name in ("key", "tok", "cnt"):
        assert torch.equal(getattr(c.table, name) * held, getattr(fresh.table, name) * held_fresh), name
    assert int(c.table.cnt.sum()) > 1000 and int((c.table.cnt > 0).sum(1).max()) < c.table.width


def test_a_record_whose_counting_fails_leaves_the_store_and_an_empty_table(monkeypatch):
    h = HistoryIndex(history_settings(1 << 12), k_max=5)
    h.record([[1, 2, 3]], [[4, 5, 6, 7]], wait=True)
    before = h.state_dict()

    def fail(*args, **kwargs):
        raise MemoryError("no room")

    monkeypatch.setattr(store_counts, "_merge_pairs", fail)
    with pytest.raises(MemoryError):
        h.record([[8, 9]], [[4, 5, 6, 1]], wait=True)
    after = h.state_dict()
    counts_before, counts_after = before.pop("counts"), after.pop("counts")
    assert same_state(before, after)   # the stored sequences as they were
    assert not counts_after["counted"].any() and counts_before["counted"].all()
    assert h.count_table.total == 0 and int(h.count_table.table.cnt.sum()) == 0
    monkeypatch.undo()
    h.record([[8, 9]], [[4, 5, 6, 1]], wait=True)   # counted from here on
    assert h.draft_context([7, 7, 4, 5, 6], 12345, 3)[0] == [1]


def test_a_count_past_2_to_the_15_still_ranks_first_on_both_backends():
    """40,000 answers' worth of 5 -> 7 and 10 of 5 -> 9 in one context: both tables draft 7 after a
    5 (a count packed above the token in one int64 wrapped past 2^15 and drafted nothing)."""
    body = np.array([5, 7] * 40_000 + [-1] + [5, 9, -1] * 10, np.int32)
    sizes, heads = [80_001] + [3] * 10, [0] * 11
    host = HostCounts(2, 200_000, 1 << 30, width=4, buckets=16)
    host._add(np.split(body, np.cumsum(sizes)[:-1]), heads, 1)
    table = CountTable("cpu", [1, 2], 4, 16, 0.1, 1 << 30)
    table.add(torch.from_numpy(body.astype(np.int64)), torch.tensor(sizes), torch.tensor(heads), 1)
    assert torch.equal(table.cnt, host.table.cnt) and int(table.cnt.max()) == 40_000
    assert torch_draft(table, [3, 5], 1) == ([7], 1)
    assert numba_draft(host, [3, 5], 1, 1 << 30) == ([7], 1)
