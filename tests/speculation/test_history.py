"""Rollout-history drafting: the store on hand-made rows (what each source drafts, where drafts
stop, the bounds, the counters), token for token against a plain reading of the draft rule on
random traces, then through real vLLM (token-for-token under greedy; the two-sample tests are in
test_lossless.py)."""
import random

import numpy as np
import pytest

from helpers.states import same_state
from rlspec.config import HistoryConfig
from rlspec.speculation.history.host.arena import HistoryArena
from rlspec.speculation.history.host.index import SOURCES, HistoryIndex
from rlspec.speculation.history.stats import per_pos
from rlspec.speculation.history.state import STATE_GLOBALS
from rlspec.speculation.history.host.proposer import HistoryProposer, configure
from rlspec.speculation.history.device.counts import MIN_PROB, WIDTH
from rlspec.speculation.history.device.memory import count_buckets
from rlspec.config.speculation import history_config
from tests.speculation.device_history_reference import CountReference

PROMPT = [1, 2, 3]
H, SIB, PR, GL = range(4)


def index(**kw) -> HistoryIndex:
    """A store keyed on 2 tokens, matching up to 8 (short hand-made rows)."""
    return HistoryIndex(history_config(**{"prompt_keys": [2], "max_match": 8, "max_candidates": 16, **kw}), k_max=5)


def ask(h, rows, sampled, k, keys=None, prompt_len=3):
    """One engine step over rows of prompt_len prompt tokens each (keys: request ids, default the
    row's index)."""
    return h.propose([np.asarray(r, np.int32) for r in rows], sampled, k, keys=keys,
                     prompt_lens=[prompt_len] * len(rows))


def test_earlier_responses_of_the_same_prompt_draft_their_continuation():
    h = index()
    h.record([PROMPT], [[10, 11, 12, 13, 14, 15, 16]], wait=True)
    h.begin_call()
    # the request wrote 10 11 so far: the history continues 12 13 14 (k=3)
    assert ask(h, [PROMPT + [10, 11]], [[11]], 3) == [[12, 13, 14]]
    assert h.stats.drafted[H] == 3 and h.stats.matched == 1
    # another prompt's history is not read as its own; with the global source off, nothing at all
    h = index(global_source=False)
    h.record([PROMPT], [[10, 11, 12, 13, 14, 15, 16]], wait=True)
    h.begin_call()
    assert ask(h, [[7, 8, 9, 10, 11]], [[11]], 3) == [[]]


@pytest.mark.parametrize("global_index", ["counts", "chains"])
def test_a_prompt_seen_for_the_first_time_drafts_from_any_prompts_history(global_index):
    h = index(global_index=global_index, global_keys=[2])
    h.record([PROMPT], [[10, 11, 12, 13, 14, 15, 16]], wait=True)
    h.begin_call()
    assert ask(h, [[7, 8, 9, 10, 11]], [[11]], 3) == [[12, 13, 14]]
    assert h.stats.drafted == [0, 0, 0, 3]


def test_other_prompts_running_answers_draft_for_a_prompt_with_nothing_of_its_own():
    # global_index=chains: the count table counts finished answers only
    h = index(global_index="chains", global_keys=[4])
    h.begin_call()
    # prompt 7 8 9's request has written 20..26 so far; prompt 1 2 3's request ends as it does
    ask(h, [[7, 8, 9, 20, 21, 22, 23, 24, 25, 26]], [[26]], 3, keys=["a"])
    assert ask(h, [PROMPT + [21, 22, 23, 24]], [[24]], 3, keys=["b"]) == [[25, 26]]
    assert h.stats.drafted[GL] == 2
    h = index(global_source=False)
    h.begin_call()
    ask(h, [[7, 8, 9, 20, 21, 22, 23, 24, 25, 26]], [[26]], 3, keys=["a"])
    assert ask(h, [PROMPT + [21, 22, 23, 24]], [[24]], 3, keys=["b"]) == [[]]


def test_global_key_lengths_longest_first_find_older_long_matches_then_one_token_matches():
    # one old answer continues 1..8 with 30 31; eight newer ones continue 5 6 7 8 with 9 (another
    # prompt's, so the global source decides); a walk of the 4-token chain reads only the newest
    old = [1, 2, 3, 4, 5, 6, 7, 8, 30, 31]
    newer = [[50 + i, 5, 6, 7, 8, 9, 9] for i in range(8)]
    context = [[7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8]]
    drafts = {}
    for keys in ([4], [8, 4]):
        h = index(max_candidates=2, global_index="chains", global_keys=keys)
        h.record([[60, 61, 62]] * 9, [old] + newer, wait=True)
        h.begin_call()
        drafts[tuple(keys)] = ask(h, context, [[8]], 2)
    assert drafts == {(4,): [[9, 9]], (8, 4): [[30, 31]]}
    # a token seen once, after nothing longer matches: only a key of one token drafts from it
    for keys, want in (([8, 4], [[]]), ([8, 4, 1], [[41, 42]])):
        h = index(global_index="chains", global_keys=keys)
        h.record([[60, 61, 62]], [[40, 41, 42]], wait=True)
        h.begin_call()
        assert ask(h, [[7, 8, 9, 33, 40]], [[40]], 2) == want


