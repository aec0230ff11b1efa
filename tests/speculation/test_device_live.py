"""The device drafter's incremental rows (history/device/live.py): the live table finds, for
every query, the position the whole-row scan finds (window_prints << 1 compared, the newest
position in [lo, n)), on random rows grown step by step, rows joining mid-way; its Triton append
(in Triton's interpreter) keeps the table as the torch method does; and a call's rows kept
by slot (LiveRows: requests joining, growing, finishing, preempted and back) draft, with the table
and without, what the same rows drafted as one plain batch draft."""
import random

import pytest
import torch

from rlspec.speculation.history.device.live import LiveRows, LiveTable, prints_at
from rlspec.speculation.history.device.ops import last_true, prompt_hash, window_prints
from rlspec.speculation.history.device.store import DeviceHistory


def scan(tokens: torch.Tensor, n: int, q: int, lo: int, m: int) -> int:
    """What _live_candidates computes for one row: the newest column c in [max(lo, m), n) whose
    window print (<< 1) equals q."""
    win = window_prints(tokens[None], m)[0] << 1
    cols = torch.arange(win.shape[0])
    hit = (win == q) & (cols < n) & (cols >= max(lo, m))
    return int(last_true(hit[None])[0])


@pytest.mark.parametrize("seed", range(6))
def test_the_incremental_table_finds_what_the_whole_row_scan_finds(seed):
    rng = random.Random(seed)
    keys, L, B, vocab = (4, 2, 1), 96, 6, rng.choice([3, 5, 50])
    table = LiveTable(slots=8, max_len=L, keys=keys)
    slots = torch.tensor(rng.sample(range(8), B))
    tokens = torch.zeros(B, L, dtype=torch.int64)   # row r's tokens; the table reads them by slot
    by_slot = torch.zeros(8, L, dtype=torch.int64)
    n = torch.zeros(B, dtype=torch.int64)
    for r in range(B):   # prompts of 3..12 tokens: rows join with them
        p = rng.randrange(3, 13)
        tokens[r, :p] = torch.tensor([rng.randrange(vocab) for _ in range(p)])
        n[r] = p
    plen = n.clone()
    by_slot[slots] = tokens
    table.reset(slots[:3])
    table.append(slots[:3], by_slot, torch.zeros(3, dtype=torch.int64), n[:3])
    joined = 3
    checked = found = 0
    for step in range(40):
        if step == 5:   # the others join later (a resumed answer: prompt and answer so far at once)
            by_slot[slots] = tokens
            table.reset(slots[3:])
            table.append(slots[3:], by_slot, torch.zeros(B - 3, dtype=torch.int64), n[3:])
            joined = B
        old = n.clone()
        for r in range(B):
            add = min(rng.randrange(1, 5), L - 1 - int(n[r]))
            tokens[r, n[r]: n[r] + add] = torch.tensor([rng.randrange(vocab) for _ in range(add)])
            n[r] += add
        by_slot[slots] = tokens
        table.append(slots[:joined], by_slot, old[:joined], n[:joined])
        for li, m in enumerate(keys):
            for reader in range(joined):
                if n[reader] < m:
                    continue
                q = prints_at(tokens[reader: reader + 1], n[reader: reader + 1], m)
                for j in range(joined):   # the reader's own row (lo = m) and every other (lo = its prompt)
                    lo = m if j == reader else max(int(plen[j]), m)
                    got = int(table.latest(slots[j: j + 1], li, q, n[j: j + 1], torch.tensor([lo]))[0])
                    want = scan(tokens[j], int(n[j]), int(q[0]), lo, m)
                    assert got == want, (seed, step, m, reader, j, got, want)
                    checked += 1
                    found += want >= 0
    assert checked > 1000 and found > 100, (checked, found)


