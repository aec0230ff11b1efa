"""The device-resident history drafter (rlspec/speculation/history/device/store.py): token for token
against a plain reading of its rule on random traces (small vocabularies, so that matches, hash
collisions, bucket overflow and ring eviction all happen), hand-made cases per source, and its
propose checked to be one graph of fixed shapes with no host sync and no device mixing."""
import random

import pytest
import torch

from rlspec.speculation import GLOBAL, HISTORY, PROMPT, SIBLINGS
from rlspec.speculation.history.device.store import DeviceHistory, prompt_hash
from rlspec.speculation.history.stats import HistoryStats
from tests.speculation.device_history_reference import Reference
from tests.speculation.device_history_reference import prompt_hash as ref_prompt_hash

SMALL = dict(max_tokens=300, buckets=16, width=4, max_match=6, prompt_keys=(4, 2), min_prob=0.5, max_siblings=3,
             max_voters=64, global_source=False)


def pair(**kw):
    cfg = {**SMALL, **kw}
    dev = DeviceHistory(**cfg)
    ref = Reference(cfg["max_tokens"], dev.n_buckets, cfg["width"], cfg["max_match"], cfg["prompt_keys"],
                    cfg["min_prob"], cfg["max_siblings"], cfg["max_voters"], dev.vocab,
                    (c.keys, c.width, c.buckets, c.min_prob) if (c := dev.counts) else None)
    return dev, ref


def batch(rows, plens, width=None, fill=0):
    """[B, L] tokens (garbage past each row's end), lengths, prompt ids, prompt lengths."""
    L = width or max(len(r) for r in rows)
    g = random.Random(fill)
    ids = torch.tensor([list(r) + [g.randrange(50) for _ in range(L - len(r))] for r in rows], dtype=torch.int32)
    n = torch.tensor([len(r) for r in rows])
    pl = torch.tensor(plens)
    return ids, n, prompt_hash(ids, pl), pl


def device_drafts(dev, rows, plens, k, width=None):
    d, nv = dev.propose(*batch(rows, plens, width), k)
    out = []
    for i in range(len(rows)):
        got = d[i].tolist()
        assert all(x >= 0 for x in got[: nv[i]]) and all(x == -1 for x in got[nv[i]:])
        out.append(got[: nv[i]])
    return out


def trace(seed, vocab, prompts=3, group=4, calls=6):
    """Calls of groups: each prompt's answers are noisy copies of a few latent answers."""
    g = random.Random(seed)
    ps = [[g.randrange(vocab) for _ in range(g.randrange(3, 8))] for _ in range(prompts)]
    latent = {i: [[g.randrange(vocab) for _ in range(g.randrange(10, 40))] for _ in range(2)] for i in range(prompts)}
    out = []
    for _ in range(calls):
        call = []
        for i in g.sample(range(prompts), 2):
            for _ in range(group):
                base = g.choice(latent[i])
                call.append((ps[i], [t if g.random() > 0.15 else g.randrange(vocab) for t in base]))
        out.append(call)
    return out


def cut_rows(g, call) -> tuple[list, list]:
    """A call's answers as running rows, each cut at a random length: rows (prompt and answer so
    far) and their prompt lengths."""
    rows, plens = [], []
    for p, r in call:
        rows.append(p + r[: g.randrange(0, len(r) + 1)])
        plens.append(len(p))
    return rows, plens