def test_the_longest_matching_suffix_decides_and_a_split_history_drafts_nothing():
    h = index(min_prob=0.6)
    # after "5 6" the history went on 7 twice and 8 once; after "4 5 6" only ever 8
    h.record([PROMPT] * 3, [[5, 6, 7, 0], [5, 6, 7, 0], [4, 5, 6, 8, 0]], wait=True)
    h.begin_call()
    assert ask(h, [PROMPT + [4, 5, 6]], [[6]], 2, keys=["a"]) == [[8, 0]]
    assert ask(h, [PROMPT + [9, 5, 6]], [[6]], 1, keys=["b"]) == [[7]]   # 2 of 3 >= 0.6
    h = index(min_prob=0.6)
    h.record([PROMPT] * 2, [[5, 6, 7], [5, 6, 8]], wait=True)
    h.begin_call()
    assert ask(h, [PROMPT + [9, 5, 6]], [[6]], 3) == [[]]   # 1 of 2 < 0.6


def test_a_longer_global_match_whose_vote_stops_falls_back_to_the_prompts_own():
    # the prompt's history continues 5 6 with 7 7; two other prompts' answers continue 4 5 6 with 8 or 9
    for min_prob, want in ((0.5, [[9]]), (0.6, [[7, 7]])):
        h = index(min_prob=min_prob, global_index="chains", global_keys=[3])
        h.record([PROMPT, [60, 61], [62, 63]], [[5, 6, 7, 7], [4, 5, 6, 8], [4, 5, 6, 9]], wait=True)
        h.begin_call()
        # 1 of 2 global votes: drafts at min_prob 0.5 (the newest's token), stops at once at 0.6
        assert ask(h, [PROMPT + [4, 5, 6]], [[6]], 2) == want


def test_the_count_table_drafts_the_commonest_continuation_where_its_match_is_longer():
    # the prompt's history matches "5 6" (2 tokens); other prompts' answers continue "4 5 6" with 8
    # twice, 9 once: the count table's 3-token match drafts 8 (2 of 3), then what followed "4 5 6 8"
    h = index()
    h.record([PROMPT, [60, 61], [62, 63], [64]], [[5, 6, 7, 7], [4, 5, 6, 8, 1], [4, 5, 6, 8, 1], [4, 5, 6, 9]],
             wait=True)
    h.begin_call()
    assert ask(h, [PROMPT + [4, 5, 6]], [[6]], 3) == [[8, 1]]
    assert h.stats.drafted == [0, 0, 0, 2]
    # where the answers counted end right after the match (END, not a token), the prompt's own draft
    h = index()
    h.record([PROMPT, [60, 61]], [[5, 6, 7, 7], [4, 5, 6]], wait=True)
    h.begin_call()
    assert ask(h, [PROMPT + [4, 5, 6]], [[6]], 2) == [[7, 7]]
    assert h.stats.drafted == [2, 0, 0, 0]


def test_a_draft_stops_where_the_responses_ended():
    h = index()
    h.record([PROMPT], [[20, 21, 22]], wait=True)
    h.begin_call()
    assert ask(h, [PROMPT + [20, 21]], [[21]], 5) == [[22]]


def test_siblings_draft_from_what_the_group_wrote_so_far():
    h = index()
    h.begin_call()
    ahead = [30, 31, 32, 33, 34]
    for t in range(1, len(ahead) + 1):  # one request runs ahead, a token per engine step
        assert ask(h, [PROMPT + ahead[:t]], [[ahead[t - 1]]], 3, keys=["a"]) == [[]]
    # its sibling starts: it drafts what the first one wrote after the same context
    got = ask(h, [PROMPT + ahead, PROMPT + [30, 31]], [[34], [31]], 3, keys=["a", "b"])
    assert got == [[], [32, 33, 34]]
    assert h.stats.drafted == [0, 3, 0, 0]


def test_the_prompt_drafts_as_prompt_lookup():
    h = index()
    h.begin_call()
    assert ask(h, [[40, 41, 42, 43, 44, 9, 40, 41]], [[41]], 2, prompt_len=5) == [[42, 43]]
    assert h.stats.drafted[PR] == 2


def test_a_call_of_more_requests_than_the_live_arenas_first_slots():
    """300 requests of one prompt (the live arena starts with 256 slots): the slots grow, and a row
    behind the others drafts what its siblings wrote."""
    h = index()
    h.begin_call()
    keys = list(range(300))
    ask(h, [[1, 2, 3, 9]] * 300, [[9]] * 300, 4, keys=keys)
    rows = [[1, 2, 3, 9, 8, 7, 6, 5]] * 299 + [[1, 2, 3, 9, 8]]
    got = ask(h, rows, [[0] * 4] * 299 + [[8]], 4, keys=keys)
    assert got[-1] == [7, 6, 5] and h.live.last.shape[0] >= 300


