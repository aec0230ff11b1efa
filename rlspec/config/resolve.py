"""The settings left 'auto' in the schema that the settings alone decide (rlspec/checks.py's
`resolve_auto` resolves them all, once, before anything reads them)."""
from __future__ import annotations

from rlspec.config.schema import GenerationConfig, RLSpecConfig, TrainerConfig


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


def resolve_engine(g: GenerationConfig, on_gpu: bool) -> GenerationConfig:
    """The engine's own 'auto' settings (generation.enforce_eager: CUDA graphs on GPUs;
    generation.dtype), for runs and for engines started outside one (offline draft training,
    benchmarks)."""
    if g.enforce_eager is None:
        g.enforce_eager = not on_gpu
    g.dtype = g.dtype or default_dtype(on_gpu)
    return g

