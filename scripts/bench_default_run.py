"""The default run, `python -m rlspec.train`, once per speculation setting and seed, side by side.

Each run is the default experiment exactly as `make demo` runs it, with only the speculation
group (and its k), the seed and logging switched; settings interleave per seed, so machine drift
hits all of them alike. From every run's summary.json it reports, mean ± std over seeds: wall
time, the stage shares, held-out accuracy at each validation, the response-length distribution,
and per epoch (one pass over data.train) the generation stage's seconds per step, its speedup
over no speculation and the tokens per verification.

    python scripts/bench_default_run.py --settings none history draft_model:3 --seeds 0 1 2 \\
        --out docs/bench/default_run.json

With --add the grid grows an earlier --out one run at a time (the JSON is rewritten after each):
a grid too long for one sitting is run in parts, each run stamped with the commit it ran at.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

import harness
from rlspec.loops.partial import groups_in_flight


def overrides(setting: str) -> list[str]:
    """'none', 'history', 'draft_model:3' -> the Hydra overrides that select it; each '+KEY=VALUE'
    after it adds that override to the setting's runs alone ('none+trainer.skip_zero_gradient_rows=false')."""
    head, *extra = setting.split("+")
    method, _, k = head.partition(":")
    return [f"speculation={method}", *([f"speculation.num_speculative_tokens={k}"] if k else []), *extra]


def epoch_steps(extra: list[str]) -> int:
    """Steps per pass over the training set in the default experiment (with `extra` applied); a
    fraction where the set does not divide into steps (the sampler runs on into the next epoch)."""
    from rlspec.train import compose_config

    cfg = compose_config(extra)
    per_epoch = cfg.data.train.num_rows / cfg.generation.num_prompts_per_step
    return int(per_epoch) if per_epoch.is_integer() else per_epoch


def read_run(setting: str, seed: int, run_dir: Path, per_epoch: float) -> dict:
    """A run's figures; a step belongs to the epoch its first prompt was drawn in."""
    s = json.loads((run_dir / "summary.json").read_text())
    recs = s["records"]
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")  # the run's composed config
    g = cfg.get("generation")
    partial = g is not None and g.get("partial", {}).get("enabled", False)
    # rows a generate call holds at its start: the step's groups, over-provisioned under partial rollouts
    held = None if g is None else g.num_generations_per_prompt * (
        groups_in_flight(g.num_prompts_per_step, g.partial.over_provision) if partial else g.num_prompts_per_step)
    parts: dict[int, list[dict]] = {}
    for r in recs:
        parts.setdefault(int((r["step"] - 1) / per_epoch + 1e-9), []).append(r)
    epochs = []
    for part in parts.values():
        drafts = sum((r["spec"] or {}).get("drafts", 0) for r in part)
        accepted = sum((r["spec"] or {}).get("accepted_tokens", 0) for r in part)
        moments = [r["decode_step_moments"] for r in part if r.get("decode_step_moments")]
        running = sum(m[1] for m in moments) / max(sum(m[0] for m in moments), 1.0)
        steps = sum(r["extra"].get("engine_steps", 0) for r in part)  # every engine step, prefills too
        rows_all = sum(r["extra"].get("engine_step_rows", 0) for r in part) / max(steps, 1.0)
        epochs.append({"steps": [part[0]["step"], part[-1]["step"]],
                       # the engine's mean running batch over its decode steps, and over the rows it held
                       "running_batch": running, "batch_fill": running / held if held and moments else None,
                       "batch_fill_all": rows_all / held if held and steps else None,
                       "generation_seconds": statistics.mean(r["stage_seconds"]["generation"] for r in part),
                       "step_seconds": statistics.mean(r["step_seconds"] for r in part),
                       "acceptance_length": 1 + accepted / drafts if drafts else None,
                       "history_matches": sum((r["spec"] or {}).get("history_matches", 0) for r in part) or None})
    ex = [r["extra"] for r in recs]
    spec = cfg.speculation
    return {"setting": setting, "seed": seed, "run_dir": str(run_dir), "wall_seconds": s["wall_seconds"],
            "speculation": {k: spec[k] for k in ("method", "num_speculative_tokens", "max_speculative_tokens")},
            "steps": s["steps"], "step_seconds": s["step_seconds"], "stage_share": s["stage_share"],
            "generation_seconds": s["stage_seconds"]["generation"], "val_steps": s["val_steps"],
            "val_accuracy": s["val_accuracy"], "val_seconds": s["val_seconds"],
            # the steps' seconds (validation left out) up to each validation: time to an accuracy
            "seconds_at_val": [sum(r["step_seconds"] for r in recs if r["step"] <= v) for v in s["val_steps"]],
            "acceptance_length": s["acceptance_length"],
            "tokens_per_second": s["tokens_per_second"], "epochs": epochs,
            # per step: [engine steps, rows summed over them, the engine's seconds] (engine_cost's points)
            "engine_points": [[r["extra"]["engine_steps"], r["extra"]["engine_step_rows"], r["engine_seconds"]]
                              for r in recs if "engine_steps" in r["extra"] and r.get("engine_seconds")],
            "partial": {k[len("partial/"):]: sum(x[k] for x in ex) for k in ex[0] if k.startswith("partial/")}
            if partial else None,
            # versions between a trained token's sampling weights and the learner's: the run's
            # largest, and the mean of the steps' per-token means
            "policy_lag": {"max": s["policy_lag_max"],
                           "mean": statistics.mean(x.get("policy_lag_mean", 0.0) for x in ex)},
            # the lengths of the first step's rollouts (the shipped policy's) and over the whole run:
            # the mean of the steps' medians and 90th percentiles, the longest answer of any step
            "response_length_first": {q: ex[0][f"response_length_{q}"] for q in ("p50", "p90", "max")},
            "response_length_run": {"p50": statistics.mean(x["response_length_p50"] for x in ex),
                                    "p90": statistics.mean(x["response_length_p90"] for x in ex),
                                    "max": max(x["response_length_max"] for x in ex)}}