def test_rows_are_told_apart_by_request_not_by_position():
    """vLLM moves requests between rows as others finish: a row's history follows its request id.
    Row 0 held request a, then holds b (of another prompt) at a length that a growth of a by one
    token would give; b drafts from b's prompt, and a's live answer keeps a's tokens."""
    h = index(global_source=False)
    h.record([[5, 5, 5]], [[60, 61, 62, 63]], wait=True)
    h.begin_call()
    ask(h, [PROMPT + [70, 71]], [[71]], 3, keys=["a"])
    assert ask(h, [[5, 5, 5, 60, 61, 62]], [[62]], 3, keys=["b"]) == [[63]]
    # a comes back in row 1: its live answer continued from 70 71, and its prompt has no history
    assert ask(h, [[5, 5, 5, 60, 61, 62, 63], PROMPT + [70, 71, 72]], [[63], [72]], 3, keys=["b", "a"]) == [[], []]


def test_rows_without_a_new_token_or_k_zero_get_no_draft():
    h = index()
    h.record([PROMPT], [[10, 11, 12]], wait=True)
    h.begin_call()
    assert ask(h, [PROMPT + [10, 11]], [[]], 3) == [[]]   # a prefill chunk
    assert ask(h, [PROMPT + [10, 11]], [[11]], 0, keys=["b"]) == [[]]


def test_a_call_begun_without_drafting_drafts_nothing():
    """Validation calls: history, siblings and prompt all match here, yet nothing is drafted or
    counted; the next drafting call drafts again."""
    h = index()
    h.record([PROMPT], [[10, 11, 12, 13]], wait=True)
    h.begin_call(draft=False)
    assert ask(h, [PROMPT + [10, 11], PROMPT + [1, 2]], [[11], [2]], 3) == [[], []]
    assert h.stats.rows == 0 and h.stats.matched == 0
    h.begin_call()
    assert ask(h, [PROMPT + [10, 11]], [[11]], 3) == [[12, 13]]


def test_draft_lengths_are_counted_per_position():
    """What 'auto' plans a per-request drafter from: of the rows asked for a draft, how many
    drafted past each position (here the first row follows the history to its end, the second
    the majority 12 and then the history's one way on, the third matches nothing)."""
    h = index(global_source=False)
    h.record([PROMPT], [[10, 11, 12, 13, 14]], wait=True)
    h.record([PROMPT], [[10, 11, 50]], wait=True)
    h.begin_call()
    drafts = ask(h, [PROMPT + [10, 11, 12], PROMPT + [10, 11], PROMPT + [77, 78]], [[12], [11], [78]], 4)
    assert drafts == [[13, 14], [12, 13, 14], []]
    stats = h.stats.as_dict()
    assert stats["rows"] == 3
    assert per_pos(stats, "drafts_ge", 5) == [2, 2, 1, 0, 0]
    assert stats["drafts_ge_1"] == stats["matched"] == 2


def test_a_call_that_drafted_nothing_is_measured_in_shadow():
    """'auto' ran a call without drafting: its responses are replayed in lock step and each
    one's would-be k_max draft is checked against the tokens that followed, emulating
    verifications. The history drafts 11 12 13 14 after 10; the response goes on 11 12 99 (two
    accepted, the verification ends with 99), then 5 where nothing matches (a verification that
    drafts nothing); a whole draft accepted ends with the bonus token. Whole groups, evenly spread,
    about max_rows responses."""
    h = index()
    h.record([PROMPT], [[10, 11, 12, 13, 14]], wait=True)
    h.begin_call()
    h.shadow([PROMPT], [[10, 11, 12, 99, 5]], max_rows=8)
    st = h.stats.as_dict()
    assert st["shadow_rows"] == 3 and st["rows"] == 0 and st["shadow_responses"] == 1
    assert per_pos(st, "shadow_drafts_ge", 5) == [1, 1, 1, 1, 0]
    assert per_pos(st, "shadow_accepted_ge", 5) == [1, 1, 0, 0, 0]
    h = index()
    h.record([PROMPT], [[10, 11, 12]], wait=True)
    h.begin_call()
    h.shadow([PROMPT], [[10, 11, 12, 7]], max_rows=8)
    assert h.stats.shadow_rows == 2 and h.stats.shadow_accepted_pos == [1, 1, 0, 0, 0]
    # siblings in lock step: the second answer writes 4 5 two steps after the first, whose 6 8 it
    # drafts and accepts
    h = index()
    h.begin_call()
    h.shadow([PROMPT, PROMPT], [[4, 5, 6, 8, 1, 2], [9, 9, 4, 5, 6, 8]], max_rows=8)
    assert h.stats.shadow_accepted_pos[:2] == [1, 1]
    # four prompts of one answer each, max_rows 2: every other group
    h = index()
    ps = [[1, 2, i] for i in range(4)]
    h.begin_call()
    h.shadow(ps, [[9] * 5, [9] * 3, [9] * 5, [9] * 3], max_rows=2)
    assert h.stats.shadow_responses == 2 and sum(h.stats.shadow_accepted_pos) > 0


