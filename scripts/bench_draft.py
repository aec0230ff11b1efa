"""Draft initialisation x online adaptation, the paper's table on this machine: acceptance length
and rollout speedup for {generic init, domain-aligned init} x {online adaptation off, on} over an
RL run (+experiment=tiny_cpu) in which the policy drifts, seeds interleaved, plus a no-speculation run per seed for the
speedup's denominator.

    python scripts/bench_draft.py --out docs/bench/draft_2x2.json          # defaults below
    python scripts/bench_draft.py --report docs/bench/draft_2x2.json       # re-print a result

Heads: domain-aligned = rlspec/assets/tiny/eagle3 (python -m rlspec.draft.train: the tiny
policy's own answers to training prompts); generic = the same command and budget on
--generic-text, lines of unrelated text (default: Python standard-library source, which the
same tokenizer encodes) written to the work directory. Each arm is `python -m rlspec.train` with
speculation=eagle3 (k=3) and that head, with or without speculation.online.enabled.
Acceptance "early" is the mean over the first quarter of steps, "late" over the last quarter;
speedup is the arm's rollout tokens/s over the no-speculation run's, same seed. Drift: the
per-token KL(final || initial) of the no-speculation run's final policy, on its own samples of
64 held-out prompts, and the held-out accuracy it reached.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "+experiment=tiny_cpu"  # the addition task: the heads are its tiny policy's
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_async import fmt, mean_std, times  # noqa: E402

DOMAIN_HEAD = ROOT / "rlspec" / "assets" / "tiny" / "eagle3"
ARMS = ("none", "generic / off", "generic / on", "domain / off", "domain / on")


def generic_text(path: Path, lines: int) -> Path:
    """Unrelated text of the same tokenizer: non-blank lines of a fixed list of stdlib modules."""
    import argparse as a, json as j, logging, statistics as st, subprocess as sp, textwrap, typing
    out = []
    for mod in (a, j, logging, st, sp, textwrap, typing):
        out += [ln.strip() for ln in Path(mod.__file__).read_text().splitlines() if len(ln.strip()) >= 20]
    path.write_text("\n".join(out[:lines]) + "\n")
    return path


def train_generic_head(work: Path, text_lines: int, timeout: int) -> dict:
    head = work / "generic_head"
    if not (head / "train_log.json").exists():
        text = generic_text(work / "generic.txt", text_lines)
        cmd = [sys.executable, "-m", "rlspec.draft.train", "draft.corpus=text", f"draft.text_file={text}",
               f"draft.out_dir={head}", "logging.wandb_mode=disabled", "logging.progress_bar=false",
               f"hydra.run.dir={work / 'generic_head_run'}"]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise SystemExit(f"generic head training failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return json.loads((head / "train_log.json").read_text())


def run_arm(arm: str, head: Path | None, seed: int, steps: int, work: Path, timeout: int, resume: bool) -> dict:
    run_dir = work / f"{arm.replace(' / ', '_')}_seed{seed}"
    reused = resume and (run_dir / "summary.json").exists() and \
        len(json.loads((run_dir / "summary.json").read_text())["records"]) == steps
    spec = ["speculation=none"] if head is None else [
        "speculation=eagle3", f"speculation.model={head}",
        f"speculation.online.enabled={'true' if arm.endswith('/ on') else 'false'}"]
    cmd = [sys.executable, "-m", "rlspec.train", EXPERIMENT, *spec, f"trainer.max_steps={steps}", f"trainer.seed={seed}",
           f"trainer.val_every={steps}", "trainer.checkpoint_every=0", f"trainer.save_final={arm == 'none'}",
           "logging.plot=false", "logging.wandb_mode=disabled", "logging.progress_bar=false",
           f"hydra.run.dir={run_dir}"]
    t0 = time.time()
    p = None if reused else subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p is not None and p.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    recs = s["records"]
    q = max(1, len(recs) // 4)
    acc = [r["acceptance_length"] for r in recs]
    out = {"arm": arm, "seed": seed, "run_dir": str(run_dir), "reused": reused,
           "wall_seconds": s["wall_seconds"] if reused else time.time() - t0,
           "tokens_per_second": s["tokens_per_second"], "val_accuracy": s["val_accuracy"],
           "acceptance_by_step": acc,
           "gen_tokens_per_s_by_step": [r["tokens_per_second"] for r in recs],
           "draft_loss_by_step": [r["extra"].get("draft/loss") for r in recs],
           "early_acceptance": None if acc[0] is None else statistics.mean(acc[:q]),
           "late_acceptance": None if acc[0] is None else statistics.mean(acc[-q:])}
    print(f"  {arm:<13} seed {seed}: acceptance {fmt(out['early_acceptance'])} -> {fmt(out['late_acceptance'])}, "
          f"rollout {out['tokens_per_second']:.0f} tok/s, held-out acc {s['val_accuracy'][0]:.3f} -> "
          f"{s['val_accuracy'][-1]:.3f} ({'reused, ' if reused else ''}{out['wall_seconds']:.0f} s)", flush=True)
    return out


def drift(final_dir: str, prompts: int = 64, max_new: int = 64, seed: int = 0) -> float:
    """Mean per-token KL(final || initial) over the final policy's own samples (T=1)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlspec.config import DatasetConfig, SyntheticConfig
    from rlspec.data.loading import load_prompts
    from rlspec.models import load_tokenizer

    initial = ROOT / "rlspec" / "assets" / "tiny" / "policy"
    tok = load_tokenizer(str(initial), "model.path")
    ps = load_prompts(DatasetConfig(split="test", num_rows=prompts, seed=1), SyntheticConfig(), key="data.val",
                      tokenizer=tok, template="rl_zero", max_prompt_tokens=128, on_bad_row="error").prompts
    a = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(str(initial), dtype=torch.float32).eval()
    torch.manual_seed(seed)
    kls = []
    with torch.no_grad():
        for p in ps:
            ids = torch.tensor([p.token_ids])
            seq = a.generate(ids, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=max_new,
                             pad_token_id=tok.pad_token_id)
            la = a(seq).logits[0, ids.shape[1] - 1: -1].log_softmax(-1)
            lb = b(seq).logits[0, ids.shape[1] - 1: -1].log_softmax(-1)
            kls.append((la.exp() * (la - lb)).sum(-1))
    return torch.cat(kls).mean().item()