def run_one(setting: str, seed: int, extra: list[str], work: Path, per_epoch: int, timeout: int) -> dict:
    name = setting.replace(':', '_k').replace('+', '__').replace('=', '-')
    run_dir = work / f"{name.replace('[', '').replace(']', '').replace(',', '_')}_seed{seed}"   # no list syntax
    cmd = harness.train_command([*extra, *overrides(setting), f"trainer.seed={seed}"], run_dir)
    seconds = harness.run(cmd, f"{setting} seed {seed}", timeout)
    out = {**read_run(setting, seed, run_dir, per_epoch), "process_seconds": seconds}
    print(f"  {setting:<14} seed {seed}: {out['wall_seconds'] / 60:.1f} min, generation "
          f"{out['stage_share']['generation']:.1%} of the step, held-out "
          f"{' -> '.join(f'{v:.3f}' for v in out['val_accuracy'])}, generation s/step by epoch "
          f"{', '.join(format(e['generation_seconds'], '.2f') for e in out['epochs'])}", flush=True)
    return out


def to_target(run: dict, target: float) -> float | None:
    """Seconds of steps until the first validation at or above `target` (None: never reached)."""
    hit = [t for t, acc in zip(run.get("seconds_at_val", []), run["val_accuracy"]) if acc >= target]
    return hit[0] if hit else None


