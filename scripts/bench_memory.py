"""Memory measured on real layers at real widths, on this CPU, and the per-GPU tables the memory
model (rlspec/cluster/memory.py) makes of the paper's experiments from them.

    python scripts/bench_memory.py --out docs/bench/memory.json

Measures, with saved-tensor hooks (what autograd keeps for backward, per token):
- one Qwen3 decoder layer at several widths, Qwen3-8B's included, plain and checkpointed, beside
  the model's 8h + 4i + 5q + 5kv elements;
- the output layer and log-softmax over Qwen3's 151,936-token vocabulary at hidden 4096: the
  model's own logits path against rlspec's chunked head (trainer.logit_chunk_tokens).
Then prints the dry-run memory table of rl_zero_qwen3_8b and qwen3_235b_a22b on GB200s.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import harness
from harness import ROOT
LAYERS = {"Qwen3 at hidden 1024": (1024, 3072, 16, 8, 64), "Qwen3-4B": (2560, 9728, 32, 8, 128),
          "Qwen3-8B": (4096, 12288, 32, 8, 128)}


def head_bytes(tokens: int, hidden: int, vocab: int, chunk: int, device: str = "cpu") -> dict:
    """Bytes per token kept for backward by the model's own logits path and by the chunked head."""
    import torch

    from rlspec.algo.logprobs import head_logprobs, token_logprobs

    head = torch.nn.Linear(hidden, vocab, bias=False).to(device=device, dtype=torch.bfloat16)
    h = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    t = torch.randint(0, vocab, (1, tokens), device=device)

    def kept(fn) -> int:
        seen = {}

        def pack(x):
            seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn()
        skip = {head.weight.untyped_storage().data_ptr(), h.untyped_storage().data_ptr()}
        return sum(n for p, n in seen.items() if p not in skip)

    def peak(fn) -> float:
        """CUDA only: the allocator's peak over forward and backward above weights, the weight's
        gradient (held from a first pass) and the input's gradient."""
        fn().sum().backward()
        h.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn().sum().backward()
        torch.cuda.synchronize()
        extra = h.numel() * 2  # the input's gradient
        h.grad = head.weight.grad = None
        return (torch.cuda.max_memory_allocated() - base - extra) / tokens

    out = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "chunk_tokens": chunk, "device": device,
           "model_logits_bytes_per_token": kept(lambda: token_logprobs(head(h), t)) / tokens,
           "chunked_head_bytes_per_token": kept(lambda: head_logprobs(h, head, t, 1.0, chunk)) / tokens}
    if device == "cuda":
        out["model_logits_peak_bytes_per_token"] = peak(lambda: token_logprobs(head(h), t))
        out["chunked_head_peak_bytes_per_token"] = peak(lambda: head_logprobs(h, head, t, 1.0, chunk))
    return out


def tables() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import compose

    from rlspec.cluster.memory import gpu_memory
    from rlspec.checks import plan_of, resolve_auto

    out = {}
    for name in ("rl_zero_qwen3_8b", "qwen3_235b_a22b"):
        cfg = resolve_auto(compose([f"+experiment={name}"], plain=False))
        mem = gpu_memory(cfg, plan_of(cfg))
        out[name] = {"capacity_gib": mem.capacity, "stages_gib": mem.stages, "table": mem.describe(),
                     "roles": [{"role": r.role, "weights": r.weights, "gradients": r.gradients,
                                "optimizer": r.optimizer, "activations": r.activations, "kv_etc": r.engine,
                                "total": r.total} for r in mem.roles]}
    return out


def torch_device_name(device: str) -> str:
    import platform

    import torch

    return torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "memory.json")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per measured layer")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: measured there, with the allocator's peaks too")
    a = ap.parse_args()
    from memory_probe import measure_layer
    from rlspec.cluster.memory import ACT_ELEMENTS, FORWARD_ELEMENTS

    t0, stamp = time.time(), harness.stamp()
    layers = []
    for name, (h, i, heads, kv, hd) in LAYERS.items():
        plain = measure_layer(h, i, heads, kv, hd, tokens=a.tokens, device=a.device)
        ckpt = measure_layer(h, i, heads, kv, hd, tokens=a.tokens, checkpointing=True, device=a.device)
        e = ACT_ELEMENTS
        model = 2 * (e[0] * h + e[1] * i + e[2] * heads * hd + e[3] * kv * hd)
        row = {"layer": name, "hidden": h, "intermediate": i, "heads": heads, "kv_heads": kv, "head_dim": hd,
               "measured_bytes_per_token": plain, "checkpointed_bytes_per_token": ckpt,
               "model_bytes_per_token": model, "model_error": model / plain - 1}
        line = (f"{name:>22}: {plain / 1024:7.1f} KiB/token kept (model {model / 1024:7.1f}, "
                f"{100 * (model / plain - 1):+.1f}%), checkpointed {ckpt / 1024:.2f} KiB")
        if a.device == "cuda":
            row["peak_bytes_per_token"] = measure_layer(h, i, heads, kv, hd, tokens=a.tokens, device=a.device,
                                                        peak=True)
            row["checkpointed_peak_bytes_per_token"] = measure_layer(h, i, heads, kv, hd, tokens=a.tokens,
                                                                     checkpointing=True, device=a.device, peak=True)
            row["forward_peak_bytes_per_token"] = measure_layer(h, i, heads, kv, hd, tokens=a.tokens, device=a.device,
                                                                peak=True, backward=False)
            f = FORWARD_ELEMENTS
            row["forward_model_bytes_per_token"] = 2 * (f[0] * h + f[1] * i)
            line += (f"; allocator peak {row['peak_bytes_per_token'] / 1024:.1f} KiB/token, "
                     f"checkpointed {row['checkpointed_peak_bytes_per_token'] / 1024:.1f}, "
                     f"no-grad forward {row['forward_peak_bytes_per_token'] / 1024:.1f} "
                     f"(model {row['forward_model_bytes_per_token'] / 1024:.1f})")
        layers.append(row)
        print(line, flush=True)
    head = head_bytes(1024, 4096, 151936, 256, a.device)
    print(f"output layer, vocab 151936: model's logits {head['model_logits_bytes_per_token'] / 2**20:.2f} "
          f"MiB/token kept, chunked head {head['chunked_head_bytes_per_token'] / 1024:.2f} KiB/token", flush=True)
    if a.device == "cuda":
        print(f"  allocator peak: model's logits {head['model_logits_peak_bytes_per_token'] / 2**20:.2f} MiB/token, "
              f"chunked head {head['chunked_head_peak_bytes_per_token'] / 1024:.2f} KiB/token", flush=True)
    t = tables()
    for name, r in t.items():
        print(f"\n{name}\n{r['table']}", flush=True)
    harness.write({**stamp, "device": torch_device_name(a.device), "tokens_per_layer_measurement": a.tokens,
                   "layers": layers, "output_layer": head, "experiments": t, "wall_seconds": time.time() - t0}, a.out)


if __name__ == "__main__":
    main()
