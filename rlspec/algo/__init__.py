"""GRPO math in pure torch: no Ray, vLLM or DeepSpeed imports here."""
from rlspec.algo.advantages import ADVANTAGES, compute_advantages, register_advantage
from rlspec.algo.losses import (LOSS_AGGREGATIONS, LOSSES, aggregate, k3_kl, policy_loss,
                                register_loss)
from rlspec.algo.filters import overlong_mask, zero_variance_groups
from rlspec.algo.offpolicy import (CORRECTIONS, behaviour_weights, importance_weights, merge_weight_sums,
                                   ratio_reference, weight_stats, weight_sums)

__all__ = ["ADVANTAGES", "CORRECTIONS", "behaviour_weights", "importance_weights", "merge_weight_sums",
           "ratio_reference", "weight_stats", "weight_sums", "LOSSES", "LOSS_AGGREGATIONS", "aggregate",
           "compute_advantages", "k3_kl", "overlong_mask", "policy_loss", "register_advantage", "register_loss",
           "zero_variance_groups"]