def summarise(runs: list[dict], target: float = 0.9) -> list[dict]:
    """One row per setting: means and stds over its seeds; speedups against 'none' of the same seeds;
    seconds to held-out accuracy `target` over the seeds that reached it."""
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    base = {r["seed"]: r for r in runs if r["setting"] == "none"}
    fits = {a: engine_cost([r for r in runs if arm(r["setting"]) == a]) for a in {arm(s) for s in settings}}
    rows = []
    for name in settings:
        mine = [r for r in runs if r["setting"] == name]
        n_ep = min(len(r["epochs"]) for r in mine)
        row = {"setting": name, "seeds": [r["seed"] for r in mine], "val_steps": mine[0]["val_steps"],
               "speculation": mine[0].get("speculation")}
        for key, get in {"wall_minutes": lambda r: r["wall_seconds"] / 60,
                         "step_seconds": lambda r: r["step_seconds"],
                         "generation_share": lambda r: r["stage_share"]["generation"],
                         "generation_seconds": lambda r: r["generation_seconds"],
                         "val_first": lambda r: r["val_accuracy"][0],
                         "val_last": lambda r: r["val_accuracy"][-1]}.items():
            row[key], row[f"{key}_std"] = harness.mean_std([get(r) for r in mine])
        reached = [t for t in (to_target(r, target) for r in mine) if t is not None]
        row["target"], row["target_reached"] = target, len(reached)
        row["target_seconds"], row["target_seconds_std"] = harness.mean_std(reached) if reached else (None, None)
        if all("val_seconds" in r for r in mine):  # seconds per validation, mean over the run's
            per_run = [statistics.mean(r["val_seconds"]) for r in mine]
            row["val_seconds"], row["val_seconds_std"] = harness.mean_std(per_run)
        row["val_accuracy"] = [statistics.mean(r["val_accuracy"][i] for r in mine)
                               for i in range(len(row["val_steps"]))]
        row["val_accuracy_std"] = [harness.mean_std([r["val_accuracy"][i] for r in mine])[1]
                                   for i in range(len(row["val_steps"]))]
        row["epochs"] = []
        for e in range(n_ep):
            gen = [r["epochs"][e]["generation_seconds"] for r in mine]
            speed = [base[r["seed"]]["epochs"][e]["generation_seconds"] / r["epochs"][e]["generation_seconds"]
                     for r in mine if r["seed"] in base]
            acc = [r["epochs"][e]["acceptance_length"] for r in mine if r["epochs"][e]["acceptance_length"]]
            fill = [r["epochs"][e]["batch_fill"] for r in mine if r["epochs"][e].get("batch_fill") is not None]
            fill_all = [r["epochs"][e]["batch_fill_all"] for r in mine
                        if r["epochs"][e].get("batch_fill_all") is not None]
            row["epochs"].append({"steps": mine[0]["epochs"][e]["steps"], "generation_seconds": harness.mean_std(gen),
                                  "batch_fill": harness.mean_std(fill) if fill else None,
                                  "batch_fill_all": harness.mean_std(fill_all) if fill_all else None,
                                  "speedup_vs_none": harness.mean_std(speed) if speed else None,
                                  "acceptance_length": statistics.mean(acc) if acc else None})
        if all(r.get("partial") for r in mine):  # partial rollouts: counts over the run, mean over seeds
            row["partial"] = {k: statistics.mean(r["partial"][k] for r in mine) for k in mine[0]["partial"]}
        row["engine_cost"] = fits[arm(name)]
        if all("policy_lag" in r for r in mine):  # the largest over the seeds, the mean of their means
            row["policy_lag"] = {"max": max(r["policy_lag"]["max"] for r in mine),
                                 "mean": statistics.mean(r["policy_lag"]["mean"] for r in mine)}
        for which in ("first", "run"):
            row[f"response_length_{which}"] = {q: statistics.mean(r[f"response_length_{which}"][q] for r in mine)
                                               for q in ("p50", "p90", "max")}
        rows.append(row)
    return rows


def arm(setting: str) -> str:
    """The setting without its partial-rollout overrides: the runs one engine cost fit pools."""
    return "+".join(p for p in setting.split("+") if not p.startswith("generation.partial."))


def engine_cost(runs: list[dict]) -> dict | None:
    """Least squares over the runs' steps of the engine's seconds = a x engine steps + b x rows
    (a step's fixed cost, a row's) and the share of the seconds' variance it explains (R^2). Fit
    over an arm's runs with and without partial rollouts, whose rows per step differ: where b
    dominates, a fuller batch costs about what it holds and fewer steps gain little."""
    pts = np.array([p for r in runs for p in r.get("engine_points", [])], dtype=float)
    if len(pts) < 3:
        return None
    (a, b), *_ = np.linalg.lstsq(pts[:, :2], pts[:, 2], rcond=None)
    resid = pts[:, 2] - pts[:, :2] @ np.array([a, b])
    r2 = 1 - float(resid @ resid) / float(((pts[:, 2] - pts[:, 2].mean()) ** 2).sum())
    steps, rows, secs = pts.sum(axis=0)
    return {"per_step_ms": 1e3 * a, "per_row_ms": 1e3 * b, "r2": r2, "row_share": b * rows / secs}


def pm(v: tuple[float, float] | None, spec: str = ".2f", unit: str = "", spread: bool = True) -> str:
    """mean ± std in format `spec`; the mean alone where `spread` is off (one seed has no spread)."""
    if v is None:
        return "-"
    return f"{v[0]:{spec}}{unit}" + (f" ± {v[1]:{spec}}" if spread else "")


def label(row: dict) -> str:
    """The setting, with the k its runs drafted (their composed config) where the setting names none."""
    spec = row.get("speculation")
    if not spec or spec["method"] == "none":
        return row["setting"]
    if spec["num_speculative_tokens"] == "auto":
        return f"{row['setting']} (k <= {spec['max_speculative_tokens']})"
    return row["setting"] if ":" in row["setting"] else f"{row['setting']} (k={spec['num_speculative_tokens']})"


def reach(row: dict, spread: bool) -> str:
    """Seconds to the target over the seeds that reached it, and how many of them did."""
    if row.get("target_seconds") is None:
        return f"never (0/{len(row['seeds'])})"
    t = pm((row["target_seconds"], row["target_seconds_std"]), ".0f", spread=spread and row["target_reached"] > 1)
    return f"{t} ({row['target_reached']}/{len(row['seeds'])})"


