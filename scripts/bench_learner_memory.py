"""The memory model against a real learner step (or log-prob pass, --role logprob_worker) on one
GPU: rl_zero_qwen3_8b's trainer settings
(bfloat16, ZeRO-3, gradient checkpointing, chunked log-probs, micro-batches of 4 rollouts of
2048 + 16384 tokens) on a model at Qwen3-8B's widths and vocabulary cut to a few layers (random
weights: memory does not depend on them), one rank. Predicted: rlspec/cluster/memory.py's learner
(weights, gradients, optimizer, activations) for that config; measured: the CUDA allocator's peak
over two optimizer steps (two passes), and what stays allocated after them.

    python scripts/bench_learner_memory.py --layers 4 --out docs/bench/learner_memory_gpu.json

Needs a CUDA GPU (about 55 GiB at 4 layers).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1e6)


def make_model(folder: Path, layers: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(num_hidden_layers=layers, torch_dtype="bfloat16", **QWEN3_8B)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


def config_for(folder: Path, overrides: list[str]):
    from rlspec.checks import plan_of, resolve_auto
    from rlspec.train import compose_config

    one_gpu = ["cluster.nodes=1", "cluster.gpus_per_node=1", "cluster.num_generators=1", "cluster.logprob_world_size=1",
               "cluster.learner_world_size=1", "cluster.gpu_memory_gib=79", "trainer.mini_batch_size=4"]
    cfg = resolve_auto(compose_config(["+experiment=rl_zero_qwen3_8b", f"model.path={folder}", *one_gpu, *overrides]))
    return cfg, plan_of(cfg)


def rollout_batch(rows: int, prompt: int, response: int, vocab: int):
    import torch

    from rlspec.messages import TrainBatch

    g = torch.Generator().manual_seed(0)
    width = prompt + response
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    loss_mask = torch.zeros(rows, width - 1)
    loss_mask[:, prompt - 1:] = 1
    behaviour = -3.0 * loss_mask
    adv = torch.linspace(-1, 1, rows)
    return TrainBatch(ids, torch.ones_like(ids), loss_mask, adv, behaviour, behaviour.clone(), None,
                      prompt_lengths=torch.full((rows,), prompt))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--role", choices=["learner", "logprob_worker"], default="learner")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "learner_memory_gpu.json")
    ap.add_argument("overrides", nargs="*", help="more config overrides (trainer.micro_batch_size=2, ...)")
    a = ap.parse_args()
    import torch

    from rlspec.cluster.memory import gpu_memory
    from rlspec.refit.ports import free_port
    from rlspec.messages import MiniBatch
    from rlspec.models import ModelPaths
    from rlspec.workers.learner import Learner
    from rlspec.workers.logprob import LogprobWorker

    t0 = time.time()
    gib = 1 << 30
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        make_model(folder, a.layers)
        # rl_zero trains on the sampler's log-probs; the log-prob worker's pass is its recompute
        cfg, plan = config_for(folder, a.overrides + ["algo.recompute_logprobs=true"] * (a.role == "logprob_worker"))
        learner_role = next(r for r in gpu_memory(cfg, plan).roles if r.role == a.role)
        t = cfg.trainer
        paths = ModelPaths(str(folder), str(ROOT / "rlspec" / "assets" / "tiny" / "policy"), None)
        torch.cuda.reset_peak_memory_stats()
        if a.role == "learner":
            learner = Learner(paths=paths, model=cfg.model, algo=cfg.algo, trainer=t, generation=cfg.generation, rank=0,
                              world_size=1, rendezvous=("127.0.0.1", free_port()), threads=8)
            run = lambda part: learner.train_step([part])[1]  # noqa: E731
        else:
            worker = LogprobWorker(paths=paths, model=cfg.model, algo=cfg.algo, trainer=t, generation=cfg.generation,
                                   threads=8)

            def run(part):
                worker.compute_logprobs(part.batch)
                return {"skipped": 0.0}
        built = torch.cuda.memory_allocated() / gib
        batch = rollout_batch(t.micro_batch_size, cfg.data.max_prompt_tokens, cfg.generation.max_new_tokens,
                              QWEN3_8B["vocab_size"])
        part = MiniBatch(batch, float(batch.loss_mask.sum()), float(len(batch)))
        steps = []
        for _ in range(2):
            torch.cuda.synchronize()
            s0 = time.perf_counter()
            stats = run(part)
            torch.cuda.synchronize()
            steps.append({"seconds": time.perf_counter() - s0, "skipped": stats["skipped"],
                          "allocated_after_gib": torch.cuda.memory_allocated() / gib})
        peak = torch.cuda.max_memory_allocated() / gib
    predicted = {"weights": learner_role.weights, "gradients": learner_role.gradients,
                 "optimizer": learner_role.optimizer, "activations": learner_role.activations,
                 "resident": learner_role.resident, "total": learner_role.total}
    command = " ".join(["python scripts/bench_learner_memory.py", f"--layers {a.layers}", f"--role {a.role}",
                        f"--out {a.out}", *a.overrides])
    out = {"command": command, "role": a.role, "overrides": a.overrides, "device": torch.cuda.get_device_name(),
           "layers": a.layers, "model": {**QWEN3_8B, "num_hidden_layers": a.layers},
           "trainer": {"dtype": t.dtype, "zero_stage": t.zero_stage, "gradient_checkpointing": t.gradient_checkpointing,
                       "micro_batch_size": t.micro_batch_size, "logit_chunk_tokens": t.logit_chunk_tokens,
                       "tokens_per_row": cfg.data.max_prompt_tokens + cfg.generation.max_new_tokens},
           "predicted_gib": predicted,
           "measured_gib": {"after_build": built, "resident_after_steps": steps[-1]["allocated_after_gib"],
                            "peak": peak},
           "peak_over_predicted_total": peak / learner_role.total,
           "resident_over_predicted": steps[-1]["allocated_after_gib"] / learner_role.resident,
           "steps": steps, "wall_seconds": time.time() - t0}
    print(f"{a.role}, {a.layers} layers at Qwen3-8B width, {out['trainer']}")
    print("predicted GiB: " + ", ".join(f"{k} {v:.2f}" for k, v in predicted.items()))
    print(f"measured GiB: after build {built:.2f}, resident after steps {steps[-1]['allocated_after_gib']:.2f}, "
          f"peak {peak:.2f} ({out['peak_over_predicted_total']:.3f} of predicted total)")
    print(f"steps: {[round(s['seconds'], 2) for s in steps]} s")
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
