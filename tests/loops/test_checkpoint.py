"""Checkpoint files: atomic commit, `latest` pointer, keep-last-N, and a driver killed with SIGKILL
mid-checkpoint leaving the previous checkpoint loadable."""
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, child_env
from rlspec.loops import checkpoint as ck
from rlspec.messages import StepRecord
from rlspec.loops.preemption import NumericalDivergence


def state(step: int) -> ck.DriverState:
    return ck.DriverState(step=step, sampler={"epoch": 0, "cursor": 4 * step, "seed": 0, "size": 64},
                          rng=ck.rng_state(), records=[], val=[], counters={"nonfinite_steps": 0})


def save(root, step: int, keep: int = 3):
    tmp = ck.begin(root, step)
    (tmp / "learner").mkdir()
    torch.save({"w": torch.full((4,), float(step))}, tmp / "learner" / "model.pt")
    ck.write_driver_parts(tmp, state(step), {"trainer": {"seed": 0}})
    return ck.commit(root, tmp, step, keep)


def test_commit_latest_and_keep_last_n(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep=2)
    assert [d.name for d in ck.complete_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000004" == ck.latest(tmp_path).name
    assert ck.read_driver_state(ck.latest(tmp_path)).sampler["cursor"] == 16
    assert ck.resolve_resume("never", tmp_path) is None
    assert ck.resolve_resume("auto", tmp_path / "nothing") is None
    assert ck.resolve_resume(str(tmp_path / "step_00000003"), "unused").name == "step_00000003"


def test_rng_state_round_trip():
    import random

    s = ck.rng_state()
    a = (random.random(), torch.rand(3))
    ck.set_rng_state(s)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


KILLER = """
import os, signal, sys, time, torch
sys.path.insert(0, {root!r})
from rlspec.loops import checkpoint as ck
from test_checkpoint import save, state
root, where = sys.argv[1], sys.argv[2]
save(root, 1)
if where == "writing":
    tmp = ck.begin(root, 2)
    with open(tmp / "big.bin", "wb") as f:
        f.write(b"x" * (1 << 20)); f.flush()
        print("writing", flush=True)
        while True:
            f.write(b"x" * (1 << 16)); time.sleep(0.01)
else:  # die between the directory rename and the pointer update
    real = os.replace
    def replace(src, dst):
        if str(dst).endswith("latest"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst)
    ck.os.replace = replace
    save(root, 2)
"""


@pytest.mark.parametrize("where", ["writing", "before_pointer"])
def test_sigkill_mid_checkpoint_leaves_previous_loadable(tmp_path, where):
    script = tmp_path / "killer.py"
    script.write_text(KILLER.format(root=str(ROOT)))
    env = child_env(ROOT / "tests" / "loops")
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck"), where], stdout=subprocess.PIPE,
                            text=True, env=env)
    if where == "writing":
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    found = ck.latest(tmp_path / "ck")
    assert found.name == "step_00000001"
    assert ck.read_driver_state(found).step == 1
    assert torch.equal(torch.load(found / "learner" / "model.pt")["w"], torch.full((4,), 1.0))
    save(tmp_path / "ck", 3)  # the next save clears the half-written temp directory
    assert not list((tmp_path / "ck").glob(".tmp-*")) and ck.latest(tmp_path / "ck").name == "step_00000003"


def test_nonfinite_guard_counts_resets_and_stops_with_checkpoint():
    from dataclasses import asdict

    from rlspec.loops.state import Counters
    from rlspec.loops.sync import guard_nonfinite

    saved = []
    log = SimpleNamespace(notes={}, write=lambda msg: None, write_summary=lambda: saved.append("summary"))
    counters = Counters()
    rec = lambda step, skipped: StepRecord(step, step, float("nan") if skipped else 0.1, 0, 0, {}, 0, 0, 0, 0,  # noqa: E731
                                           extra={"train/skipped": float(skipped)})
    for step, skipped in [(1, True), (2, True), (3, False), (4, True), (5, True)]:
        guard_nonfinite(counters, rec(step, skipped), 2, log, lambda: saved.append(step) or "ck")
    nonfinite = {k: v for k, v in asdict(counters).items() if k.startswith("nonfinite")}
    assert nonfinite == {"nonfinite_steps": 4, "nonfinite_in_row": 2} and not saved
    with pytest.raises(NumericalDivergence, match="3 non-finite updates in a row"):
        guard_nonfinite(counters, rec(6, True), 2, log, lambda: saved.append(6) or "ck")
    assert saved == [6, "summary"] and log.notes["nonfinite_steps"] == 5
