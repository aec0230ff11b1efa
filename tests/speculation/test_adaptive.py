"""The adaptive draft-length planner (pure): expected tokens, bucket ranges, choice of k."""
import pytest

from rlspec.speculation.adaptive import OFF, DraftLengthPlanner, bucket_ranges, expected_tokens, non_decreasing


def test_expected_tokens_limits():
    assert expected_tokens([1.0] * 5, 3) == 4.0          # full acceptance: k + 1 per verification
    assert expected_tokens([0.0] * 5, 5) == 1.0          # none accepted: the target's own token
    assert expected_tokens([0.5, 0.5], 0) == 1.0         # k = 0
    assert expected_tokens([0.8, 0.5, 1.0], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.4)


def test_non_decreasing_pools_the_violators_and_keeps_the_mean():
    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]          # already ordered: unchanged
    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    # a noisy cheap k=2 pools back through k=1 and k=0: three equal costs at the mean of the three
    assert non_decreasing([2.0, 2.3, 1.4, 3.0]) == pytest.approx([1.9, 1.9, 1.9, 3.0])
    costs = [5.0, 1.0, 4.0, 2.0, 6.0]
    fit = non_decreasing(costs)
    assert all(a <= b for a, b in zip(fit, fit[1:])) and sum(fit) == pytest.approx(sum(costs))


def test_bucket_ranges_cover_every_batch_size_once():
    ranges = bucket_ranges([1, 4, 16, 64, 256], 300)
    assert ranges[0][0] == 1 and ranges[-1][1] == 300
    for (_, hi, _), (lo, _, _) in zip(ranges, ranges[1:]):
        assert lo == hi + 1
    # log-scale nearest: 8 goes to 4 (sqrt(4*16) = 8), 9 to 16
    k_of = {b: bk for lo, hi, bk in ranges for b in range(lo, hi + 1)}
    assert k_of[8] == 4 and k_of[9] == 16 and k_of[300] == 256


def _planner(cost, accept, k_max=3, buckets=(1, 256)):
    """cost(b, k) -> step seconds; OFF costs what k = 0 costs minus the draft's 10%."""
    secs = {}
    for b in buckets:
        for k in range(k_max + 1):
            secs[(b, k)] = cost(b, k)
        secs[(b, OFF)] = cost(b, 0) * 0.9
    return DraftLengthPlanner(k_max=k_max, max_batch=max(buckets), step_seconds=secs, accept=list(accept))


def test_plan_weight_bound_small_batch_long_k_compute_bound_large_batch_off():
    # Batch 1: a step costs the same for any k (weight-bound) -> longest k.
    # Batch 256: a step costs k+1 times more (compute-bound) -> speculation loses -> k = 0.
    p = _planner(lambda b, k: 1.0 if b == 1 else 1.0 * (k + 1), [0.9, 0.9, 0.9]).plan()
    assert p.k_by_bucket == {1: 3, 256: 0} and not p.off
    assert p.k_at(1) == 3 and p.k_at(200) == 0


def test_plan_switches_off_when_no_bucket_gains():
    p = _planner(lambda b, k: 1.0 * (k + 1), [0.5, 0.5, 0.5]).plan()
    assert p.off and p.k_at(1) == 0


def test_plan_follows_acceptance():
    cost = lambda b, k: 1.0 + 0.3 * k  # noqa: E731  each drafted token costs 30% of a step
    assert _planner(cost, [0.95] * 3).plan().k_by_bucket[1] == 3
    mid = _planner(cost, [0.6] * 3).plan()   # L(k)/t(k): k=1 1.23, k=2 1.225, k=3 1.145; OFF 1.11
    assert mid.k_by_bucket[1] == 1 and not mid.off
    assert _planner(cost, [0.05] * 3).plan().off


def test_observe_updates_only_positions_every_draft_covered():
    pl = _planner(lambda b, k: 1.0, [0.5, 0.5, 0.5])
    pl.observe(drafts=100, accepted_per_pos=[80, 40, 0], k_min=2)
    assert pl.accept == [0.8, 0.5, 0.5]   # a_0 = 80/100, a_1 = 40/80, a_2 untouched (k_min = 2)
    pl.observe(drafts=0, accepted_per_pos=[0, 0, 0], k_min=3)
    assert pl.accept == [0.8, 0.5, 0.5]   # no drafts: nothing measured


