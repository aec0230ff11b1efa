"""Write docs/benchmarks.md from docs/benchmarks.template.md and the benchmark JSON files in
docs/bench/. The template holds the page's prose; each of its placeholder lines is replaced by
what the JSON files say:

    {{summary}}          the headline figure of each area, its file, machine and date
    {{file NAME.json}}   one file: where and when it was measured, the command that made it (the
                         file's own `command`), its tables
    {{superseded NAME.json: REASON}}
                         a file whose measurement a newer one replaces: one line of its name, version,
                         date and REASON, no command or tables
    {{learner_memory}}   the GPU learner and log-prob memory files, one table row each

A template line that is one HTML comment (`<!-- ... -->`) is left out of the page, a placeholder in
it too. Every JSON file in docs/bench/ is placed exactly once; nothing reads git, so the page is the
same from a full clone, a depth-1 clone or a tarball.

    python scripts/make_benchmarks_page.py                 # -> docs/benchmarks.md
    python scripts/make_benchmarks_page.py --bench other/dir --out /tmp/page.md
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import bench_async
import bench_default_run
import bench_draft
import bench_minibatch
import bench_rollout
import bench_vs_peer
from harness import ROOT

TEMPLATE = ROOT / "docs" / "benchmarks.template.md"
LEARNER_MEMORY = ("learner_memory_gpu_*.json", "logprob_memory_gpu_*.json")
PLACEHOLDER = re.compile(r"^\{\{(\w+)(?: (\S+?))?(?:: (.+))?\}\}$")  # {{kind}}, {{kind NAME}}, {{kind NAME: text}}


class PageError(ValueError):
    """The template and the JSON files disagree; the message names the file and line."""


def version(r: dict) -> str:
    return r.get("version") or (r.get("versions") or {}).get("rlspec") or "not recorded"


def where(r: dict) -> str:
    """Version, date and machine of a result, as far as it records them."""
    if r.get("device"):
        machine = r["device"]
    elif r.get("cpu"):
        machine = f"{r['cpu_count']} cores of {r['cpu']}"
    elif r.get("machine"):
        machine = f"{r['machine']['cpu_count']} CPU cores"
    else:
        machine = f"{r['cpu_count']} CPU cores" if r.get("cpu_count") else "machine not recorded"
    return f"rlspec {version(r)}, {r['date']}, {machine}"


def head(path: Path, r: dict) -> list[str]:
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f"`{shown}`: {where(r)}; made by `{r['command']}`", ""]


def superseded(path: Path, reason: str) -> str:
    r = json.loads(path.read_text())
    return f"- `{path.name}` (rlspec {version(r)}, {r['date']}), superseded: {reason}"


# -- one renderer per kind of file: its tables --------------------------------------------------
def default_run(r: dict, path: Path) -> list[str]:
    speed = bench_default_run.machines(r["runs"])
    return [bench_default_run.table(r["rows"]), *(["", speed] if speed else [])]


def async_2x2(r: dict, path: Path) -> list[str]:
    return [bench_async.table(bench_async.summarise(r["runs"]))]


def draft(r: dict, path: Path) -> list[str]:
    return [bench_draft.report(r), "", f"![acceptance by step]({path.with_suffix('.png').relative_to(ROOT / 'docs')})"]


def minibatch(r: dict, path: Path) -> list[str]:
    return [bench_minibatch.table(r["rows"])]


def auto_lines(records: list[dict]) -> list[str]:
    """Per batch size: 'auto' against no speculation and against the best fixed k of its method."""
    out = []
    for a in (r for r in records if r["k"] == "auto"):
        fixed = [r for r in records if r["method"] == a["method"] and r["batch_size"] == a["batch_size"]
                 and r["k"] != "auto"]
        if fixed:
            best = max(fixed, key=lambda r: r["tokens_per_second"])
            out.append(f"- {a['method']}, batch {a['batch_size']}: `auto` {a['speedup_vs_none']:.2f}x no speculation, "
                       f"{a['tokens_per_second'] / best['tokens_per_second']:.2f}x the best fixed k (k={best['k']}, "
                       f"{best['speedup_vs_none']:.2f}x)")
    return out


def rollout(r: dict, path: Path) -> list[str]:
    records = r["records"]
    out = [f"{records[0].get('repeats', '?')} timed calls per cell; prompts: {records[0].get('prompts', 'fresh')}.", "",
           bench_rollout.table(records)]
    if lines := auto_lines(records):
        out += ["", *lines]
    if tail := [x for x in records if "decode_seconds_by_running" in x and x["batch_size"] > 1]:
        out += ["", bench_rollout.tail_table(tail)]  # a batch of 1 runs one request throughout
    return out


def replay(r: dict, path: Path) -> list[str]:
    eps = sorted({e for v in r["stores"].values() for e in v["tokens_per_verification"]}, key=int)
    out = [f"{r['steps']} calls of real rollouts ({r['tokens']:,} tokens), k={r['k']}, batch up to {r['max_batch']}, "
           f"a store of at most {r['max_tokens']:,} response tokens.",
           *([f"The rollouts came from: `{r['trace_command']}`."] if r.get("trace_command") else []), "",
           "| store | " + " | ".join(f"epoch {e} tok/verif. (hit rate)" for e in eps)
           + " | whole run | draft tokens per verification | us per row per step | prompts held at the end |",
           "|---|" + "---|" * (len(eps) + 4)]
    for name, v in r["stores"].items():
        cells = [f"{v['tokens_per_verification'][e]:.3f}"
                 + (f" ({v['hit_rate'][e]:.0%})" if v["hit_rate"].get(e) is not None else "") for e in eps]
        drafted, share = v.get("drafted_per_verification"), v.get("resident_share")
        out.append(f"| {name} | " + " | ".join(cells) + f" | {v['whole_run_tokens_per_verification']:.3f} | "
                   + (" / ".join(f"{drafted[e]:.2f}" for e in eps) if drafted else "-")
                   + f" | {v['us_per_row_per_propose']:.1f} | " + (f"{share:.0%}" if share is not None else "-") + " |")
    return out


def rule_variants(r: dict, path: Path) -> list[str]:
    """The device drafter's rule variants on one trace, beside the stores they are measured against."""
    eps = sorted(next(iter(r["variants"].values()))["tokens_per_verification"], key=int)
    out = [f"{r['steps']} calls of the default run's rollouts, k={r['k']}, batch up to {r['max_batch']}; each "
           "variant's DeviceHistory arguments (`--device KEY=VALUE`) beside the default rule.", "",
           "| device rule | " + " | ".join(f"epoch {e} tok/verif." for e in eps)
           + " | whole run | draft tokens per verification | us per row per step |", "|---|" + "---|" * (len(eps) + 3)]
    for name, v in r["variants"].items():
        drafted = v["drafted_per_verification"]
        out.append(f"| {' '.join(v['device']) or 'default'} | "
                   + " | ".join(f"{v['tokens_per_verification'][e]:.3f}" for e in eps)
                   + f" | {v['whole_run_tokens_per_verification']:.3f} | "
                   + " / ".join(f"{drafted[e]:.2f}" for e in eps) + f" | {v['us_per_row_per_propose']:.0f} |")
    for name, v in r.get("reference", {}).items():  # the same trace's other stores (their own file)
        out.append(f"| store `{name}` | " + " | ".join(f"{v['tokens_per_verification'][e]:.3f}" for e in eps)
                   + " | - | - | - |")
    return out