@pytest.mark.parametrize("source", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_drafts_equal_the_reference_on_random_traces(seed, source):
    g = random.Random(100 + seed)
    dev, ref = pair(max_tokens=g.choice([120, 300, 2000]), buckets=g.choice([4, 16, 256]),
                    min_prob=g.choice([0.3, 0.5, 0.8]), max_voters=g.choice([2, 5, 64]),
                    prompt_keys=g.choice([(4, 2), (4, 2, 1), (3,)]), global_source=source,
                    count_keys=g.choice([(1, 2, 4), (1, 3, 6), (2, 5), None]),
                    count_width=g.choice([2, 4, 16]), count_buckets=g.choice([1, 8, 64]),
                    count_min_prob=g.choice([0.05, 0.2, 0.5]))
    drafted = 0
    for call in trace(seed, vocab=g.choice([4, 6, 10])):
        rows, plens = cut_rows(g, call)
        rows.append([])   # an empty row (padding) drafts nothing
        plens.append(0)
        for k in range(1, 6):
            want = ref.draft(rows, plens, k)
            got = device_drafts(dev, rows, plens, k, width=max(map(len, rows)) + g.randrange(3))
            assert got == want, (k, rows)
            drafted += sum(map(len, got))
        dev.insert(*zip(*call))
        ref.insert(*zip(*call))
        assert ref.written == dev.stored() or dev.stored() == dev.capacity
    assert drafted > 0


def shadow_reference(ref, prompts, responses, rows, k):
    """The lock-step shadow replay of `rows` (indices into the call) row by row in Python, each
    step's drafts read from the plain reference drafter: (verifications, drafted per position,
    accepted per position)."""
    pending = {i: ([], 0) for i in rows}
    verifications, drafted, accepted = 0, [0] * k, [0] * k
    for t in range(max(len(responses[i]) for i in rows)):
        seqs = [list(prompts[i]) + list(responses[i][: t + 1]) for i in rows]
        fresh = ref.draft(seqs, [len(prompts[i]) for i in rows], k)
        for slot, i in enumerate(rows):
            if t >= len(responses[i]):
                continue
            draft, j = pending[i]
            if j < len(draft) and draft[j] == responses[i][t]:
                accepted[j] += 1
                pending[i] = (draft, j + 1)
                continue
            verifications += 1
            for x in range(len(fresh[slot])):
                drafted[x] += 1
            pending[i] = (fresh[slot], 0)
    return verifications, drafted, accepted


def replay_in_shadow(dev, prompts, responses, max_rows, k):
    st = HistoryStats()
    dev.shadow(st, prompts, responses, max_rows, k)
    return st.as_dict()


def shadow_counts(st, k):
    return (st["shadow_rows"], [st[f"shadow_drafts_ge_{i + 1}"] for i in range(k)],
            [st[f"shadow_accepted_ge_{i + 1}"] for i in range(k)])


def test_a_call_that_drafted_nothing_is_measured_in_shadow():
    """As the host drafter's shadow replay (tests/speculation/test_history.py): the history drafts
    11 12 13 14 after 10; the response goes on 11 12 99 (two accepted, the verification ends with
    99), then 5 where nothing matches (a verification that drafts nothing)."""
    dev = DeviceHistory(max_tokens=1024)
    dev.insert([[1, 2, 3]], [[10, 11, 12, 13, 14]])
    st = replay_in_shadow(dev, [[1, 2, 3]], [[10, 11, 12, 99, 5]], max_rows=8, k=5)
    assert shadow_counts(st, 5) == (3, [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]) and st["shadow_responses"] == 1
    # siblings in lock step: the second answer writes 4 5 two steps after the first, whose 6 8 it
    # drafts and accepts
    dev, ref = pair()
    responses = [[4, 5, 6, 8, 1, 2], [9, 9, 4, 5, 6, 8]]
    st = replay_in_shadow(dev, [[1, 2, 3]] * 2, responses, 8, 5)
    assert shadow_counts(st, 5) == shadow_reference(ref, [[1, 2, 3]] * 2, responses, [0, 1], 5)
    assert shadow_counts(st, 5)[2][:2] == [1, 1]
    # four prompts of one answer each, max_rows 2: every other group
    st = replay_in_shadow(DeviceHistory(max_tokens=1024), [[1, 2, i] for i in range(4)], [[9] * 5, [9] * 3] * 2, 2, 5)
    assert st["shadow_responses"] == 2 and sum(shadow_counts(st, 5)[2]) > 0


@pytest.mark.parametrize("seed", range(3))
def test_the_shadow_replay_equals_the_reference_on_random_traces(seed):
    g = random.Random(200 + seed)
    dev, ref = pair(max_tokens=g.choice([300, 2000]), prompt_keys=g.choice([(4, 2), (4, 2, 1)]))
    calls = trace(seed, vocab=g.choice([4, 6, 10]))
    for call in calls[:-1]:
        dev.insert(*zip(*call))
        ref.insert(*zip(*call))
    prompts, responses = zip(*calls[-1])
    k = g.choice([2, 5])
    st = replay_in_shadow(dev, prompts, responses, max_rows=64, k=k)
    want = shadow_reference(ref, prompts, responses, list(range(len(prompts))), k)
    assert shadow_counts(st, k) == want and st["shadow_responses"] == len(prompts)
    assert sum(want[2]) > 0


def test_prompt_hash_equals_the_reference():
    rows = [[5, 6, 7, 8, 9], [5, 6, 7, 1, 1], [0]]
    ids, _, pid, _ = batch(rows, [3, 3, 1])
    assert [x % (1 << 64) for x in pid.tolist()] == [ref_prompt_hash(r[:pl]) for r, pl in zip(rows, [3, 3, 1])]
    assert pid[0] == pid[1] != pid[2]


def test_the_prompts_history_drafts_and_another_prompts_only_through_the_global_source():
    dev = DeviceHistory(**SMALL)
    dev.insert([[1, 2, 3]], [[10, 11, 12, 13, 14, 15]])
    assert device_drafts(dev, [[1, 2, 3, 10, 11]], [3], 3) == [[12, 13, 14]]
    assert device_drafts(dev, [[7, 8, 9, 10, 11]], [3], 3) == [[]]
    dev = DeviceHistory(**{**SMALL, "global_source": True})
    dev.insert([[1, 2, 3]], [[10, 11, 12, 13, 14, 15]])
    assert device_drafts(dev, [[7, 8, 9, 10, 11]], [3], 3) == [[12, 13, 14]]
    # a draft stops where the stored response ended
    assert device_drafts(dev, [[1, 2, 3, 13, 14]], [3], 5) == [[15]]


def test_a_longer_global_match_drafts_unless_its_walk_stops_at_once():
    dev = DeviceHistory(**{**SMALL, "width": 8, "global_source": True, "count_min_prob": 0.5})
    # two other prompts' answers: 40 41 42 then 50 or 51; this prompt's row has 41 42 ... 60 in its own prompt
    dev.insert([[7, 7], [8, 8]], [[40, 41, 42, 50], [40, 41, 42, 51]])
    row = [41, 42, 60, 61, 9, 40, 41, 42]
    # global: 3 tokens matched (40 41 42), split 1 to 1 on the next (share 0.5 >= count_min_prob 0.5,
    # ties to the lower token): it drafts, and stops at the answer's end
    assert device_drafts(dev, [row], [5], 2) == [[50]]
    dev = DeviceHistory(**{**SMALL, "width": 8, "global_source": True, "count_min_prob": 0.6})
    dev.insert([[7, 7], [8, 8]], [[40, 41, 42, 50], [40, 41, 42, 51]])
    # the global walk stops at once (0.5 < 0.6): the row's own prompt (41 42 -> 60 61) drafts instead
    assert device_drafts(dev, [row], [5], 2) == [[60, 61]]


def test_counts_decide_and_min_prob_stops():
    dev = DeviceHistory(**{**SMALL, "width": 8})
    p = [1, 2, 3]
    dev.insert([p] * 3, [[10, 11, 12, 20], [10, 11, 12, 20], [10, 11, 12, 21]])
    assert device_drafts(dev, [p + [10, 11]], [3], 3) == [[12, 20]]   # 2 of 3 say 20
    dev = DeviceHistory(**{**SMALL, "width": 8, "min_prob": 0.7})
    dev.insert([p] * 3, [[10, 11, 12, 20], [10, 11, 12, 20], [10, 11, 12, 21]])
    assert device_drafts(dev, [p + [10, 11]], [3], 3) == [[12]]       # 2/3 < 0.7


def test_siblings_and_the_prompt_draft_without_history():
    dev = DeviceHistory(**SMALL)
    p = [1, 2, 3, 4, 5]
    # a sibling wrote 30 31 32 33 34; this row is at 30 31
    rows = [p + [30, 31, 32, 33, 34], p + [30, 31]]
    assert device_drafts(dev, rows, [5, 5], 3)[1] == [32, 33, 34]
    # another prompt's running answer is no sibling
    rows = [[9, 9, 9, 9, 9, 30, 31, 32, 33, 34], p + [30, 31]]
    assert device_drafts(dev, rows, [5, 5], 3)[1] == []
    # prompt lookup: the row's own prompt (and on into its answer)
    assert device_drafts(dev, [p + [2, 3]], [5], 3) == [[4, 5, 2]]


def test_the_calls_finished_answers_draft_for_their_running_siblings():
    """The last `done` rows are answers of the call that finished: a running row reads them as
    siblings (its max_siblings - 1 followers are its prompt's running and finished answers in
    proportion, not only the running rows in lockstep with it), and nothing drafts for them."""
    from rlspec.speculation.history.device.ops import prompt_siblings

    dev = DeviceHistory(**SMALL)   # max_siblings=3: each row reads 2 siblings
    p = [1, 2, 3, 4, 5]
    running = [p + [30, 31]] * 4                  # in lockstep: no sibling knows what follows 30 31
    finished = [p + [30, 31, 32, 33, 34, 35]] * 4
    ids, n, salt, pl = batch(running + finished, [5] * 8)
    drafts, counts = dev.propose(ids, n, salt, pl, 3, done=4)
    assert [d[:c] for d, c in zip(drafts.tolist(), counts.tolist())] == [[32, 33, 34]] * 4 + [[]] * 4
    assert device_drafts(dev, running + finished, [5] * 8, 3)[:4] == [[]] * 2 + [[32, 33, 34]] * 2   # row order
    salt = torch.zeros(8, dtype=torch.int64)
    sib, _, _ = prompt_siblings(salt, 3, done=4)
    assert sib[:4].tolist() == [[4, 1], [5, 2], [6, 3], [7, 0]]   # r0 f4 r1 f5 r2 f6 r3 f7, cyclically
    assert prompt_siblings(salt, 3)[0][:4].tolist() == [[1, 2], [2, 3], [3, 4], [4, 5]]


def test_an_empty_store_drafts_from_the_batch_only():
    dev = DeviceHistory(**SMALL)
    assert device_drafts(dev, [[1, 2, 3, 10, 11], [4, 5]], [3, 2], 3) == [[], []]
    assert device_drafts(dev, [[1, 2, 3, 1, 2]], [3], 3) == [[3, 1, 2]]     # its own prompt


def test_a_hash_collision_never_drafts():
    # one bucket: every key lands in it, only exact matches may draft
    dev = DeviceHistory(**{**SMALL, "buckets": 1, "width": 64})
    dev.insert([[1, 2, 3]], [[10, 11, 12, 13, 14, 15]])
    assert device_drafts(dev, [[1, 2, 3, 40, 41]], [3], 3) == [[]]
    assert device_drafts(dev, [[1, 2, 3, 11, 12]], [3], 3) == [[13, 14, 15]]


COUNTS = {**SMALL, "global_source": True, "count_keys": None, "max_tokens": 2000}


def test_the_count_source_drafts_the_commonest_continuation_within_other_prompts_answers():
    dev = DeviceHistory(**COUNTS)
    dev.insert([[7], [8], [9]], [[40, 41, 42, 43], [40, 41, 42, 43], [40, 41, 50]])
    # a new prompt: 40 41 went on 42 43 in 2 of 3 answers (the product of the shares 2/3 each step;
    # the answers' END stops it)
    assert device_drafts(dev, [[5, 5, 40, 41]], [2], 3) == [[42, 43]]
    dev = DeviceHistory(**{**COUNTS, "count_min_prob": 0.7})
    dev.insert([[7], [8], [9]], [[40, 41, 42, 43], [40, 41, 42, 43], [40, 41, 50]])
    assert device_drafts(dev, [[5, 5, 40, 41]], [2], 3) == [[]]
    # a context reaching into a prompt is not counted: 40 41 -> 42 only across a prompt's end
    dev = DeviceHistory(**COUNTS)
    dev.insert([[40, 41]], [[42, 43]])
    assert device_drafts(dev, [[5, 40, 41]], [1], 2) == [[]]
    assert device_drafts(dev, [[5, 42]], [1], 2) == [[43]]


def test_score_walks_from_the_context_whose_draft_is_surest():
    dev = DeviceHistory(**{**COUNTS, "prompt_keys": (1,)})
    # after 41: 42 in 3 answers, 50 in 2; after 30 41 (the row's last two): 50 then 51 52 in 2 answers
    dev.insert([[7]] * 5, [[41, 42], [41, 42], [41, 42], [30, 41, 50, 51, 52], [30, 41, 50, 51, 52]])
    row = [[5, 30, 41]]
    assert device_drafts(dev, row, [1], 3) == [[50, 51, 52]]
    # from 41 alone (3 of 5 say 42, then END): score 0.6 against 3 from 30 41
    assert device_drafts(dev, [[5, 9, 41]], [1], 3) == [[42]]


def test_each_drafted_token_is_told_by_its_source():
    dev = DeviceHistory(**COUNTS)
    dev.insert([[1, 2, 3], [7]], [[10, 11, 12, 13], [40, 41, 42, 43]])
    rows = [[1, 2, 3, 10, 11],                  # the prompt's history: 12 13
            [5, 6, 20, 21, 22, 23, 20, 21],     # the row itself (prompt lookup): 22 23
            [8, 8, 30, 31, 32, 33], [8, 8, 30, 31],   # the second from its sibling: 32 33
            [9, 40, 41]]                        # another prompt's answer: 42 43
    args = batch(rows, [3, 2, 2, 2, 1])
    drafts, counts, src = dev.propose(*args, 2, sources=True)
    assert torch.equal(drafts, dev.propose(*args, 2)[0]) and torch.equal(src >= 0, drafts >= 0)
    want = {0: ([12, 13], HISTORY), 1: ([22, 23], PROMPT), 3: ([32, 33], SIBLINGS), 4: ([42, 43], GLOBAL)}
    for i, (tokens, s) in want.items():
        assert drafts[i].tolist() == tokens and src[i].tolist() == [s, s], (i, drafts[i], src[i])


@pytest.mark.parametrize("bound", [None, 2])
def test_the_count_table_follows_the_ring_and_its_saved_state(bound):
    """Past the ring's size (and past a per-prompt bound), the count table is the one built afresh
    from the ring's whole answers still held (a saved and restored store's), entry for entry."""
    cfg = {**COUNTS, "max_tokens": 200, "count_buckets": 64, "count_width": 64, "max_per_prompt": bound}

    def table(h):
        held = h.counts.cnt > 0
        return sorted(zip(h.counts.key[held].tolist(), h.counts.tok[held].tolist(), h.counts.cnt[held].tolist()))

    dev = DeviceHistory(**cfg)
    for call in trace(3, vocab=6, calls=12):
        dev.insert(*zip(*call))
        fresh = DeviceHistory(**cfg)
        fresh.load_state_dict(dev.state_dict())
        assert table(dev) == table(fresh) and int((dev.counts.cnt > 0).sum(1).max()) < 64   # no bucket overflowed
    assert dev._written > 3 * dev.capacity and table(dev)


def test_a_prompt_keeps_its_newest_answers_up_to_the_bound():
    """max_per_prompt: a prompt's oldest answers past the bound draft nothing (their tokens are
    blanked, their bucket entries match nothing); another prompt's are untouched; a saved store holds
    the answers kept."""
    dev = DeviceHistory(**{**SMALL, "max_per_prompt": 2})
    p, q = [1, 2, 3], [7, 8, 9]
    dev.insert([p, q], [[10, 11, 12, 13], [10, 11, 40, 41]])
    dev.insert([p, p], [[10, 11, 20, 21], [10, 11, 20, 21]])        # p holds three: its first goes
    assert device_drafts(dev, [p + [10, 11], q + [10, 11]], [3, 3], 2) == [[20, 21], [40, 41]]
    dev.insert([p], [[10, 11, 30, 31]])
    # one of the two [20, 21] answers went: one vote each, the newest wins (held, 20 would have two)
    assert device_drafts(dev, [p + [10, 11]], [3], 2) == [[30, 31]]
    state = dev.state_dict()
    assert state["stored"].tolist() == [3 + 4 + 1] * 3 and state["tokens"].tolist() == [4] * 3
    assert len(set(state["salt"].tolist())) == 2


def test_the_ring_evicts_the_oldest():
    dev = DeviceHistory(**{**SMALL, "max_tokens": 24})
    dev.insert([[1, 2, 3]], [[10, 11, 12, 13, 14, 15]])                 # 3 + 6 + 1 = 10 tokens
    assert device_drafts(dev, [[1, 2, 3, 10, 11]], [3], 2) == [[12, 13]]
    dev.insert([[1, 2, 3]] * 2, [[20, 21, 22, 23, 24, 25]] * 2)       # 20 more: the first is overwritten
    assert device_drafts(dev, [[1, 2, 3, 10, 11]], [3], 2) == [[]]
    assert device_drafts(dev, [[1, 2, 3, 20, 21]], [3], 2) == [[22, 23]]


@pytest.mark.parametrize("source", [False, True])
def test_propose_is_one_graph_of_fixed_shapes(source):
    """torch.compile(fullgraph=True) fails on .item(), .tolist(), data-dependent shapes and
    Python branches on tensor values."""
    dev = DeviceHistory(**{**SMALL, "global_source": source})
    dev.insert([[1, 2, 3]], [[10, 11, 12, 13, 14, 15]])
    args = batch([[1, 2, 3, 10, 11], [1, 2, 3, 10], [7, 7]], [3, 3, 2])
    want = dev.propose(*args, 4)
    torch._dynamo.reset()
    fn = torch.compile(dev.propose, fullgraph=True, dynamic=False, backend="eager")
    got = fn(*args, 4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("source", [False, True])
def test_propose_on_the_meta_device_keeps_to_it(source):
    """On `meta` tensors (no values: .item() or .tolist() raise) any CPU tensor mixed into an op
    raises; the drafts come out on the store's device. (Fake cuda tensors of this CPU build of
    torch refuse indexing, so meta stands in for the engine's device.)"""
    dev = DeviceHistory(device="meta", **{**SMALL, "global_source": source})
    B, L = 4, 32
    ids = torch.zeros(B, L, dtype=torch.int32, device="meta")
    n = torch.full((B,), 10, dtype=torch.int64, device="meta")
    pl = torch.full((B,), 3, dtype=torch.int64, device="meta")
    drafts, valid = dev.propose(ids, n, prompt_hash(ids, pl), pl, 5)
    assert drafts.device.type == "meta" and drafts.shape == (B, 5) and drafts.dtype == torch.int32
    assert valid.shape == (B,) and valid.dtype == torch.int32
    with pytest.raises(RuntimeError, match="device"):
        dev.propose(ids, torch.full((B,), 10), prompt_hash(ids, pl), pl, 5)
