"""Exact resume of history-drafting runs through the real entry point, where the drafters' buckets
overflow (count tables of 2^10 tokens with two entries a bucket; the device ring of 2^10 tokens
wraps): a run resumed from its step-2 checkpoint trains steps 3 and 4 as the uninterrupted run did,
the same drafts (speculation counters), tokens and losses, synchronously and in async GRPO at lag 0
(whose checkpoint is written with the next call already queued on the Generator)."""
import shutil

import pytest

from helpers.cli import records, train

SMALL_TABLES = {"host": ["speculation.history.count_tokens=1024", "speculation.history.max_candidates=2"],
                "device": ["speculation.history.drafter=device", "speculation.history.device_max_tokens=1024",
                           "speculation.history.count_tokens=1024", "speculation.history.max_candidates=2"]}


def drafts(rec: dict) -> dict:
    """A step's speculation counters, less the drafter's timings."""
    return {k: v for k, v in rec["spec"].items() if "timing" not in k and "seconds" not in k}


def resumed_from_step_2(run, tmp_path, name, *extra):
    step2 = run / "checkpoints" / "step_00000002"
    again = tmp_path / name
    shutil.copytree(step2, again / "checkpoints" / step2.name)
    (again / "checkpoints" / "latest").write_text(step2.name)
    p = train(again, *extra)
    assert p.returncode == 0 and "resumed from" in p.stdout, p.stderr[-3000:]
    return records(again)


@pytest.mark.slow  # four CLI runs a drafter
@pytest.mark.parametrize("drafter", ["host", "device"])
def test_a_history_run_resumed_with_overflowing_buckets_continues_exactly(tmp_path, drafter):
    extra = ("speculation=history", "generation.max_new_tokens=48", *SMALL_TABLES[drafter])
    ref = train(tmp_path / "ref", *extra, "trainer.checkpoint_every=2")
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = records(tmp_path / "ref")
    assert sum(r["spec"]["accepted_tokens"] for r in want) > 0
    lag0 = (*extra, "async_grpo.enabled=true", "async_grpo.max_policy_lag=0")
    whole = train(tmp_path / "async", *lag0, "trainer.checkpoint_every=2")
    assert whole.returncode == 0, whole.stderr[-3000:]
    runs = {"sync": records(tmp_path / "ref"), "async": records(tmp_path / "async"),
            "sync resumed": resumed_from_step_2(tmp_path / "ref", tmp_path, "again", *extra),
            "async resumed": resumed_from_step_2(tmp_path / "async", tmp_path, "async_again", *lag0)}
    for name, got in runs.items():
        assert [r["step"] for r in got] == [1, 2, 3, 4], name
        for g, w in zip(got, want):  # exact: the same drafts, tokens and floats
            assert (drafts(g), g["generated_tokens"], g["loss"], g["reward_mean"]) == \
                   (drafts(w), w["generated_tokens"], w["loss"], w["reward_mean"]), (name, g["step"])