CHILD_APPEND = r'''
import random, torch
from rlspec.speculation.history.device.live import LiveTable
from rlspec.speculation.history.device import kernels
rng = random.Random(SEED)
keys, L, B = (4, 2, 1), 120, 8
ref, got = LiveTable(slots=10, max_len=L, keys=keys), LiveTable(slots=10, max_len=L, keys=keys)
slots = torch.tensor(rng.sample(range(10), B))
tok = torch.zeros(10, L, dtype=torch.int64)   # by slot
tok[slots] = torch.tensor([[rng.randrange(5) for _ in range(L)] for _ in range(B)])
n = torch.tensor([rng.randrange(1, 12) for _ in range(B)])
ref.append(slots, tok, torch.zeros_like(n), n)   # a join: the slots start empty
kernels.append(got, slots, tok, torch.zeros_like(n), n)
for step in range(25):
    new = torch.minimum(n + torch.tensor([rng.randrange(0, 5) for _ in range(B)]), torch.tensor(L - 1))
    ref.append(slots, tok, n, new)
    kernels.append(got, slots, tok, n, new)
    n = new
for name in ("used", "head", "prev"):
    assert torch.equal(getattr(ref, name), getattr(got, name)), name
assert torch.equal(torch.where(ref.used, ref.fp, 0), torch.where(got.used, got.fp, 0))
print("ok", int(ref.used.sum()), int((ref.prev >= 0).sum()))
'''


@pytest.mark.parametrize("seed", range(3))
def test_the_triton_append_links_what_the_torch_table_links(seed):
    """kernels.append in Triton's interpreter against LiveTable.append: the same tables, heads
    and links, entry for entry, after a join and 25 steps of 0 to 4 new tokens a row."""
    import subprocess
    import sys

    from conftest import ROOT, child_env

    run = subprocess.run([sys.executable, "-c", CHILD_APPEND.replace("SEED", str(seed))], cwd=ROOT, text=True,
                         capture_output=True, timeout=600, env={**child_env(), "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ok"), run.stdout


def _call(rng, vocab, prompts, group):
    """A call's requests: (prompt, answer) pairs, each answer a noisy copy of one of its prompt's two
    latent answers (so that siblings, the row itself and the store all match)."""
    ps = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 9))] for _ in range(prompts)]
    latent = [[[rng.randrange(vocab) for _ in range(rng.randrange(15, 50))] for _ in range(2)] for _ in ps]
    return [(ps[i], [t if rng.random() > 0.15 else rng.randrange(vocab) for t in rng.choice(latent[i])])
            for i in range(prompts) for _ in range(group)]