def test_observe_weighs_calls_by_their_drafts():
    pl = _planner(lambda b, k: 1.0, [])
    pl.observe(drafts=10000, accepted_per_pos=[9000, 8100, 0], k_min=3)
    assert pl.accept == pytest.approx([0.9, 0.9, 0.0])
    # a call of 8 drafts that all failed barely moves what 10000 measured (decay 0.9)
    pl.observe(drafts=8, accepted_per_pos=[0, 0, 0], k_min=1)
    assert pl.accept[0] == pytest.approx(8100 / 9008) and pl.accept[1:] == pytest.approx([0.9, 0.0])
    # the counts decay: after many small calls at 0.5, the estimate follows them
    for _ in range(60):
        pl.observe(drafts=100, accepted_per_pos=[50, 25, 0], k_min=1)
    assert pl.accept[0] == pytest.approx(0.5, abs=0.01)


def test_observe_steps_adds_the_measured_offset_to_every_k_of_a_bucket():
    pl = _planner(lambda b, k: (1.0 if b == 1 else 4.0) * (1 + 0.1 * k), [0.9] * 3)
    assert pl.predicted(16, 2) == pytest.approx((1.2 * 4.8) ** 0.5)     # log-log between buckets 1, 256
    assert pl.predicted(300, 2) == pytest.approx(4.8)                   # beyond the last bucket: its cost
    # bucket 256's range (17..256): k=3 steps 0.6 s over the prediction, a k=1 step 0.3 s over;
    # bucket 1's range (1..16): a step at the predicted cost
    pl.observe_steps([(256, 3, 5.2 + 0.6), (200, 3, pl.predicted(200, 3) + 0.6), (100, 1, pl.predicted(100, 1) + 0.3),
                      (16, 2, pl.predicted(16, 2))])
    assert pl.step_seconds[(256, 0)] == pytest.approx(4.0 + 0.5)        # every k, OFF too, moves by the mean
    assert pl.step_seconds[(256, 3)] == pytest.approx(5.2 + 0.5)
    assert pl.step_seconds[(256, OFF)] == pytest.approx(3.6 + 0.5)
    assert pl.step_seconds[(1, 2)] == pytest.approx(1.2)
    # a per-step overhead favours longer drafts: with it, k=3 beats k=2 at bucket 256 by more
    gain = lambda: pl.tokens_per_second(256, 3) / pl.tokens_per_second(256, 2)  # noqa: E731
    before = gain()
    pl.observe_steps([(256, 2, 4.8 + 2.0)] * 10)
    assert gain() > before
    # later calls weigh by their steps, earlier ones decayed
    assert pl.cost_counts[256][1] == pytest.approx(0.9 * 3 + 10)
    # steps far faster than timed lower every k of the bucket by at most half its cheapest cost
    pl.observe_steps([(1, 2, 0.01)] * 50)
    assert pl.step_seconds[(1, OFF)] == pytest.approx(0.45) and pl.step_seconds[(1, 3)] == pytest.approx(1.3 - 0.45)


def test_probes_draft_as_long_as_the_cost_bound_allows_and_reach_deeper_positions_stepwise():
    """Nothing measured: each bucket drafts the longest k whose step costs at most 1.5x a step
    without drafting (batch 256: k=1 at 1.4x; k=2 would be 1.8x). Measured: a probe drafts, where
    the plan speculates, the longest k whose step costs at most 1.5x the planned k's, so a plan that
    picked k=1 from a_1 alone reaches k=3 through the probes."""
    costs = {(1, OFF): 1.0, (1, 0): 1.1, (1, 1): 1.3, (1, 2): 1.6, (1, 3): 1.9,
             (256, OFF): 1.0, (256, 0): 1.2, (256, 1): 1.4, (256, 2): 1.8, (256, 3): 2.2}
    p = DraftLengthPlanner(k_max=3, max_batch=256, step_seconds=costs)
    assert p.unmeasured()
    first = p.plan(probe=True)
    assert first.k_by_bucket == {1: 1, 256: 1} and not first.off
    p.observe(drafts=100, accepted_per_pos=[95, 0, 0], k_min=1)   # only a_1 measured
    plan = p.plan()
    assert plan.k_by_bucket == {1: 1, 256: 1} and p.unmeasured()
    probe = p.plan(probe=True)                                      # 1.5 x 1.3 = 1.95 >= t(1, 3)
    assert probe.k_by_bucket == {1: 3, 256: 2}
    p.observe(drafts=100, accepted_per_pos=[95, 90, 85], k_min=2)
    p.observe(drafts=100, accepted_per_pos=[95, 90, 85], k_min=3)
    assert not p.unmeasured() and p.plan().k_by_bucket[1] == 3
    # a probe never switches a call off: that is judged on the plan, whose positions are measured
    # (a_1 = 0.5: k=1 beats OFF, 1.5 tokens per 1.3x step; the probe's k=3 predicts 1.5 per 1.9x)
    p = DraftLengthPlanner(k_max=3, max_batch=256, step_seconds=dict(costs))
    p.observe(drafts=100, accepted_per_pos=[50, 0, 0], k_min=1)
    lengths = [40] * 8
    assert not p.plan(lengths).off and not p.plan(lengths, probe=True).off
    assert p.plan(lengths, probe=True).k_by_bucket == {1: 3, 256: 2}
    # with drafting unaffordable everywhere, the first call runs without it (and so stays bounded)
    p = DraftLengthPlanner(k_max=3, max_batch=256, step_seconds={**costs, (1, 1): 1.6, (256, 1): 1.6})
    assert p.plan(probe=True).off


