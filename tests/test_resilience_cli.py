"""Preemption, exact resume and actor faults through the real entry point (subprocesses)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from helpers.cli import BASE, interrupted, kill_actor_of, left_behind, ray_processes, records, train
from rlspec.loops import checkpoint as ck


@pytest.mark.slow  # the default suite stays under 30 minutes on 2 cores; tests/loops/test_queue.py resumes
def test_sigterm_checkpoints_exits_3_and_resume_continues_exactly(tmp_path):
    six = "trainer.max_steps=6"  # room to land the signal mid-run
    ref = train(tmp_path / "ref", six)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = records(tmp_path / "ref")

    run = tmp_path / "pre"
    proc, _, err, exit_s = interrupted(run, six, after_steps=2, act=lambda p: p.send_signal(signal.SIGTERM))
    assert proc.returncode == 3, err[-3000:]
    assert "preempted by SIGTERM" in err and exit_s < 60
    latest = (run / "checkpoints" / "latest").read_text().strip()
    k = int(latest.split("_")[1])
    assert 2 <= k < 6 and (run / "checkpoints" / latest / "COMPLETE").is_file()

    resumed = train(run, six)  # trainer.resume=auto is the default
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    got = records(run)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for g, w in zip(got, want):  # exact: same floats, not approximately
        assert (g["loss"], g["reward_mean"], g["generated_tokens"]) == (w["loss"], w["reward_mean"],
                                                                        w["generated_tokens"])
    print(f"preempted at step {k}, exit {exit_s:.1f}s after SIGTERM; losses {[r['loss'] for r in got]}")


@pytest.mark.slow
def test_killed_actor_restarts_from_checkpoint_and_finishes(tmp_path):
    run = tmp_path / "run"
    before = ray_processes()
    # the default skips the log-prob recompute on-policy, so the worker would sit idle: use it every step
    proc, _, err, waited = interrupted(run, "trainer.checkpoint_every=1", "cluster.max_restarts=1",
                                       "algo.recompute_logprobs=true", after_steps=2,
                                       act=lambda p: kill_actor_of(p.pid, "ray::LogprobWorker"), timeout=500)
    assert proc.returncode == 0, err[-3000:]
    assert "actor failure: logprob_worker died" in err and "restart 1/1 from" in err
    s = json.loads((run / "summary.json").read_text())
    assert [r["step"] for r in s["records"]] == [1, 2, 3, 4] and s["restarts"] == 1
    print(f"killed LogprobWorker at step >= 2: restarted and finished {waited:.1f}s later")
    assert not left_behind(before)


@pytest.mark.slow  # the default suite stays under 30 minutes on 2 cores
def test_sigusr2_checkpoints_and_the_run_goes_on(tmp_path):
    run = tmp_path / "run"
    proc, _, err, _ = interrupted(run, "trainer.max_steps=5", after_steps=1,
                                  act=lambda p: p.send_signal(signal.SIGUSR2))
    assert proc.returncode == 0, err[-3000:]
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and 1 <= int(saved[0].split("_")[1]) < 5, saved  # checkpoint_every=0: only the signal's
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4, 5]



@pytest.mark.slow  # the default suite stays under 30 minutes on 2 cores
def test_sigkill_of_the_driver_mid_checkpoint_leaves_the_last_one_loadable(tmp_path):
    """kill -9 of the whole driver (its process group) while it writes checkpoint k: the half-written
    directory stays hidden, `latest` still names k-1, and trainer.resume=auto continues from it."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    before = ray_processes()
    every = "trainer.checkpoint_every=1"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlspec.train", *BASE, every, f"hydra.run.dir={run}"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    caught = None
    try:
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            if (ckpts / "latest").is_file() and (writing := sorted(ckpts.glob(".tmp-step_*"))):
                os.killpg(proc.pid, signal.SIGKILL)
                caught = writing[0].name
                break
            time.sleep(0.005)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        orphans, named = left_behind(before), []
        for pid in orphans:  # keep the machine clean even when the assertion below fails
            try:
                named.append((pid, Path(f"/proc/{pid}/cmdline").read_bytes()[:120]))
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for d in Path("/tmp").glob(f"rlspec-ray-{proc.pid}-*"):  # no __exit__ ran to remove it
            shutil.rmtree(d, ignore_errors=True)
    assert caught, ("the run ended before a second checkpoint was being written:\n"
                    + (tmp_path / "killed.log").read_text()[-3000:])
    assert proc.returncode == -signal.SIGKILL and not orphans, named
    assert (ckpts / caught).is_dir()  # killed mid-write: the half-written checkpoint is still on disk
    k = int(caught.split("_")[1].split("-")[0])
    assert not (ckpts / ck.step_dir_name(k)).exists()
    assert (ckpts / "latest").read_text().strip() == ck.step_dir_name(k - 1)
    found = ck.latest(ckpts)
    assert found.name == ck.step_dir_name(k - 1) and ck.read_driver_state(found).step == k - 1

    resumed = train(run, every)  # trainer.resume=auto is the default
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and f"(step {k - 1})" in resumed.stdout
    assert [r["step"] for r in records(run)] == [1, 2, 3, 4]
    assert not list(ckpts.glob(".tmp-*")) and ck.latest(ckpts).name == ck.step_dir_name(4)
    print(f"killed the driver while it wrote {caught}; resumed from step {k - 1} and finished")
