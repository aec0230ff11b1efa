"""Turn a Hydra multirun of rlspec.train (e.g. a k sweep) into a markdown table and a plot.

    python -m rlspec.train -m +experiment=tiny_cpu speculation=draft_model \\
        speculation.num_speculative_tokens=1,3,5,7
    python scripts/sweep_report.py multirun/DATE/TIME [--baseline RUN_DIR] [--out report.md]

Each job directory holds summary.json and .hydra/config.yaml. Rollout speedup is generation
tokens/s against a run without speculation: a job of the sweep with speculation.method=none, or
--baseline RUN_DIR. Jobs that differ only in trainer.seed are also summarised per configuration
(mean and spread over seeds). Writes REPORT.md and sweep.png into the sweep directory (or --out).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml


def load_job(d: Path) -> dict | None:
    s, c = d / "summary.json", d / ".hydra" / "config.yaml"
    if not s.exists() or not c.exists():
        return None
    summary, cfg = json.loads(s.read_text()), yaml.safe_load(c.read_text())
    recs = [r for r in summary["records"] if r.get("spec")]
    drafts = sum(r["spec"]["drafts"] for r in recs)
    k = cfg["speculation"]["num_speculative_tokens"]
    n_pos = max((len(r["spec"]["acceptance_per_pos"]) for r in recs), default=0)
    per_pos = [sum(r["spec"]["acceptance_per_pos"][i] * r["spec"]["drafts"] for r in recs) / drafts
               if drafts else 0.0 for i in range(n_pos)]
    return {"job": d.name, "method": cfg["speculation"]["method"], "k": k,
            "seed": cfg.get("trainer", {}).get("seed", 0),
            "tokens_per_second": summary["tokens_per_second"],
            "generation_seconds": summary["stage_seconds"]["generation"],
            "step_seconds": summary["step_seconds"],
            "acceptance_length": 1 + sum(r["spec"]["accepted_tokens"] for r in recs) / drafts if drafts else None,
            "acceptance_per_pos": per_pos,
            "final_val_accuracy": summary["val_accuracy"][-1] if summary["val_accuracy"] else None}


def report(jobs: list[dict], base: dict | None) -> str:
    lines = ["| method | k | gen tokens/s | rollout speedup | gen s/step | step s | acceptance length | "
             "acceptance per position | final val acc |", "|---|---|---|---|---|---|---|---|---|"]
    for j in jobs:
        speed = f"{j['tokens_per_second'] / base['tokens_per_second']:.2f}x" if base else "n/a"
        acc = f"{j['acceptance_length']:.2f}" if j["acceptance_length"] else "-"
        pos = ", ".join(f"{a:.2f}" for a in j["acceptance_per_pos"]) or "-"
        val = f"{j['final_val_accuracy']:.3f}" if j["final_val_accuracy"] is not None else "-"
        lines.append(f"| {j['method']} | {j['k'] if j['method'] != 'none' else 0} | {j['tokens_per_second']:.0f} | "
                     f"{speed} | {j['generation_seconds']:.2f} | {j['step_seconds']:.2f} | {acc} | {pos} | {val} |")
    if base is None:
        lines.append("\nNo run without speculation in the sweep and no --baseline: speedups not computed.")
    return "\n".join(lines) + "\n" + over_seeds(jobs)


def over_seeds(jobs: list[dict]) -> str:
    """Per configuration (method, k) with more than one seed: mean +- stdev [min, max] over seeds."""
    groups: dict = {}
    for j in jobs:
        groups.setdefault((j["method"], j["k"] if j["method"] != "none" else 0), []).append(j)
    if all(len(g) < 2 for g in groups.values()):
        return ""

    def stat(g, key, fmt):
        v = [j[key] for j in g if j[key] is not None]
        if not v:
            return "-"
        sd = statistics.stdev(v) if len(v) > 1 else 0.0
        return f"{fmt.format(statistics.mean(v))} +- {fmt.format(sd)} [{fmt.format(min(v))}, {fmt.format(max(v))}]"

    lines = ["\nOver seeds (mean +- stdev [min, max]):\n",
             "| method | k | seeds | gen s/step | gen tokens/s | step s | final val acc |",
             "|---|---|---|---|---|---|---|"]
    for (method, k), g in groups.items():
        lines.append(f"| {method} | {k} | {', '.join(str(j['seed']) for j in g)} | "
                     f"{stat(g, 'generation_seconds', '{:.3f}')} | "
                     f"{stat(g, 'tokens_per_second', '{:.0f}')} | {stat(g, 'step_seconds', '{:.2f}')} | "
                     f"{stat(g, 'final_val_accuracy', '{:.3f}')} |")
    return "\n".join(lines) + "\n"


def plot(jobs: list[dict], base: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = sorted((j for j in jobs if j["method"] != "none" and isinstance(j["k"], int)), key=lambda j: j["k"])
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    ks = [j["k"] for j in spec]
    if base:
        ax[0].plot(ks, [j["tokens_per_second"] / base["tokens_per_second"] for j in spec], "o-")
        ax[0].axhline(1.0, color="grey", ls="--")
    ax[0].set(xlabel="k", ylabel="rollout speedup vs no speculation", title="speedup")
    ax[1].plot(ks, [j["acceptance_length"] or 1.0 for j in spec], "o-", label="measured")
    ax[1].plot(ks, [k + 1 for k in ks], ":", color="grey", label="k + 1 (all accepted)")
    ax[1].set(xlabel="k", ylabel="tokens per verification", title="acceptance length")
    ax[1].legend()
    for j in spec:
        ax[2].plot(range(1, j["k"] + 1), j["acceptance_per_pos"], "o-", label=f"k={j['k']}")
    ax[2].set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05), title="per position")
    ax[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--baseline", type=Path, help="run directory of a run without speculation")
    ap.add_argument("--out", type=Path, help="markdown file (default: SWEEP_DIR/REPORT.md)")
    args = ap.parse_args()
    dirs = sorted((d for d in args.sweep_dir.iterdir() if d.is_dir()), key=lambda d: (len(d.name), d.name))
    jobs = [j for j in map(load_job, dirs) if j]
    if not jobs:
        raise SystemExit(f"{args.sweep_dir}: no job directories with summary.json and .hydra/config.yaml")
    base = load_job(args.baseline) if args.baseline else next((j for j in jobs if j["method"] == "none"), None)
    if args.baseline and base is None:
        raise SystemExit(f"--baseline {args.baseline}: no summary.json / .hydra/config.yaml there")
    jobs.sort(key=lambda j: (j["method"] != "none", str(j["k"]).rjust(4), j["seed"]))
    text = report(jobs, base)
    out = args.out or args.sweep_dir / "REPORT.md"
    out.write_text(text)
    plot(jobs, base, out.with_name("sweep.png"))
    print(text)
    print(f"wrote {out} and {out.with_name('sweep.png')}")


if __name__ == "__main__":
    main()
