"""The config schema: one dataclass per section, the only home of defaults (each field documented
here; the speculation section in rlspec/config/speculation.py). YAML under conf/ selects groups and
overrides values."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

# the speculation section, in its own module; here for the rest of the package
from rlspec.config.speculation import (SPEC_METHODS, V1_ONLY_METHODS, HistoryConfig, OnlineDraftConfig,  # noqa: F401
                                       SpeculationConfig, SuffixConfig)

ASSETS = Path(__file__).resolve().parents[1] / "assets"


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
    # auto: behaviour_ppo when async_grpo runs with max_policy_lag >= 1 or partial rollouts carry
    # answers across versions (generation.partial.max_carry_versions >= 1); else tis when the engines
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
class PartialRolloutConfig:
    """Partial rollouts (rlspec/loops/partial.py): a generate call is given more groups than the
    step trains on and returns once the step's groups are complete; the unfinished answers are
    aborted, their tokens kept (each with its behaviour log-prob and policy version), and the next
    call resumes them first with the weights it has."""
    enabled: bool = False
    # Groups in flight per call over the groups a step trains (generation.num_prompts_per_step);
    # new prompts fill the call up to it beside the carried groups.
    over_provision: float = 1.5
    # A carried answer (finished or not) with a token sampled more than this many policy versions
    # before the weights that would resume it is started again, and counted (partial/dropped_answers).
    # It caps a trained token's lag; a tight cap restarts the long answers that need several calls,
    # and the tokens they had are sampled again (docs/async.md#partial-rollouts-the-long-tail).
    max_carry_versions: int = 8
    # A group started and carried out of this many calls unfinished is run to its end by the next
    # call, which returns it first (partial/forced_groups): every group is trained within
    # max_carries + 1 calls of its start, the long answers too. Without the bound a group that
    # loses every call's race (its answers longer than the others') is carried for the rest of the
    # run, holds its slot and never trains: the long tail is left out.
    max_carries: int = 4
    # Refill: a call also holds num_prompts_per_step - 1 spare groups, one started each time a group
    # completes, so the running batch stays at over_provision x the step's groups until the call
    # returns (false: it thins out as groups complete, as in APRIL).
    refill: bool = False


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
    # vLLM's attention backend by name (its AttentionBackendEnum: FLASH_ATTN, TRITON_ATTN,
    # FLASHINFER, ...); null: vLLM's own choice. TRITON_ATTN needs no compiled attention kernels
    # (the GPU kit carries none: docs/gpu.md).
    attention_backend: Optional[str] = None
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
    # vLLM's async scheduling (the next step scheduled while this one runs). null: vLLM's choice
    # (on GPUs on for every method but a custom proposer and suffix; vLLM's CPU platform turns it
    # off); true: on, on the CPU platform too; false: off.
    async_scheduling: Optional[bool] = None
    partial: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)


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
    # Refit broadcast bucket size, MiB: tensors are flattened into buckets of about this size
    # (under ipc at least the largest tensor: vLLM's IPC buffer must hold it).
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
    # adamw (betas 0.9 / 0.999, eps 1e-8; fp32 state) or sgd (no momentum: the update is lr times the
    # clipped gradient). Runs train with adamw; sgd is what comparisons of two training paths use,
    # since Adam's first step, about lr x sign(g), turns float noise in a near-zero gradient into a
    # step of up to lr.
    optimizer: str = "adamw"
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
    # Leave out of the learner's forward and backward the rows that cannot move the weights: every
    # sample of a group whose rewards all agree (advantage 0) and samples of weight 0, when the loss
    # gives them zero gradient (rlspec.algo.losses.INERT_AT_ZERO_ADVANTAGE; kl_coef 0). The loss's
    # denominators still count them, so the loss and the update are the same; the step's metrics
    # (entropy, ratio, clip fractions, sampler mismatch) are then means over the rows trained.
    skip_zero_gradient_rows: bool = True
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
    # Append every step's rollouts to <run dir>/rollouts.jsonl (a line a step: per group its prompt's
    # and responses' token ids and rewards): traces to replay (scripts/bench_history_store.py).
    save_rollouts: bool = False


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

