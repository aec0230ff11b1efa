"""rlspec's own refit transport, `group`: a torch.distributed group of its own (gloo on CPU, NCCL
on GPUs) carrying flattened buckets of about `bucket_bytes`, one collective per bucket. vLLM's
factory reaches it through backend "rlspec" (refit/engine.py); the CPU tests run it where GPUs
run vLLM's `nccl`/`ipc`. `buckets` also sizes the source's ZeRO-3 gathers (refit/source.py)."""
from __future__ import annotations

import datetime
import math
import time
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

if TYPE_CHECKING:  # vLLM loads where a round runs, not where a driver imports the learner's class
    from vllm.distributed.weight_transfer.base import ParamMeta


def numel(m: ParamMeta) -> int:
    return math.prod(m.shape)


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
            opts = torch.distributed.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = torch.distributed.ProcessGroupNCCL(store, rank, world, opts)
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


def buckets(metas: list[ParamMeta], bucket_bytes: int) -> list[list[int]]:
    """Consecutive indices grouped into buckets of one dtype and at most bucket_bytes (a tensor
    larger than that gets a bucket of its own)."""
    out, cur, size = [], [], 0
    for i, m in enumerate(metas):
        nbytes = numel(m) * m.dtype.itemsize
        if cur and (size + nbytes > bucket_bytes or metas[cur[0]].dtype != m.dtype):
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    return out + ([cur] if cur else [])


def send_state(group: RefitGroup, metas: list[ParamMeta], pairs: Iterable[tuple[str, torch.Tensor]],
               bucket_bytes: int) -> float:
    """Rank 0: broadcast the tensors `pairs` yields, in the order and dtypes `metas` declares, one
    bucket at a time (so a producer can gather them just in time). Returns seconds."""
    t0 = time.perf_counter()
    it = iter(pairs)
    for idx in buckets(metas, bucket_bytes):
        ts = []
        for i in idx:
            name, t = next(it)
            m = metas[i]
            if name != m.name or t.dtype != m.dtype or tuple(t.shape) != tuple(m.shape):
                raise ValueError(f"weight source yields {name} {t.dtype} {tuple(t.shape)} where its metadata "
                                 f"declares {m.name} {m.dtype} {tuple(m.shape)}")
            ts.append(t.detach().reshape(-1).to(group.device))
        group.broadcast(torch.cat(ts))
    for extra in it:  # run the producer to its end (closes its last gather)
        raise ValueError(f"weight source yields {extra[0]} beyond its metadata")
    return time.perf_counter() - t0


def recv_state(group: RefitGroup, metas: list[ParamMeta],
               bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Ranks > 0: rank 0's tensors, one bucket at a time, on this rank's device."""
    for idx in buckets(metas, bucket_bytes):
        ms = [metas[i] for i in idx]
        flat = group.broadcast(torch.empty(sum(numel(m) for m in ms), dtype=ms[0].dtype, device=group.device))
        yield [(m.name, part.view(m.shape)) for m, part in zip(ms, torch.split(flat, [numel(m) for m in ms]))]


def metas_from_lists(names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> list[ParamMeta]:
    """The per-round parameter lists vLLM's update infos carry, as metas."""
    from vllm.distributed.weight_transfer.base import ParamMeta
    return [ParamMeta(n, getattr(torch, d), tuple(s)) for n, d, s in zip(names, dtype_names, shapes)]
