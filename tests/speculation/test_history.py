"""Rollout-history drafting: the index on hand-made rows (what each source drafts, where drafts
stop, the bounds, the counters), then through real vLLM (token-for-token under greedy; the
two-sample tests are in test_lossless.py)."""
import random

import numpy as np
import pytest

from rlspec.config import HistoryConfig
from rlspec.speculation.history import SOURCES, HistoryIndex, HistoryProposer, PromptHistory, per_pos

PROMPT = [1, 2, 3]


def rows(*seqs):
    return [np.asarray(s, np.int64) for s in seqs]


def index(**kw) -> HistoryIndex:
    return HistoryIndex(HistoryConfig(**kw), k_max=5)


def test_earlier_responses_of_the_same_prompt_draft_their_continuation():
    h = index()
    h.record([PROMPT], [[10, 11, 12, 13, 14, 15, 16]])
    h.begin_call([PROMPT])
    # the request wrote 10 11 so far: the history continues 12 13 14 (k=3)
    assert h.propose(rows(PROMPT + [10, 11]), [[11]], 3) == [[12, 13, 14]]
    assert h.stats.drafted[SOURCES.index("history")] == 3 and h.stats.matched == 1
    # another prompt's history is not read
    h.begin_call([[7, 8, 9]])
    assert h.propose(rows([7, 8, 9, 10, 11]), [[11]], 3) == [[]]


def test_the_longest_matching_suffix_decides_and_a_split_history_drafts_nothing():
    h = index(min_prob=0.6)
    # after "5 6" the history went on 7 twice and 8 once; after "4 5 6" only ever 8
    h.record([PROMPT] * 3, [[5, 6, 7, 0], [5, 6, 7, 0], [4, 5, 6, 8, 0]])
    h.begin_call([PROMPT])
    assert h.propose(rows(PROMPT + [4, 5, 6]), [[6]], 2) == [[8, 0]]
    assert h.propose(rows(PROMPT + [9, 5, 6]), [[6]], 1) == [[7]]   # 2 of 3 >= 0.6
    h = index(min_prob=0.6)
    h.record([PROMPT] * 2, [[5, 6, 7], [5, 6, 8]])
    h.begin_call([PROMPT])
    assert h.propose(rows(PROMPT + [9, 5, 6]), [[6]], 3) == [[]]   # 1 of 2 < 0.6


def test_a_draft_stops_where_the_responses_ended():
    h = index()
    h.record([PROMPT], [[20, 21, 22]])
    h.begin_call([PROMPT])
    assert h.propose(rows(PROMPT + [20, 21]), [[21]], 5) == [[22]]


def test_siblings_draft_from_what_the_group_wrote_so_far():
    h = index()
    h.begin_call([PROMPT])
    ahead = [30, 31, 32, 33, 34]
    for t in range(1, len(ahead) + 1):  # one request runs ahead, a token per engine step
        assert h.propose(rows(PROMPT + ahead[:t]), [[ahead[t - 1]]], 3) == [[]]
    # its sibling starts: it drafts what the first one wrote after the same context
    got = h.propose(rows(PROMPT + ahead, PROMPT + [30, 31]), [[34], [31]], 3)
    assert got == [[], [32, 33, 34]]
    assert h.stats.drafted == [0, 3, 0]


def test_the_prompt_drafts_as_prompt_lookup():
    h = index()
    h.begin_call([[40, 41, 42, 43, 44]])
    assert h.propose(rows([40, 41, 42, 43, 44, 9, 40, 41]), [[41]], 2) == [[42, 43]]
    assert h.stats.drafted[SOURCES.index("prompt")] == 2


def test_rows_without_a_new_token_or_k_zero_get_no_draft():
    h = index()
    h.record([PROMPT], [[10, 11, 12]])
    h.begin_call([PROMPT])
    assert h.propose(rows(PROMPT + [10, 11]), [[]], 3) == [[]]   # a prefill chunk
    assert h.propose(rows(PROMPT + [10, 11]), [[11]], 0) == [[]]


