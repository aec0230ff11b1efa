"""The speculation section of the config schema (rlspec/config/schema.py holds the rest): drafting
method, k, the draft model, online adaptation, rollout-history and suffix drafting."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

SPEC_METHODS = ("none", "draft_model", "eagle3", "mtp", "ngram", "suffix", "history")
# vLLM methods Model Runner V2 lacks (vLLM falls back to V1 for them); rlspec's history is custom_class
V1_ONLY_METHODS = ("suffix", "medusa", "mlp_speculator", "custom_class")


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
class HostHistoryConfig:
    """The host drafter's store (speculation.history.drafter=host, rlspec/speculation/history/host/index.py):
    in the engine's process, vLLM's custom proposer (Model Runner V1, async scheduling off)."""
    # Drafts from any prompt's answers (global_source) come from:
    # - `counts` (the device drafter's rule): a count table of the newest count_tokens stored tokens
    #   (tails, answers and END marks), per context of 1..max_match answer tokens its next tokens'
    #   counts, drafted as suffix decoding does (the commonest next token while the product of the
    #   shares is at least 0.1, from the context length of highest score); about 64 bytes a counted
    #   token (256 MB at the default count_tokens), whatever the store holds.
    # - `chains`: hash chains over the whole store and this call's running answers, one per key
    #   length of global_keys, longest first: the first that yields matches decides (4 bytes per
    #   stored token each, and time per insert).
    global_index: str = "counts"
    count_tokens: int = 1 << 22
    global_keys: list[int] = field(default_factory=lambda: [4, 1])
    # Response tokens kept over all prompts (about 20-40 bytes each). Over it the prompts holding
    # the most responses drop their oldest, down to min_rollouts_per_prompt; then whole prompts go,
    # a fixed subset of them kept (the prompts whose identity hashes lowest), so that every epoch
    # comes back to the same ones.
    max_tokens: int = 50_000_000
    min_rollouts_per_prompt: int = 1


@dataclass
class DeviceHistoryConfig:
    """The device drafter's store (speculation.history.drafter=device,
    rlspec/speculation/history/device/store.py): tensors on the engine's device, in vLLM's ngram_gpu slot
    (no copy of the rows to the host, async scheduling kept on a GPU). Its global source is the
    count table; its ring drops the oldest tokens, so no prompt keeps a floor of answers."""
    # The ring's tokens (about 110 bytes each: the ring, its buckets and the count table).
    max_tokens: int = 1 << 22
    # How a row finds its latest match in itself and its running siblings (the same drafts
    # either way): `scan` compares every window of the rows each step (reads 2 x max_num_seqs x
    # max_model_len tokens a step); `table` keeps a hash table per row and prompt key length,
    # advanced by each step's new tokens (Triton kernels on a GPU), at 30 to 56 x max_model_len
    # bytes per row and key length on the engine's device (2 x max_num_seqs rows).
    lookup: str = "scan"
    # Whether a step runs as kernels.py's Triton kernels (the rows' advance and the draft in six
    # launches, in memory allocated once): `auto` where the engine's device is a GPU; `true`
    # elsewhere runs them in Triton's interpreter (TRITON_INTERPRET=1 set before Triton loads:
    # slow, for checking them on a CPU); `false` runs the torch code they were checked against.
    kernels: str = "auto"


@dataclass
class HistoryConfig:
    """Rollout-history drafting (speculation.method=history): drafts read from earlier rollouts of
    the same prompt, the live siblings of its group, the prompt, and where those give nothing,
    earlier rollouts of any prompt. The keys here are both drafters'; `host` and `device` hold
    each drafter's own, and validation refuses a key set in the section of the drafter not chosen."""
    # Where drafts are made: `host` or `device` (the sections below).
    drafter: str = "host"
    # A draft continues the longest context suffix (at most max_match tokens) seen before in the
    # prompt's own sources, found by keys of these lengths (longest first; the device drafter's).
    prompt_keys: list[int] = field(default_factory=lambda: [8, 3, 1])
    max_match: int = 16
    # Each drafted token must be the continuation of at least this share of the matches still
    # agreeing with the draft so far: drafts stop where the history disagrees.
    min_prob: float = 0.5
    # Stored matches read per key length and draft, newest first (bounds a lookup's work; the
    # device drafter's bucket width).
    max_candidates: int = 64
    # Draft from any prompt's answers where they match the context further back than the prompt's
    # own history, its siblings and the prompt itself (a prompt seen for the first time has only
    # these): host.global_index says how; the device drafter reads its count table.
    global_source: bool = True
    # Responses kept per prompt (oldest dropped).
    max_rollouts_per_prompt: int = 32
    # Draft for validation calls too. Held-out prompts have no history and one answer each (no
    # siblings), so only the prompt and the answer itself are left to draft from: off by default.
    draft_validation: bool = False
    # Under num_speculative_tokens=auto, engine steps that draft nothing (k=0, or the call run
    # without speculation) still look up, for up to this many rows per step, what would have been
    # drafted, and check it against the tokens the target samples next: the acceptance 'auto' needs
    # to turn drafting back on when prompts come back with history (0: no such measurement).
    shadow_rows: int = 32
    host: HostHistoryConfig = field(default_factory=HostHistoryConfig)
    device: DeviceHistoryConfig = field(default_factory=DeviceHistoryConfig)

    def __post_init__(self):  # from a dict (the engine's additional_config) as from keywords
        if isinstance(self.host, dict):
            self.host = HostHistoryConfig(**self.host)
        if isinstance(self.device, dict):
            self.device = DeviceHistoryConfig(**self.device)


def history_config(**flat) -> HistoryConfig:
    """HistoryConfig from flat keywords, the host section's (max_tokens, count_tokens, global_index,
    ...) among them: how the benchmarks and tests set a host store."""
    host_keys = HostHistoryConfig.__dataclass_fields__
    host = HostHistoryConfig(**{k: v for k, v in flat.items() if k in host_keys})
    return HistoryConfig(**{k: v for k, v in flat.items() if k not in host_keys}, host=host)


@dataclass
class SuffixConfig:
    """vLLM's suffix decoding (speculation.method=suffix; Snowflake's arctic-inference, installed by
    `make suffix-install`): suffix trees over each request's prompt and answer so far, and over earlier
    responses to any prompt. vLLM's defaults; its suffix_decoding_* settings."""
    # Longest context a tree matches (and depth of the trees).
    max_tree_depth: int = 24
    # A draft is at most this many times the matched context's length (and k).
    max_spec_factor: float = 1.0
    # A drafted token's estimated probability at least this.
    min_token_prob: float = 0.1
    # Responses kept for the global tree (oldest evicted; -1: no bound).
    max_cached_requests: int = 10000


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
    # 'auto' plans from these step costs instead of timing the engine: a JSON file mapping batch
    # sizes to seconds per engine step [off, k=0, 1, ..., max_speculative_tokens], as
    # {"1": [...], "64": [...]}, used as given (no start-up timing, no per-call refinement), so
    # a run's k follow its measured acceptance alone and repeat from run to run.
    auto_step_costs: Optional[str] = None
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
    suffix: SuffixConfig = field(default_factory=SuffixConfig)

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
