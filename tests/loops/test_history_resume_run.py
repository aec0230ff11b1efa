"""Exact resume of history-drafting runs through the real entry point, where the drafters' buckets
overflow (count tables of 2^10 tokens with two entries a bucket; the device ring of 2^10 tokens
wraps). 8 prompts, 4 a step: steps 3-4 are the second epoch and draft from steps 1-2's answers,
which a resumed run has only from its checkpoint. A run resumed from its step-2 checkpoint trains
steps 3 and 4 as the uninterrupted run did: the same drafts (speculation counters), tokens and
losses. Both run async GRPO: the device drafter at lag 0, whose checkpoint is written with nothing
queued on the Generator (lag 0 trains as the synchronous loop: tests/loops/test_queue.py); the host
drafter at lag 1, whose checkpoint is written while step 3's call is out, with its result and the
store that recorded its answers."""
import shutil

import pytest

from helpers.cli import drafts, records, train

SMALL_TABLES = {"host": ["speculation.history.host.count_tokens=1024", "speculation.history.max_candidates=2",
                         "async_grpo.enabled=true", "async_grpo.max_policy_lag=1"],
                "device": ["speculation.history.drafter=device", "speculation.history.device.max_tokens=1024",
                           "speculation.history.max_candidates=2",
                           "async_grpo.enabled=true", "async_grpo.max_policy_lag=0"]}


@pytest.mark.slow  # two CLI runs a drafter
@pytest.mark.parametrize("drafter", ["host", "device"])
def test_a_history_run_resumed_with_overflowing_buckets_continues_exactly(tmp_path, drafter):
    from rlspec.loops.checkpoint import read_driver_state, read_queued

    extra = ("speculation=history", "generation.max_new_tokens=48", "data.train.num_rows=8",
             *SMALL_TABLES[drafter])
    ref = train(tmp_path / "ref", *extra, "trainer.checkpoint_every=2")
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = records(tmp_path / "ref")
    assert want[2]["spec"]["history_accepted_history"] > 0, want[2]["spec"]   # drafted from steps 1-2
    if drafter == "host":   # generation ran a step ahead; step 3's call, out during step 2, drafted from 1-2
        assert max(r["policy_lag_max"] for r in want) == 1
        assert want[0]["spec"]["history_prompts"] == 0 and want[2]["spec"]["history_prompts"] == 8, want[2]["spec"]
    step2 = tmp_path / "ref" / "checkpoints" / "step_00000002"
    lag = 1 if drafter == "host" else 0   # at lag 1 the checkpoint holds step 3's call, already out
    assert [q["step"] for q in read_queued(step2)] == [3][:lag]
    at = read_driver_state(step2).sampler
    assert at["epoch"] * 8 + at["cursor"] == 4 * (2 + lag)   # the data position after it (8 rows, 4 a step)
    again = tmp_path / "again"
    shutil.copytree(step2, again / "checkpoints" / step2.name)
    (again / "checkpoints" / "latest").write_text(step2.name)
    p = train(again, *extra)
    assert p.returncode == 0 and "resumed from" in p.stdout, p.stderr[-3000:]
    got = records(again)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for g, w in zip(got, want):  # exact: the same drafts, tokens and floats
        assert (drafts(g), g["generated_tokens"], g["loss"], g["reward_mean"]) == \
               (drafts(w), w["generated_tokens"], w["loss"], w["reward_mean"]), g["step"]
