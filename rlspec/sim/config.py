"""Simulator configs: the only home of the simulator's defaults, each field documented where it is
defined. YAML under conf/sim/ holds named data (a GPU's datasheet, a model's config.json shapes,
a paper scenario) and selects it; `validate` checks what types cannot, naming the offending key.

Units: seconds, bytes, FLOP/s, bytes/s. Hardware and shape fields have no default: a preset from
conf/sim/gpu and conf/sim/model supplies them (the primary config selects gb200 + qwen3_8b).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING


class SimConfigError(ValueError):
    """A simulator config value is invalid; the message starts with the dotted key."""


@dataclass
class GPUSpec:
    name: str = MISSING
    # Dense tensor FLOP/s of one GPU at the compute dtype (datasheet figure without sparsity).
    peak_flops: float = MISSING
    # Memory bandwidth of one GPU, bytes/s (datasheet).
    hbm_bandwidth: float = MISSING
    # Memory capacity of one GPU, bytes (datasheet); used only to warn when the KV cache overflows.
    hbm_capacity: float = MISSING
    # Scale-up link bandwidth of one GPU, one direction, bytes/s (NVLink; datasheet).
    nvlink_bandwidth: float = MISSING
    # GPUs that share one NVLink domain (72 for GB200 NVL72, 8 for HGX H200).
    nvlink_domain: int = MISSING
    # Scale-out bandwidth of one GPU, one direction, bytes/s (its NIC; datasheet).
    network_bandwidth: float = MISSING
    # Latency of one small collective (all-reduce / all-to-all) inside the NVLink domain.
    collective_latency_s: float = MISSING


@dataclass
class ModelShape:
    """A decoder's shapes as its config.json states them; parameter counts are derived."""
    name: str = MISSING
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    head_dim: int = MISSING
    # Dense MLP width (0 when every layer is MoE).
    intermediate_size: int = 0
    vocab_size: int = MISSING
    tie_word_embeddings: bool = False
    # MoE: routed experts per layer, experts each token visits, and one expert's MLP width.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    # Input width of q/k/v projections when it is not hidden_size (EAGLE-3 feeds 2 x hidden).
    qkv_input_size: int = 0
    # Whether the model owns an input embedding (an EAGLE-3 head borrows the target's).
    has_embedding: bool = True
    # Parameters outside layers and embeddings read on every forward (EAGLE-3's fc over 3 hidden states).
    extra_params: int = 0
    # Bytes per weight and per KV-cache element (2 for bf16, 4 for float32).
    bytes_per_param: int = 2


@dataclass
class ModelPair:
    target: ModelShape = field(default_factory=ModelShape)
    # The drafter (EAGLE-3 head, MTP layer or small LM); None for n-gram drafting or none.
    draft: Optional[ModelShape] = None


@dataclass
class WorkloadConfig:
    num_prompts_per_step: int = 128
    # Group size G: samples per prompt.
    num_generations_per_prompt: int = 16
    # Mean templated prompt length, tokens.
    prompt_tokens: int = 256
    max_new_tokens: int = 16384
    # Mean response length after the max_new_tokens cap (what a run's response_length reports).
    mean_response_tokens: float = 4096.0
    # Spread of the uncapped response lengths, std/mean of a lognormal: the long tail the step waits on.
    response_length_cv: float = 0.6
    # Partial rollouts (generation.partial): 0 = whole calls (the analytic tail model); >= 1 = a call
    # holds this many times the step's groups and returns once the step's groups are complete, the
    # rest resumed by the next call after a prefill of prompt + answer so far (event simulation over
    # seeded lengths, steady state; 1.0 is whole calls in the same simulation, the like-for-like
    # baseline).
    partial_over_provision: float = 0.0
    # ... with refill (generation.partial.refill): each group completed before the step's last starts
    # a new one (its prompt prefilled), so the batch holds over_provision x the step's groups throughout.
    partial_refill: bool = False
    # Log-prob and train batches padded to the longest sequence (rlspec) instead of packed (NeMo RL).
    padded: bool = False
    # A reference-policy forward in the log-prob stage (KL penalty on).
    kl_reference: bool = False
    # A log-prob recompute stage before the update. NeMo RL runs one every step; rlspec skips it
    # unless the KL term or online draft training needs it (algo.recompute_logprobs).
    recompute_logprobs: bool = True


