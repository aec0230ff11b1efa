"""Numerical faults in the Learner (a real DeepSpeed engine, no Ray): a non-finite loss or
gradient leaves weights, optimizer and scheduler untouched and is reported as skipped."""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_paths
from rlspec.config import AlgoConfig, GenerationConfig, ModelConfig, TrainerConfig
from rlspec.messages import TrainBatch


def batch(nan_advantage: bool) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (4, 12), generator=g)
    mask = torch.zeros(4, 11)
    mask[:, 5:] = 1
    adv = torch.tensor([1.0, -1.0, 0.5, float("nan") if nan_advantage else -0.5])
    old = torch.full((4, 11), -3.0)
    return TrainBatch(ids, torch.ones_like(ids), mask, adv, old, old.clone(), None)


def learner_of(t: TrainerConfig, port: int):
    """A one-rank Learner (no Ray) on the tiny policy, 4 samples per step, no off-policy correction."""
    from rlspec.workers.learner import Learner

    return Learner(paths=tiny_paths(), model=ModelConfig(), algo=AlgoConfig(off_policy_correction="none"), trainer=t,
                   generation=GenerationConfig(num_prompts_per_step=1, num_generations_per_prompt=4), rank=0,
                   world_size=1, rendezvous=("127.0.0.1", port), threads=1)


def test_nonfinite_update_is_skipped_and_the_next_one_applies(zero_stage=1):
    """(One engine per process: DeepSpeed keeps its process groups, so one ZeRO stage here.)"""
    t = TrainerConfig(micro_batch_size=2, zero_stage=zero_stage, dtype="float32")
    learner = learner_of(t, 29600 + zero_stage)
    before = learner.full_weights()
    opt_steps = learner.engine.global_steps
    metrics, stats = learner.train_step(batch(nan_advantage=True), 28.0, 4.0)
    assert stats["skipped"] == 1.0 and math.isnan(metrics["loss"])
    after = learner.full_weights()
    assert all(torch.equal(before[k], after[k]) for k in before) and learner.engine.global_steps == opt_steps
    metrics, stats = learner.train_step(batch(nan_advantage=False), 28.0, 4.0)
    assert stats["skipped"] == 0.0 and math.isfinite(metrics["loss"])
    assert any(not torch.equal(before[k], v) for k, v in learner.full_weights().items())


def gradient_fault(zero_stage: int, dtype: str = "float32") -> None:
    """Finite inputs, a non-finite gradient (a backward hook turns one weight's gradient into NaN,
    as an overflow would): the engine refuses the update (weights, optimizer moments and the
    scheduler stay), the Learner reports it skipped, and the next clean step applies. In bfloat16
    DeepSpeed wraps the optimizer as it does on GPUs (it picks the wrapper from the dtypes, not the
    accelerator): FP16_UnfusedOptimizer in bf16 under ZeRO 0, bf16 ZeRO partitions above; the
    wrapper does the refusing."""
    t = TrainerConfig(micro_batch_size=2, zero_stage=zero_stage, warmup_steps=10, dtype=dtype)
    learner = learner_of(t, 29610 + 2 * zero_stage + (dtype == "bfloat16"))
    wrapper = type(learner.engine.optimizer).__name__
    assert wrapper == {(0, "float32"): "SkippingAdamW", (0, "bfloat16"): "FP16_UnfusedOptimizer"}.get((zero_stage, dtype), wrapper)
    assert learner.train_step(batch(nan_advantage=False), 28.0, 4.0)[1]["skipped"] == 0.0  # moments exist now
    before, lr = learner.full_weights(), learner.sched.get_last_lr()
    moments = [v.clone() for s in learner.engine.optimizer.state.values() for v in s.values()
               if torch.is_tensor(v)] if zero_stage == 0 else []
    emb = learner.engine.module.get_input_embeddings().weight
    hook = emb.register_hook(lambda g: torch.full_like(g, float("nan")))
    metrics, stats = learner.train_step(batch(nan_advantage=False), 28.0, 4.0)
    assert stats["skipped"] == 1.0 and not math.isfinite(stats["grad_norm"]), (metrics, stats)
    after = learner.full_weights()
    assert all(torch.equal(before[k], after[k]) for k in before) and learner.sched.get_last_lr() == lr
    now = [v for s in learner.engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert all(torch.equal(a, b) for a, b in zip(moments, now)) and len(moments) == (len(now) if zero_stage == 0 else 0)
    hook.remove()
    metrics, stats = learner.train_step(batch(nan_advantage=False), 28.0, 4.0)
    assert stats["skipped"] == 0.0 and math.isfinite(metrics["loss"]) and learner.sched.get_last_lr() != lr
    assert any(not torch.equal(before[k], v) for k, v in learner.full_weights().items())
    print("gradient fault skipped", flush=True)


@pytest.mark.parametrize("zero_stage,dtype", [(0, "float32"), (1, "float32"), (0, "bfloat16"), (1, "bfloat16")])
def test_nonfinite_gradient_is_skipped_by_the_engine(zero_stage, dtype):
    """In a fresh process per stage (DeepSpeed keeps its process groups)."""
    r = subprocess.run([sys.executable, "-c", f"from test_learner import gradient_fault; gradient_fault({zero_stage}, {dtype!r})"],
                       cwd=Path(__file__).parent, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "gradient fault skipped" in r.stdout, r.stderr[-3000:]
