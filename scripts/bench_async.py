"""The paper's 2x2 on one workload: {sync, async} x {speculation off, on}, side by side.

Runs `python -m rlspec.train` for every cell and seed (cells interleaved per seed, so machine drift
hits all four alike), reads each run's summary.json and reports per cell, mean +- std over seeds:
step time, exposed generation time (what the learner waited for rollouts), rollout engine time and
tokens/s, overlap, largest policy lag, acceptance length, held-out accuracy after the last step.

    python scripts/bench_async.py --seeds 0 1 2 --async-set cluster.generator_threads=1 --out docs/bench/async_2x2.json

The cells run the default experiment for its own trainer.max_steps unless told otherwise: Hydra
overrides after --set apply to every cell (e.g. --set +experiment=tiny_cpu
generation.max_new_tokens=96), --async-set to the async cells only, --steps sets the steps.
Held-out accuracy is measured before the first step and after the last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import harness
from harness import fmt, times

CELLS = {  # name -> overrides
    "sync / spec off": ["async_grpo.enabled=false", "speculation=none"],
    "sync / spec on": ["async_grpo.enabled=false"],
    "async / spec off": ["async_grpo.enabled=true", "speculation=none"],
    "async / spec on": ["async_grpo.enabled=true"],
}
METRICS = ("step_seconds", "steady_step_seconds", "exposed_generation_seconds", "engine_seconds", "learner_seconds",
           "tokens_per_second", "overlap_fraction", "val_accuracy", "acceptance_length", "wall_seconds")


def read_run(name: str, seed: int, run_dir: Path) -> dict:
    """One cell's figures from its run's summary.json (steady state: steps 2..N)."""
    s = json.loads((run_dir / "summary.json").read_text())
    recs = s["records"]
    steady = recs[1:] or recs  # step 1 has nothing to overlap with
    return {
        "cell": name, "seed": seed, "run_dir": str(run_dir), "wall_seconds": s["wall_seconds"],
        "step_seconds": s["step_seconds"],
        "steady_step_seconds": statistics.mean(r["step_seconds"] for r in steady),
        "exposed_generation_seconds": statistics.mean(r["exposed_generation_seconds"] for r in steady),
        "engine_seconds": statistics.mean(r["engine_seconds"] for r in steady),
        # the learner's own stages (log-prob recompute, update, refit): slower while the engine
        # shares their cores
        "learner_seconds": statistics.mean(r["logprob_seconds"] + r["train_seconds"] for r in steady),
        "tokens_per_second": s["tokens_per_second"],
        "overlap_fraction": statistics.mean(r["overlap_fraction"] for r in steady),
        "policy_lag_max": s["policy_lag_max"],
        "val_accuracy": s["val_accuracy"][-1], "val_accuracy_start": s["val_accuracy"][0],
        "train_accuracy_last": recs[-1]["accuracy"],
        "acceptance_length": s["acceptance_length"],
        "importance_weight_max": max(r["importance_weight"].get("max", 1.0) for r in recs),
        "importance_capped_frac": statistics.mean(r["importance_weight"].get("capped_frac", 0.0) for r in recs),
    }


def run_cell(name: str, overrides: list[str], seed: int, steps: int, work: Path, timeout: int) -> dict:
    run_dir = work / f"{name.replace(' / ', '_').replace(' ', '_')}_seed{seed}"
    cmd = harness.train_command([*overrides, f"trainer.max_steps={steps}", f"trainer.seed={seed}",
                                 f"trainer.val_every={steps}"], run_dir)
    seconds = harness.run(cmd, f"{name} seed {seed}", timeout)
    out = {**read_run(name, seed, run_dir), "wall_seconds": seconds}
    print(f"  {name:<17} seed {seed}: step {out['steady_step_seconds']:.2f}s, exposed gen "
          f"{out['exposed_generation_seconds']:.2f}s of {out['engine_seconds']:.2f}s, held-out acc "
          f"{out['val_accuracy']:.3f}", flush=True)
    return out


def summarise(runs: list[dict]) -> list[dict]:
    rows = []
    for name in [c for c in CELLS if any(r["cell"] == c for r in runs)]:
        mine = [r for r in runs if r["cell"] == name]
        row = {"cell": name, "seeds": [r["seed"] for r in mine],
               "policy_lag_max": max(r["policy_lag_max"] for r in mine)}
        for m in METRICS:
            row[m], row[f"{m}_std"] = harness.mean_std([r[m] for r in mine])
        rows.append(row)
    base = {r["cell"]: r for r in rows}
    ratio = lambda b, r: None if b is None else b["steady_step_seconds"] / r["steady_step_seconds"]  # noqa: E731
    for r in rows:
        sync = base.get("sync / spec on" if "spec on" in r["cell"] else "sync / spec off")
        r["step_speedup_vs_sync"] = ratio(sync, r)
        r["step_speedup_vs_baseline"] = ratio(base.get("sync / spec off"), r)
        r["val_accuracy_diff_vs_sync"] = None if sync is None else r["val_accuracy"] - sync["val_accuracy"]
    return rows


def table(rows: list[dict]) -> str:
    head = ("| cell | step s (steady) | vs sync | vs sync/off | exposed gen s | engine gen s | learner s | "
            "overlap | tokens/s | acc. len | lag max | held-out acc |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['cell']} | {fmt(r['steady_step_seconds'], r['steady_step_seconds_std'])} | "
                     f"{times(r['step_speedup_vs_sync'])} | {times(r['step_speedup_vs_baseline'])} | "
                     f"{fmt(r['exposed_generation_seconds'], r['exposed_generation_seconds_std'])} | "
                     f"{fmt(r['engine_seconds'], r['engine_seconds_std'])} | "
                     f"{fmt(r['learner_seconds'], r['learner_seconds_std'])} | {fmt(r['overlap_fraction'])} | "
                     f"{fmt(r['tokens_per_second'], p=0)} | {fmt(r['acceptance_length'])} | {r['policy_lag_max']} | "
                     f"{fmt(r['val_accuracy'], r['val_accuracy_std'], 3)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, help="RL steps per run (default: the experiment's trainer.max_steps)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", nargs="*", default=[], dest="overrides", help="Hydra overrides for every cell")
    ap.add_argument("--async-set", nargs="*", default=[], help="Hydra overrides for the async cells only")
    ap.add_argument("--cells", nargs="+", choices=list(CELLS), default=list(CELLS), help="a subset of the four")
    ap.add_argument("--work", default="multirun/bench_async", help="run directories go here")
    ap.add_argument("--out", default="bench_async.json")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run before it counts as hung")
    ap.add_argument("--table", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    ap.add_argument("--rescan", metavar="JSON", help="re-read an earlier run's run directories into its JSON")
    a = ap.parse_args()
    if a.table or a.rescan:
        path = Path(a.table or a.rescan)
        result = json.loads(path.read_text())
        if a.rescan:
            result["runs"] = [{**read_run(r["cell"], r["seed"], Path(r["run_dir"])), "wall_seconds": r["wall_seconds"]}
                              for r in result["runs"]]
            result["rows"] = summarise(result["runs"])
            harness.write(result, path)
        print(table(summarise(result["runs"])))
        return
    if a.steps is None:
        from rlspec.train import compose_config

        a.steps = compose_config(a.overrides).trainer.max_steps
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    runs = []
    for seed in a.seeds:
        for name, cell in ((n, CELLS[n]) for n in a.cells):
            extra = a.async_set if name.startswith("async") else []
            runs.append(run_cell(name, [*a.overrides, *cell, *extra], seed, a.steps, work, a.timeout))
    rows = summarise(runs)
    result = {**harness.stamp(), "experiment": harness.experiment_of(a.overrides), "steps": a.steps, "seeds": a.seeds,
              "overrides": a.overrides, "async_overrides": a.async_set, "cells": {n: CELLS[n] for n in a.cells},
              "rows": rows, "runs": runs}
    print(table(rows))
    harness.write(result, a.out)


if __name__ == "__main__":
    main()
