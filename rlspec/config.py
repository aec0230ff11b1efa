"""Structured configs: the only home of defaults. YAML under conf/ selects groups and overrides
values; `validate` checks what types cannot, naming the offending key."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from rlspec.cluster.plan import (PlanError, make_plan, receivers_off_learner_gpus, refit_transport,
                                 shared_weight_group_gpus)

ASSETS = Path(__file__).resolve().parent / "assets"


def register_resolvers() -> None:
    """`${asset:tiny/policy}` names a model or dataset shipped inside the package (idempotent)."""
    OmegaConf.register_new_resolver("asset", lambda rel: str(ASSETS / rel), replace=True)


register_resolvers()  # the defaults below use it


class ConfigError(ValueError):
    """A config value is invalid; the message starts with the dotted key."""


@dataclass
class ModelConfig:
    # A local Hugging Face checkpoint directory or a hub ID (e.g. Qwen/Qwen3-8B-Base).
    path: str = "${asset:tiny/policy}"
    # Tokenizer directory or hub ID; None means the model's own.
    tokenizer: Optional[str] = None
    # Hub revision for hub IDs.
    revision: Optional[str] = None
    # Longest prompt + response the engines are sized for.
    max_model_len: int = 256
    trust_remote_code: bool = False


@dataclass
class DatasetConfig:
    # 'synthetic' (rlspec's addition generator), 'synthetic_chain' (chains of additions with every
    # partial sum written out: reasoning-length answers), 'synthetic_code' (small stdin/stdout programming
    # tasks for the code reward), a .jsonl/.json/.parquet/.csv file, a directory written by
    # datasets' save_to_disk, or a hub dataset ID (e.g. BytedTsinghua-SIA/DAPO-Math-17k).
    source: str = "synthetic"
    split: str = "train"
    # Row layout: auto | plain {prompt, answer} | dapo (DAPO-Math-17k) | aime {problem|question, answer}.
    schema: str = "auto"
    # Keep at most this many rows (None: all).
    limit: Optional[int] = None
    # Synthetic source only: rows to generate and the seed that draws them.
    num_rows: int = 20000
    seed: int = 0


@dataclass
class SyntheticConfig:
    # Digits of each number (addition; chain: of each term).
    min_digits: int = 2
    max_digits: int = 3
    # synthetic_chain: terms per problem, 2 .. max_terms, P(k) proportional to k ** -term_tail.
    max_terms: int = 8
    term_tail: float = 1.5


@dataclass
class DataConfig:
    train: DatasetConfig = field(default_factory=DatasetConfig)
    val: DatasetConfig = field(default_factory=lambda: DatasetConfig(split="test", num_rows=256, seed=1))
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    # Prompt template: rl_zero (plain text for base models), rl_think (chat template), raw.
    template: str = "rl_zero"
    # Prompts longer than this many tokens are bad rows.
    max_prompt_tokens: int = 128
    # What to do with a malformed row: 'skip' (count it and go on) or 'error' (stop, naming file and row).
    on_bad_row: str = "skip"
    shuffle: bool = True
    # Reward from rlspec.rewards.REWARDS: math (boxed / 'Answer:' checked with math-verify) or code
    # (the response's Python run against the row's test cases in a sandbox; fraction passed).
    reward: str = "math"


@dataclass
class AlgoConfig:
    # Advantage estimator from rlspec.algo registry: grpo (group mean/std) or loo (leave-one-out).
    advantage: str = "grpo"
    # Divide advantages by the group's reward std (GRPO); off gives Dr. GRPO-style advantages.
    normalize_std: bool = True
    # Policy loss from the registry: grpo (PPO clipped surrogate).
    loss: str = "grpo"
    # Loss aggregation: token_mean (every token of the batch weighs the same, DAPO) or seq_mean.
    loss_agg: str = "token_mean"
    clip_low: float = 0.2
    # Clip-higher (DAPO): a larger upper clip keeps low-probability tokens learnable.
    clip_high: float = 0.28
    # Dual-clip (verl's clip_ratio_c): a negative advantage's term is bounded at clip_ratio_c * |A|,
    # which the PPO clip leaves unbounded where the ratio runs far above 1 (tokens the policy has
    # moved towards since they were sampled, or off-policy under async). null: off. It binds only
    # where the ratio's denominator is not this step's own forward (several steps per batch, a
    # recompute, behaviour_ppo), and there it is on by default.
    clip_ratio_c: Optional[float] = 3.0
    # k3 KL penalty to the reference (initial) policy; 0 disables it and the reference model.
    kl_coef: float = 0.0
    # Dynamic sampling (DAPO): drop groups whose rewards all agree and refill from new prompts.
    dynamic_sampling: bool = False
    # Extra generation rounds dynamic sampling may spend filling one step's batch.
    dynamic_sampling_max_rounds: int = 3
    # Overlong filtering (DAPO): truncated responses get no loss.
    overlong_filter: bool = False
    # Off-policy correction for rollouts sampled by older weights (rlspec/algo/offpolicy.py):
    # behaviour_ppo (the PPO ratio and its clip taken against the sampler's log-probs pi_behav),
    # decoupled_ppo (ratio against the proximal policy, i.e. the current weights' log-probs,
    # times the behaviour weight pi_prox/pi_behav; tokens whose weight exceeds
    # behaviour_weight_cap get no loss), tis (the same weight truncated to the cap), none, or
    # auto: behaviour_ppo when async_grpo runs with max_policy_lag >= 1; else tis when the engines
    # sample in a low precision (generation.dtype bfloat16 / float16, the GPU default), whose
    # log-probs differ from the learner's; else none.
    off_policy_correction: str = "auto"
    behaviour_weight_cap: float = 2.0
    # Recompute the rollouts' log-probs under the current weights on the LogprobWorker before the
    # update. null (auto): only when the KL term's reference log-probs or online draft training's
    # features are needed. Otherwise every batch gets exactly one optimizer step, so the current
    # weights' log-probs (the PPO ratio's denominator and, under async, the proximal policy of
    # the behaviour weight) are the learner's own forward pass, detached (ratio 1 in value, as in
    # PPO's first epoch), and the recompute is skipped.
    recompute_logprobs: Optional[bool] = None


@dataclass
class GenerationConfig:
    num_prompts_per_step: int = 32
    # Group size G: samples per prompt.
    num_generations_per_prompt: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Validation decoding temperature (0: greedy).
    val_temperature: float = 0.0
    # Engine dtype (weights are refit in it). null (auto): bfloat16 on GPUs, float32 on CPU machines,
    # where it keeps the sampler/learner mismatch at float noise. The mismatch is reported every step
    # (logprob_mismatch) and, in low precision, corrected by default (algo.off_policy_correction).
    dtype: Optional[str] = None
    # vLLM KV cache on CPU, GiB (VLLM_CPU_KVCACHE_SPACE).
    cpu_kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.6
    # vLLM without CUDA graphs. null (auto): eager on CPU machines (cluster.gpus_per_node=0), CUDA
    # graphs on GPUs. Under speculation 'auto' every k the planner may pick is a captured shape
    # (rlspec/speculation/vllm_config.py).
    enforce_eager: Optional[bool] = None
    # GPUs per vLLM engine (tensor parallel); an engine sits inside one node or spans whole nodes.
    tensor_parallel_size: int = 1
    # MoE targets: shard experts over the engine's GPUs (vLLM enable_expert_parallel) instead of
    # tensor-slicing every expert.
    expert_parallel: bool = False
    # vLLM sleep mode: after every generate call the engine offloads its weights to CPU memory and
    # frees its KV cache, so colocated training gets the GPU; weights come back for the refit, the
    # KV cache for the next call. null (auto): on when colocated on GPUs without async GRPO. Needs
    # a platform with vLLM sleep mode (CUDA, ROCm); true elsewhere stops the engine's start.
    sleep_mode: Optional[bool] = None


@dataclass
class OnlineDraftConfig:
    """Online draft adaptation (EAGLE-3 heads): the LogprobWorker's forward pass over every rollout
    also captures the head's inputs and labels into a bounded cache; a DraftTrainer actor trains
    the head from it and pushes new weights into the Generator. No gradient reaches the policy."""
    enabled: bool = False
    # Push the trained head into the Generator every this many RL steps.
    push_every: int = 1
    # Head optimizer steps per RL step (run while the learner trains).
    steps_per_rl_step: int = 4
    batch_size: int = 32
    # Rows per forward/backward of a head step (gradients accumulated; 0: the whole batch). The
    # head's attention keeps [heads, T, T] per row and draft step: on a GPU, --dry-run shows what fits.
    micro_batch_size: int = 0
    lr: float = 3e-4
    # Target log-probs kept per position (the soft label).
    topk: int = 20
    # Bound on the feature cache (oldest sequences evicted first).
    cache_mb: int = 256
    # A longer rollout keeps a window of this many consecutive positions reaching into its
    # response (also cut to a quarter of cache_mb): the head trains on it at its own positions.
    max_positions: int = 4096
    loss_decay: float = 0.8


@dataclass
class HistoryConfig:
    """Rollout-history drafting (speculation.method=history, rlspec/speculation/history.py): drafts
    read from earlier rollouts of the same prompt, the live siblings of its group and the prompt."""
    # A draft continues the longest context suffix (at least min_match tokens, at most max_match)
    # seen before; min_match is the length of the index key (1 to 3).
    min_match: int = 2
    max_match: int = 8
    # Each drafted token must be the continuation of at least this share of the matches still
    # agreeing with the draft so far: drafts stop where the history disagrees.
    min_prob: float = 0.5
    # Matches read per source and row, the most recent ones.
    max_candidates: int = 64
    # Bounds: responses kept per prompt (oldest dropped), and tokens kept over all prompts (least
    # recently seen prompts evicted first).
    max_rollouts_per_prompt: int = 32
    max_tokens: int = 2_000_000
    # Draft for validation calls too. Held-out prompts have no history and one answer each (no
    # siblings), so only the prompt and the answer itself are left to draft from: off by default.
    draft_validation: bool = False


@dataclass
class SpeculationConfig:
    # none | draft_model (a small LM) | eagle3 (a draft head) | mtp (the target's own MTP layers)
    # | ngram (prompt lookup) | suffix | history (earlier rollouts of the same prompt and its
    # group's siblings). Verification is lossless rejection sampling in vLLM.
    method: str = "none"
    # Draft length k (tokens proposed per verification), or 'auto': k (0 .. max_speculative_tokens,
    # or speculation off) chosen per batch-size bucket and per step from measured step costs and
    # measured acceptance per position, maximising tokens/s (rlspec/speculation/adaptive.py).
    num_speculative_tokens: Union[int, str] = 3
    # Largest k 'auto' may choose (the engine is built for it).
    max_speculative_tokens: int = 5
    # Batch sizes at which 'auto' times engine steps at start (each running batch size uses the
    # nearest, in log scale).
    auto_buckets: list[int] = field(default_factory=lambda: [1, 4, 16, 64, 256])
    # 'auto' probes (drafts longer than planned, to measure acceptance further along the draft) on
    # the first call, on every this many training calls, and on every training call while some draft
    # position was never measured.
    auto_probe_every: int = 8
    # A probing step costs at most this many times the step it replaces: on the first call a step
    # without drafting, later the bucket's planned k (rlspec/speculation/adaptive.py: plan).
    auto_probe_max_cost: float = 1.5
    # Draft checkpoint directory or hub ID (draft_model, eagle3); none for ngram, mtp, suffix, history.
    model: Optional[str] = None
    # How the draft proposes: 'probabilistic' samples from the draft's distribution and accepts
    # with min(1, p/q); 'greedy' proposes the draft's argmax (one-hot q). Both keep the target's
    # distribution; at temperature > 0 probabilistic accepts far more.
    draft_sample_method: str = "probabilistic"
    draft_tensor_parallel_size: Optional[int] = None
    # n-gram prompt lookup window.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    online: OnlineDraftConfig = field(default_factory=OnlineDraftConfig)
    history: HistoryConfig = field(default_factory=HistoryConfig)

    @property
    def adaptive(self) -> bool:
        """num_speculative_tokens=auto: k chosen per call and batch size (rlspec/speculation/adaptive.py)."""
        return self.method != "none" and self.num_speculative_tokens == "auto"

    @property
    def k_max(self) -> int:
        """The k the engine is built for: the fixed k, or under 'auto' the largest it may choose
        (0 without speculation)."""
        if self.method == "none":
            return 0
        return int(self.max_speculative_tokens if self.adaptive else self.num_speculative_tokens)


@dataclass
class AsyncGRPOConfig:
    # Generation runs ahead of the learner through a bounded rollout queue (rlspec/loops/queue.py).
    enabled: bool = False
    # Most policy versions a trained rollout may trail the learner by. 0 keeps the synchronous
    # loop's order exactly (every rollout on-policy); 1 is one-step-off (the paper's lag 1).
    max_policy_lag: int = 1
    # Steps of rollouts submitted ahead of the learner (in flight or waiting). None: max_policy_lag
    # + 1, the most that can never go stale. Larger values run further ahead and older batches
    # are handled per on_stale; smaller values cap memory at the cost of overlap.
    queue_capacity: Optional[int] = None
    # A batch older than max_policy_lag when the learner reaches it: 'regenerate' (same prompts,
    # current weights) or 'drop' (new prompts). Either way it is counted and never trained on.
    on_stale: str = "regenerate"


@dataclass
class ClusterConfig:
    # Ray address of an existing cluster (scripts/ray_bootstrap.py passes it); None starts a local one.
    address: Optional[str] = None
    # CPUs Ray may schedule on a local cluster (None: all of this machine's).
    num_cpus: Optional[int] = None
    # Nodes the run spans; every role is placed on them (rlspec/cluster/plan.py).
    nodes: int = 1
    # GPUs per node; 0 on CPU machines, where a placement slot is cpus_per_slot CPUs.
    gpus_per_node: int = 0
    # CPUs in each placement slot (with a GPU, or alone on CPU machines).
    cpus_per_slot: int = 1
    # colocated: generation, log-prob and training share every slot (one stage runs at a time);
    # disaggregated: generation engines get slots of their own (what async GRPO needs).
    placement: str = "disaggregated"
    # Generator engines (vLLM instances) of generation.tensor_parallel_size slots each; a step's
    # prompts are spread across them.
    num_generators: int = 1
    # LogprobWorker ranks; a batch's rows are spread across them.
    logprob_world_size: int = 1
    # Data-parallel learner ranks (DeepSpeed world size).
    learner_world_size: int = 1
    # Weight refit, learner rank 0 driving vLLM's RL weight-transfer API: nccl (vLLM's engine: every
    # receiver on a GPU of its own), ipc (vLLM's CUDA IPC engine: every receiver on a learner's GPU),
    # group (rlspec's own torch.distributed group: gloo on CPU, NCCL on GPUs) or object_store
    # (through Ray's object store). null (auto): group on CPU machines; on GPUs nccl, else ipc,
    # else object_store (a plan mixing the two).
    refit: Optional[str] = None
    # Refit broadcast bucket size, MiB: tensors are flattened into buckets of about this size.
    refit_bucket_mb: int = 256
    # Print the resolved placement plan and exit without starting anything (also: --dry-run).
    dry_run: bool = False
    # Torch threads per actor; the synchronous loop runs one stage at a time, so each may use all.
    threads_per_actor: int = 2
    # Torch threads of each Generator engine (None: threads_per_actor). Under async GRPO the
    # engine runs beside the learner: on a small CPU machine give each its own cores.
    generator_threads: Optional[int] = None
    # Scheduling niceness of Generator processes (0-19). Under async GRPO on a machine with few
    # cores, a niced engine takes only the cycles the learner leaves idle (its serial sections)
    # instead of slowing every learner stage.
    generator_nice: int = 0
    # Memory of each GPU, GiB (GB200: 173). Set, validation refuses a run whose busiest GPU would
    # not hold its roles (rlspec/cluster/memory.py; `--dry-run` prints the table either way).
    gpu_memory_gib: Optional[float] = None
    # Upper bound on any single wait for an actor; a dead or stuck actor ends the run.
    actor_timeout_s: float = 900.0
    # After an actor failure, restart Ray and every actor and continue from the latest checkpoint
    # (from the start when there is none) up to this many times; then exit 1.
    max_restarts: int = 0


@dataclass
class TrainerConfig:
    max_steps: int = 40
    seed: int = 0
    # Learner compute dtype, also the LogprobWorker's and the reference's. null (auto): bfloat16 on
    # GPUs (DeepSpeed bf16: fp32 master weights and optimizer state), float32 on CPU machines.
    dtype: Optional[str] = None
    # Validate every N steps (and before the first and after the last); 0 only at start and end.
    val_every: int = 10
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    # Samples per learner forward/backward; gradient accumulation covers the rest of a mini-batch.
    micro_batch_size: int = 64
    # Samples per optimizer step (all learner ranks): the rollout batch is cut into mini-batches,
    # each one optimizer step (verl's ppo_mini_batch_size, NeMo RL's train_global_batch_size). null:
    # the whole batch, one step. With several steps per batch the PPO ratio is taken against the
    # weights before the first (the recompute's log-probs, or the learner's own no-grad pass),
    # so clipping binds; each step's token mean is over its own mini-batch (DAPO).
    mini_batch_size: Optional[int] = None
    # Passes over the rollout batch's mini-batches per RL step.
    ppo_epochs: int = 1
    # Forward each distinct prompt of a micro-batch once and the responses against its KV cache
    # (rlspec.algo.logprobs.shared_prompt_forward): the same log-probs and gradients for the
    # compute of one prompt per group. Off, or a model with sliding-window or recurrent layers:
    # every row is forwarded whole.
    shared_prompt_forward: bool = True
    # Recompute each decoder layer's activations in backward instead of keeping them (Hugging Face
    # gradient checkpointing): about 1/100 of the activation memory at Qwen3-8B width for one more
    # forward pass. Turns shared_prompt_forward off (the KV cache it needs is dropped under it).
    gradient_checkpointing: bool = False
    # Positions of a micro-batch the output layer and log-softmax run on at a time, in float32
    # (rlspec.algo.logprobs.head_logprobs): bounds the [tokens, vocab] logits held at once.
    logit_chunk_tokens: int = 4096
    zero_stage: int = 1
    # Save the final policy (Hugging Face format) to <run dir>/final.
    save_final: bool = True
    # Checkpoint every N steps (0: only on SIGUSR2, preemption and numerical stops); see
    # rlspec/loops/checkpoint.py for what a checkpoint holds.
    checkpoint_every: int = 50
    # Complete checkpoints kept (oldest deleted first).
    checkpoint_keep: int = 3
    # Where checkpoints go; None: <run dir>/checkpoints. Give a fixed path (or a fixed
    # hydra.run.dir) for requeued jobs, so the requeued run finds them.
    checkpoint_dir: Optional[str] = None
    # 'auto': continue from the latest complete checkpoint in checkpoint_dir if there is one;
    # 'never': start fresh; or a checkpoint directory (or a checkpoint root) to continue from.
    resume: str = "auto"
    # Updates skipped for a non-finite loss or gradient tolerated in a row; one more stops the
    # run (exit 4) with a checkpoint of the last good state.
    max_nonfinite_steps: int = 3


@dataclass
class LoggingConfig:
    # wandb: offline (default, no network), online, or disabled.
    wandb_mode: str = "offline"
    wandb_project: str = "rlspec"
    wandb_entity: Optional[str] = None
    progress_bar: bool = True
    plot: bool = True


@dataclass
class RLSpecConfig:
    # The shipped family of tiny models (rlspec/assets/<assets>: policy, draft, eagle3) that the
    # default model and speculation groups name: tiny (addition) or chain (reasoning-length answers).
    assets: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    async_grpo: AsyncGRPOConfig = field(default_factory=AsyncGRPOConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="rlspec_schema", node=RLSpecConfig)


SPEC_METHODS = ("none", "draft_model", "eagle3", "mtp", "ngram", "suffix", "history")


def _check(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def off_policy_correction(cfg: RLSpecConfig) -> str:
    """algo.off_policy_correction with 'auto' resolved."""
    c = cfg.algo.off_policy_correction
    if c != "auto":
        return c
    q = cfg.async_grpo
    if q.enabled and q.max_policy_lag >= 1:
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


def validate(cfg: RLSpecConfig) -> None:
    """Cross-field and value checks; raises ConfigError naming the key."""
    _validate_data(cfg)
    _validate_algo(cfg)
    _validate_generation(cfg)
    _validate_speculation(cfg)
    _validate_run(cfg)
    _validate_memory(cfg)


def _validate_memory(cfg: RLSpecConfig) -> None:
    """With cluster.gpu_memory_gib set, the busiest GPU must hold its roles (rlspec/cluster/memory.py)."""
    if not (cfg.cluster.gpu_memory_gib and cfg.cluster.gpus_per_node):
        return
    from rlspec.cluster.memory import check_fits, gpu_memory

    resolved = resolve_auto(copy.deepcopy(cfg))
    problem = check_fits(gpu_memory(resolved, plan_of(resolved)))
    if problem is not None:
        raise ConfigError(f"{problem[0]}: {problem[1]}")


def _validate_data(cfg: RLSpecConfig) -> None:
    from rlspec.data.templates import TEMPLATES
    from rlspec.rewards import REWARDS

    _check(bool(cfg.model.path), "model.path", "must name a checkpoint directory or hub ID")
    _check(cfg.model.max_model_len > 0, "model.max_model_len", "must be > 0")
    _check(cfg.data.template in TEMPLATES, "data.template", f"{cfg.data.template!r} not in {sorted(TEMPLATES)}")
    _check(cfg.data.reward in REWARDS, "data.reward", f"{cfg.data.reward!r} not in {sorted(REWARDS)}")
    _check(cfg.data.on_bad_row in ("skip", "error"), "data.on_bad_row", "must be 'skip' or 'error'")
    _check(0 < cfg.data.max_prompt_tokens < cfg.model.max_model_len, "data.max_prompt_tokens",
           f"must be in (0, model.max_model_len={cfg.model.max_model_len})")
    for split in ("train", "val"):
        ds = getattr(cfg.data, split)
        _check(ds.schema in ("auto", "plain", "dapo", "aime"), f"data.{split}.schema",
               "must be auto, plain, dapo or aime")
        _check(ds.limit is None or ds.limit > 0, f"data.{split}.limit", "must be > 0 or null")
    s = cfg.data.synthetic
    _check(1 <= s.min_digits <= s.max_digits, "data.synthetic.min_digits", "must be in [1, max_digits]")
    _check(s.max_terms >= 2, "data.synthetic.max_terms", "must be >= 2")
    _check(s.term_tail >= 0, "data.synthetic.term_tail", "must be >= 0")


def _validate_algo(cfg: RLSpecConfig) -> None:
    from rlspec.algo import ADVANTAGES, CORRECTIONS, LOSS_AGGREGATIONS, LOSSES

    a, g, c = cfg.algo, cfg.generation, cfg.cluster
    _check(a.advantage in ADVANTAGES, "algo.advantage", f"{a.advantage!r} not in {sorted(ADVANTAGES)}")
    _check(a.loss in LOSSES, "algo.loss", f"{a.loss!r} not in {sorted(LOSSES)}")
    _check(a.loss_agg in LOSS_AGGREGATIONS, "algo.loss_agg", f"{a.loss_agg!r} not in {sorted(LOSS_AGGREGATIONS)}")
    _check(0 <= a.clip_low < 1, "algo.clip_low", "must be in [0, 1)")
    _check(a.clip_high >= 0, "algo.clip_high", "must be >= 0")
    _check(a.kl_coef >= 0, "algo.kl_coef", "must be >= 0")
    _check(a.off_policy_correction in ("auto", *CORRECTIONS), "algo.off_policy_correction",
           f"{a.off_policy_correction!r} not in {['auto', *CORRECTIONS]}")
    _check(a.recompute_logprobs is not False or a.kl_coef == 0, "algo.recompute_logprobs",
           "false, but the KL term (algo.kl_coef > 0) needs the reference policy's log-probs")
    _check(a.recompute_logprobs is not False or not cfg.speculation.online.enabled, "algo.recompute_logprobs",
           "false, but speculation.online.enabled captures the draft's features in the log-prob recompute")
    _check(a.behaviour_weight_cap >= 1.0, "algo.behaviour_weight_cap", "must be >= 1 (1 is on-policy)")
    _check(a.clip_ratio_c is None or a.clip_ratio_c > 1.0, "algo.clip_ratio_c", "must be > 1 or null (off)")
    q = cfg.async_grpo
    _check(q.max_policy_lag >= 0, "async_grpo.max_policy_lag", "must be >= 0")
    _check(q.queue_capacity is None or q.queue_capacity >= 1, "async_grpo.queue_capacity", "must be >= 1 or null")
    _check(q.on_stale in ("regenerate", "drop"), "async_grpo.on_stale", "must be regenerate or drop")
    _check(not (q.enabled and c.placement == "colocated" and c.gpus_per_node > 0), "async_grpo.enabled",
           "needs cluster.placement=disaggregated: colocated roles share every GPU one stage at a time")
    _check(not (q.enabled and g.sleep_mode), "generation.sleep_mode",
           "true, but async GRPO keeps the engines generating while the learner trains")
    _check(a.dynamic_sampling_max_rounds >= 0, "algo.dynamic_sampling_max_rounds", "must be >= 0")


def _validate_generation(cfg: RLSpecConfig) -> None:
    g = cfg.generation
    _check(g.num_prompts_per_step > 0, "generation.num_prompts_per_step", "must be > 0")
    _check(g.num_generations_per_prompt >= 2, "generation.num_generations_per_prompt",
           "GRPO needs at least 2 samples per prompt")
    _check(g.max_new_tokens > 0, "generation.max_new_tokens", "must be > 0")
    _check(cfg.data.max_prompt_tokens + g.max_new_tokens <= cfg.model.max_model_len,
           "generation.max_new_tokens", f"data.max_prompt_tokens + max_new_tokens must fit "
           f"model.max_model_len={cfg.model.max_model_len}")
    _check(g.temperature > 0, "generation.temperature", "must be > 0 for RL rollouts")
    _check(g.val_temperature >= 0, "generation.val_temperature", "must be >= 0")
    # The log-prob recompute applies the temperature only; a truncated sampling distribution would
    # make every ratio off-policy without saying so.
    _check(g.top_p == 1.0, "generation.top_p", "RL rollouts support top_p=1.0 only (the log-prob "
           "recompute does not truncate the distribution yet)")
    _check(g.top_k == -1, "generation.top_k", "RL rollouts support top_k=-1 only (the log-prob "
           "recompute does not truncate the distribution yet)")
    _check(g.dtype in (None, "float32", "bfloat16", "float16"), "generation.dtype",
           "must be float32, bfloat16, float16 or null (auto)")


def _validate_speculation(cfg: RLSpecConfig) -> None:
    sp = cfg.speculation
    _check(sp.method in SPEC_METHODS, "speculation.method", f"{sp.method!r} not in {list(SPEC_METHODS)}")
    if sp.method != "none":
        k = sp.num_speculative_tokens
        _check(k == "auto" or (isinstance(k, int) and k >= 1), "speculation.num_speculative_tokens",
               f"k must be an integer >= 1 or 'auto', got {k!r}")
        _check(sp.max_speculative_tokens >= 1, "speculation.max_speculative_tokens", "must be >= 1")
        _check(sp.auto_probe_every >= 1, "speculation.auto_probe_every", "must be >= 1")
        _check(sp.auto_probe_max_cost >= 1.0, "speculation.auto_probe_max_cost", "must be >= 1")
        _check(len(sp.auto_buckets) > 0 and min(sp.auto_buckets) >= 1, "speculation.auto_buckets",
               "must be a non-empty list of batch sizes >= 1")
        needs_model = sp.method in ("draft_model", "eagle3")
        _check(needs_model == (sp.model is not None), "speculation.model",
               f"method {sp.method} {'needs a draft checkpoint' if needs_model else 'takes no draft checkpoint'}")
        _check(sp.draft_sample_method in ("greedy", "probabilistic"), "speculation.draft_sample_method",
               "must be greedy or probabilistic")
        _check(1 <= sp.prompt_lookup_min <= sp.prompt_lookup_max, "speculation.prompt_lookup_min",
               "must be in [1, prompt_lookup_max]")
    h = sp.history
    _check(1 <= h.min_match <= 3, "speculation.history.min_match", f"must be 1, 2 or 3, got {h.min_match}")
    _check(h.max_match >= h.min_match, "speculation.history.max_match", "must be >= speculation.history.min_match")
    _check(0 < h.min_prob <= 1, "speculation.history.min_prob", f"must be in (0, 1], got {h.min_prob}")
    for key in ("max_candidates", "max_rollouts_per_prompt", "max_tokens"):
        _check(getattr(h, key) >= 1, f"speculation.history.{key}", "must be >= 1")
    o = sp.online
    if o.enabled:
        _check(sp.method == "eagle3", "speculation.online.enabled",
               f"online draft adaptation trains EAGLE-3 heads; speculation.method is {sp.method!r}")
        for key in ("push_every", "steps_per_rl_step", "batch_size", "topk", "cache_mb", "max_positions"):
            _check(getattr(o, key) >= 1, f"speculation.online.{key}", "must be >= 1")
        _check(o.lr > 0, "speculation.online.lr", "must be > 0")
        _check(o.micro_batch_size >= 0, "speculation.online.micro_batch_size", "must be >= 0 (0: the whole batch)")
        _check(not cfg.async_grpo.enabled, "speculation.online.enabled",
               "runs with the synchronous loop for now (async_grpo.enabled=false)")


def _validate_run(cfg: RLSpecConfig) -> None:
    """Placement, cluster, trainer and logging."""
    g, t, c = cfg.generation, cfg.trainer, cfg.cluster
    plan_of(cfg)  # raises naming the key that does not fit
    shipped = sorted(d.name for d in ASSETS.iterdir() if (d / "policy").is_dir())
    _check(cfg.assets in shipped, "assets", f"{cfg.assets!r} is not a shipped model family {shipped}")
    _check(c.refit in (None, "nccl", "ipc", "group", "object_store"), "cluster.refit",
           "must be nccl, ipc, group, object_store or null (auto)")
    plan = plan_of(cfg)
    if c.refit in ("nccl", "ipc"):
        _check(plan.on_gpu, "cluster.refit", f"{c.refit} is vLLM's GPU transport; this plan has no GPUs "
               "(cluster.gpus_per_node=0): use group, or null to choose")
    if c.refit in ("nccl", "group"):
        shared = shared_weight_group_gpus(plan, recompute_logprobs(cfg))
        slot, names = next(iter(shared.items()), (None, []))
        _check(not shared, "cluster.refit", f"{c.refit} puts {' and '.join(names)} in one NCCL group on one GPU "
               f"(node {getattr(slot, 'node', 0)}, GPU {getattr(slot, 'index', 0)}; {len(shared)} such GPUs), "
               "which NCCL refuses; use ipc or object_store, or null to choose")
    if c.refit == "ipc":
        off = receivers_off_learner_gpus(plan, recompute_logprobs(cfg))
        _check(not off, "cluster.refit", f"ipc reaches receivers on the learners' GPUs only; {', '.join(off)} "
               "sit elsewhere: use nccl or object_store, or null to choose")
    _check(c.refit_bucket_mb >= 1, "cluster.refit_bucket_mb", "must be >= 1")
    _check(c.threads_per_actor >= 1, "cluster.threads_per_actor", "must be >= 1")
    _check(c.generator_threads is None or c.generator_threads >= 1, "cluster.generator_threads", "must be >= 1 or null")
    _check(0 <= c.generator_nice <= 19, "cluster.generator_nice", "must be in [0, 19]")
    _check(c.actor_timeout_s > 0, "cluster.actor_timeout_s", "must be > 0")
    _check(t.max_steps >= 1, "trainer.max_steps", "must be >= 1")
    _check(t.checkpoint_every >= 0, "trainer.checkpoint_every", "must be >= 0")
    _check(t.checkpoint_keep >= 1, "trainer.checkpoint_keep", "must be >= 1")
    _check(t.max_nonfinite_steps >= 0, "trainer.max_nonfinite_steps", "must be >= 0")
    _check(bool(t.resume), "trainer.resume", "must be 'auto', 'never' or a checkpoint directory")
    _check(c.max_restarts >= 0, "cluster.max_restarts", "must be >= 0")
    _check(t.val_every >= 0, "trainer.val_every", "must be >= 0")
    _check(t.lr > 0, "trainer.lr", "must be > 0")
    _check(t.zero_stage in (0, 1, 2, 3), "trainer.zero_stage", "must be 0, 1, 2 or 3")
    _check(t.logit_chunk_tokens >= 1, "trainer.logit_chunk_tokens", "must be >= 1")
    _check(c.gpu_memory_gib is None or c.gpu_memory_gib > 0, "cluster.gpu_memory_gib", "must be > 0 or null")
    _check(t.dtype in (None, "float32", "bfloat16"), "trainer.dtype", "must be float32, bfloat16 or null (auto)")
    samples = g.num_prompts_per_step * g.num_generations_per_prompt
    mini = t.mini_batch_size or samples
    _check(t.mini_batch_size is None or (0 < mini and samples % mini == 0), "trainer.mini_batch_size",
           f"must divide the rollout batch of {samples} samples (or be null)")
    _check(t.ppo_epochs >= 1, "trainer.ppo_epochs", "must be >= 1")
    per_rank = mini // c.learner_world_size
    _check(mini % c.learner_world_size == 0, "cluster.learner_world_size",
           f"must divide the {mini} samples of each optimizer step")
    _check(t.micro_batch_size > 0 and per_rank % t.micro_batch_size == 0, "trainer.micro_batch_size",
           f"must divide the {per_rank} samples each learner rank gets per optimizer step")
    _check(cfg.logging.wandb_mode in ("offline", "online", "disabled"), "logging.wandb_mode",
           "must be offline, online or disabled")