@dataclass
class SimSpeculationConfig:
    # none | eagle3 | mtp | draft_model (cost: k forwards of model.draft per verification) |
    # ngram (no draft forward).
    method: str = "eagle3"
    # Draft length k: tokens proposed per verification (0 means no speculation).
    k: int = 3
    # Measured per-position acceptance as vLLM counts it: fraction of verifications in which draft
    # position i was accepted (non-increasing). Positions past its end extend it geometrically with
    # its last ratio. Empty: use acceptance_rate.
    acceptance_per_pos: list[float] = field(default_factory=list)
    # Per-token acceptance a when acceptance_per_pos is empty: position i is accepted with
    # probability a^i, so a verification yields (1 - a^(k+1)) / (1 - a) tokens.
    acceptance_rate: float = 0.7
    # The refit also ships the draft's weights (online draft training).
    refit_draft: bool = False


@dataclass
class SimClusterConfig:
    num_gpus: int = 32
    # sync: every GPU generates, then every GPU computes log-probs and trains (colocated, NeMo RL
    # default). async: gen_gpus generate while the rest train, overlapped up to policy_lag steps.
    mode: str = "sync"
    # GPUs per generation engine: tensor parallel for dense layers, expert parallel for MoE layers.
    gen_tp: int = 1
    # async: GPUs in the generation pool (the remaining num_gpus - gen_gpus train).
    gen_gpus: int = 0
    # async: how many policy versions a rollout may lag. With lag L >= 2 engines refill finished
    # slots from the next batches and hold L batches at once (NeMo RL's async collector; no tail
    # wait); with lag 1 each batch still waits for its longest rollout, but generation overlaps
    # training. rlspec's own queue generates whole batches: model it with lag 1.
    policy_lag: int = 1


@dataclass
class EfficiencyConfig:
    """The few parameters a real run measures (`python -m rlspec.sim calibrate`); the defaults are
    published measurements for GPU clusters, cited in docs/simulator.md."""
    # Fraction of datasheet memory bandwidth that decode (weight + KV streaming) reaches.
    hbm: float = 0.8
    # Fraction of datasheet FLOP/s that decode/verification GEMMs reach when compute-bound.
    decode_flops: float = 0.6
    # Fixed cost of one engine forward (kernel launches, scheduler, sampler) on top of the roofline.
    forward_overhead_s: float = 0.0
    # Model FLOP utilisation of the log-prob recompute (forward only) and of training (fwd + bwd).
    logprob_mfu: float = 0.3
    train_mfu: float = 0.3
    # Fraction of link bandwidth a weight refit reaches, and a fixed cost per refit (RPCs, reload).
    link: float = 0.8
    refit_overhead_s: float = 0.0
    # CPU seconds per sample for data loading, reward and advantage computation (the prep stage).
    prep_s_per_sample: float = 0.0


@dataclass
class SweepConfig:
    """Axes of the plots (speedup vs k, vs acceptance, vs scale)."""
    k: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 7, 8])
    acceptance_rate: list[float] = field(default_factory=lambda: [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    # Cluster sizes as multiples of cluster.num_gpus (the global batch stays fixed).
    scale: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0, 2.0, 4.0])


@dataclass
class SimConfig:
    gpu: GPUSpec = field(default_factory=GPUSpec)
    model: ModelPair = field(default_factory=ModelPair)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    spec: SimSpeculationConfig = field(default_factory=SimSpeculationConfig)
    cluster: SimClusterConfig = field(default_factory=SimClusterConfig)
    eff: EfficiencyConfig = field(default_factory=EfficiencyConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    # A scenario's figures to print beside the simulator's, e.g. {rollout_speedup: 1.8}.
    paper: dict[str, Any] = field(default_factory=dict)
    # Write PNG plots next to sim.json.
    plot: bool = True


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="sim_schema", node=SimConfig)
    # The primary config: schema first, then the default presets, then the command line.
    cs.store(name="sim", node={
        "defaults": ["sim_schema", {"gpu": "gb200"}, {"model": "qwen3_8b"}, "_self_"],
        "hydra": {"run": {"dir": "outputs/sim/${now:%Y-%m-%d}/${now:%H-%M-%S}"},
                  "sweep": {"dir": "multirun/sim/${now:%Y-%m-%d}/${now:%H-%M-%S}"},
                  "job": {"chdir": False}}})


SPEC_METHODS = ("none", "eagle3", "mtp", "draft_model", "ngram")


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise SimConfigError(f"{key}: {msg}")