def machines(runs: list[dict]) -> str:
    """One line: per seed, the machine its runs found (harness.machine_seconds, lower is faster;
    runs from before that field show none). Empty when no run has it."""
    if not any("machine_seconds" in r for r in runs):
        return ""
    parts = []
    for seed in sorted({r["seed"] for r in runs}):
        got = [r["machine_seconds"] for r in runs if r["seed"] == seed and "machine_seconds" in r]
        n = sum(r["seed"] == seed for r in runs)
        shown = f"{min(got):.3f}-{max(got):.3f} s ({len(got)} of {n} runs)" if got else f"not recorded ({n} runs)"
        parts.append(f"seed {seed}: {shown}")
    return ("Machine speed before each run (one core's fixed torch work, `harness.machine_seconds`, lower is "
            "faster; compare settings within a seed where seeds ran on different machines): " + "; ".join(parts) + ".")


def table(rows: list[dict]) -> str:
    """Two markdown tables: the runs' totals, and generation per epoch."""
    vals = " | ".join(f"held-out @{s}" for s in rows[0]["val_steps"])
    target = rows[0].get("target")  # None: a JSON from before the time-to-target column
    to = "" if target is None else f" step s to held-out >= {target:.2f} (seeds) |"
    out = [f"| setting | wall min | step s | generation share | validation s | {vals} |{to} "
           "response p50 / p90 / max (step 1) |",
           "|---|---|---|---|---|" + "---|" * (len(rows[0]["val_steps"]) + (target is not None)) + "---|"]
    spread = any(len(r["seeds"]) > 1 for r in rows)
    for r in rows:
        v = " | ".join(pm(x, ".3f", spread=spread) for x in zip(r["val_accuracy"], r["val_accuracy_std"]))
        ln = r["response_length_first"]
        out.append(f"| {label(r)} | {pm((r['wall_minutes'], r['wall_minutes_std']), spread=spread)} | "
                   f"{pm((r['step_seconds'], r['step_seconds_std']), spread=spread)} | "
                   f"{pm((r['generation_share'], r['generation_share_std']), '.1%', spread=spread)} | "
                   f"{pm((r['val_seconds'], r['val_seconds_std']), spread=spread) if 'val_seconds' in r else '-'} | "
                   f"{v} |{'' if target is None else ' ' + reach(r, spread) + ' |'} "
                   f"{ln['p50']:.0f} / {ln['p90']:.0f} / {ln['max']:.0f} |")
    eps = rows[0]["epochs"]
    out += ["", "| setting | " + " | ".join(f"epoch {i + 1} (steps {e['steps'][0]}-{e['steps'][1]})"
                                            for i, e in enumerate(eps)) + " |",
            "|---|" + "---|" * len(eps)]
    for r in rows:
        cells = []
        for e in r["epochs"]:
            sp = ("" if r["setting"] == "none" or not e["speedup_vs_none"] else
                  f", {pm(e['speedup_vs_none'], unit='x', spread=spread)}")
            acc = "" if e["acceptance_length"] is None else f", {e['acceptance_length']:.2f} tok/verif."
            fill = "" if not e.get("batch_fill") else f", batch {pm(e['batch_fill'], '.0%', spread=False)} full"
            if e.get("batch_fill_all"):  # over every engine step, and over the decode steps alone
                fill = f", batch {pm(e['batch_fill_all'], '.0%', spread=False)} full" + (
                    f" ({pm(e['batch_fill'], '.0%', spread=False)} over decode steps)" if e.get("batch_fill") else "")
            cells.append(f"{pm(e['generation_seconds'], spread=spread)} s{sp}{acc}{fill}")
        out.append(f"| {label(r)} | " + " | ".join(cells) + " |")
    if any(r.get("partial") for r in rows):  # partial rollouts: what the run's calls carried (mean over seeds)
        out += ["", "| setting | groups carried | answers carried | answers resumed | answers dropped (too old) | "
                "tokens sampled / dropped | policy lag per token: mean, max |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("partial"):
                c, lag = r["partial"], r.get("policy_lag")
                out.append(f"| {label(r)} | {c['carried_groups']:.0f} | {c['carried_answers']:.0f} | "
                           f"{c['resumed_answers']:.0f} | {c['dropped_answers']:.0f} | "
                           f"{c['new_tokens']:.0f} / {c.get('dropped_tokens', 0):.0f} | "
                           f"{'-' if lag is None else format(lag['mean'], '.2f') + ', ' + str(lag['max'])} |")
    fits = {arm(r["setting"]): r["engine_cost"] for r in rows if r.get("engine_cost")}
    if fits:  # one fit an arm: its runs with and without partial rollouts pooled
        out += ["", "| arm (with and without partial rollouts) | engine s = a x steps + b x rows: a (ms) | b (ms) | "
                "R^2 over steps | rows' share of the seconds |", "|---|---|---|---|---|"]
        out += [f"| {name} | {c['per_step_ms']:.2f} | {c['per_row_ms']:.3f} | {c['r2']:.2f} | {c['row_share']:.0%} |"
                for name, c in fits.items()]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=["none", "history"],
                    help="speculation group[:k] per arm; 'none' first (speedups are against it)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", nargs="*", default=[], dest="overrides", help="Hydra overrides for every run")
    ap.add_argument("--work", default="multirun/bench_default_run", help="run directories go here")
    ap.add_argument("--out", default="bench_default_run.json")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run before it counts as hung")
    ap.add_argument("--target", type=float, default=0.9, help="held-out accuracy the time-to-target column reads")
    ap.add_argument("--add", action="store_true", help="grow --out where it exists: the (setting, seed) runs it "
                    "holds are kept, the others run; the JSON is rewritten after every run, so a grid can span "
                    "several invocations")
    ap.add_argument("--table", metavar="JSON", help="print the tables of an earlier run's JSON and exit")
    ap.add_argument("--rescan", metavar="JSON", help="re-read an earlier run's run directories (still on disk) "
                    "into its JSON")
    a = ap.parse_args()
    if a.table or a.rescan:
        path = Path(a.table or a.rescan)
        result = json.loads(path.read_text())
        if a.rescan:
            result["runs"] = [{**read_run(r["setting"], r["seed"], Path(r["run_dir"]), result["steps_per_epoch"]),
                               "process_seconds": r["process_seconds"]} for r in result["runs"]]
            result["rows"] = summarise(result["runs"], a.target)
            harness.write(result, path)
        print(table(result["rows"]))
        return
    if a.settings[0] != "none":
        ap.error("--settings must start with 'none' (the baseline)")
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    per_epoch = epoch_steps(a.overrides)
    stamp = harness.stamp()
    runs = earlier(Path(a.out), a.overrides) if a.add else []
    done = {(r["setting"], r["seed"]) for r in runs}
    for seed in a.seeds:  # settings interleave per seed: a grid stopped early has whole seeds
        for s in a.settings:
            if (s, seed) in done:
                continue
            speed = harness.machine_seconds()   # before the run: the machine as the run found it
            runs.append({**run_one(s, seed, a.overrides, work, per_epoch, a.timeout), "version": stamp["version"],
                         "machine_seconds": speed})
            write_grid(a, stamp, per_epoch, runs)  # after every run: a stopped grid loses only the run in flight
    if not runs:
        raise SystemExit("no runs: --settings and --seeds name none")
    print(table(write_grid(a, stamp, per_epoch, runs)["rows"]))


