"""Running rlspec's entry point in a subprocess, for the CLI, resilience and queue tests: the small
run they share, its summary's records, and Ray processes a run leaves behind."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT, TEST_EXPERIMENT
from helpers.procs import processes_with

SMALL = [TEST_EXPERIMENT, "trainer.max_steps=2", "trainer.val_every=1", "generation.num_prompts_per_step=4",
         "generation.num_generations_per_prompt=4", "trainer.micro_batch_size=8", "data.train.num_rows=64",
         "data.val.num_rows=16", "generation.max_new_tokens=40", "logging.wandb_mode=offline"]
BASE = [*SMALL, "trainer.max_steps=4", "trainer.val_every=0", "trainer.checkpoint_every=0", "trainer.save_final=false",
        "logging.plot=false", "logging.wandb_mode=disabled", "logging.progress_bar=false"]


def train(run_dir: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlspec.train", *BASE, *extra, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def records(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "summary.json").read_text())["records"]


def drafts(rec: dict) -> dict:
    """A step record's speculation counters, less the drafter's timings."""
    return {k: v for k, v in rec["spec"].items() if "timing" not in k and "seconds" not in k}


def steps_done(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "summary.json").read_text())["steps"]
    except (OSError, ValueError):
        return 0


def interrupted(run_dir: Path, *extra: str, after_steps: int, act, timeout: int = 400):
    """Start a CLI run, call act(proc) once it has finished `after_steps` steps, and wait for it
    to end. Returns (proc, stdout, stderr, seconds from act to exit)."""
    proc = subprocess.Popen([sys.executable, "-m", "rlspec.train", *BASE, *extra, f"hydra.run.dir={run_dir}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + timeout
        while steps_done(run_dir) < after_steps and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        if steps_done(run_dir) < after_steps:  # what act() was to interrupt never happened: say why
            ended = (f"ended with exit {proc.returncode}" if proc.poll() is not None
                     else f"was still running after {timeout}s")
            if proc.poll() is None:
                proc.kill()
            out, err = proc.communicate(timeout=60)
            raise AssertionError(f"the run {ended} before finishing step {after_steps}:\n{out[-2000:]}\n{err[-4000:]}")
        act(proc)
        t0 = time.time()
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, out, err, time.time() - t0


def ray_processes() -> set[int]:
    """Live processes of this test session's rlspec local Ray clusters (raylet, gcs, workers)."""
    return processes_with(b"rlspec-ray-")


def left_behind(before: set[int], within_s: float = 20.0) -> list[int]:
    """Ray processes that appeared after `before` was taken and are still alive `within_s`
    seconds from now (shutdown takes a moment)."""
    deadline = time.time() + within_s
    while (new := ray_processes() - before) and time.time() < deadline:
        time.sleep(0.5)
    return sorted(new)


def kill_actor_of(driver_pid: int, title: str, within_s: float = 30.0) -> int:
    """SIGKILL the Ray worker process titled `title` that this driver started (by pid), looking
    again for up to `within_s` seconds while the driver lives."""
    from rlspec.rewards.sandbox import _descendants

    deadline = time.time() + within_s
    while True:
        seen = {}
        for pid in _descendants(driver_pid):
            try:
                seen[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
                if seen[pid].startswith(title.encode()):
                    os.kill(pid, signal.SIGKILL)
                    return pid
            except OSError:
                continue
        if time.time() > deadline or not Path(f"/proc/{driver_pid}").exists():
            break
        time.sleep(0.5)
    names = "\n".join(f"  {pid}: {cmd[:120]!r}" for pid, cmd in seen.items())
    raise AssertionError(f"no {title} process under driver {driver_pid}; its descendants:\n{names or '  none'}")
