"""The settings left 'auto' in the schema, resolved once before anything reads them."""
from __future__ import annotations

from rlspec.cluster.plan import PlanError, make_plan, refit_transport
from rlspec.config.schema import ConfigError, GenerationConfig, RLSpecConfig, TrainerConfig


def off_policy_correction(cfg: RLSpecConfig) -> str:
    """algo.off_policy_correction with 'auto' resolved."""
    c = cfg.algo.off_policy_correction
    if c != "auto":
        return c
    q, pr = cfg.async_grpo, cfg.generation.partial
    # tokens sampled by older weights: lagged batches, or answers partial rollouts resumed
    if (q.enabled and q.max_policy_lag >= 1) or (pr.enabled and pr.max_carry_versions >= 1):
        return "behaviour_ppo"
    return "tis" if engine_dtype(cfg) != "float32" else "none"


def plan_of(cfg: RLSpecConfig):
    """The run's placement plan (rlspec/cluster/plan.py); ConfigError names the key that does not fit."""
    g = cfg.generation
    try:
        return make_plan(cfg.cluster, g.tensor_parallel_size, g.expert_parallel, cfg.speculation.online.enabled)
    except PlanError as e:
        raise ConfigError(str(e)) from None


def engine_dtype(cfg: RLSpecConfig) -> str:
    """generation.dtype with null resolved (bfloat16 on GPUs, float32 on CPU machines)."""
    return cfg.generation.dtype or default_dtype(cfg.cluster.gpus_per_node > 0)


def default_dtype(on_gpu: bool) -> str:
    return "bfloat16" if on_gpu else "float32"


def fp32_grad_accumulation(t: TrainerConfig) -> bool:
    """Whether the learner's micro-batch gradients add up in fp32 while it computes in bf16: where
    DeepSpeed takes grad_accum_dtype (ZeRO 1 and 2; ZeRO 0 refuses the mix, ZeRO-3 ignores it)."""
    return t.dtype == "bfloat16" and t.zero_stage in (1, 2)


def recompute_logprobs(cfg: RLSpecConfig) -> bool:
    """algo.recompute_logprobs with auto (null) resolved."""
    a = cfg.algo
    if a.recompute_logprobs is not None:
        return a.recompute_logprobs
    # online draft adaptation captures its features in the LogprobWorker's forward pass
    return a.kl_coef > 0 or cfg.speculation.online.enabled


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


def resolve_engine(g: GenerationConfig, on_gpu: bool) -> GenerationConfig:
    """The engine's own 'auto' settings (generation.enforce_eager: CUDA graphs on GPUs;
    generation.dtype), for runs and for engines started outside one (offline draft training,
    benchmarks)."""
    if g.enforce_eager is None:
        g.enforce_eager = not on_gpu
    g.dtype = g.dtype or default_dtype(on_gpu)
    return g