def earlier(out: Path, overrides: list[str]) -> list[dict]:
    """--add: the runs an earlier invocation wrote to `out` (none where it does not exist yet)."""
    if not out.exists():
        return []
    old = json.loads(out.read_text())
    if old.get("overrides", []) != overrides:
        raise SystemExit(f"{out}: its runs were made with --set {old.get('overrides')}, not {overrides}: "
                         "one grid has one set of overrides (another --out starts another)")
    return old["runs"]


def write_grid(a: argparse.Namespace, stamp: dict, per_epoch: float, runs: list[dict]) -> dict:
    """The grid's JSON so far: every run, and per setting its summary over the seeds done. Settings
    and seeds list what the runs hold (an earlier invocation's too, under --add), this invocation's
    settings first."""
    settings = list(dict.fromkeys([*a.settings, *(r["setting"] for r in runs)]))   # 'none' first
    runs = sorted(runs, key=lambda r: (r["seed"], settings.index(r["setting"])))
    versions = sorted({r.get("version", stamp["version"]) for r in runs})
    result = {**stamp, "versions": versions, "settings": [s for s in settings if any(r["setting"] == s for r in runs)],
              "seeds": sorted({r["seed"] for r in runs}), "overrides": a.overrides, "steps_per_epoch": per_epoch,
              "rows": summarise(runs, a.target), "runs": runs}
    harness.write(result, a.out)
    return result


if __name__ == "__main__":
    main()