def test_a_per_request_drafter_is_planned_per_row_from_its_fill():
    """speculation=history drafts per request: a fraction m of the rows drafts (here k tokens,
    each accepted with probability p given the ones before), the rest draft nothing. On engine
    steps whose cost is linear in the tokens verified, t(B, k) = a + c B (1 + k) timed with every
    row drafting k, the planner fed per-row counters predicts each k's tokens per second exactly,
    and so picks the k that is truly best in each bucket (OFF where drafting does not pay)."""
    k_max, a, c = 4, 1.0, 0.1
    secs = {(b, k): a + c * b * (1 + k) for b in (1, 64) for k in range(k_max + 1)}
    secs.update({(b, OFF): secs[(b, 0)] for b in (1, 64)})
    for m, p in ((0.2, 0.5), (0.9, 0.9), (0.05, 0.8)):
        pl = DraftLengthPlanner(k_max=k_max, max_batch=64, step_seconds=dict(secs))
        rows = 1000
        pl.observe(drafts=rows, accepted_per_pos=[m * rows * p ** (i + 1) for i in range(k_max)], k_min=k_max,
                   drafted_per_pos=[m * rows] * k_max)
        assert pl.fill == pytest.approx([m] + [1.0] * (k_max - 1))  # a row that drafts drafts k

        def truth(b, k):  # tokens per row per second on this engine
            return (1 + m * sum(p ** (i + 1) for i in range(k))) / (a + c * b * (1 + m * k))

        for b in (1, 64):
            for k in range(k_max + 1):
                assert pl.tokens_per_second(b, k) == pytest.approx(truth(b, k)), (m, p, b, k)
        plan = pl.plan()
        assert plan.k_by_bucket == {b: max(range(k_max + 1), key=lambda k: truth(b, k)) for b in (1, 64)}
    # m=0.2, p=0.5: batch 1 drafts 3 (1.013 against 1.006 at k=4, 0.909 without), batch 64 nothing
    pl = DraftLengthPlanner(k_max=k_max, max_batch=64, step_seconds=dict(secs))
    pl.observe(drafts=1000, accepted_per_pos=[200 * 0.5 ** (i + 1) for i in range(k_max)], k_min=k_max,
               drafted_per_pos=[200] * k_max)
    assert pl.plan().k_by_bucket == {1: 3, 64: 0}
    # positions a call did not reach keep counting as filled (the costlier assumption)
    pl = DraftLengthPlanner(k_max=k_max, max_batch=64, step_seconds=dict(secs))
    pl.observe(drafts=100, accepted_per_pos=[40, 20, 0, 0], k_min=2, drafted_per_pos=[50, 30, 0, 0])
    assert pl.fill[:2] == pytest.approx([0.5, 0.6])   # 50 of 100 rows drafted position 0, 30 of those 50 position 1
    assert pl.cost(64, 4) == pytest.approx(secs[(64, 0)] + (0.5 + 0.3 + 0.3 + 0.3) / 4
                                           * (secs[(64, 4)] - secs[(64, 0)]))
    # a model drafter (no fill passed) pays the timed cost of k
    pl = DraftLengthPlanner(k_max=k_max, max_batch=64, step_seconds=dict(secs))
    pl.observe(drafts=100, accepted_per_pos=[40, 20, 10, 5], k_min=4)
    assert pl.cost(64, 4) == secs[(64, 4)]


