"""Partial rollouts through the real entry point (rlspec/loops/partial.py): the lag bound on carried
answers, synchronous and async, async at lag 0 equal to the synchronous loop, and exact resumes
with unfinished answers in flight (lag 0, and lag 1 with a call out and history drafting)."""
import shutil

import pytest

from helpers.cli import drafts, records, train

PARTIAL = "generation.partial.enabled=true"
ASYNC = "async_grpo.enabled=true"


def partial_counts(recs: list[dict], key: str) -> list[float]:
    return [r["extra"][f"partial/{key}"] for r in recs]


def test_with_no_version_to_carry_over_every_trained_token_is_on_policy(tmp_path):
    """max_carry_versions=0: every answer a step carries is started again by the next (the weights
    moved), counted as dropped; nothing is resumed and every trained token has lag 0, while
    over-provisioning still leaves groups over for the next step."""
    p = train(tmp_path / "run", PARTIAL, "generation.partial.max_carry_versions=0", "generation.max_new_tokens=64")
    assert p.returncode == 0, p.stderr[-3000:]
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(r["policy_lag_max"] == 0 and r["extra"]["policy_lag_mean"] == 0 for r in recs)
    assert sum(partial_counts(recs, "carried_groups")) > 0
    assert sum(partial_counts(recs, "dropped_answers")) > 0
    assert partial_counts(recs, "resumed_answers") == [0.0] * 4


def test_async_partial_rollouts_keep_every_token_within_both_bounds(tmp_path):
    """Async GRPO (lag 1) with partial rollouts: a call goes out once the one before it is back, so
    from step 2 on every batch was sampled a version behind the learner, and a resumed answer adds
    at most max_carry_versions (1) to that: no trained token is more than 2 versions old. With
    dynamic sampling on, the extra rounds (whole calls under async) take the place of the groups
    whose rewards agree."""
    p = train(tmp_path / "run", PARTIAL, ASYNC, "generation.partial.max_carry_versions=1",
              "generation.max_new_tokens=64", "algo.dynamic_sampling=true")
    assert p.returncode == 0, p.stderr[-3000:]
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[0]["policy_lag_max"] == 0 and all(1 <= r["policy_lag_max"] <= 2 for r in recs[1:])
    assert all(r["extra"]["behaviour_version"] >= r["step"] - 3 for r in recs)
    assert sum(partial_counts(recs, "carried_groups")) > 0 and sum(partial_counts(recs, "resumed_answers")) > 0
    assert all(r["stale_groups_dropped"] == 0 for r in recs)
    assert all(r["extra"]["sampling_rounds"] >= 1 for r in recs) and any(r["extra"]["sampling_rounds"] > 1
                                                                        for r in recs)


def test_synchronous_partial_rollouts_with_dynamic_sampling_run_to_the_end(tmp_path):
    """The synchronous loop with partial rollouts and dynamic sampling: each extra round is a
    partial call whose carried answers are of other versions than the first round's, so the
    rounds' groups join as a batch of several versions (sampling_rounds > 1 somewhere, a resumed
    answer trained), and the run ends."""
    p = train(tmp_path / "run", PARTIAL, "generation.max_new_tokens=64", "algo.dynamic_sampling=true",
              "generation.partial.max_carry_versions=2", "trainer.max_steps=6")
    assert p.returncode == 0, p.stderr[-3000:]
    recs = records(tmp_path / "run")
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    assert any(r["extra"]["sampling_rounds"] > 1 for r in recs)
    assert any(r["policy_lag_max"] > 0 for r in recs) and all(r["policy_lag_max"] <= 2 for r in recs)


def resume_from_step2(tmp_path, run, *args):
    """A run as if it had stopped after `run`'s step-2 checkpoint, resumed; its records."""
    step2 = run / "checkpoints" / "step_00000002"
    again = tmp_path / "again"
    shutil.copytree(step2, again / "checkpoints" / step2.name)
    (again / "checkpoints" / "latest").write_text(step2.name)
    resumed = train(again, *args)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    return records(again)


@pytest.mark.slow  # three CLI runs
def test_a_run_resumed_with_carried_answers_continues_exactly(tmp_path):
    """Async GRPO at lag 0 with partial rollouts trains on the synchronous loop's rollouts (the same
    floats). Its step-2 checkpoint, written before step 3's call goes out, holds the unfinished
    answers as they were before that call; a run resumed from it trains steps 3 and 4 exactly as
    the others did. In these runs answers are resumed and no trained token trails the learner by
    more than max_carry_versions (2)."""
    from rlspec.loops.checkpoint import read_driver_state

    extra = (PARTIAL, "generation.max_new_tokens=64", "generation.partial.max_carry_versions=2")
    ref = train(tmp_path / "ref", *extra)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = records(tmp_path / "ref")
    assert sum(partial_counts(want, "resumed_answers")) > 0
    assert all(r["policy_lag_max"] <= 2 for r in want) and max(r["extra"]["policy_lag_mean"] for r in want) > 0

    lag0 = (*extra, ASYNC, "async_grpo.max_policy_lag=0")
    run = tmp_path / "async"
    whole = train(run, *lag0, "trainer.checkpoint_every=2")
    assert whole.returncode == 0, whole.stderr[-3000:]
    carry = read_driver_state(run / "checkpoints" / "step_00000002").sampler["partial"]["carry"]
    assert any(a["response_ids"] and not a["done"] for g in carry for a in g["answers"])
    for got in (records(run), resume_from_step2(tmp_path, run, *lag0)):
        assert [r["step"] for r in got] == [1, 2, 3, 4]
        for g, w in zip(got, want):  # exact: same floats
            assert (g["loss"], g["reward_mean"], g["generated_tokens"]) == (w["loss"], w["reward_mean"],
                                                                            w["generated_tokens"])
            assert g["extra"]["policy_lag_mean"] == w["extra"]["policy_lag_mean"]


@pytest.mark.slow  # two CLI runs
def test_a_lag_one_history_run_resumed_with_a_call_out_continues_exactly(tmp_path):
    """Async GRPO at lag 1 with partial rollouts (refill on: spares started mid-call) and history
    drafting: the step-2 checkpoint is saved while step 3's call is out, with that call's result
    (queued.pt), the carried groups after it and the store that recorded its answers. A run resumed
    from it trains steps 3 and 4 as the uninterrupted run did: the same drafts, tokens and floats
    (it neither redraws step 3 from its own answers nor samples it with other weights)."""
    from rlspec.loops.checkpoint import read_queued

    lag1 = (PARTIAL, "generation.max_new_tokens=64", "generation.partial.refill=true",
            "generation.partial.max_carry_versions=2", ASYNC, "async_grpo.max_policy_lag=1",
            "speculation=history", "data.train.num_rows=8")
    run = tmp_path / "async"
    whole = train(run, *lag1, "trainer.checkpoint_every=2")
    assert whole.returncode == 0, whole.stderr[-3000:]
    want = records(run)
    assert sum(partial_counts(want, "spares_started")) > 0 and sum(partial_counts(want, "resumed_answers")) > 0
    assert want[2]["spec"]["history_accepted_history"] > 0, want[2]["spec"]
    assert [q["step"] for q in read_queued(run / "checkpoints" / "step_00000002")] == [3]
    got = resume_from_step2(tmp_path, run, *lag1)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want):  # exact: the same drafts, tokens and floats
        assert (drafts(g), g["generated_tokens"], g["loss"], g["reward_mean"], g["extra"]["policy_lag_mean"]) == \
               (drafts(w), w["generated_tokens"], w["loss"], w["reward_mean"], w["extra"]["policy_lag_mean"]), g["step"]
