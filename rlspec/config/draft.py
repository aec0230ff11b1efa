"""The offline draft trainer's config (`python -m rlspec.draft.train`, rlspec/draft/train.py): the
`draft` section and the root that composes it with the trainer's model, data, generation and
logging sections."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlspec.config.schema import DataConfig, GenerationConfig, LoggingConfig, ModelConfig


@dataclass
class DraftConfig:
    # "eagle3": an EAGLE-3 head on the target's hidden states; "draft_model": a small causal LM.
    kind: str = "eagle3"
    # What to continue from (a directory vLLM loads): an EAGLE-3 head (null: a fresh head from
    # `seed`), or for draft_model the small model (required; same tokenizer as the target).
    init: Optional[str] = None
    # Where the trained head goes; null: <hydra run dir>/head.
    out_dir: Optional[str] = None
    # "target": data.train prompts with responses the target regenerates; "text": lines of text_file.
    corpus: str = "target"
    text_file: Optional[str] = None
    num_prompts: int = 2048
    samples_per_prompt: int = 1
    # Held-out prompts (data.val) for the acceptance proxy and the vLLM measurement.
    val_prompts: int = 128
    # A fresh EAGLE-3 head's draft vocabulary: the this-many target tokens most frequent in the
    # training responses (EAGLE-3's rule; public heads use 32000 of Qwen3's 151936). null: all.
    draft_vocab_size: Optional[int] = None
    ttt_steps: int = 3          # draft steps unrolled in training (the k the head is trained for)
    #                             (draft_model trains one step; ttt_steps is the k of its proxy)
    topk: int = 20              # target log-probs kept per position as the soft label
    loss_decay: float = 0.8     # weight of draft step j: decay**j
    steps: int = 800            # 0: no training, measure draft.init as it is
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    grad_clip: float = 1.0
    eval_every: int = 250
    seed: int = 0
    threads: int = 2
    # After training, start vLLM with the new head and measure acceptance on the val prompts.
    eval_vllm: bool = True
    eval_k: int = 3
    actor_timeout_s: float = 900.0


@dataclass
class DraftTrainConfig:
    # The shipped family of tiny models the model group names (rlspec.config.RLSpecConfig.assets).
    assets: str = "tiny"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
