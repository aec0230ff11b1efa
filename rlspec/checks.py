"""The run's settings checked and resolved where the placement plan, the memory model or a
registry decides: `validate` (after config's own checks, rlspec/config/checks.py), `resolve_auto`
and `plan_of`. The entry point (rlspec/train.py) calls them before anything reads the settings."""
from __future__ import annotations

import copy

from rlspec.cluster.plan import (PlanError, make_plan, receivers_off_learner_gpus, refit_transport,
                                 shared_weight_group_gpus)
from rlspec.config import RLSpecConfig
from rlspec.config.checks import check_values, require
from rlspec.config.resolve import default_dtype, off_policy_correction, recompute_logprobs, resolve_engine
from rlspec.config.schema import ConfigError


def validate(cfg: RLSpecConfig) -> None:
    """Every check of the settings; raises ConfigError naming the key."""
    check_values(cfg)
    _validate_registries(cfg)
    _validate_placement(cfg)
    _validate_memory(cfg)


def _validate_registries(cfg: RLSpecConfig) -> None:
    """Names a registry must hold: templates, rewards, advantages, losses, corrections, transports."""
    from rlspec.algo import ADVANTAGES, CORRECTIONS, LOSS_AGGREGATIONS, LOSSES
    from rlspec.data.templates import TEMPLATES
    from rlspec.refit import TRANSPORTS
    from rlspec.rewards import REWARDS

    a, c = cfg.algo, cfg.cluster
    require(cfg.data.template in TEMPLATES, "data.template", f"{cfg.data.template!r} not in {sorted(TEMPLATES)}")
    require(cfg.data.reward in REWARDS, "data.reward", f"{cfg.data.reward!r} not in {sorted(REWARDS)}")
    require(a.advantage in ADVANTAGES, "algo.advantage", f"{a.advantage!r} not in {sorted(ADVANTAGES)}")
    require(a.loss in LOSSES, "algo.loss", f"{a.loss!r} not in {sorted(LOSSES)}")
    require(a.loss_agg in LOSS_AGGREGATIONS, "algo.loss_agg", f"{a.loss_agg!r} not in {sorted(LOSS_AGGREGATIONS)}")
    require(a.off_policy_correction in ("auto", *CORRECTIONS), "algo.off_policy_correction",
            f"{a.off_policy_correction!r} not in {['auto', *CORRECTIONS]}")
    require(c.refit in (None, *TRANSPORTS), "cluster.refit", f"must be one of {', '.join(TRANSPORTS)} or null (auto)")


def _validate_placement(cfg: RLSpecConfig) -> None:
    """The placement plan fits the cluster, and the refit transport reaches every receiver."""
    c = cfg.cluster
    plan = plan_of(cfg)
    if c.refit in ("nccl", "ipc"):
        require(plan.on_gpu, "cluster.refit", f"{c.refit} is vLLM's GPU transport; this plan has no GPUs "
                "(cluster.gpus_per_node=0): use group, or null to choose")
    if c.refit in ("nccl", "group"):
        shared = shared_weight_group_gpus(plan, recompute_logprobs(cfg))
        slot, names = next(iter(shared.items()), (None, []))
        require(not shared, "cluster.refit", f"{c.refit} puts {' and '.join(names)} in one NCCL group on one GPU "
                f"(node {getattr(slot, 'node', 0)}, GPU {getattr(slot, 'index', 0)}; {len(shared)} such GPUs), "
                "which NCCL refuses; use ipc or object_store, or null to choose")
    if c.refit == "ipc":
        off = receivers_off_learner_gpus(plan, recompute_logprobs(cfg))
        require(not off, "cluster.refit", f"ipc reaches receivers on the learners' GPUs only; {', '.join(off)} "
                "sit elsewhere: use nccl or object_store, or null to choose")


def _validate_memory(cfg: RLSpecConfig) -> None:
    """With cluster.gpu_memory_gib set, the busiest GPU must hold its roles (rlspec/cluster/memory.py)."""
    if not (cfg.cluster.gpu_memory_gib and cfg.cluster.gpus_per_node):
        return
    from rlspec.cluster.memory import check_fits, gpu_memory

    resolved = resolve_auto(copy.deepcopy(cfg))
    problem = check_fits(gpu_memory(resolved, plan_of(resolved)))
    if problem is not None:
        raise ConfigError(f"{problem[0]}: {problem[1]}")


def plan_of(cfg: RLSpecConfig):
    """The run's placement plan (rlspec/cluster/plan.py); ConfigError names the key that does not fit."""
    g = cfg.generation
    try:
        return make_plan(cfg.cluster, g.tensor_parallel_size, g.expert_parallel, cfg.speculation.online.enabled)
    except PlanError as e:
        raise ConfigError(str(e)) from None


def resolve_auto(cfg: RLSpecConfig) -> RLSpecConfig:
    """Resolve the 'auto' settings in place (idempotent), once, before anything reads them:
    algo.off_policy_correction, algo.recompute_logprobs, generation.sleep_mode,
    generation.enforce_eager, generation.dtype and trainer.dtype. summary.json and every actor then
    see the values the run uses.
    (speculation 'auto' k stays 'auto': the engine's k is SpeculationConfig.k_max, and the
    Generator picks k per call.)"""
    cfg.algo.off_policy_correction = off_policy_correction(cfg)
    cfg.algo.recompute_logprobs = recompute_logprobs(cfg)
    c = cfg.cluster
    if cfg.generation.sleep_mode is None:
        cfg.generation.sleep_mode = c.placement == "colocated" and c.gpus_per_node > 0 and not cfg.async_grpo.enabled
    resolve_engine(cfg.generation, on_gpu=c.gpus_per_node > 0)
    if c.refit is None:
        c.refit = refit_transport(plan_of(cfg), cfg.algo.recompute_logprobs)
    cfg.trainer.dtype = cfg.trainer.dtype or default_dtype(c.gpus_per_node > 0)
    return cfg
