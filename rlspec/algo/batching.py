"""Turning rollouts into padded training tensors (pure torch)."""
from __future__ import annotations

import torch

from rlspec.messages import RolloutBatch, TrainBatch


def build_train_batch(rollouts: RolloutBatch, advantages: torch.Tensor, sample_weight: torch.Tensor,
                      pad_id: int) -> TrainBatch:
    """advantages, sample_weight: [N]. A sample with weight 0 is kept for shape but carries no loss."""
    n = len(rollouts.response_ids)
    width = max(len(p) + len(r) for p, r in zip(rollouts.prompt_ids, rollouts.response_ids))
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width - 1)
    behaviour = torch.zeros(n, width - 1)
    for i, (p, r, lp) in enumerate(zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.logprobs)):
        seq = p + r
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        # the response token at sequence position len(p)+j is predicted at position len(p)+j-1
        loss_mask[i, len(p) - 1: len(seq) - 1] = sample_weight[i]
        behaviour[i, len(p) - 1: len(seq) - 1] = torch.tensor(lp)
    return TrainBatch(input_ids, attention, loss_mask, advantages.float(), behaviour,
                      policy_version=rollouts.policy_version,
                      prompt_lengths=torch.tensor([len(p) for p in rollouts.prompt_ids]))


def micro_batches(attention_mask: torch.Tensor, size: int) -> list[tuple[torch.Tensor, int]]:
    """Row indices of each micro-batch of `size` rows, longest rows first, and the width (input
    positions) its longest row needs. A right-padded row's positions before that width attend to
    the same tokens whatever follows, so cutting the padding changes no log-prob; it only stops
    every micro-batch from paying for the step's single longest rollout. The losses' denominators
    are the whole step's, so how rows are grouped does not change the summed loss or gradient."""
    lengths = attention_mask.sum(dim=1)
    order = torch.argsort(lengths, descending=True, stable=True)
    return [(idx, int(lengths[idx].max())) for idx in order.split(size)]
