"""Draft initialisation x online adaptation, the paper's table on this machine: acceptance length
and rollout speedup for {generic init, domain-aligned init} x {online adaptation off, on} over an
RL run in which the policy drifts (the default experiment unless --set names another), seeds
interleaved, plus a no-speculation run per seed for the speedup's denominator.

    python scripts/bench_draft.py --out docs/bench/draft_2x2.json          # the default run, 3 seeds
    python scripts/bench_draft.py --set +experiment=tiny_cpu --steps 24 --out /tmp/d.json
    python scripts/bench_draft.py --report docs/bench/draft_2x2.json       # re-print a result

Heads: domain-aligned = the experiment's shipped head, rlspec/assets/<assets>/eagle3
(python -m rlspec.draft.train: the policy's own answers to training prompts); generic = the
command that head's train_log.json records, same budget, on --generic-text: lines of unrelated
text (Python standard-library source, which the same tokenizer encodes) written to the work
directory. Each arm is `python -m rlspec.train` with speculation=eagle3 and that head, with or
without speculation.online.enabled. Acceptance "early" is the mean over the first quarter of
steps, "late" over the last quarter; speedup is the arm's rollout tokens/s over the
no-speculation run's, same seed. Drift: the per-token KL(final || initial) of the
no-speculation run's final policy, on its own samples of 64 held-out prompts, and the held-out
accuracy it reached.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import harness
from harness import ROOT, fmt, mean_std, times

ARMS = ("none", "generic / off", "generic / on", "domain / off", "domain / on")


def experiment_cfg(overrides: list[str]):
    """The eagle3 arms' composed config (`python -m rlspec.train OVERRIDES speculation=eagle3`)."""
    from rlspec.train import compose_config

    return compose_config([*overrides, "speculation=eagle3"])


def generic_text(path: Path, lines: int) -> Path:
    """Unrelated text of the same tokenizer: non-blank lines of a fixed list of stdlib modules."""
    import argparse as a
    import json as j
    import logging
    import statistics as st
    import subprocess as sp
    import textwrap
    import typing
    out = []
    for mod in (a, j, logging, st, sp, textwrap, typing):
        out += [ln.strip() for ln in Path(mod.__file__).read_text().splitlines() if len(ln.strip()) >= 20]
    path.write_text("\n".join(out[:lines]) + "\n")
    return path


