"""Turning rollouts into padded training tensors (pure torch)."""
from __future__ import annotations

import math

import torch

from rlspec.algo.losses import INERT_AT_ZERO_ADVANTAGE
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


def micro_batches(attention_mask: torch.Tensor, size: int,
                  count: int | None = None) -> list[tuple[torch.Tensor, int]]:
    """Row indices of each micro-batch of `size` rows, longest rows first, and the width (input
    positions) its longest row needs; with `count`, exactly that many micro-batches of at most
    `size` rows, as even as the rows allow (count <= rows <= count * size). A right-padded row's
    positions before that width attend to the same tokens whatever follows, so cutting the padding
    changes no log-prob; it only stops every micro-batch from paying for the step's single longest
    rollout. The losses' denominators are the whole step's, so how rows are grouped does not change
    the summed loss or gradient."""
    lengths = attention_mask.sum(dim=1)
    order = torch.argsort(lengths, descending=True, stable=True)
    if count is not None and not count <= len(order) <= count * size:
        raise ValueError(f"{len(order)} rows cannot make {count} micro-batches of at most {size}")
    parts = order.split(size) if count is None else order.tensor_split(count)
    return [(idx, int(lengths[idx].max())) for idx in parts]


def gradient_rows(advantages: torch.Tensor, weight: torch.Tensor, loss: str, kl_coef: float) -> torch.Tensor:
    """[N] bool: the rows whose loss can move the weights. Under a loss registered
    inert_at_zero_advantage and no KL term, a row with advantage 0 (every group whose rewards all
    agree) or sample weight 0 has zero gradient; under any other loss, every row may have some."""
    if kl_coef > 0 or loss not in INERT_AT_ZERO_ADVANTAGE:
        return torch.ones(len(advantages), dtype=torch.bool)
    return (advantages != 0) & (weight > 0)


def shard_rows(live: torch.Tensor, lengths: torch.Tensor, world: int,
               size: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Split one mini-batch's rows over `world` learner ranks so that every rank runs the same
    number m of micro-batches of at most `size` rows (each rank's collectives, ZeRO-3's gathers in
    every forward among them, must pair up): the live rows in order, contiguous and even, the
    fewest micro-batches that hold them (at least one). A rank with fewer than m live rows is
    padded with the shortest rows that are not live, which carry no loss and are there to run.
    live: [N] bool; lengths: [N]. Returns (each rank's rows, each rank's padding rows, m); with
    every row live this is the plain contiguous split into N / (world * size) micro-batches."""
    keep = live.nonzero().flatten()
    m = max(1, math.ceil(len(keep) / (world * size)))
    spare = (~live).nonzero().flatten()
    spare = spare[torch.argsort(lengths[spare], stable=True)].tolist()
    rows, pads = [], []
    for r in range(world):
        mine = keep[r * len(keep) // world: (r + 1) * len(keep) // world]
        pad = torch.tensor([spare.pop(0) for _ in range(m - len(mine))], dtype=torch.long)
        rows.append(torch.cat([mine, pad]))
        pads.append(pad)
    return rows, pads, m