def summarise(runs: list[dict]) -> list[dict]:
    base = {r["seed"]: r["tokens_per_second"] for r in runs if r["arm"] == "none"}
    rows = []
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        if not rs:
            continue
        row = {"arm": arm, "seeds": [r["seed"] for r in rs]}
        for k in ("early_acceptance", "late_acceptance", "tokens_per_second"):
            row[k], row[k + "_std"] = mean_std([r[k] for r in rs])
            row[k + "_per_seed"] = [r[k] for r in rs]
        sp = [r["tokens_per_second"] / base[r["seed"]] for r in rs if r["seed"] in base]
        row["speedup"], row["speedup_std"] = mean_std(sp)
        row["speedup_per_seed"] = sp
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = "| init / online adaptation | acceptance, first quarter | acceptance, last quarter | rollout tokens/s | speedup vs no spec |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['arm']} | {fmt(r['early_acceptance'], r['early_acceptance_std'])} | "
                     f"{fmt(r['late_acceptance'], r['late_acceptance_std'])} | "
                     f"{fmt(r['tokens_per_second'], r['tokens_per_second_std'], 0)} | "
                     f"{times(r['speedup'])}" + (f" ± {r['speedup_std']:.2f}" if r["speedup_std"] else "") + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for arm in ARMS[1:]:
        rs = [r["acceptance_by_step"] for r in result["runs"] if r["arm"] == arm]
        if rs:
            ax.plot(range(1, len(rs[0]) + 1), [statistics.mean(x) for x in zip(*rs)], label=arm)
    ax.set_xlabel("RL step"), ax.set_ylabel("acceptance length (k=3), seed mean"), ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(result: dict) -> str:
    d = result["drift"]
    g = result["generic_head"]
    text = [table(summarise(result["runs"])), "",
            f"Policy drift over {result['steps']} steps (no-speculation runs, seeds {result['seeds']}): per-token "
            f"KL(final || initial) {fmt(*mean_std(d['kl']), p=3)} nats on the final policy's samples of 64 held-out "
            f"prompts; held-out accuracy {fmt(*mean_std(d['val_start']), p=3)} -> {fmt(*mean_std(d['val_end']), p=3)}.",
            f"Heads at the start, in vLLM on 128 held-out prompts x 8 (T=1, k=3): generic "
            f"{g['vllm_acceptance']:.3f}, domain-aligned {result['domain_head']['vllm_acceptance']:.3f}."]
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_draft.json")
    ap.add_argument("--work", default="outputs/bench_draft")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--generic-lines", type=int, default=4000)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--resume", action="store_true",
                    help="reuse an arm's run directory under --work when it holds all --steps steps (an interrupted bench)")
    ap.add_argument("--report", help="print the table of an earlier --out JSON and exit")
    args = ap.parse_args()
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print("generic head (draft.corpus=text) ...", flush=True)
    glog = train_generic_head(work, args.generic_lines, args.timeout)
    dlog = json.loads((DOMAIN_HEAD / "train_log.json").read_text())
    heads = {"generic": work / "generic_head", "domain": DOMAIN_HEAD}
    runs = []
    for seed in args.seeds:  # interleaved: drift in machine speed spreads over every arm
        for arm in args.arms:
            runs.append(run_arm(arm, None if arm == "none" else heads[arm.split(" / ")[0]], seed, args.steps, work,
                                args.timeout, args.resume))
    finals = [r for r in runs if r["arm"] == "none"]
    result = {
        "steps": args.steps, "seeds": args.seeds, "wall_seconds": time.time() - t0,
        "version": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                  text=True).stdout.strip(),
        "generic_head": {"train_sequences": glog["train_sequences"], "vllm_acceptance": glog["vllm"]["acceptance_length"],
                         "proxy": glog["evals"][-1]["acceptance_length_proxy"]},
        "domain_head": {"train_sequences": dlog["train_sequences"], "vllm_acceptance": dlog["vllm"]["acceptance_length"],
                        "proxy": dlog["evals"][-1]["acceptance_length_proxy"]},
        "drift": {"kl": [drift(str(Path(r["run_dir"]) / "final"), seed=r["seed"]) for r in finals],
                  "val_start": [r["val_accuracy"][0] for r in finals], "val_end": [r["val_accuracy"][-1] for r in finals]},
        "runs": runs, "reused_runs": [f"{r['arm']} seed {r['seed']}" for r in runs if r["reused"]],
    }
    result["rows"] = summarise(runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    plot(result, Path(args.out).with_suffix(".png"))
    text = report(result)
    Path(args.out).with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"{args.out}; {result['wall_seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