@pytest.mark.parametrize("table", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_rows_kept_by_slot_draft_what_the_plain_batch_drafts(seed, table):
    """A call of random requests run step by step: up to R running at once, each step's rows gaining
    1..k+1 tokens, requests finishing (their answers kept, a ring of F) and preempted (back later,
    rejoining); the batch reordered. Each step, LiveRows.step and propose over its slots (the table's
    lookups, or the scan of the slot rows) against propose over the same rows as one plain batch
    (running rows then the finished ring): the same drafts and sources token for token."""
    slot_trace(seed, table)


def slot_trace(seed: int, table: bool, kernels: bool = False) -> tuple[int, int]:
    """The call of test_rows_kept_by_slot_draft_what_the_plain_batch_drafts (kernels: the table's
    Triton kernels, in Triton's interpreter on CPU): rows checked and tokens drafted."""
    rng = random.Random(seed)
    vocab, k, R, F, L = rng.choice([4, 6, 12]), 4, 6, rng.choice([0, 3, 8]), 96
    store = DeviceHistory(max_tokens=rng.choice([150, 2000]), width=4, max_match=6, prompt_keys=(4, 2, 1),
                          max_siblings=3, vocab_size=vocab, global_source=bool(seed % 2), kernels=False)
    warm = _call(rng, vocab, 3, 3)
    store.insert(*zip(*warm))
    reqs = _call(rng, vocab, 3, 4) + [(p, r[::-1]) for p, r in warm[:3]]
    live = LiveRows(R, F, L, store.prompt_keys, "cpu", table=table, kernels=kernels)
    if kernels:
        from rlspec.speculation.history.device.kernels import Workspace, step
        work = Workspace(store, live, k)
    src = torch.randint(0, vocab, (len(reqs), L), dtype=torch.int32)   # the runner's buffer, by request
    length = [len(p) for p, _ in reqs]      # tokens the runner holds
    waiting, running, ring, finished = list(range(len(reqs))), [], [], 0
    checked = drafted = 0
    while waiting or running:
        while waiting and len(running) < R and rng.random() < 0.7:
            running.insert(rng.randrange(len(running) + 1), waiting.pop(0))
        if not running:
            continue
        for i in running:   # this step's tokens: the accepted drafts and the bonus token
            p, r = reqs[i]
            length[i] = min(len(p) + len(r), length[i] + rng.randrange(1, k + 2))
            full = torch.tensor(p + r, dtype=torch.int32)
            src[i, : length[i]] = full[: length[i]]
        B = len(running)
        ids = [f"r{i}" for i in running]
        at = live.step(ids, src, torch.tensor(running), torch.tensor([length[i] for i in running]),
                       lambda pos: [len(reqs[running[j]][0]) for j in pos], k + 1)
        rows = live.rows(at)
        plain = running + [ring[j] for j in range(len(ring))]
        tok = torch.stack([torch.cat([src[i, : length[i]], torch.full((L - length[i],), 7, dtype=torch.int32)])
                           for i in plain])
        n = torch.tensor([length[i] for i in plain])
        pl = torch.tensor([len(reqs[i][0]) for i in plain])
        want = store.propose(tok, n, prompt_hash(tok, pl), pl, k, sources=True, done=len(ring))
        if kernels:   # the proposer's step: kernels.step over the slots, the running rows' drafts
            got = step(store, live, work, at, torch.ones(B, dtype=torch.bool), k)
            want = tuple(w[:B] for w in want)
        else:
            got = store.propose(live.tok, live.n[rows], live.salt[rows], live.plen[rows], k, sources=True,
                                done=len(ring), at=rows, table=live.table,
                                siblings=live.siblings(rows, min(store.max_siblings, len(rows))))
        assert torch.equal(live.n[rows], n) and torch.equal(live.salt[rows], prompt_hash(tok, pl))
        for w, g in zip(want, got):
            assert torch.equal(w, g), (seed, table)
        checked += B
        drafted += int(want[1].sum())
        for i in list(running):
            p, r = reqs[i]
            if length[i] == len(p) + len(r):        # finished: its answer kept for its siblings
                running.remove(i)
                live.finish(f"r{i}")
                if F:
                    if len(ring) < F:
                        ring.append(i)
                    else:
                        ring[finished % F] = i
                    finished += 1
            elif rng.random() < 0.04:                # preempted: leaves the batch, back later
                running.remove(i)
                waiting.insert(rng.randrange(len(waiting) + 1), i)
        rng.shuffle(running) if rng.random() < 0.2 else None
    assert checked > 100 and drafted > 50, (checked, drafted)
    return checked, drafted


@pytest.mark.parametrize("seed,table", [(0, True), (1, True), (0, False),
                                        *(pytest.param(s, True, marks=pytest.mark.slow) for s in (2, 3))])
def test_rows_kept_by_slot_draft_what_the_plain_batch_drafts_with_the_kernels(seed, table):
    """slot_trace with the Triton kernels (Triton's interpreter, in a child process): the call's
    joins through kernels.append, its steps through kernels.advance and its drafts through
    kernels.step (the rows gathered, the table's lookups, the own draft, the count table's walk
    and the choice between them, in the step's fixed memory) draft token for token what the plain
    batch drafts with the torch code; and without the table (lookup=scan), the scan in torch
    between the kernels."""
    import subprocess
    import sys

    from conftest import ROOT, child_env

    code = f"from tests.speculation.test_device_live import slot_trace; print('ok', *slot_trace({seed}, {table}, True))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, timeout=900,
                         env={**child_env(), "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("ok"), run.stdout
