"""Exact resume of the history drafters' stores where buckets overflow: a store saved and loaded
holds the same tables and drafts the same tokens as the store that was built call by call, in both
backends. A full bucket keeps its newest positions (the device ring) or highest counts (the count
table, both backends) insert by insert, so the sequences inserted afresh in one go build another
table: the saved state holds the tables as they are."""
import io
import random

import numpy as np
import torch

from rlspec.speculation.history.device.store import DeviceHistory, prompt_hash
from rlspec.speculation.history.host.index import HistoryIndex
from rlspec.speculation.history.state import STATE_GLOBALS
from rlspec.config.speculation import history_config

K = 5


def round_trip(state: dict) -> dict:
    """The state as a checkpoint holds it (torch.save, loaded with weights_only)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    with torch.serialization.safe_globals(STATE_GLOBALS):
        return torch.load(buf, weights_only=True)


def calls(rng: random.Random, V: int, n_calls: int = 6):
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(2, 10))] for _ in range(4)]
    for _ in range(n_calls):
        ps = [rng.choice(prompts) for _ in range(rng.randrange(3, 8))]
        yield ps, [[rng.randrange(V) for _ in range(rng.randrange(5, 60))] for _ in ps]


def rows_of(rng: random.Random, V: int, n: int = 24) -> list[list[int]]:
    return [[rng.randrange(V) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def device_drafts(d: DeviceHistory, rows: list[list[int]]) -> list[list[int]]:
    L = max(map(len, rows)) + K + 1
    ids = torch.tensor([r + [0] * (L - len(r)) for r in rows], dtype=torch.int32)
    n, pl = torch.tensor([len(r) for r in rows]), torch.full((len(rows),), 2)
    drafts, valid = d.propose(ids, n, prompt_hash(ids, pl), pl, K)
    return [x[:c] for x, c in zip(drafts.tolist(), valid.tolist())]


def held(d: DeviceHistory) -> list[torch.Tensor]:
    """Every tensor of the ring (a count entry of count 0 is empty: its key and token are never read)."""
    c = d.counts
    return [d.tok, d.pid, d.table, d.fill, d.written, c.cnt, torch.where(c.cnt > 0, c.key, 0),
            torch.where(c.cnt > 0, c.tok, 0)]


def test_a_saved_device_ring_loads_as_it_was_held_and_drafts_the_same():
    """A ring of 600 tokens (wrapping), buckets of 2 positions, count buckets of 2 entries and a
    per-prompt bound of 2 (answers blanked in place), six inserts: the loaded ring's every tensor
    equals the saved one's and every row drafts the same; the same sequences inserted afresh would
    build other buckets (the case the held state is for)."""
    rng = random.Random(0)

    def make():
        return DeviceHistory(max_tokens=600, buckets=16, width=2, max_match=8, prompt_keys=(3, 1),
                             count_buckets=16, count_width=2, max_per_prompt=2)

    run = make()
    for ps, rs in calls(rng, 3):
        run.insert(ps, rs)
    assert run._written > run.capacity   # the ring wrapped
    state = round_trip(run.state_dict())
    loaded = make()
    loaded.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(held(run), held(loaded)))
    rows = rows_of(rng, 3)
    assert device_drafts(loaded, rows) == device_drafts(run, rows)
    afresh = make()
    afresh.load_state_dict({k: v for k, v in state.items() if k != "exact"})
    assert not all(torch.equal(a, b) for a, b in zip(held(run), held(afresh)))


def test_a_saved_host_store_loads_its_count_table_as_it_was_held_and_drafts_the_same():
    """The host store with a count table of 2^10 tokens (256 buckets of 16) over a 3-token
    vocabulary, six records: the loaded table equals the one built record by record, entry for
    entry, it counts the same sequences, and every row drafts the same; counted afresh from the
    saved sequences the table would differ."""
    rng = random.Random(1)
    cfg = history_config(prompt_keys=[3, 1], max_match=8, count_tokens=1 << 10, max_tokens=1 << 20)

    def drafts(h: HistoryIndex, rows):
        h.begin_call()
        return h.propose([np.asarray(r, np.int32) for r in rows], [[0]] * len(rows), K,
                         keys=[f"r{i}" for i in range(len(rows))], prompt_lens=[2] * len(rows))

    run = HistoryIndex(cfg, k_max=K)
    for ps, rs in calls(rng, 3):
        run.record(ps, rs, wait=True)
    state = round_trip(run.state_dict())
    loaded = HistoryIndex(cfg, k_max=K)
    loaded.load_state_dict(state)
    t, u = run.count_table, loaded.count_table
    on = t.table.cnt > 0
    assert torch.equal(t.table.cnt, u.table.cnt)
    assert all(torch.equal(getattr(t.table, k)[on], getattr(u.table, k)[on]) for k in ("key", "tok"))
    assert [s.stored for s in t.seqs] == [s.stored for s in u.seqs] and t.total == u.total
    rows = rows_of(rng, 3)
    assert drafts(loaded, rows) == drafts(run, rows)
    afresh = HistoryIndex(cfg, k_max=K)
    afresh.load_state_dict({k: v for k, v in state.items() if k != "counts"})
    assert not torch.equal(afresh.count_table.table.cnt, t.table.cnt)
