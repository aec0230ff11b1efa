"""Numerical faults in the Learner (a real DeepSpeed engine, no Ray): a non-finite loss or
gradient leaves weights, optimizer and scheduler untouched and is reported as skipped."""
import math

import torch

from conftest import ROOT
from rlspec.config import AlgoConfig, TrainerConfig
from rlspec.messages import TrainBatch


def batch(nan_advantage: bool) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (4, 12), generator=g)
    mask = torch.zeros(4, 11)
    mask[:, 5:] = 1
    adv = torch.tensor([1.0, -1.0, 0.5, float("nan") if nan_advantage else -0.5])
    old = torch.full((4, 11), -3.0)
    return TrainBatch(ids, torch.ones_like(ids), mask, adv, old, old.clone(), None)


def test_nonfinite_update_is_skipped_and_the_next_one_applies(zero_stage=1):
    """(One engine per process: DeepSpeed keeps its process groups, so one ZeRO stage here.)"""
    from rlspec.workers.learner import Learner

    t = TrainerConfig(micro_batch_size=2, zero_stage=zero_stage)
    learner = Learner(str(ROOT / "rlspec/assets/tiny/policy"), AlgoConfig(), t, 1.0, 4, 0, 1, "127.0.0.1",
                      29600 + zero_stage, 1)
    before = learner.full_weights()
    opt_steps = learner.engine.global_steps
    metrics, stats = learner.train_step(batch(nan_advantage=True), 28.0, 4.0)
    assert stats["skipped"] == 1.0 and math.isnan(metrics["loss"])
    after = learner.full_weights()
    assert all(torch.equal(before[k], after[k]) for k in before) and learner.engine.global_steps == opt_steps
    metrics, stats = learner.train_step(batch(nan_advantage=False), 28.0, 4.0)
    assert stats["skipped"] == 0.0 and math.isfinite(metrics["loss"])
    assert any(not torch.equal(before[k], v) for k, v in learner.full_weights().items())