def test_timing_fills_every_draft_to_k():
    """'auto' times the engine verifying k drafts a row (the row's last token k times, no lookup:
    the drafter's own time is measured in calls, per batch bin and k); rows without a new token
    still draft nothing, and k=0 nothing."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4),
                          model_config=SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 100))
    prop = HistoryProposer(cfg)
    runner = SimpleNamespace(drafter=prop,
                             input_batch=SimpleNamespace(req_ids=["a", "b"], num_prompt_tokens=np.array([3, 4])))
    configure(SimpleNamespace(model_runner=runner, rank=0, parallel_config=SimpleNamespace(
        world_size=1, tensor_parallel_size=1, prefill_context_parallel_size=1)))
    prop.index.record([PROMPT], [[10, 11, 12]], wait=True)
    prop.index.begin_call()
    ids = np.zeros((2, 64), np.int32)
    ids[0, :5], ids[1, :5] = PROMPT + [10, 11], [7, 7, 7, 7, 8]
    args = ([[11], [8]], np.array([5, 5]), ids)
    assert prop.propose(*args) == [[12], []]
    assert [c[0] for c in prop.index.stats.as_dict()["propose_timing"]] == [1]   # batch 2: bin 1
    prop.full = True
    prop.index.begin_call()
    assert prop.propose(*args) == [[11, 11, 11, 11], [8, 8, 8, 8]]
    assert prop.index.stats.propose_timing == {}   # timing steps are not the drafter's
    assert prop.propose([[], [8]], np.array([5, 5]), ids) == [[], [8, 8, 8, 8]]
    prop.k_of_batch = [0, 0, 0]
    assert prop.propose(*args) == [[], []]


def test_accepted_tokens_are_attributed_to_the_source_that_drafted_them():
    h = index()
    h.record([PROMPT], [[10, 11, 12, 13, 14]], wait=True)
    h.begin_call()
    assert ask(h, [PROMPT + [10, 11]], [[11]], 3) == [[12, 13, 14]]
    # the target accepted 12 13, rejected 14 and sampled 99 in its place
    ask(h, [PROMPT + [10, 11, 12, 13, 99]], [[12, 13, 99]], 3)
    assert h.stats.accepted == [2, 0, 0, 0]


def test_bounds_per_prompt_then_the_fullest_prompts_then_a_fixed_resident_set():
    h = index(max_rollouts_per_prompt=2, min_rollouts_per_prompt=1, max_tokens=10)
    h.record([PROMPT] * 3, [[1, 1], [2, 2], [3, 3]], wait=True)
    kept = lambda p: [h.arena.tok[q.start + q.stored - 1 - q.tokens: q.start + q.stored - 1].tolist()  # noqa: E731
                      for q in h.prompts[salt(p)].seqs]
    assert kept(PROMPT) == [[2, 2], [3, 3]] and h.tokens() == 4
    other, third = [5, 5], [6, 6]
    h.record([other], [[7, 7, 7]], wait=True)
    h.record([third], [[8, 8, 8, 8]], wait=True)   # 4 + 3 + 4 = 11 > 10: PROMPT, holding the most, drops its oldest
    assert kept(PROMPT) == [[3, 3]] and h.tokens() == 9
    # one response each: whole prompts go, the highest identity hash first, and it is not admitted again
    before = set(h.prompts)
    h.record([[4, 4]], [[9, 9, 9]], wait=True)
    assert h.tokens() <= 10 and len(h.prompts) == 3
    gone = (before | {salt([4, 4])}) - set(h.prompts)
    assert len(gone) == 1 and all(r.rank < h.admit_below for r in h.prompts.values())
    assert max(before | {salt([4, 4])}) in gone


def salt(prompt) -> int:
    from rlspec.speculation.history.host.store import prompt_salt

    a = np.asarray(prompt, np.int32)
    return int(prompt_salt(a, len(a)))


def test_a_budget_under_the_store_keeps_a_fixed_resident_set_under_reshuffled_epochs():
    """Epochs over 40 prompts in a new order each, 4 answers of 5 tokens a visit, a budget of a
    quarter of them at the floor of 2 answers: from the second epoch on, the prompts that find
    history when they come back are a fixed set of about a quarter, every epoch the same (by
    recency alone, each epoch would evict the prompts it has yet to revisit)."""
    h = index(max_rollouts_per_prompt=8, min_rollouts_per_prompt=2, max_tokens=100)
    prompts = [[50 + i, 60 + i, 7] for i in range(40)]
    hits = []
    for epoch in range(4):
        found = set()
        for i in random.Random(epoch).sample(range(40), 40):
            h.flush()
            if salt(prompts[i]) in h.prompts:
                found.add(i)
            h.record([prompts[i]] * 4, [[epoch, i, 1, 2, 3]] * 4)
        assert h.tokens() <= 100
        hits.append(found)
    assert hits[0] == set() and 5 <= len(hits[1]) <= 10 and hits[1] == hits[2] == hits[3]




@pytest.mark.parametrize("global_index", ["counts", "chains"])
def test_state_round_trip_keeps_the_drafts(tmp_path, global_index):
    import torch

    h = index()
    h.record([PROMPT] * 2, [[10, 11, 12], [10, 11, 13, 15]], wait=True)
    h.record([[9]], [[]], wait=True)
    g = index()
    g.load_state_dict(h.state_dict())
    assert same_state(g.state_dict(), h.state_dict())
    for x in (h, g):
        x.begin_call()
    assert ask(g, [PROMPT + [10, 11, 13]], [[13]], 2) == ask(h, [PROMPT + [10, 11, 13]], [[13]], 2) == [[15]]
    # prompts recorded interleaved over a small vocabulary, the global source on: every draft is the
    # same after a round trip through torch.save and a weights-only load (the global chains run
    # newest first through every prompt's answers: the state keeps the arena's order)
    rng = random.Random(1)
    prompts = [[rng.randrange(6) for _ in range(4)] for _ in range(12)]
    h = index(global_index=global_index, global_keys=[4, 1])
    for _ in range(6):
        ps = [rng.choice(prompts) for _ in range(8)]
        h.record(ps, [[rng.randrange(6) for _ in range(rng.randrange(5, 30))] for _ in ps], wait=True)
    state = h.state_dict()
    assert all(isinstance(state[key], np.ndarray) for key in ("salt", "tokens", "stored", "arena"))
    torch.save(state, tmp_path / "history.pt")
    with torch.serialization.safe_globals(STATE_GLOBALS):
        g = index(global_index=global_index, global_keys=[4, 1])
        g.load_state_dict(torch.load(tmp_path / "history.pt", weights_only=True))
    asked = [(p, p + [rng.randrange(6) for _ in range(rng.randrange(1, 9))]) for p in prompts * 30]
    asked += [([7, 7, 7, 7], [7, 7, 7, 7] + [rng.randrange(6) for _ in range(8)]) for _ in range(200)]
    drafts = [[x.draft_context(ctx, salt(p), 5) for p, ctx in asked] for x in (h, g)]
    assert drafts[0] == drafts[1] and sum(len(d) for d, _ in drafts[0]) > 500
    # a store saved by an earlier rlspec: version 2 (sequences grouped by prompt) loads as it is...
    old = index()
    old.load_state_dict({"version": 2, "admit_below": str(1 << 64), "prompts": [
        [str(salt(PROMPT)), [[3, PROMPT + [10, 11, 12, -1]], [4, PROMPT + [10, 11, 13, 15, -1]]]]]})
    old.begin_call()
    assert old.tokens() == 7 and ask(old, [PROMPT + [10, 11, 13]], [[13]], 2) == [[15]]
    # ... and one written before the arena (prompt, responses) is recorded afresh
    old = index()
    old.load_state_dict({"prompts": [[PROMPT, [[10, 11, 12], [10, 11, 13, 15]]]]})
    old.begin_call()
    assert ask(old, [PROMPT + [10, 11, 13]], [[13]], 2) == [[15]]


def test_an_arena_that_grew_drafts_as_one_built_at_once():
    """Over 2^16 stored tokens in small records: the arena grows (arrays extended with links kept,
    relinked at every other growth); every draft equals that of a store given the same records in
    an arena with room for all of them from the start (its heads, and so its chains, of another
    size: the walks are given room to read every candidate)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(50) for _ in range(4)] for _ in range(40)]
    h, g = index(max_candidates=1024), index(max_candidates=1024)   # walks read every match of a key
    g.arena = HistoryArena(len(g.pkeys), len(g.gkeys), 1 << 20)  # room for everything from the start: never grown
    for _ in range(30):
        ps = [rng.choice(prompts) for _ in range(16)]
        rs = [[rng.randrange(50) for _ in range(rng.randrange(100, 250))] for _ in ps]
        for x in (h, g):
            x.record(ps, rs, wait=True)
    assert h.arena.capacity > 1 << 16 and h.tokens() > 1 << 16 and g.arena.capacity == 1 << 20
    for x in (h, g):
        x.begin_call()
        x.walk = x.global_walk = 1 << 30  # chains of other lengths: walks read to the end
    rows = [p + [rng.randrange(50) for _ in range(6)] for p in prompts]
    keys = [f"r{i}" for i in range(len(rows))]
    got = ask(h, rows, [[0]] * len(rows), 4, keys=keys, prompt_len=4)
    assert got == ask(g, rows, [[0]] * len(rows), 4, keys=keys, prompt_len=4) and sum(map(len, got)) > 0