def validate(cfg: SimConfig) -> None:
    """Value and cross-field checks; raises SimConfigError naming the key."""
    g, w, s, c, e = cfg.gpu, cfg.workload, cfg.spec, cfg.cluster, cfg.eff
    for key in ("peak_flops", "hbm_bandwidth", "hbm_capacity", "nvlink_bandwidth", "network_bandwidth"):
        _check(getattr(g, key) > 0, f"gpu.{key}", "must be > 0")
    _check(g.nvlink_domain >= 1, "gpu.nvlink_domain", "must be >= 1")
    _check(g.collective_latency_s >= 0, "gpu.collective_latency_s", "must be >= 0")
    for role in ("target", "draft"):
        m = getattr(cfg.model, role)
        if m is None:
            continue
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                    "bytes_per_param"):
            _check(getattr(m, key) > 0, f"model.{role}.{key}", "must be > 0")
        _check((m.num_experts > 0) == (m.experts_per_token > 0) == (m.moe_intermediate_size > 0),
               f"model.{role}.num_experts", "num_experts, experts_per_token and moe_intermediate_size "
               "must be set together")
        _check(m.experts_per_token <= m.num_experts, f"model.{role}.experts_per_token", "must be <= num_experts")
        _check(m.intermediate_size > 0 or m.num_experts > 0, f"model.{role}.intermediate_size",
               "a layer needs a dense MLP or experts")
    _check(w.num_prompts_per_step > 0, "workload.num_prompts_per_step", "must be > 0")
    _check(w.num_generations_per_prompt > 0, "workload.num_generations_per_prompt", "must be > 0")
    _check(w.prompt_tokens >= 0, "workload.prompt_tokens", "must be >= 0")
    _check(w.max_new_tokens > 0, "workload.max_new_tokens", "must be > 0")
    _check(0 < w.mean_response_tokens <= w.max_new_tokens, "workload.mean_response_tokens",
           f"must be in (0, max_new_tokens={w.max_new_tokens}]")
    _check(w.response_length_cv >= 0, "workload.response_length_cv", "must be >= 0")
    _check(w.partial_over_provision == 0 or w.partial_over_provision >= 1, "workload.partial_over_provision",
           "must be 0 (whole calls) or >= 1")
    _check(w.partial_over_provision == 0 or c.mode == "sync" or c.policy_lag == 1, "workload.partial_over_provision",
           "partial rollouts are simulated for sync or async lag 1 (rlspec's queue)")
    _check(s.method in SPEC_METHODS, "spec.method", f"{s.method!r} not in {list(SPEC_METHODS)}")
    _check(s.k >= 0, "spec.k", "must be >= 0")
    _check(0 <= s.acceptance_rate < 1, "spec.acceptance_rate", "must be in [0, 1)")
    p = list(s.acceptance_per_pos)
    _check(all(0 <= a <= 1 for a in p) and all(b <= a + 1e-9 for a, b in zip(p, p[1:])),
           "spec.acceptance_per_pos", "must be non-increasing values in [0, 1]")
    if s.method in ("eagle3", "mtp", "draft_model") and s.k > 0:
        _check(cfg.model.draft is not None, "model.draft", f"spec.method={s.method} needs a draft shape")
    _check(c.mode in ("sync", "async"), "cluster.mode", "must be sync or async")
    _check(c.gen_tp >= 1, "cluster.gen_tp", "must be >= 1")
    _check(c.num_gpus >= c.gen_tp, "cluster.num_gpus", f"must be >= cluster.gen_tp={c.gen_tp}")
    if c.mode == "async":
        _check(c.gen_tp <= c.gen_gpus < c.num_gpus, "cluster.gen_gpus",
               f"async needs gen_tp <= gen_gpus < num_gpus={c.num_gpus}")
        _check(c.policy_lag >= 1, "cluster.policy_lag", "async needs a lag >= 1")
    for key in ("hbm", "decode_flops", "logprob_mfu", "train_mfu", "link"):
        _check(0 < getattr(e, key) <= 1, f"eff.{key}", "must be in (0, 1]")
    for key in ("forward_overhead_s", "refit_overhead_s", "prep_s_per_sample"):
        _check(getattr(e, key) >= 0, f"eff.{key}", "must be >= 0")


CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "sim"


def compose(overrides: list[str] | tuple[str, ...] = ()) -> SimConfig:
    """The validated config `python -m rlspec.sim OVERRIDES` runs with."""
    from hydra import compose as hcompose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_object(hcompose("sim", overrides=list(overrides)))
    validate(cfg)
    return cfg