def test_a_call_begun_without_drafting_drafts_nothing():
    """Validation calls: history, siblings and prompt all match here, yet nothing is drafted or
    counted; the next drafting call drafts again."""
    h = index()
    h.record([PROMPT], [[10, 11, 12, 13]])
    h.begin_call([PROMPT], draft=False)
    assert h.propose(rows(PROMPT + [10, 11], PROMPT + [1, 2]), [[11], [2]], 3) == [[], []]
    assert h.stats.rows == 0 and h.stats.matched == 0
    h.begin_call([PROMPT])
    assert h.propose(rows(PROMPT + [10, 11]), [[11]], 3) == [[12, 13]]


def test_draft_lengths_are_counted_per_position():
    """What 'auto' plans a per-request drafter from: of the rows asked for a draft, how many
    drafted past each position (here the first row follows the history to its end, the second
    the group's majority 12 and then the history, the third matches nothing)."""
    h = index()
    h.record([PROMPT], [[10, 11, 12, 13, 14]])
    h.record([PROMPT], [[10, 11, 50]])
    h.begin_call([PROMPT])
    drafts = h.propose(rows(PROMPT + [10, 11, 12], PROMPT + [10, 11], PROMPT + [77, 78]), [[12], [11], [78]], 4)
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
    h.record([PROMPT], [[10, 11, 12, 13, 14]])
    h.begin_call([PROMPT])
    h.shadow([PROMPT], [[10, 11, 12, 99, 5]], max_rows=8)
    st = h.stats.as_dict()
    assert st["shadow_rows"] == 3 and st["rows"] == 0 and st["shadow_responses"] == 1
    assert per_pos(st, "shadow_drafts_ge", 5) == [1, 1, 1, 1, 0]
    assert per_pos(st, "shadow_accepted_ge", 5) == [1, 1, 0, 0, 0]
    h = index()
    h.record([PROMPT], [[10, 11, 12]])
    h.begin_call([PROMPT])
    h.shadow([PROMPT], [[10, 11, 12, 7]], max_rows=8)
    assert h.stats.shadow_rows == 2 and h.stats.shadow_accepted_pos == [1, 1, 0, 0, 0]
    # siblings in lock step: the second answer writes 4 5 two steps after the first, whose 6 8 it
    # drafts (the first's 8 joined the group's table earlier in the same step) and accepts
    h = index()
    h.begin_call([PROMPT])
    h.shadow([PROMPT, PROMPT], [[4, 5, 6, 8, 1, 2], [9, 9, 4, 5, 6, 8]], max_rows=8)
    assert h.stats.shadow_accepted_pos[:2] == [1, 1]
    # four prompts of one answer each, max_rows 2: every other group
    h = index()
    ps = [[1, 2, i] for i in range(4)]
    h.begin_call(ps)
    h.shadow(ps, [[9] * 5, [9] * 3, [9] * 5, [9] * 3], max_rows=2)
    # (groups 0 and 2, five tokens each: no draft after the first two 9s, then 9 9 9 9 9 drafted and
    # two accepted before the answer ends)
    assert h.stats.shadow_rows == 6 and h.stats.shadow_accepted_pos == [2, 2, 0, 0, 0]
    assert h.stats.shadow_responses == 2