LIVE, SELF = 1 << 42, 1 << 41


class Reference:
    """The draft rule of rlspec/speculation/history/host/store.py read plainly: rows and sequences in lists, every
    position scanned, no hashing; the count table (global_index=counts) the device drafter's plain
    reading."""

    def __init__(self, cfg: HistoryConfig, tail: int):
        self.cfg, self.tail = cfg, tail
        self.counts = None
        if cfg.global_source and cfg.host.global_index == "counts":
            self.counts = CountReference(cfg.host.count_tokens, range(1, cfg.max_match + 1), WIDTH,
                                         count_buckets(cfg.host.count_tokens, WIDTH), MIN_PROB, 1 << 31)
        self.stored = []   # (prompt, [tail | response | END]) oldest first
        self.clock = 0

    def record(self, prompts, responses):
        new = [(tuple(p), list(p[-self.tail:]) + list(r) + [-1]) for p, r in zip(prompts, responses) if r]
        self.stored += new
        if self.counts is not None:
            self.counts.insert([(body, min(len(p), self.tail)) for p, body in new])

    def begin_call(self):
        self.requests = {}   # key -> [prompt, row, stamp per answer token, plen, batch row]

    def step(self, rows, news, keys, plens, k):
        for i, (row, new, key, plen) in enumerate(zip(rows, news, keys, plens)):   # every row's tokens in
            req = self.requests.get(key)
            if req is None and new > 0:
                req = self.requests[key] = [tuple(row[:plen]), list(row[:plen]), [], plen, i]
                new = len(row) - plen
            if req is not None:
                req[4] = i
                for t in row[len(row) - new:]:
                    req[1].append(t)
                    req[2].append(self.clock)
                    self.clock += 1
        return [self.draft(list(row), key, len(rows), k) if new > 0 and k > 0 else []
                for row, new, key in zip(rows, news, keys)]

    def _length(self, seq, j, ctx):
        m, n, length = self.cfg.max_match, len(ctx), 0
        while length < m and j - length - 1 >= 0 and length < n and seq[j - length - 1] == ctx[n - length - 1]:
            length += 1
        return length

    def draft(self, ctx, key, rows, k):
        c, me = self.cfg, self.requests[key]
        prompt, n = me[0], len(ctx)
        cands = []   # (length, source, sequence, position), highest rank first
        for m in c.prompt_keys:
            if n < m:
                continue
            live = []
            for rk, req in self.requests.items():
                if req[0] != prompt:
                    continue
                lo = m if rk == key else max(req[3], m)   # the row anywhere, a sibling's answer
                hits = [p for p in range(lo, len(req[1])) if req[1][p - m: p] == ctx[-m:]]
                if hits:
                    p = hits[-1]
                    live.append((LIVE + (rk == key) * SELF + p * rows + req[4], req[1], p, PR if rk == key else SIB))
            live = [(self._length(seq, p, ctx), src, seq, p) for _, seq, p, src in sorted(live, key=lambda x: -x[0])]
            hist = [(seq, p) for q, seq in reversed(self.stored) if q == prompt for p in range(len(seq) - 1, m - 1, -1)
                    if seq[p - m: p] == ctx[-m:]][: c.max_candidates]
            cands = live + [(self._length(seq, p, ctx), H, seq, p) for seq, p in hist]
            if cands:
                break
        own = max((x[0] for x in cands), default=0)
        cands = [x for x in cands if x[0] == own][:64]
        mine = list(cands)
        if self.counts is not None:   # the count table's draft where its match is longer and it drafts
            far, m = self.counts.walk(ctx, k) if own < c.max_match else ([], 0)
            return far if far and m > own else self._extend(mine, k)
        for gm in c.host.global_keys if c.global_source else []:
            if own >= c.max_match or n < gm:
                continue
            # matches of gm tokens or more where longer than all of the prompt's own: other prompts'
            # running answers (answer tokens only), newest first, then any prompt's history; the
            # first key length that yields any decides
            running = sorted(((req[2][p - req[3]], req[1], p) for req in self.requests.values() if req[0] != prompt
                              for p in range(max(gm, req[3]), len(req[1])) if req[1][p - gm: p] == ctx[-gm:]),
                             key=lambda x: -x[0])
            glob = [(seq, p) for _, seq, p in running]
            glob += [(seq, p) for _, seq in reversed(self.stored) for p in range(len(seq) - 1, gm - 1, -1)
                     if seq[p - gm: p] == ctx[-gm:]]
            longer = [(self._length(seq, p, ctx), GL, seq, p) for seq, p in glob]
            found = [x for x in longer if x[0] >= gm and x[0] > own][: c.max_candidates]
            if found:
                cands += found
                break
        out = self._extend(cands, k)
        # global matches whose vote stops at once: the prompt's own draft instead
        return out if out or len(cands) == len(mine) else self._extend(mine, k)

    def _extend(self, cands, k):
        if not cands:
            return []
        longest = max(x[0] for x in cands)
        cands = [(src, seq, j) for length, src, seq, j in cands if length == longest]
        out = []
        while len(out) < k and cands:
            nxt = [seq[j] for _, seq, j in cands]
            x = max(nxt, key=lambda t: (nxt.count(t), -nxt.index(t)))
            if x < 0 or nxt.count(x) / len(cands) < self.cfg.min_prob:
                break
            out.append(x)
            cands = [(src, seq, j + 1) for src, seq, j in cands if seq[j] == x and j + 1 < len(seq)]
        return out