def crosscheck(r: dict, path: Path) -> list[str]:
    """Every store's tokens per verification at the states of each driver's replay."""
    eps = sorted(next(iter(next(iter(r["drives"].values())).values())), key=int)
    names = list(dict.fromkeys(n for by in r["drives"].values() for n in by))
    out = [f"{r['steps']} calls, k={r['k']}, batch up to {r['max_batch']}; a row per driver, its own figure "
           "in bold; cells: tokens per verification by epoch (" + " / ".join(eps) + ").", "",
           "| states of | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
    for drive, by in r["drives"].items():
        cells = [" / ".join(f"{by[n][e]:.3f}" for e in eps) if n in by else "-" for n in names]
        out.append(f"| `{drive}`'s replay | " + " | ".join(f"**{c}**" if n == drive else c
                                                         for n, c in zip(names, cells)) + " |")
    return out


def scale(r: dict, path: Path) -> list[str]:
    out = [f"k={r['k']}.", "",
           "| store | size | stored tokens | bytes/token (RSS) | bytes/token (arrays) | us per inserted token "
           "| us/row at batch 1 / 64 / 512 | tok/verif. | hit rate (2,000 prompts) |", "|---" * 9 + "|"]
    for x in r["rows"]:
        us, arrays = x["us_per_row_per_propose"], x.get("arrays_bytes_per_stored_token")
        hit = x.get("hit_rate_2000_prompts")
        out.append(f"| {x['store']} | {x['size']:.0e} | {x['stored_tokens']:,} | "
                   f"{x['rss_bytes_per_stored_token']:.0f} | "
                   + (f"{arrays:.0f}" if arrays is not None else "-") + f" | {x['us_per_inserted_token']:.2f} | "
                   + " / ".join(f"{us[b]:.1f}" if us.get(b) is not None else "-" for b in ("1", "64", "512"))
                   + f" | {x['tokens_per_verification']:.3f} | " + (f"{hit:.0%}" if hit is not None else "-") + " |")
    return out + ([""] + [f"- {n}" for n in r["notes"]] if r["notes"] else [])


def device_cost(r: dict, path: Path) -> list[str]:
    out = [f"k={r['k']}, a token buffer {r['width']:,} columns wide, {r['stored_tokens']:,} tokens stored, torch on "
           f"{r['torch_threads']} CPU thread(s); the device drafter's step as the engine runs it (the rows' new "
           f"tokens, then the drafts), its running rows' matches scanned or looked up in the live table.", "",
           "| batch | device, scan (us/row) | device, table (us/row) | host store, numba (us/row) | scan / host |",
           "|---|---|---|---|---|"]
    for b, v in r["us_per_row"].items():
        out.append(f"| {b} | {v['device_torch_cpu']:.1f} | {v['device_table_torch_cpu']:.1f} | {v['host_numba']:.1f} | "
                   f"{v['device_torch_cpu'] / v['host_numba']:.0f}x |")
    ins = r["insert_us_per_token"]
    out += ["", f"Insert per stored token: device {ins['device_torch_cpu']:.2f} us, host {ins['host_numba']:.2f} us."]
    if est := r.get("gpu_estimate"):
        out += ["", "Counted on the `meta` device (no GPU ran), at the engine's largest shape (the batch's running "
                "rows and as many finished answers): the launches of the step a CUDA device runs (the rows' advance "
                "and the draft as Triton kernels, each one launch, their bytes from their grids at "
                f"{est['probes']:g} probes a lookup; every torch op beside them one, under `scan` the whole-row "
                "scan) and the bytes they move; seconds at "
                f"{est['hbm_efficiency']:.0%} of {est['hbm_bytes_per_s'] / 1e12:.2f} TB/s, and with "
                f"{1e6 * est['launch_seconds']:.0f} us a launch; the step's working memory, allocated with the "
                "drafter (under `scan` the scan allocates beside it).", "",
                "| batch x buffer width, lookup | launches (kernels) | GB moved | ms at that bandwidth | "
                "ms with the launches | working memory (MB) |",
                "|---|---|---|---|---|---|"]
        for key, t in est["per_step"].items():
            out.append(f"| {key} | {t['launches']} ({t['kernel_launches']}) | {t['bytes'] / 1e9:.4f} | "
                       f"{1e3 * t['memory_seconds']:.3f} | {1e3 * t['seconds']:.3f} | {t['working_bytes'] / 1e6:.2f} |")
        if regs := est.get("kernels_sm90"):
            out += ["", "The Triton kernels compiled for sm_90 here (ptxas): " + "; ".join(
                f"`{k}` {r['registers']} registers a thread at {r['warps']} warps"
                + (f", spilling {r['spill_store_bytes']} bytes and reloading {r['spill_load_bytes']}"
                   if r['spill_store_bytes'] else "") for k, r in regs.items()) + "."]
    return out


def peer(r: dict, path: Path) -> list[str]:
    s, m, v = r["summary"], r["machine"], r["versions"]
    rows = {x["mode"]: x for x in s["rows"]}
    trl, best = rows.get(bench_vs_peer.PEER), rows.get(s["best_rlspec_mode"] or "")
    out = [f"{m['cpu_count']} CPU cores, {m['memory_gib']} GiB, {m['platform']}, Python {m['python']}; "
           + ", ".join(f"{k} {x}" for k, x in v.items()) + f". {r['steps']} steps, seeds {r['seeds']}, held-out "
           f"accuracy every {r['val_every']} steps, on `{r['experiment']}`; the benchmark took "
           f"{r['bench_seconds'] / 60:.1f} min. Modes: "
           + "; ".join(f"{k}: `{' '.join(x) if x else '(the peer)'}`" for k, x in r["modes"].items()) + ".", "",
           bench_vs_peer.report(r), ""]
    if path.with_suffix(".png").exists():
        out += [f"![accuracy against wall-clock time]({path.with_suffix('.png').relative_to(ROOT / 'docs')})", ""]
    if trl is not None and best is not None and trl["time_to_target"] is not None:
        start = best["curve"][0]["seconds"] - trl["curve"][0]["seconds"]
        gap = best["time_to_target"] - trl["time_to_target"]
        d_step = best["steady_step_seconds"] - trl["steady_step_seconds"]
        out += [f"rlspec's best mode ({best['mode']}) reached the target {abs(gap):.0f} s "
                f"{'later' if gap > 0 else 'earlier'} than TRL ({best['time_to_target_ratio_vs_peer']:.2f}x TRL's "
                f"speed to it), at step {best['step_to_target']} against TRL's step {trl['step_to_target']}; its first "
                f"validation came {abs(start):.0f} s {'later' if start > 0 else 'earlier'} (start-up) and its steps "
                f"took {abs(d_step):.2f} s {'less' if d_step < 0 else 'more'} each.", ""]
    if trl is not None:
        out.append(f"Step-0 accuracy (the same initial weights): TRL's `generate` {trl['step0_accuracy']:.4f}; "
                   + ", ".join(f"{x['mode']} {x['step0_accuracy']:.4f}" for x in s["rows"] if x is not trl) + ".")
    return out


def memory(r: dict, path: Path) -> list[str]:
    h = r["output_layer"]
    out = [f"{r['tokens_per_layer_measurement']} tokens per layer measurement.", "",
           "| layer | hidden / MLP / heads / KV heads | KiB per token | model | error | checkpointed |",
           "|---|---|---|---|---|---|"]
    out += [f"| {x['layer']} | {x['hidden']} / {x['intermediate']} / {x['heads']} / {x['kv_heads']} | "
            f"{x['measured_bytes_per_token'] / 1024:.1f} | {x['model_bytes_per_token'] / 1024:.1f} | "
            f"{100 * x['model_error']:+.1f}% | {x['checkpointed_bytes_per_token'] / 1024:.2f} |" for x in r["layers"]]
    # the file's `experiments` (the memory model's tables of its day) are left out: `--dry-run` prints today's
    return out + ["", f"Output layer at hidden {h['hidden']}, vocabulary {h['vocab']:,}: the model's own logits path "
                  f"keeps {h['model_logits_bytes_per_token'] / 2**20:.2f} MiB per token for backward, rlspec's chunked "
                  f"head ({h['chunk_tokens']} tokens at a time) {h['chunked_head_bytes_per_token']:.0f} bytes."]


def memory_gpu(r: dict, path: Path) -> list[str]:
    h, n = r["output_layer"], r["output_layer"]["tokens"]
    out = ["| layer | kept KiB/token | model | peak KiB/token | checkpointed: kept | checkpointed: peak | "
           "no-grad forward: peak | model |", "|---|---|---|---|---|---|---|---|"]
    out += [f"| {x['layer']} | {x['measured_bytes_per_token'] / 1024:.1f} | {x['model_bytes_per_token'] / 1024:.1f} | "
            f"{x['peak_bytes_per_token'] / 1024:.1f} | {x['checkpointed_bytes_per_token'] / 1024:.2f} | "
            f"{x['checkpointed_peak_bytes_per_token'] / 1024:.1f} | {x['forward_peak_bytes_per_token'] / 1024:.1f} | "
            f"{x['forward_model_bytes_per_token'] / 1024:.1f} |" for x in r["layers"]]
    return out + ["", f"Output layer at hidden {h['hidden']}, vocabulary {h['vocab']:,}, {n} tokens: kept for "
                  f"backward, the model's logits path {h['model_logits_bytes_per_token'] * n / 2**30:.2f} GiB, the "
                  f"chunked head {h['chunked_head_bytes_per_token'] * n / 2**10:.0f} KiB; the allocator's peak, "
                  f"{h['model_logits_peak_bytes_per_token'] * n / 2**30:.2f} GiB against "
                  f"{h['chunked_head_peak_bytes_per_token'] * n / 2**30:.2f} GiB."]


def learner_memory(paths: list[Path]) -> list[str]:
    rows = [json.loads(p.read_text()) for p in paths]
    m = rows[0]["model"]
    out = [f"On one {rows[0]['device']}, a model at Qwen3-8B's widths (hidden {m['hidden_size']}, MLP "
           f"{m['intermediate_size']}, vocabulary {m['vocab_size']:,}, untied) cut to a few layers:", "", "```bash",
           *(r["command"] for r in rows), "```", "",
           "| file | role | layers | micro-batch x tokens | ZeRO | predicted resident GiB | measured | "
           "predicted peak GiB | measured | measured / predicted | step s |", "|---" * 11 + "|"]
    for p, r in zip(paths, rows):
        t, pr, me = r["trainer"], r["predicted_gib"], r["measured_gib"]
        out.append(f"| `{p.name}` ({r['date']}) | {r.get('role', 'learner')} | {r['layers']} | "
                   f"{t['micro_batch_size']} x {t['tokens_per_row']:,} | {t['zero_stage']} | {pr['resident']:.2f} | "
                   f"{me['resident_after_steps']:.2f} | {pr['total']:.2f} | {me['peak']:.2f} | "
                   f"{r['peak_over_predicted_total']:.3f} | {r['steps'][-1]['seconds']:.2f} |")
    return out


RENDER = [  # (file name pattern, renderer(result, path))
    ("default_run*.json", default_run), ("async_*.json", async_2x2), ("draft_*.json", draft),
    ("minibatch*.json", minibatch), ("rollout_*.json", rollout), ("history_store_replay*.json", replay),
    ("history_rule_variants*.json", rule_variants), ("history_crosscheck*.json", crosscheck),
    ("history_store_scale*.json", scale), ("vs_peer.json", peer), ("memory.json", memory),
    ("memory_gpu.json", memory_gpu), ("device_history_cost.json", device_cost),
]


def section(path: Path) -> list[str]:
    r = json.loads(path.read_text())
    for pattern, render in RENDER:
        if path.match(pattern):
            return head(path, r) + render(r, path)
    raise PageError(f"{path}: no renderer for this file name in scripts/make_benchmarks_page.py (RENDER)")


# -- the summary: each area's headline figure ---------------------------------------------------
def _row(rows: list[dict], key: str, value: str) -> dict:
    return next(x for x in rows if x[key] == value)


def h_default_run(r: dict) -> str:
    none, best = _row(r["rows"], "setting", "none"), _row(r["rows"], "setting", "history:5")  # make demo's setting
    return (f"`{best['setting']}` steps {none['step_seconds'] / best['step_seconds']:.2f}x faster than no speculation "
            f"({none['step_seconds']:.2f} -> {best['step_seconds']:.2f} s), held-out accuracy {best['val_last']:.3f} "
            f"against {none['val_last']:.3f}")


def h_peer(r: dict) -> str:
    rows = {x["mode"]: x for x in r["summary"]["rows"]}
    trl, best = rows[bench_vs_peer.PEER], rows[r["summary"]["best_rlspec_mode"]]
    return (f"{best['mode']}: {best['time_to_target_ratio_vs_peer']:.2f}x TRL's speed to its final accuracy; "
            f"TRL peaks at {trl['peak_memory_gib']:.2f} GiB, rlspec at {best['peak_memory_gib']:.2f}")


def h_rollout(r: dict) -> str:
    records = r["records"]
    top = max(x["batch_size"] for x in records)
    at = [x for x in records if x["batch_size"] == top and x["method"] != "none"]
    by_method = {}
    for x in at:
        if x["speedup_vs_none"] > by_method.get(x["method"], (0, None))[0]:
            by_method[x["method"]] = (x["speedup_vs_none"], x["k"])
    return f"batch {top}, best k of each method against no speculation: " + ", ".join(
        f"{m} {s:.2f}x (k={k})" for m, (s, k) in sorted(by_method.items(), key=lambda kv: -kv[1][0]))


def h_scale(r: dict) -> str:
    size = max(x["size"] for x in r["rows"])
    at = {x["store"]: x for x in r["rows"] if x["size"] == size}
    return f"{size:.0e} stored tokens: " + ", ".join(
        f"{n} {x['rss_bytes_per_stored_token']:.0f} B/token, {x['us_per_row_per_propose']['512']:.1f} us/row "
        "at batch 512" for n, x in at.items())


def h_async(r: dict) -> str:
    rows = {x["cell"]: x for x in bench_async.summarise(r["runs"])}
    best = rows["async / spec on"]
    return (f"async + speculation steps {best['step_speedup_vs_baseline']:.2f}x faster than sync without it "
            f"({rows['sync / spec off']['steady_step_seconds']:.2f} -> {best['steady_step_seconds']:.2f} s)")


def h_draft(r: dict) -> str:
    return "rollout speedup by head: " + ", ".join(f"{x['arm']} {x['speedup']:.2f}x" for x in r["rows"]
                                                   if x["arm"] != "none")


def h_minibatch(r: dict) -> str:
    return "held-out accuracy by optimizer steps per batch: " + ", ".join(
        f"{x['optimizer_steps']:.0f} step(s) {x['val_accuracy']:.3f}" for x in r["rows"])


def h_memory(r: dict) -> str:
    errs = [100 * x["model_error"] for x in r["layers"]]
    return f"memory model against measured decoder layers: {min(errs):+.1f}% to {max(errs):+.1f}%"


def h_learner_memory(paths: list[Path]) -> str:
    ratios = [json.loads(p.read_text())["peak_over_predicted_total"] for p in paths]
    return f"measured peak over predicted, {len(paths)} runs: {min(ratios):.3f} to {max(ratios):.3f}"


SUMMARY = [  # (area, file, headline(result))
    ("The default run (`make demo`)", "default_run_host_counts.json", h_default_run),
    ("rlspec against TRL", "vs_peer.json", h_peer),
    ("Rollout generation, k sweep", "rollout_chain_replay.json", h_rollout),
    ("History drafting at scale", "history_store_scale_counts.json", h_scale),
    ("Sync/async x speculation", "async_2x2_chain.json", h_async),
    ("EAGLE-3 head initialisation", "draft_2x2_chain.json", h_draft),
    ("Mini-batches per rollout batch", "minibatch_chain.json", h_minibatch),
    ("Memory model, CPU", "memory.json", h_memory),
]


def learner_files(bench: Path) -> list[Path]:
    return [p for pattern in LEARNER_MEMORY for p in sorted(bench.glob(pattern))]


def summary(bench: Path) -> list[str]:
    out = ["| area | headline | measured |", "|---|---|---|"]
    for area, name, headline in SUMMARY:
        path = bench / name
        if not path.exists():
            raise PageError(f"{path} is missing: the summary's {area!r} row reads it (SUMMARY)")
        r = json.loads(path.read_text())
        out.append(f"| {area} | {headline(r)} (`{name}`) | {where(r)} |")
    if learners := learner_files(bench):
        r = json.loads(learners[0].read_text())
        out.append(f"| Memory model, GPU | {h_learner_memory(learners)} | {r['device']}, {r['date']} |")
    return out


def page(bench: Path, template: Path = TEMPLATE) -> str:
    placed, out = set(), []
    for n, line in enumerate(template.read_text().splitlines(), 1):
        if re.fullmatch(r"<!--.*-->", line.strip()):
            continue
        m = PLACEHOLDER.match(line.strip())
        if not m:
            out.append(line)
            continue
        kind, arg, reason = m.groups()
        if kind == "summary":
            out += summary(bench)
        elif kind == "learner_memory":
            paths = learner_files(bench)
            placed.update(paths)
            out += learner_memory(paths)
        elif (kind == "file" and arg and not reason) or (kind == "superseded" and arg and reason):
            path = bench / arg
            if not path.exists():
                raise PageError(f"{template}:{n}: {{{{{kind} {arg}}}}} names no file in {bench}")
            placed.add(path)
            out += section(path) if kind == "file" else [superseded(path, reason)]
        else:
            raise PageError(f"{template}:{n}: unknown placeholder {line.strip()!r}")
    if left := sorted(set(bench.glob("*.json")) - placed):
        raise PageError(f"{template}: no placeholder for {', '.join(p.name for p in left)} (add {{{{file NAME}}}} "
                        "or {{{{superseded NAME: REASON}}}} lines)")
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", type=Path, default=ROOT / "docs" / "bench")
    ap.add_argument("--template", type=Path, default=TEMPLATE)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    a = ap.parse_args()
    try:
        a.out.write_text(page(a.bench.resolve(), a.template))
    except PageError as e:
        raise SystemExit(f"make_benchmarks_page: {e}") from None
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
