"""What every benchmark script shares: run `python -m rlspec.train` and read its summary.json, stamp a
result with the version, machine, date and the exact command that made it, mean and spread over
seeds, and write the JSON. docs/benchmarks.md reads the command from the JSON (`command`).

Scripts under scripts/ import it as `harness` (Python puts a script's own folder on its path)."""
from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what a benchmarked run leaves out: checkpoints, plots, wandb, the progress bar
QUIET = ["trainer.checkpoint_every=0", "logging.plot=false", "logging.wandb_mode=disabled",
         "logging.progress_bar=false"]


def rlspec_version() -> str:
    """The commit the benchmark ran at, "-dirty" when it ran with uncommitted changes ("unknown"
    outside a git checkout)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
    except OSError:  # no git on this machine
        out = ""
    return out or "unknown"


def cpu_model() -> str:
    """This machine's CPU as the kernel names it (timings move with it, not only with the core count)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown"


def command(argv: list[str] | None = None) -> str:
    """The command line that runs this script with `argv` (default: this process's), as a user types
    it from the repository root."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *argv[1:]])


def machine_seconds(repeats: int = 5) -> float:
    """Seconds one core takes for a fixed piece of torch work (the best of `repeats`): two machines
    sold under one CPU name, or one machine on a busy day, can differ by more than the settings a
    grid compares; a run records this beside its timings, so runs from different machines are told
    apart."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(400):
                a = torch.tanh(a @ b)
            best = min(best, time.perf_counter() - t0)
        return best
    finally:
        torch.set_num_threads(threads)


def stamp() -> dict:
    """The fields every benchmark JSON carries: version, date, machine, command."""
    return {"version": rlspec_version(), "date": datetime.date.today().isoformat(), "cpu": cpu_model(),
            "cpu_count": os.cpu_count(), "command": command()}


def experiment_of(overrides: list[str]) -> str:
    """The experiment `python -m rlspec.train <overrides>` runs (the default where they name none)."""
    from rlspec.train import with_default_experiment

    return [o.split("=", 1)[1] for o in with_default_experiment(list(overrides))
            if o.lstrip("+~").startswith("experiment=")][-1]


def mean_std(xs: list[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the values that are not None (std 0 for one value;
    (None, None) for none)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt(v, std=None, p=2) -> str:
    """A mean (and ± its spread), "-" for none."""
    if v is None:
        return "-"
    return f"{v:.{p}f}" + (f" ± {std:.{p}f}" if std is not None else "")


def times(v) -> str:
    """A ratio as "1.23x"."""
    return "-" if v is None else f"{v:.2f}x"


def train_command(overrides: list[str], run_dir: Path, save_final: bool = False) -> list[str]:
    """`python -m rlspec.train` with `overrides`, quiet, writing into run_dir; from the start unless
    the overrides say otherwise (a run directory an interrupted benchmark left would otherwise be
    resumed from its checkpoint, and the run would measure only its remainder)."""
    fresh = [] if any(o.startswith("trainer.resume=") for o in overrides) else ["trainer.resume=never"]
    return [sys.executable, "-m", "rlspec.train", *overrides, *fresh, f"trainer.save_final={str(save_final).lower()}",
            *QUIET, f"hydra.run.dir={run_dir}"]


def run(cmd: list[str], label: str, timeout: int) -> float:
    """Run `cmd` from the repository root; seconds taken. A failure exits naming `label`, the
    command and the end of its stderr; past `timeout` seconds it counts as hung."""
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{label} failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return time.time() - t0


def train(overrides: list[str], run_dir: Path, label: str, timeout: int) -> tuple[dict, float]:
    """One training run: its summary.json and the seconds its process took."""
    seconds = run(train_command(overrides, run_dir), label, timeout)
    return json.loads((run_dir / "summary.json").read_text()), seconds


def write(result: dict, out: str | Path) -> None:
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
