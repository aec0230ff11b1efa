"""Partial rollouts through the real entry point (rlspec/loops/partial.py): the lag bound on carried
answers, and an exact resume with unfinished answers in flight."""
import pytest

from helpers.cli import records, train

PARTIAL = "generation.partial.enabled=true"


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


@pytest.mark.slow  # three CLI runs
def test_a_run_resumed_with_carried_answers_continues_exactly(tmp_path):
    """The step-2 checkpoint holds unfinished answers; resumed from it, steps 3 and 4 train on the
    same rollouts (the same floats) as the run that never stopped. In that run answers are resumed
    and no trained token trails the learner by more than max_carry_versions (2)."""
    from rlspec.loops.checkpoint import read_driver_state

    extra = (PARTIAL, "generation.max_new_tokens=64")
    ref = train(tmp_path / "ref", *extra)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = records(tmp_path / "ref")
    assert sum(partial_counts(want, "resumed_answers")) > 0
    assert all(r["policy_lag_max"] <= 2 for r in want) and max(r["extra"]["policy_lag_mean"] for r in want) > 0

    run = tmp_path / "run"
    first = train(run, *extra, "trainer.max_steps=2", "trainer.checkpoint_every=2")
    assert first.returncode == 0, first.stderr[-3000:]
    carry = read_driver_state(run / "checkpoints" / "step_00000002").sampler["partial"]["carry"]
    assert any(a["response_ids"] and not a["done"] for g in carry for a in g["answers"])
    resumed = train(run, *extra)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    got = records(run)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want):  # exact: same floats
        assert (g["loss"], g["reward_mean"], g["generated_tokens"]) == (w["loss"], w["reward_mean"],
                                                                        w["generated_tokens"])
        assert g["extra"]["policy_lag_mean"] == w["extra"]["policy_lag_mean"]
