"""GRPO's update written once in plain torch from rlspec/algo: no DeepSpeed, no Ray, no micro-batches,
no sharding over ranks, no rows left out. Every Learner configuration must reproduce it (the matrix
in test_reference_matrix.py).

One RL step (`reference_step`) over a TrainBatch and its sample weights: ppo_epochs passes over
consecutive mini-batches of trainer.mini_batch_size rows (the whole batch when null), one SGD step
each. A mini-batch's loss is algo.loss under algo.loss_agg with the mini-batch's own denominators
(its loss-carrying tokens, its samples of positive weight); the PPO ratio is taken against the
proximal policy, the batch's old_logprobs when given (the log-prob worker's recompute), else the
weights before the step's first update (with one update per step: the forward pass itself,
detached); algo.off_policy_correction takes the ratio or weights the terms against the sampler's
log-probs (rlspec/algo/offpolicy.py); the KL term reads the batch's ref_logprobs. Gradients are
clipped to trainer.grad_clip by their global norm, the learning rate follows the warmup schedule,
and SGD steps the weights (the comparisons run SGD: Adam's first step amplifies float noise).
"""
from __future__ import annotations

import math

import torch

from rlspec.algo import behaviour_weights, policy_loss, ratio_reference
from rlspec.algo.logprobs import sequence_logprobs
from rlspec.algo.losses import LossInputs
from rlspec.config import AlgoConfig, TrainerConfig
from rlspec.messages import TrainBatch


class ReferencePolicy:
    """The tiny policy under SGD with the Learner's warmup schedule, stepped by hand. Under
    trainer.dtype bfloat16 the model computes in bf16 and SGD steps an fp32 master copy of its
    weights, copied back into the model after each step (as DeepSpeed's bf16 does)."""

    def __init__(self, model: torch.nn.Module, trainer: TrainerConfig):
        if trainer.optimizer != "sgd":
            raise ValueError("the reference steps SGD (trainer.optimizer=sgd)")
        self.trainer, self.lowp = trainer, trainer.dtype == "bfloat16"
        self.model = model.to(torch.bfloat16) if self.lowp else model
        self.names, self.params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        self.master = ([p.detach().float().clone().requires_grad_(True) for p in self.params] if self.lowp
                       else list(self.params))
        self.opt = torch.optim.SGD(self.master, lr=trainer.lr, momentum=0.0, weight_decay=trainer.weight_decay)
        warm = max(trainer.warmup_steps, 0)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)

    def logprobs(self, batch: TrainBatch, temperature: float = 1.0) -> torch.Tensor:
        return sequence_logprobs(self.model, batch.input_ids, batch.attention_mask,
                                 temperature) * (batch.loss_mask != 0)

    def step(self, batch: TrainBatch, weight: torch.Tensor, algo: AlgoConfig,
             temperature: float = 1.0) -> dict[str, float]:
        """One RL step; returns the mean over its optimizer steps of the loss and of the pre-clip
        gradient norm, how many optimizer steps it took, and the largest mean ratio of a step."""
        t = self.trainer
        size = t.mini_batch_size or len(batch)
        steps = t.ppo_epochs * math.ceil(len(batch) / size)
        prox_all = batch.old_logprobs
        if prox_all is None and steps > 1:
            with torch.no_grad():
                prox_all = self.logprobs(batch, temperature)
        losses, norms, ratios = [], [], []
        for _ in range(t.ppo_epochs):
            for lo in range(0, len(batch), size):
                part, w = batch.rows(slice(lo, lo + size)), weight[lo: lo + size]
                logp = sequence_logprobs(self.model, part.input_ids, part.attention_mask, temperature)
                prox = logp.detach() if prox_all is None else prox_all[lo: lo + size]
                behav = part.behaviour_logprobs
                old = ratio_reference(prox, behav, algo.off_policy_correction)
                bw, mask = behaviour_weights(prox, behav, part.loss_mask, algo.off_policy_correction,
                                             algo.behaviour_weight_cap)
                x = LossInputs(logp=logp, old_logp=old, advantages=part.advantages, mask=mask,
                               ref_logp=part.ref_logprobs, weight=bw)
                loss, metrics = policy_loss(algo.loss, x, clip_low=algo.clip_low, clip_high=algo.clip_high,
                                            kl_coef=algo.kl_coef, agg=algo.loss_agg,
                                            num_tokens=float(part.loss_mask.sum()), num_seqs=float((w > 0).sum()),
                                            clip_ratio_c=algo.clip_ratio_c)
                for p in {*self.params, *self.master}:
                    p.grad = None
                loss.backward()
                if self.lowp:
                    for p, m in zip(self.params, self.master):
                        m.grad = p.grad.float()
                clip = t.grad_clip if t.grad_clip > 0 else float("inf")
                norms.append(float(torch.nn.utils.clip_grad_norm_(self.master, clip)))
                self.opt.step()
                self.sched.step()
                self._to_model()
                losses.append(float(loss.detach()))
                ratios.append(float(metrics["ratio_mean"]))
        return {"loss": sum(losses) / steps, "grad_norm": sum(norms) / steps, "optimizer_steps": float(steps),
                "ratio_max": max(ratios)}

    @torch.no_grad()
    def _to_model(self) -> None:
        if self.lowp:
            for p, m in zip(self.params, self.master):
                p.copy_(m)

    @torch.no_grad()
    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Set the (master) weights by name."""
        for n, m in zip(self.names, self.master):
            m.copy_(weights[n])
        self._to_model()

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights SGD steps (bf16: the fp32 master copy), by name."""
        return {n: m.detach().cpu().clone() for n, m in zip(self.names, self.master)}