@pytest.mark.parametrize("seed", range(10))
def test_the_store_drafts_token_for_token_what_the_plain_rule_drafts(seed):
    """Random traces over a small vocabulary (many matches): calls over a few prompts, groups of
    requests growing by 0 to k+1 tokens a step in a shuffled row order (an answer that finished
    stays readable to its siblings), then recorded; every draft of every step equals the plain
    reference's. The store's walks are given room to read every candidate, and chain heads enough
    that no key shares one with another's (the only places the two may part)."""
    rng = random.Random(seed)
    max_match = rng.choice([4, 8])
    cfg = history_config(prompt_keys=[m for m in rng.choice([[8, 3, 1], [3], [2, 1], [4, 1]]) if m <= max_match],
                        max_match=max_match, min_prob=rng.choice([0.3, 0.5]),
                        max_candidates=rng.choice([2, 4, 16]), global_source=rng.random() < 0.8,
                        global_index=rng.choice(["counts", "chains"]), count_tokens=rng.choice([150, 1 << 12]),
                        global_keys=[g for g in rng.choice([[4], [3, 1], [8, 4, 1], [6, 2]]) if g <= max_match])
    h = HistoryIndex(cfg, k_max=4)
    h.walk = h.global_walk = 1 << 30
    h.arena = HistoryArena(len(h.pkeys), len(h.gkeys), 1 << 16, heads=1 << 20)
    ref = Reference(cfg, h.tail)
    prompts = [[rng.randrange(6) for _ in range(rng.randrange(2, 9))] for _ in range(4)]
    checked = global_drafted = 0
    for call in range(4):
        h.begin_call()
        ref.begin_call()
        group = [(f"{call}-{i}", rng.choice(prompts)) for i in range(6)]
        answers = {key: [rng.randrange(6) for _ in range(rng.randrange(4, 30))] for key, _ in group}
        done = {key: 0 for key, _ in group}
        while any(done[key] < len(answers[key]) for key, _ in group):
            running = [(key, p) for key, p in group if done[key] < len(answers[key])]
            rng.shuffle(running)
            rows, news = [], []
            for key, p in running:
                new = min(rng.randrange(0, 4), len(answers[key]) - done[key]) if done[key] else 1
                done[key] += new
                rows.append(p + answers[key][: done[key]])
                news.append(new)
            keys, plens = [key for key, _ in running], [len(p) for _, p in running]
            want = ref.step(rows, news, keys, plens, 4)
            got = h.propose([np.asarray(r, np.int32) for r in rows], [[0] * n for n in news], 4, keys=keys,
                            prompt_lens=plens)
            assert got == want, (call, rows, got, want)
            checked += sum(map(len, want))
        global_drafted += h.stats.drafted[GL]
        finished = [(p, answers[key]) for key, p in group]
        h.record([p for p, _ in finished], [a for _, a in finished])
        ref.record([p for p, _ in finished], [a for _, a in finished])
    assert checked > 50 and (global_drafted > 0 or not cfg.global_source), (checked, global_drafted)


