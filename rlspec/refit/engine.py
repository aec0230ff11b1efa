"""rlspec's backend of vLLM's RL weight-transfer API, both ends.

Engine side: backend "rlspec", registered through vLLM's `WeightTransferEngineFactory`; vLLM builds
one in every worker of an engine (each tensor-parallel rank). It carries one of four transports,
chosen at `init_weight_transfer_engine` (`transport`) and named again by every update (`mode`):
- `nccl` and `ipc`: vLLM's own engines (`NCCLWeightTransferEngine` for receivers on GPUs of
  their own, `IPCWeightTransferEngine` for receivers sharing the learners' GPUs), built inside
  this one with the same model and config, receive vLLM's own payloads (`inner`);
- `group`: rlspec's torch.distributed group (gloo on CPU, NCCL on GPUs: refit/group.py),
  the same round trip on machines without GPUs;
- `tensors` (no init needed): the update carries the tensors (Ray's object store; the draft head
  of online draft training; checkpoint-free pushes).
A draft update (`start_draft_weight_update`) retargets whichever engine receives. Weights go
through the model's own `load_weights` inside vLLM's layerwise reload, as vLLM's engines do; a
floating-point tensor in another dtype than the engine's is refused.

Trainer side: learner rank 0 holds one of vLLM's trainer engines (`WeightTransferTrainerFactory`:
vLLM's `nccl` and `ipc`, and rlspec's `rlspec` for the group), which drives every round through a
`VLLMWeightSyncClient` (refit/sender.py's ActorClient)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.config import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine,
                                                   WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from rlspec.messages import PeerDied
from rlspec.refit import COLLECTIVE
from rlspec.refit.group import RefitGroup, metas_from_lists, numel, recv_state, send_state

BACKEND = "rlspec"
MODES = ("tensors", *COLLECTIVE)  # what an update carries


def _inner_engine_class(transport: str) -> type[WeightTransferEngine]:
    if transport == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
        return NCCLWeightTransferEngine
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
    return IPCWeightTransferEngine


@dataclass
class RLSpecInitInfo(WeightTransferInitInfo):
    transport: str = "group"
    inner: dict = field(default_factory=dict)  # group: GroupInit's fields; nccl, ipc: vLLM's own init payload

    def __post_init__(self):
        if self.transport not in COLLECTIVE:
            raise ValueError(f"rlspec weight transfer: transport {self.transport!r} not in {COLLECTIVE}")


@dataclass
class GroupInit:
    master_address: str
    master_port: int
    rank_offset: int                  # this engine's first worker's rank (the learner is 0)
    world_size: int
    backend: str = "gloo"             # torch.distributed backend: gloo (CPU) or nccl
    bucket_bytes: int = 256 << 20
    timeout_s: float = 1800.0         # the rendezvous and every collective


@dataclass
class RLSpecUpdateInfo(WeightTransferUpdateInfo):
    mode: str = "tensors"
    names: list = field(default_factory=list)     # tensors: the tensors' names
    tensors: list = field(default_factory=list)
    inner: dict = field(default_factory=dict)     # group: names, dtype_names, shapes; nccl, ipc: vLLM's payload

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"rlspec weight update mode {self.mode!r}: one of {MODES}")
        if self.mode == "tensors" and len(self.names) != len(self.tensors):
            raise ValueError(f"{len(self.names)} names for {len(self.tensors)} tensors")


class RLSpecTransferEngine(WeightTransferEngine[RLSpecInitInfo, RLSpecUpdateInfo]):
    init_info_cls = RLSpecInitInfo
    update_info_cls = RLSpecUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.transport: str | None = None
        self.group: RefitGroup | None = None
        self.bucket_bytes = 0
        self.inner: WeightTransferEngine | None = None

    def init_transfer_engine(self, init_info: RLSpecInitInfo) -> None:
        self.shutdown()
        if init_info.transport == "group":
            g = GroupInit(**init_info.inner)
            p = self.parallel_config
            rank = g.rank_offset + p.data_parallel_index * p.world_size + p.rank
            self.group = RefitGroup(g.master_address, g.master_port, rank, g.world_size, g.backend, g.timeout_s,
                                    device=self.device)
            self.bucket_bytes = g.bucket_bytes
        else:
            cls = _inner_engine_class(init_info.transport)
            self.inner = cls(WeightTransferConfig(backend=init_info.transport), self.vllm_config, self.device,
                             self._default_model)
            self.inner.init_transfer_engine(self.inner.parse_init_info(init_info.inner))
        self.transport = init_info.transport

    # a draft update retargets the engine that receives, vLLM's inner one included
    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        super().set_weight_update_target(model, model_config)
        if self.inner is not None:
            self.inner.set_weight_update_target(model, model_config)

    def reset_weight_update_target(self) -> None:
        super().reset_weight_update_target()
        if self.inner is not None:
            self.inner.reset_weight_update_target()

    def start_weight_update(self) -> None:
        if self.inner is not None:  # vLLM's engine: layerwise reload (and its own bookkeeping)
            self.inner.start_weight_update()
        else:
            initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        if self.inner is not None:  # ipc: also releases the buffers this update imported
            self.inner.finish_weight_update()
        else:
            finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: RLSpecUpdateInfo) -> None:
        mode = update_info.mode
        if mode == "tensors":
            self._check(update_info.names, [t.dtype for t in update_info.tensors])
            weights = list(zip(update_info.names, update_info.tensors))
            if getattr(getattr(self.model_config, "hf_config", None), "tie_word_embeddings", False) \
                    and "lm_head.weight" not in update_info.names:
                # an in-place reload unties lm_head from the embedding: give it the embedding too
                # (the learner's source sends it; tensors from elsewhere may not)
                weights += [("lm_head.weight", t) for n, t in weights if n == "model.embed_tokens.weight"]
            self.model.load_weights([(n, t.to(self.device)) for n, t in weights])
            return
        if mode != self.transport:
            raise RuntimeError(f"rlspec weight transfer: a {mode} update, but this engine joined "
                               f"{self.transport or 'no transport'} (init_weight_transfer_engine)")
        inner = update_info.inner
        metas = metas_from_lists(inner["names"], inner["dtype_names"], inner["shapes"])
        self._check([m.name for m in metas], [m.dtype for m in metas])
        if mode == "group":
            for part in recv_state(self.group, metas, self.bucket_bytes):
                self.model.load_weights(part)
        else:
            self.inner.receive_weights(self.inner.parse_update_info(inner))

    def _check(self, names: list[str], dtypes: list[torch.dtype]) -> None:
        want = self.model_config.dtype
        for name, dt in zip(names, dtypes):
            if dt.is_floating_point and dt != want:
                raise TypeError(f"rlspec weight transfer: {name} arrives as {dt}, the engine computes in "
                                f"{want}; send weights in the engine's dtype")

    def shutdown(self) -> None:
        if self.inner is not None:
            self.inner.shutdown()
        self.group, self.inner, self.transport = None, None, None


# -- the trainer side ------------------------------------------------------------------------------
@dataclass
class RLSpecTrainerInitInfo(TrainerInitInfo):
    """rlspec's group: learner rank 0 is the group's rank 0, receivers follow."""
    backend: ClassVar[str] = BACKEND
    master_address: str = ""
    master_port: int = 0
    world_size: int = 0
    group_backend: str = "gloo"
    bucket_bytes: int = 256 << 20
    timeout_s: float = 1800.0


class RLSpecTrainerEngine(TrainerWeightTransferEngine[RLSpecTrainerInitInfo]):
    """The group's sender, shaped as vLLM's NCCL trainer engine: every round starts the update on
    every receiver, broadcasts bucket by bucket while they receive, then finishes it."""
    init_info_cls = RLSpecTrainerInitInfo

    def __init__(self, *, client, source, is_sender: bool = True, bucket_bytes: int = 256 << 20):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.group: RefitGroup | None = None

    @classmethod
    def trainer_init(cls, init_info: RLSpecTrainerInitInfo, *, client, source=None) -> "RLSpecTrainerEngine":
        if source is None:
            raise ValueError("rlspec trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.bucket_bytes)
        if not engine.is_sender:
            return engine
        worker = dict(master_address=init_info.master_address, master_port=init_info.master_port, rank_offset=1,
                      world_size=init_info.world_size, backend=init_info.group_backend,
                      bucket_bytes=init_info.bucket_bytes, timeout_s=init_info.timeout_s)
        with ThreadPoolExecutor(max_workers=1) as exe:  # the receivers block in the rendezvous with rank 0
            joined = exe.submit(client.init_weight_transfer_engine, worker)
            engine.group = RefitGroup(init_info.master_address, init_info.master_port, 0, init_info.world_size,
                                      init_info.group_backend, init_info.timeout_s)
            joined.result()
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # the ZeRO-3 gathers are collectives
                pass
            return
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as exe:  # the receivers take part in every broadcast
            received = exe.submit(self.client.update_weights, dict(
                names=[m.name for m in meta], dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                shapes=[list(m.shape) for m in meta]))
            try:
                send_state(self.group, meta, self.source, self.bucket_bytes)
            except Exception:
                # a receiver that died mid-round breaks the group: name it, not the broken pipe
                if isinstance(died := _failure_within(received, 10.0), PeerDied):
                    raise died from None
                raise
            received.result()
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = None


def _failure_within(future, seconds: float) -> BaseException | None:
    """What `future` raised, if it ends within `seconds` (None: it succeeded or still runs)."""
    from concurrent.futures import TimeoutError as StillRunning

    try:
        return future.exception(timeout=seconds)
    except StillRunning:
        return None


def trainer_init_info(transport: str, *, rank: int, address: str, port: int, world_size: int, bucket_bytes: int,
                      group_backend: str = "gloo", timeout_s: float = 1800.0, source=None) -> TrainerInitInfo:
    """vLLM's trainer init info for `transport`: `nccl`/`ipc` (vLLM's engines, packed into buffers of
    bucket_bytes) or `group` (rlspec's). vLLM's packed IPC producer allocates one buffer and refuses
    a tensor larger than it, so under `ipc` the buffer grows to the source's largest tensor (a
    Qwen3-8B embedding is 1.2 GB in bfloat16, cluster.refit_bucket_mb 256)."""
    if transport == "ipc" and source is not None:
        bucket_bytes = max(bucket_bytes, *(numel(m) * m.dtype.itemsize for m in source.metadata()))
    if transport == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        return NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=world_size, packed=True,
                                   packed_buffer_size_bytes=bucket_bytes, rank=rank)
    if transport == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
        return IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=bucket_bytes, rank=rank)
    return RLSpecTrainerInitInfo(master_address=address, master_port=port, world_size=world_size,
                                 group_backend=group_backend, bucket_bytes=bucket_bytes, timeout_s=timeout_s, rank=rank)


def register() -> None:
    """Make backend "rlspec" known to vLLM's factories in this process, engine and trainer side
    (idempotent). Engine processes vLLM starts itself get it through the vllm.general_plugins
    entry point."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, RLSpecTransferEngine),
                         (WeightTransferTrainerFactory, RLSpecTrainerEngine)):
        try:
            factory.register_engine(BACKEND, cls)
        except ValueError:  # registered already (the factory refuses a name twice)
            pass
