"""Weight-sync transports, the worker side: learner rank 0 streams full weights to every Generator
engine and LogprobWorker over one torch.distributed group (NCCL on GPUs, gloo on CPU).

Departures from a plain `state_dict` push through the object store:
- the group is its own store-based process group (learner 0 = rank 0, then every engine and
  log-prob worker), independent of DeepSpeed's learner group, so receivers need no DeepSpeed;
- under ZeRO-3 the learner ranks gather one bucket of parameters at a time (every rank takes part
  in the gather, rank 0 alone broadcasts), so no rank ever holds the whole model twice;
- tensors travel flattened into buckets of about `bucket_mb`, one collective per bucket.
The learner owns a BroadcastSender; vLLM engines receive inside their workers
(rlspec/engines/vllm_transfer.py), a LogprobWorker through its BroadcastReceiver. The driver side,
which picks the transport, is rlspec/cluster/refit.py.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class RefitGroup:
    """A torch.distributed process group of its own (TCPStore rendezvous at addr:port). device:
    where this rank's buffers live (default: the current CUDA device under NCCL, else the CPU)."""

    def __init__(self, addr: str, port: int, rank: int, world: int, backend: str = "gloo",
                 timeout_s: float = 1800.0, device: torch.device | None = None):
        store = torch.distributed.TCPStore(addr, port, world, is_master=rank == 0,
                                           timeout=datetime.timedelta(seconds=timeout_s))
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            self.device = device or torch.device("cuda", torch.cuda.current_device())
            self.pg = torch.distributed.ProcessGroupNCCL(store, rank, world)
        else:
            self.pg = torch.distributed.ProcessGroupGloo(store, rank, world, timeout)
            self.device = torch.device("cpu")
        self.rank, self.world, self.store = rank, world, store

    def broadcast(self, flat: torch.Tensor) -> torch.Tensor:
        """In place: rank 0's `flat` lands in every rank's `flat`."""
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([flat], opts).wait()
        return flat


def buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Consecutive indices grouped into buckets of one dtype and at most bucket_bytes (a tensor
    larger than that gets a bucket of its own)."""
    out, cur, size = [], [], 0
    for i, m in enumerate(metas):
        nbytes = m.numel * m.dtype.itemsize
        if cur and (size + nbytes > bucket_bytes or metas[cur[0]].dtype != m.dtype):
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    return out + ([cur] if cur else [])


def send_state(group: RefitGroup, metas: list[TensorMeta], tensors: Iterator[list[torch.Tensor]],
               bucket_bytes: int) -> float:
    """Rank 0: broadcast the tensors described by `metas`; `tensors` yields each bucket's tensors
    (so a caller can gather them just in time). Returns seconds."""
    t0 = time.perf_counter()
    # `tensors` first: zip then runs the producer to its end, closing its last gather.
    for ts, idx in zip(tensors, buckets(metas, bucket_bytes)):
        dtype = metas[idx[0]].dtype
        flat = torch.cat([t.detach().reshape(-1).to(group.device, dtype) for t in ts])
        group.broadcast(flat)
    return time.perf_counter() - t0


def recv_state(group: RefitGroup, metas: list[TensorMeta], bucket_bytes: int) -> dict[str, torch.Tensor]:
    """Ranks > 0: the tensors rank 0 sends, by name, on this rank's device."""
    out = {}
    for idx in buckets(metas, bucket_bytes):
        ms = [metas[i] for i in idx]
        flat = group.broadcast(torch.empty(sum(m.numel for m in ms), dtype=ms[0].dtype, device=group.device))
        for m, part in zip(ms, torch.split(flat, [m.numel for m in ms])):
            out[m.name] = part.view(m.shape)
    return out


def metas_of(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> list[TensorMeta]:
    """Full shapes, also for ZeRO-3 partitioned parameters (whose local shape is empty); each
    tensor's own dtype, or `dtype` (what the receivers compute in) for every one."""
    return [TensorMeta(n, tuple(getattr(p, "ds_shape", p.shape)), dtype or p.dtype) for n, p in named]


def metas_to_wire(metas: list[TensorMeta]) -> list[list]:
    """[name, dtype name, shape] per tensor: plain values for vLLM's init-info dict."""
    return [[m.name, str(m.dtype).removeprefix("torch."), list(m.shape)] for m in metas]


def metas_from_wire(wire: list[list]) -> list[TensorMeta]:
    return [TensorMeta(name, tuple(shape), getattr(torch, dtype)) for name, dtype, shape in wire]


def endpoint() -> tuple[str, int]:
    """(this node's IP, a free port on it) for the group's TCPStore."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


class BroadcastReceiver:
    """A receiving rank of the group outside vLLM (a LogprobWorker holds one)."""

    def __init__(self, addr: str, port: int, rank: int, world: int, backend: str, metas: list[TensorMeta],
                 bucket_bytes: int):
        self.group = RefitGroup(addr, port, rank, world, backend)
        self.metas, self.bucket_bytes = metas, bucket_bytes

    def receive(self) -> dict[str, torch.Tensor]:
        """The target weights rank 0 sends this round, by name."""
        return recv_state(self.group, self.metas, self.bucket_bytes)

    def receive_into(self, push: Callable[[dict[str, torch.Tensor], int], object], version: int) -> float:
        """Receive this round's weights and hand them to the owner's `push(weights, version)`;
        seconds taken."""
        t0 = time.perf_counter()
        push(self.receive(), version)
        return time.perf_counter() - t0


class BroadcastSender:
    """The learner's side: every rank calls `send` (ZeRO-3 gathers need all of them); only rank 0
    holds the group and broadcasts."""

    def __init__(self, module: torch.nn.Module, zero3: bool, bucket_bytes: int, group: RefitGroup | None,
                 dtype: torch.dtype | None = None):
        self.module, self.zero3, self.bucket_bytes, self.group = module, zero3, bucket_bytes, group
        self.dtype = dtype  # the receivers' compute dtype (None: the parameters' own)

    def send(self) -> float:
        """Target weights bucket by bucket (gathered just in time under ZeRO-3), in the
        receivers' dtype; seconds taken."""
        import deepspeed

        params = list(self.module.named_parameters())
        metas = metas_of(params, self.dtype)

        def gathered() -> Iterator[list[torch.Tensor]]:
            for idx in buckets(metas, self.bucket_bytes):
                ps = [params[i][1] for i in idx]
                with deepspeed.zero.GatheredParameters(ps, modifier_rank=None, enabled=self.zero3):
                    yield [p.data for p in ps]

        if self.group is None:  # other ranks only take part in the gathers
            for _ in gathered():
                pass
            return 0.0
        return send_state(self.group, metas, gathered(), self.bucket_bytes)