def test_timing_fills_every_draft_to_k():
    """'auto' times steps with every row drafting k (the lookup's draft, then the row's last
    token); rows without a new token still draft nothing, and k=0 nothing."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4),
                          model_config=SimpleNamespace(max_model_len=64))
    prop = HistoryProposer(cfg)
    prop.index.record([PROMPT], [[10, 11, 12]])
    prop.index.begin_call([PROMPT])
    ids = np.zeros((2, 64), np.int64)
    ids[0, :5], ids[1, :5] = PROMPT + [10, 11], [7, 7, 7, 7, 8]
    args = ([[11], [8]], np.array([5, 5]), ids)
    assert prop.propose(*args) == [[12], []]
    prop.full = True
    prop.index.begin_call([PROMPT])
    assert prop.propose(*args) == [[12, 11, 11, 11], [8, 8, 8, 8]]
    assert prop.propose([[], [8]], np.array([5, 5]), ids) == [[], [8, 8, 8, 8]]
    prop.k_of_batch = [0, 0, 0]
    assert prop.propose(*args) == [[], []]


def test_accepted_tokens_are_attributed_to_the_source_that_drafted_them():
    h = index()
    h.record([PROMPT], [[10, 11, 12, 13, 14]])
    h.begin_call([PROMPT])
    assert h.propose(rows(PROMPT + [10, 11]), [[11]], 3) == [[12, 13, 14]]
    # the target accepted 12 13, rejected 14 and sampled 99 in its place
    h.propose(rows(PROMPT + [10, 11, 12, 13, 99]), [[12, 13, 99]], 3)
    assert h.stats.accepted == [2, 0, 0]


def test_bounds_per_prompt_then_the_fullest_prompts_then_the_least_recently_seen():
    h = index(max_rollouts_per_prompt=2, max_tokens=10)
    h.record([PROMPT] * 3, [[1, 1], [2, 2], [3, 3]])
    kept = h.prompts[tuple(PROMPT)]
    assert list(kept.responses) == [[2, 2], [3, 3]]
    fresh = PromptHistory(PROMPT, 2, kept.table.orders)
    for r in kept.responses:
        fresh.add(r)
    assert kept.table.next == fresh.table.next  # the dropped response's counts were taken back
    other, third, fourth = [5, 5], [6, 6], [4, 4]
    h.record([other], [[7, 7, 7]])
    h.begin_call([PROMPT])   # PROMPT is now the most recently seen
    h.record([third], [[8, 8, 8, 8]])   # 4 + 3 + 4 = 11 > 10: PROMPT, holding the most, drops its oldest
    assert list(h.prompts) == [tuple(other), tuple(PROMPT), tuple(third)]
    assert list(h.prompts[tuple(PROMPT)].responses) == [[3, 3]] and h.tokens() == 9
    h.record([fourth], [[9, 9, 9]])   # 12 > 10 with one response each: the least recently seen goes
    assert list(h.prompts) == [tuple(PROMPT), tuple(third), tuple(fourth)] and h.tokens() == 9


def test_a_budget_under_the_store_keeps_every_prompt_of_a_revisited_set():
    """Epochs over 10 prompts, 4 answers of 5 tokens a visit, a budget of 2 answers a prompt: every
    prompt keeps its latest answers when it comes back (by recency alone, each epoch's revisits
    would find the prompts it has yet to visit evicted)."""
    h = index(max_rollouts_per_prompt=32, max_tokens=100)
    prompts = [[50 + i, 60 + i] for i in range(10)]
    for epoch in range(3):
        for i in random.Random(epoch).sample(range(10), 10):
            h.begin_call([prompts[i]])
            h.record([prompts[i]] * 4, [[epoch, i, 1, 2, 3]] * 4)
            assert h.tokens() <= 100
    assert len(h.prompts) == 10
    assert all(len(x.responses) == 2 and x.responses[-1][0] == 2 for x in h.prompts.values())


def test_state_round_trip_keeps_the_drafts():
    h = index()
    h.record([PROMPT] * 2, [[10, 11, 12], [10, 11, 13, 15]])
    h.record([[9]], [[]])
    g = index()
    g.load_state_dict(h.state_dict())
    assert g.state_dict() == h.state_dict()
    for x in (h, g):
        x.begin_call([PROMPT])
    assert g.propose(rows(PROMPT + [10, 11, 13]), [[13]], 2) == h.propose(rows(PROMPT + [10, 11, 13]), [[13]], 2) == [[15]]


def test_settings_are_validated_by_key():
    from conftest import compose
    from rlspec.config import ConfigError, validate

    validate(compose(["speculation=history"]))
    with pytest.raises(ConfigError, match=r"^speculation\.history\.min_match: must be 1, 2 or 3"):
        validate(compose(["speculation=history", "speculation.history.min_match=4"]))
    with pytest.raises(ConfigError, match=r"^speculation\.history\.min_prob"):
        validate(compose(["speculation=history", "speculation.history.min_prob=0"]))


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
    # vLLM's own counters agree with the drafter's: everything drafted was verified
    assert second.spec.draft_tokens == sum(second.history[f"drafted_{s}"] for s in SOURCES)
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

    auto = start_generator(["speculation=history", "speculation.num_speculative_tokens=auto",
                            "speculation.max_speculative_tokens=3", "speculation.auto_buckets=[1,4]"])
    for _ in range(2):
        ro = _gen(auto, prompts, 1, 0.0)
        assert ro.response_ids == base.response_ids
        assert ro.spec.draft_tokens <= 3 * ro.spec.drafts
    # the planner measured the fill: per position, the share of rows drafting it among those that
    # drafted the one before
    fill, counts = ray.get(auto.__ray_call__.remote(lambda g: (g.adaptive.planner.fill,
                                                               g.adaptive.planner.fill_counts)), timeout=60)
    measured = [f for f, c in zip(fill, counts) if c[1] > 0]
    assert measured and all(0 < f <= 1 for f in measured) and min(measured) < 1

    def generate_at(gen, k, prompts, s):  # the engine alone, at a k set as 'auto' sets it
        from rlspec.speculation.adaptive import OFF
        from rlspec.speculation import history
        gen.adaptive.set_k(OFF if k == OFF else (lambda b: k))
        gen.engine.llm.collective_rpc(history.begin_call, args=(prompts,))
        return gen.engine.generate(prompts, s, 0)

    one = ray.get(auto.__ray_call__.remote(generate_at, 1, prompts, sampling(1, 0.0, 48)), timeout=600)
    assert one.response_ids == base.response_ids
    assert one.spec.drafts > 0 and one.spec.draft_tokens == one.spec.drafts
    off = ray.get(auto.__ray_call__.remote(generate_at, -1, prompts, sampling(1, 0.0, 48)), timeout=600)
    assert off.response_ids == base.response_ids and off.spec.draft_tokens == 0
    # switched off, it measured in shadow: the same greedy answers again, so shadow drafts are accepted
    from rlspec.speculation import history
    st = ray.get(auto.__ray_call__.remote(
        lambda g: g.engine.llm.collective_rpc(history.finish_call, args=(off.prompt_ids, off.response_ids))[0]),
        timeout=60)
    assert st["rows"] == 0 and st["shadow_rows"] > 0 and st["shadow_accepted_ge_1"] > 0, st
    ray.kill(auto)


@pytest.mark.slow
def test_a_run_keeps_its_history_through_a_checkpoint(tmp_path):
    """8 prompts, 4 per step: steps 3-4 are the second epoch. A run stopped after step 2 and
    resumed drafts step 3 from step 1-2's rollouts, restored from the checkpoint."""
    from test_resilience_cli import records, train

    hist = ["speculation=history", "data.train.num_rows=8", "trainer.checkpoint_every=2"]
    first = train(tmp_path, *hist, "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert (tmp_path / "checkpoints" / "step_00000002" / "history_0.pt").is_file()
    resumed = train(tmp_path, *hist, "trainer.max_steps=4")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    s1, s3 = recs[0]["spec"], recs[2]["spec"]
    assert s1["history_prompts"] == 0 and s1["history_drafted_history"] == 0
    assert s3["history_prompts"] == 8 and s3["history_accepted_history"] > 0, s3


@pytest.mark.slow
def test_async_grpo_drafts_from_history(tmp_path):
    """Async GRPO (lag 1, generation a step ahead of the learner) over 8 prompts, 4 per step: steps
    3-4 come back to step 1-2's prompts and draft from their rollouts (recorded by the Generator as
    each call ends, whichever step the learner is at)."""
    from test_resilience_cli import records, train

    run = train(tmp_path, "speculation=history", "data.train.num_rows=8",
                "async_grpo.enabled=true", "async_grpo.max_policy_lag=1")
    assert run.returncode == 0, run.stderr[-3000:]
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    s1, s3 = recs[0]["spec"], recs[2]["spec"]
    assert s1["history_prompts"] == 0 and s1["history_drafted_history"] == 0
    assert s3["history_prompts"] == 8 and s3["history_drafted_history"] > 0, s3
    assert max(r["policy_lag_max"] for r in recs) == 1  # generation ran a step ahead


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
