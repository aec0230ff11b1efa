"""One optimizer step per rollout batch against several (trainer.mini_batch_size), side by side:
held-out accuracy, how often the PPO clip binds, step time. On tiny_cpu (the addition task, 64
prompts x 4 answers a step, mini-batches of 64) unless --experiment and --mini-batch-size say
otherwise.

    python scripts/bench_minibatch.py --steps 40 --seeds 0 1 2 --out docs/bench/minibatch.json
    python scripts/bench_minibatch.py --experiment chain_cpu --mini-batch-size 16 --steps 60 \
        --out docs/bench/minibatch_chain.json

Cells run interleaved per seed (machine drift hits both alike); each is `python -m rlspec.train`
with the cell's overrides (scripts/bench_async.py runs them).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import harness
from bench_async import run_cell
from harness import ROOT, mean_std

def cells(experiment: str, mini: int) -> dict[str, list[str]]:
    """Cell name -> overrides: the experiment as it is, and with `mini` samples per optimizer step."""
    from rlspec.train import compose_config

    g = compose_config([f"+experiment={experiment}"]).generation
    samples = g.num_prompts_per_step * g.num_generations_per_prompt
    if samples % mini:
        raise SystemExit(f"--mini-batch-size {mini} does not divide {experiment}'s {samples} samples a step")
    exp = f"+experiment={experiment}"
    return {"one step per batch": [exp], f"{samples // mini} mini-batches": [exp, f"trainer.mini_batch_size={mini}"]}


def with_clipping(r: dict) -> dict:
    recs = json.loads((Path(r["run_dir"]) / "summary.json").read_text())["records"]
    clip = [x["extra"]["train/clip_frac"] for x in recs]
    return {**r, "clip_frac": statistics.mean(clip), "clip_frac_max": max(clip),
            "clip_steps": sum(c > 0 for c in clip),
            "dual_clip_frac": statistics.mean(x["extra"]["train/dual_clip_frac"] for x in recs),
            "optimizer_steps": recs[-1]["extra"]["train/optimizer_steps"]}


def table(rows: list[dict]) -> str:
    out = ["| cell | optimizer steps per batch | clip_frac (mean over steps) | largest step's clip_frac | "
           "steps where the clip bound | held-out acc (start -> end) | step s |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['cell']} | {r['optimizer_steps']:.0f} | {r['clip_frac']:.1e} ± {r['clip_frac_std']:.1e} | "
                   f"{r['clip_frac_max']:.1e} | {r['clip_steps']:.1f} of {r['steps']} | "
                   f"{r['val_accuracy_start']:.3f} -> {r['val_accuracy']:.3f} ± {r['val_accuracy_std']:.3f} | "
                   f"{r['step_seconds']:.2f} ± {r['step_seconds_std']:.2f} |")
    return "\n".join(out)


def summarise(runs: list[dict]) -> list[dict]:
    rows = []
    for name in dict.fromkeys(r["cell"] for r in runs):
        mine = [r for r in runs if r["cell"] == name]
        row = {"cell": name, "seeds": [r["seed"] for r in mine], "overrides": mine[0].get("overrides"),
               "optimizer_steps": mine[0]["optimizer_steps"], "val_accuracy_start": mine[0]["val_accuracy_start"]}
        row["steps"] = mine[0]["steps"]
        for m in ("clip_frac", "clip_frac_max", "clip_steps", "dual_clip_frac", "val_accuracy", "step_seconds"):
            row[m], row[f"{m}_std"] = mean_std([r[m] for r in mine])
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--experiment", default="tiny_cpu")
    ap.add_argument("--mini-batch-size", type=int, default=64, help="samples per optimizer step in the second cell")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", default="multirun/bench_minibatch", help="run directories go here")
    ap.add_argument("--out", default="bench_minibatch.json")
    ap.add_argument("--resummarise", metavar="JSON", help="recompute an earlier run's rows from its run directories "
                    "(still on disk) and write them back")
    a = ap.parse_args()
    if a.resummarise:
        r = json.loads(Path(a.resummarise).read_text())
        r["runs"] = [with_clipping({**x, "steps": r["steps"]}) for x in r["runs"]]
        r["rows"] = summarise(r["runs"])
        harness.write(r, a.resummarise)
        print(table(r["rows"]))
        return
    t0, runs, grid, stamp = time.time(), [], cells(a.experiment, a.mini_batch_size), harness.stamp()
    for seed in a.seeds:
        for name, overrides in grid.items():
            runs.append(with_clipping({**run_cell(name, overrides, seed, a.steps, ROOT / a.work, 1800),
                                       "steps": a.steps, "overrides": overrides}))
    rows = summarise(runs)
    print(table(rows))
    harness.write({**stamp, "steps": a.steps, "seeds": a.seeds, "experiment": a.experiment,
                   "mini_batch_size": a.mini_batch_size, "rows": rows, "runs": runs, "wall_seconds": time.time() - t0},
                  a.out)


if __name__ == "__main__":
    main()