def test_settings_are_validated_by_key():
    from conftest import compose
    from rlspec.config import ConfigError
    from rlspec.checks import validate

    validate(compose(["speculation=history"]))
    with pytest.raises(ConfigError, match=r"^speculation\.history\.prompt_keys: must be distinct key lengths"):
        validate(compose(["speculation=history", "speculation.history.prompt_keys=[1,3]"]))
    with pytest.raises(ConfigError, match=r"^speculation\.history\.prompt_keys: must be distinct key lengths"):
        validate(compose(["speculation=history", "speculation.history.prompt_keys=[20]"]))
    with pytest.raises(ConfigError, match=r"^speculation\.history\.min_prob"):
        validate(compose(["speculation=history", "speculation.history.min_prob=0"]))
    with pytest.raises(ConfigError, match=r"^speculation\.history\.host\.global_keys: must be distinct key lengths"):
        validate(compose(["speculation=history", "speculation.history.host.global_keys=[1,4]"]))
    # arena positions are int32 (rlspec/speculation/history/host/arena.py)
    validate(compose(["speculation=history", "speculation.history.host.max_tokens=500000000"]))
    with pytest.raises(ConfigError, match=r"^speculation\.history\.host\.max_tokens: must be in \[1, 536870912\]"):
        validate(compose(["speculation=history", "speculation.history.host.max_tokens=3000000000"]))
    # the device drafter's settings: a host store's key it would ignore is refused, naming both keys
    validate(compose(["speculation=history", "speculation.history.drafter=device"]))
    with pytest.raises(ConfigError,
                       match=r"^speculation\.history\.host\.global_index: speculation\.history\.drafter=device"):
        validate(compose(["speculation=history", "speculation.history.drafter=device",
                          "speculation.history.host.global_index=chains"]))
    key = r"^speculation\.history\.host\.min_rollouts_per_prompt"
    with pytest.raises(ConfigError, match=key + r": speculation\.history\.drafter=device"):
        validate(compose(["speculation=history", "speculation.history.drafter=device",
                          "speculation.history.host.min_rollouts_per_prompt=4"]))


# -- through real vLLM: the drafter hosted as vLLM's custom proposer, in a Generator actor ---------
def _gen(actor, prompts, n, temperature, max_tokens=48):
    import ray

    from conftest import sampling

    return ray.get(actor.generate.remote(prompts, sampling(n, temperature, max_tokens)), timeout=600)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from conftest import heldout_prompts

    return heldout_prompts(tokenizer, 12)


@pytest.fixture(scope="module")
def base(ray_session, prompts):
    """Greedy responses without speculation."""
    import ray

    from conftest import start_generator

    plain = start_generator([])
    ro = _gen(plain, prompts, 1, 0.0)
    ray.kill(plain)
    return ro


