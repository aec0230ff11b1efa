"""rlspec's weight-transfer engine for vLLM, registered through vLLM's own factory
(`WeightTransferEngineFactory`, backend "rlspec"). vLLM builds one in every worker of an engine
(each tensor-parallel rank), and the Generator drives it through vLLM's RL weight-update API
(`init_weight_transfer_engine`, `start_weight_update` / `start_draft_weight_update`,
`update_weights`, `finish_weight_update`), so weights land inside the workers whichever model
runner vLLM chose, and a draft update goes to the draft model vLLM itself names.

Two ways in, chosen per update:
- broadcast: this worker is a rank of rlspec's own weight group (rlspec/engines/weight_sync.py:
  gloo on CPU, NCCL on GPUs) and receives the learner's weights bucket by bucket, loading each
  bucket as it lands (memory bounded by the bucket size);
- tensors: the update carries the tensors themselves (the object-store transport, and the draft
  head from the DraftTrainer).
Either way the weights go through the model's own `load_weights` (checkpoint names; vLLM's weight
loaders shard them for tensor parallelism) inside vLLM's layerwise reload, as its built-in engines
do. The dtype sent must be the engine's own (checked)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from rlspec.engines.weight_sync import RefitGroup, TensorMeta, buckets, metas_from_wire, recv_state

BACKEND = "rlspec"


@dataclass
class RLSpecInitInfo(WeightTransferInitInfo):
    """The weight group this engine's workers join (none: tensors-only updates)."""
    addr: str | None = None
    port: int = 0
    rank_offset: int = 1          # this engine's first worker's rank in the group (the learner is 0)
    world: int = 0
    backend: str = "gloo"         # torch.distributed backend of the group: gloo (CPU) or nccl
    metas: list = field(default_factory=list)   # [name, dtype name, shape] of every broadcast tensor
    bucket_bytes: int = 256 << 20


@dataclass
class RLSpecUpdateInfo(WeightTransferUpdateInfo):
    mode: str = "broadcast"       # broadcast | tensors
    names: list = field(default_factory=list)
    tensors: list = field(default_factory=list)

    def __post_init__(self):
        if self.mode not in ("broadcast", "tensors"):
            raise ValueError(f"rlspec weight update mode {self.mode!r}: broadcast or tensors")
        if self.mode == "tensors" and len(self.names) != len(self.tensors):
            raise ValueError(f"{len(self.names)} names for {len(self.tensors)} tensors")


class RLSpecTransferEngine(WeightTransferEngine[RLSpecInitInfo, RLSpecUpdateInfo]):
    init_info_cls = RLSpecInitInfo
    update_info_cls = RLSpecUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.group: RefitGroup | None = None
        self.metas: list[TensorMeta] = []
        self.bucket_bytes = 0

    def init_transfer_engine(self, init_info: RLSpecInitInfo) -> None:
        if init_info.addr is None:
            return
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        self.group = RefitGroup(init_info.addr, init_info.port, rank, init_info.world, init_info.backend,
                                device=self.device)
        self.metas = metas_from_wire(init_info.metas)
        self.bucket_bytes = init_info.bucket_bytes

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: RLSpecUpdateInfo) -> None:
        if update_info.mode == "tensors":
            self._load(list(zip(update_info.names, update_info.tensors)))
            return
        if self.group is None:
            raise RuntimeError("rlspec weight transfer: a broadcast update before the engine joined a weight group")
        for idx in buckets(self.metas, self.bucket_bytes):
            self._load(list(recv_state(self.group, [self.metas[i] for i in idx], self.bucket_bytes).items()))

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        want = self.model_config.dtype
        for name, t in weights:
            if t.is_floating_point() and t.dtype != want:
                raise TypeError(f"rlspec weight transfer: {name} arrives as {t.dtype}, the engine computes in "
                                f"{want}; send weights in the engine's dtype")
        hf = self.model_config.hf_config
        if getattr(hf, "tie_word_embeddings", False):
            # An in-place reload unties lm_head from the embedding: give it the embedding too.
            names = {n for n, _ in weights}
            weights += [("lm_head.weight", t) for n, t in weights
                        if n == "model.embed_tokens.weight" and "lm_head.weight" not in names]
        self.model.load_weights([(n, t.to(self.device)) for n, t in weights])

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Make backend "rlspec" known to vLLM in this process (idempotent). The Generator calls it
    before its engine starts; engine processes vLLM starts itself get it through the
    vllm.general_plugins entry point."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, RLSpecTransferEngine)
    except ValueError:  # registered already (the factory refuses a name twice)
        pass