def leaves(d: dict, prefix: str) -> list[str]:
    """`key=value` Hydra overrides for every leaf of a recorded config section (strings quoted, so
    a value is never read as a sweep, an interpolation or another type)."""
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += leaves(v, f"{prefix}{k}.")
        elif isinstance(v, str):  # Hydra: backslashes escape only before a quote or the end
            v = re.sub(r"(\\+)('|$)", lambda m: m.group(1) * 2 + m.group(2), v)
            out.append(f"{prefix}{k}='" + v.replace("'", "\\'").replace("${", "\\${") + "'")
        else:
            out.append(f"{prefix}{k}=" + ("null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)))
    return out


def generic_head_command(domain_log: dict, text: Path, head: Path, work: Path) -> list[str]:
    """The draft trainer's command rebuilt from the config the domain head's train_log.json
    records, on unrelated text: same target, data, generation and training budget."""
    c = domain_log["config"]
    model = c["model"]
    # a shipped policy by its family (its recorded path is the machine's that trained it); any other by path
    target = ([] if "rlspec/assets/" in model["path"] else
              leaves({k: model[k] for k in ("path", "tokenizer", "revision", "trust_remote_code") if k in model},
                     "model."))
    recorded = [f"assets={c.get('assets', 'tiny')}", *target, f"model.max_model_len={model['max_model_len']}",
                *leaves(c["data"], "data."), *leaves(c["generation"], "generation."),
                *[o for o in leaves(c["draft"], "draft.")
                  if o.split("=", 1)[0] not in ("draft.corpus", "draft.text_file", "draft.out_dir")]]
    return [sys.executable, "-m", "rlspec.draft.train", *recorded, "draft.corpus=text", f"draft.text_file={text}",
            f"draft.out_dir={head}", "logging.wandb_mode=disabled", "logging.progress_bar=false",
            f"hydra.run.dir={work / 'generic_head_run'}"]


def train_generic_head(work: Path, domain_log: dict, text_lines: int, timeout: int, resume: bool) -> dict:
    """The generic head under work/generic_head; with `resume`, one trained there by the same command
    on as many lines of text."""
    head, kept = work / "generic_head", work / "generic_head_command.json"
    cmd = generic_head_command(domain_log, work / "generic.txt", head, work)
    made = {"command": cmd, "text_lines": text_lines}
    if not (resume and kept.exists() and json.loads(kept.read_text()) == made and (head / "train_log.json").exists()):
        kept.unlink(missing_ok=True)
        generic_text(work / "generic.txt", text_lines)
        harness.run(cmd, "generic head training", timeout)
        kept.write_text(json.dumps(made) + "\n")
    return json.loads((head / "train_log.json").read_text())


def run_arm(arm: str, head: Path | None, seed: int, steps: int, overrides: list[str], work: Path, timeout: int,
            resume: bool) -> dict:
    run_dir = work / f"{arm.replace(' / ', '_')}_seed{seed}"
    spec = ["speculation=none"] if head is None else [
        "speculation=eagle3", f"speculation.model={head}",
        f"speculation.online.enabled={'true' if arm.endswith('/ on') else 'false'}"]
    cmd = harness.train_command([*overrides, *spec, f"trainer.max_steps={steps}", f"trainer.seed={seed}",
                                 f"trainer.val_every={steps}"], run_dir, save_final=arm == "none")
    # what the directory's finished run was made by: the command and its head's training log
    made = {"command": cmd, "head": None if head is None else (head / "train_log.json").read_text()}
    kept = run_dir / "bench_made.json"
    reused = resume and kept.exists() and json.loads(kept.read_text()) == made and (run_dir / "summary.json").exists()
    if not reused:
        kept.unlink(missing_ok=True)
    seconds = None
    if not reused:
        seconds = harness.run(cmd, f"{arm} seed {seed}", timeout)
        kept.write_text(json.dumps(made) + "\n")
    s = json.loads((run_dir / "summary.json").read_text())
    recs = s["records"]
    q = max(1, len(recs) // 4)
    acc = [r["acceptance_length"] for r in recs]
    out = {"arm": arm, "seed": seed, "run_dir": str(run_dir), "reused": reused,
           "wall_seconds": s["wall_seconds"] if reused else seconds,
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


def drift(final_dir: str, cfg, prompts: int = 64, seed: int = 0) -> float:
    """Mean per-token KL(final || initial) over the final policy's own samples (T=1) of the
    experiment's first `prompts` held-out prompts, up to its generation.max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlspec.data.loading import load_split
    from rlspec.models import load_tokenizer

    initial = cfg.model.path
    tok = load_tokenizer(initial, "model.path")
    ps = load_split(cfg.data, "val", tok).prompts[:prompts]
    max_new = cfg.generation.max_new_tokens
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
    head = ("| init / online adaptation | acceptance, first quarter | acceptance, last quarter | rollout tokens/s | "
            "speedup vs no spec |")
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
    ax.set_xlabel("RL step"), ax.set_ylabel(f"acceptance length (k={result.get('k', 3)}), seed mean"), ax.legend()
    ax.set_title(result.get("experiment", "tiny_cpu"), fontsize=10)
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
            f"Heads at the start, in vLLM on 128 held-out prompts x 8 (T=1, k={g.get('vllm_k', 3)}): generic "
            f"{g['vllm_acceptance']:.3f}, domain-aligned {result['domain_head']['vllm_acceptance']:.3f}."]
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_draft.json")
    ap.add_argument("--work", default="outputs/bench_draft")
    ap.add_argument("--set", nargs="*", default=[], help="Hydra overrides for every run (default: the default "
                    "experiment); the domain head is the composed speculation=eagle3 model")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, help="RL steps per run (default: the experiment's trainer.max_steps)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--generic-lines", type=int, default=4000)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--resume", action="store_true",
                    help="reuse an arm's run directory under --work when it finished with the same command "
                         "(an interrupted bench), and the generic head already trained there")
    ap.add_argument("--report", help="print the table of an earlier --out JSON and exit")
    args = ap.parse_args()
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return
    cfg = experiment_cfg(args.set)
    steps = args.steps or cfg.trainer.max_steps
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    domain = Path(cfg.speculation.model)
    dlog = json.loads((domain / "train_log.json").read_text())
    print(f"generic head: {domain}'s draft.train command on text (draft.corpus=text) ...", flush=True)
    glog = train_generic_head(work, dlog, args.generic_lines, args.timeout, args.resume)
    heads = {"generic": work / "generic_head", "domain": domain}
    runs = []
    for seed in args.seeds:  # interleaved: drift in machine speed spreads over every arm
        for arm in args.arms:
            runs.append(run_arm(arm, None if arm == "none" else heads[arm.split(" / ")[0]], seed, steps, args.set,
                                work, args.timeout, args.resume))
    finals = [r for r in runs if r["arm"] == "none"]
    result = {
        **harness.stamp(), "experiment": harness.experiment_of(args.set), "overrides": args.set,
        "k": cfg.speculation.num_speculative_tokens, "steps": steps, "seeds": args.seeds,
        "wall_seconds": time.time() - t0,
        "generic_head": {"train_sequences": glog["train_sequences"],
                         "vllm_acceptance": glog["vllm"]["acceptance_length"],
                         "vllm_k": glog["vllm"]["k"],
                         "proxy": glog["evals"][-1]["acceptance_length_proxy"]},
        "domain_head": {"path": str(domain.relative_to(ROOT) if domain.is_relative_to(ROOT) else domain),
                        "train_sequences": dlog["train_sequences"],
                        "vllm_acceptance": dlog["vllm"]["acceptance_length"],
                        "vllm_k": dlog["vllm"]["k"],
                        "proxy": dlog["evals"][-1]["acceptance_length_proxy"]},
        "drift": {"kl": [drift(str(Path(r["run_dir"]) / "final"), cfg, seed=r["seed"]) for r in finals],
                  "val_start": [r["val_accuracy"][0] for r in finals],
                  "val_end": [r["val_accuracy"][-1] for r in finals]},
        "runs": runs, "reused_runs": [f"{r['arm']} seed {r['seed']}" for r in runs if r["reused"]],
    }
    result["rows"] = summarise(runs)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    harness.write(result, args.out)
    plot(result, Path(args.out).with_suffix(".png"))
    text = report(result)
    Path(args.out).with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"{args.out}; {result['wall_seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