def test_shadow_measurements_turn_drafting_back_on():
    """First-seen prompts: few rows match, speculation is off. Steps that draft nothing still
    measure what drafting would accept (fresh=False: the same call's second measurement); when the
    prompts come back with history the acceptance and fill rise and the plan drafts again."""
    secs = {(b, k): 1.0 + 0.1 * b * (1 + k) for b in (1, 64) for k in range(4)}
    secs.update({(b, OFF): secs[(b, 0)] for b in (1, 64)})
    pl = DraftLengthPlanner(k_max=3, max_batch=64, step_seconds=secs)
    pl.observe(drafts=1000, accepted_per_pos=[50, 20, 5], k_min=3, drafted_per_pos=[300, 200, 100])
    assert pl.plan([40] * 64).off
    for _ in range(5):  # calls run off: only the shadow measures, every position
        pl.observe(drafts=0, accepted_per_pos=[0, 0, 0], k_min=3, drafted_per_pos=[0, 0, 0])
        pl.observe(drafts=1000, accepted_per_pos=[850, 800, 750], k_min=3, drafted_per_pos=[900, 880, 860],
                   fresh=True)
    plan = pl.plan([40] * 64)
    assert not plan.off and plan.k_by_bucket[1] == 3
    # a second measurement of one call adds without decaying the first again
    pl = DraftLengthPlanner(k_max=3, max_batch=64, step_seconds=secs)
    pl.observe(drafts=100, accepted_per_pos=[50, 0, 0], k_min=1, drafted_per_pos=[60, 0, 0])
    pl.observe(drafts=100, accepted_per_pos=[70, 40, 20], k_min=3, drafted_per_pos=[80, 60, 40], fresh=False)
    assert pl.accept[0] == pytest.approx(120 / 200) and pl.fill[0] == pytest.approx(140 / 200)
    assert pl.accept[1] == pytest.approx(40 / 70) and pl.fill[2] == pytest.approx(40 / 60)


def test_a_drafters_own_time_is_charged_to_drafting_modes_only():
    """speculation=history looks up drafts outside the engine work calibration times. Its time, as
    calls measure it per batch bin and k, adds to every drafting mode's cost (k >= 0) and never to
    OFF, whose steps never call it; a call's decode steps, which include it, then leave no offset
    behind for OFF to pay."""
    from rlspec.speculation.adaptive import OFF, DraftLengthPlanner

    secs = {(b, k): 0.010 + 0.0001 * b * (1 + k) for b in (1, 64) for k in range(4)}
    secs.update({(b, OFF): 0.009 + 0.0001 * b for b in (1, 64)})
    p = DraftLengthPlanner(k_max=3, max_batch=64, step_seconds=secs)
    off_before = p.cost(64, OFF)
    p.observe_drafter([[6, 3, 10, 10 * 0.004]])   # batch 64..127, k=3: 4 ms a step
    assert p.cost(64, OFF) == off_before
    assert p.cost(64, 3) == pytest.approx(secs[(64, 3)] + 0.004)
    assert p.drafter_seconds(64, 2) == pytest.approx(0.004)   # the bin's other k: its mean
    # steps of a drafting call measured at calibrated cost + the drafter's time: no offset
    p.observe_steps([(64, 3, secs[(64, 3)] + 0.004)] * 20)
    assert p.cost(64, OFF) == pytest.approx(off_before)


def test_given_step_costs_load_as_given_and_stay(tmp_path):
    """speculation.auto_step_costs: a file of seconds per step [off, k=0..k_max] by batch size, used
    as given: the calls' measured steps and drafter time leave them as they are, so a run's k
    follow acceptance alone."""
    import json

    from rlspec.speculation.adaptive import load_step_costs

    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"1": [1.0, 1.1, 1.2, 1.3, 1.4], "64": [4.0, 4.4, 4.8, 5.2, 5.6]}))
    costs = load_step_costs(str(path), 3)
    assert costs[(1, OFF)] == 1.0 and costs[(64, 0)] == 4.4 and costs[(64, 3)] == 5.6 and len(costs) == 10
    pl = DraftLengthPlanner(k_max=3, max_batch=64, step_seconds=dict(costs), accept=[0.9] * 3, fixed=True)
    pl.observe_steps([(64, 3, 50.0)] * 10)
    pl.observe_drafter([[6, 3, 10, 100.0]])
    assert pl.step_seconds == costs and pl.cost(64, 3) == 5.6
    for text, says in (("{", "cannot read it as JSON"), ("[1]", "must be a JSON object"),
                       ('{"x": [1, 1, 1, 1, 1]}', "key 'x' is not a batch size"),
                       ('{"1": [1, 1, 1]}', "batch size 1: want 5 positive seconds"),
                       ('{"1": [1, 1, 1, 1, -1]}', "batch size 1: want 5")):
        path.write_text(text)
        with pytest.raises(ValueError, match=f"speculation.auto_step_costs \\({path}\\): {says}"):
            load_step_costs(str(path), 3)
    with pytest.raises(ValueError, match="cannot read"):
        load_step_costs(str(tmp_path / "missing.json"), 3)