def test_greedy_history_drafting_is_exact_and_history_pays_on_the_second_epoch(base, prompts):
    """Greedy: every call equals no speculation token for token; the first call has only prompt
    lookup and the live batch, the second drafts from the first's responses and accepts more; a
    new engine loaded with the first's store drafts as the first engine did on its second call."""
    import ray

    from conftest import start_generator

    hist = start_generator(["speculation=history"])
    first = _gen(hist, prompts, 1, 0.0)
    second = _gen(hist, prompts, 1, 0.0)
    assert first.response_ids == base.response_ids and second.response_ids == base.response_ids
    assert first.history["drafted_history"] == 0 and second.history["prompts"] == len(prompts)
    assert second.history["accepted_history"] > 0
    print(f"acceptance length: first call {first.spec.acceptance_length:.2f}, second "
          f"{second.spec.acceptance_length:.2f}; counters {first.history} / {second.history}")
    assert second.spec.acceptance_length > first.spec.acceptance_length + 0.5, (first.spec, second.spec)
    # vLLM's own counters agree with the drafter's: everything drafted was verified, save the
    # drafts made at a request's last step (it finished there; at most k a request)
    drafted = sum(second.history[f"drafted_{s}"] for s in SOURCES)
    assert drafted - 5 * len(prompts) <= second.spec.draft_tokens <= drafted, drafted
    assert second.spec.accepted_tokens >= sum(second.history[f"accepted_{s}"] for s in SOURCES)
    state = ray.get(hist.history_state.remote(), timeout=60)
    ray.kill(hist)
    resumed = start_generator(["speculation=history"])
    ray.get(resumed.load_history_state.remote(state), timeout=60)
    again = _gen(resumed, prompts, 1, 0.0)
    assert again.response_ids == base.response_ids
    assert again.spec.accepted_tokens == second.spec.accepted_tokens
    # sampled groups: siblings draft for each other
    group = _gen(resumed, prompts[:4], 8, 1.0)
    assert group.history["drafted_siblings"] > 0 and group.history["accepted_siblings"] > 0
    ray.kill(resumed)


def test_history_with_auto_k_is_exact_and_drafts_the_k_it_is_given(base, prompts):
    """Under 'auto' the scheduler's k per batch size reaches the history drafter (vLLM does not
    pass it to custom proposers): at k=1 every draft is one token, with speculation off none."""
    import ray

    from conftest import sampling, start_generator

    from helpers.auto_k import auto_calls_keep_to_their_schedule

    auto = start_generator(["speculation=history", "speculation.num_speculative_tokens=auto",
                            "speculation.max_speculative_tokens=3", "speculation.auto_buckets=[1,4]"])
    # the planner measured the fill, and some position drafted for fewer rows than the one before
    assert min(auto_calls_keep_to_their_schedule(auto, lambda a: _gen(a, prompts, 1, 0.0), base.response_ids)) < 1

    def generate_at(gen, k, prompts, s):  # the engine alone, at a k set as 'auto' sets it
        from rlspec.speculation.adaptive import OFF
        from rlspec.speculation.history.host import proposer as history_proposer
        gen.adaptive.set_k(OFF if k == OFF else (lambda b: k))
        gen.engine.llm.collective_rpc(history_proposer.begin_call, args=(True,))
        return gen.engine.generate(prompts, s, 0)

    one = ray.get(auto.__ray_call__.remote(generate_at, 1, prompts, sampling(1, 0.0, 48)), timeout=600)
    assert one.response_ids == base.response_ids
    assert one.spec.drafts > 0 and one.spec.draft_tokens == one.spec.drafts
    off = ray.get(auto.__ray_call__.remote(generate_at, -1, prompts, sampling(1, 0.0, 48)), timeout=600)
    assert off.response_ids == base.response_ids and off.spec.draft_tokens == 0
    # switched off, it measured in shadow: the same greedy answers again, so shadow drafts are accepted
    from rlspec.speculation.history.host import proposer as history_proposer
    st = ray.get(auto.__ray_call__.remote(
        lambda g: g.engine.llm.collective_rpc(history_proposer.finish_call,
                                              args=(off.prompt_ids, off.response_ids))[0]),
        timeout=60)
    assert st["rows"] == 0 and st["shadow_rows"] > 0 and st["shadow_accepted_ge_1"] > 0, st
    ray.kill(auto)


def test_a_shadow_sample_weighs_as_the_whole_call():
    """auto switched history off on first-seen prompts (thousands of rows measured, few accepted);
    the prompts come back and the call, run without drafting, is measured in shadow on 32 of its
    480 responses: counted as the whole call, one such call turns drafting back on."""
    from rlspec.messages import RolloutBatch, SpecStats
    from rlspec.speculation.adaptive import OFF, DraftLengthPlanner
    from rlspec.speculation.calibration import AdaptiveK

    secs = {(b, k): 0.1 + 0.001 * b * (1 + k) for b in (1, 64) for k in range(4)}
    secs.update({(b, OFF): secs[(b, 0)] for b in (1, 64)})
    ak = AdaptiveK.__new__(AdaptiveK)
    ak.planner, ak.last_lengths = DraftLengthPlanner(k_max=3, max_batch=64, step_seconds=secs), None
    ak.planner.observe(20000, [1000, 400, 100], 3, [6000, 3000, 1000])
    ak.plan = ak.planner.plan([60] * 480)
    assert ak.plan.off
    stats = {"rows": 0, "shadow_responses": 32, "shadow_rows": 600,
             **{f"shadow_accepted_ge_{i + 1}": v for i, v in enumerate([540, 500, 450])},
             **{f"shadow_drafts_ge_{i + 1}": v for i, v in enumerate([580, 560, 520])}}
    ro = RolloutBatch([[1]] * 480, [[2] * 60] * 480, [[0.0] * 60] * 480, [False] * 480, 0, 1.0,
                      SpecStats(accepted_per_pos=[0, 0, 0]), history=stats)
    ak.after_call(ro, [])
    assert ak.planner.accept[0] == pytest.approx((0.9 * 1000 + 15 * 540) / (0.9 * 20000 + 15 * 600))
    assert not ak.planner.plan([60] * 480).off
