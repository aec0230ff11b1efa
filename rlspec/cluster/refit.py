"""The weight sync: after every update the learners' weights go into every Generator engine and
LogprobWorker (policy version += 1), and online draft training's head into every engine. One
WeightSync, built at launch, owns the transport; nothing else knows which one runs:
- broadcast: learner rank 0 streams the gathered weights over a torch.distributed group it
  shares with every engine worker and log-prob worker (NCCL on GPUs, gloo on CPU;
  rlspec/engines/weight_sync.py); a push is a collective every receiver joins at once;
- object_store: rank 0's full weights go through Ray's object store to each receiver, which
  takes them after the calls already queued on it.
Engines take either inside their vLLM workers, through vLLM's RL weight-update API
(rlspec/engines/vllm_transfer.py). Weights travel in the engines' dtype.
"""
from __future__ import annotations

from rlspec.cluster.calls import Call, wait
from rlspec.cluster.handles import DraftTrainerHandle, Generators, Learners, LogprobWorkers
from rlspec.engines.weight_sync import metas_to_wire
from rlspec.workers.generator import Generator
from rlspec.workers.learner import Learner
from rlspec.workers.logprob import LogprobWorker

TRANSPORTS = ("broadcast", "object_store")


class WeightSync:
    def __init__(self, transport: str, learners: Learners, generators: Generators, logprobs: LogprobWorkers,
                 timeout_s: float, bucket_bytes: int, dtype: str, tensor_parallel_size: int = 1):
        """dtype: what the engines compute in (generation.dtype): weights travel in it.
        tensor_parallel_size: workers per engine, each a rank of the broadcast group."""
        if transport not in TRANSPORTS:
            raise ValueError(f"cluster.refit={transport!r} not in {TRANSPORTS}")
        self.transport = transport
        self.learners, self.generators, self.logprobs = learners, generators, logprobs
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.dtype, self.tp = dtype, tensor_parallel_size

    @property
    def collective(self) -> bool:
        """Whether a push is a collective the engines join at once: the learner would block in it
        until every engine had finished the calls queued before its receive."""
        return self.transport == "broadcast"

    def connect(self) -> None:
        """Join the broadcast group (learner 0 as rank 0, then every engine and log-prob worker)."""
        if not self.collective:
            return
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        (addr, port), metas = wait([self.learners.weight_group_endpoint(), self.learners.weight_metas(self.dtype)],
                                   self.timeout_s)
        # rank 0: learner 0; then every engine's workers (tp each); then the log-prob workers
        engines = [1 + e * self.tp for e in range(len(self.generators))]
        first_lp = 1 + len(self.generators) * self.tp
        world = first_lp + len(self.logprobs)
        calls = self.learners.each(Learner.join_weight_group, addr, port, world, backend, self.bucket_bytes,
                                   self.dtype)
        calls += [self.generators.one(e, Generator.join_weight_group, addr, port, offset, world, backend,
                                      metas_to_wire(metas), self.bucket_bytes) for e, offset in enumerate(engines)]
        calls += [self.logprobs.one(r, LogprobWorker.join_weight_group, addr, port, first_lp + r, world, backend,
                                    metas, self.bucket_bytes) for r in range(len(self.logprobs))]
        wait(calls, self.timeout_s)

    def push(self, version: int) -> tuple[list[Call], list[Call]]:
        """Calls that put the learners' weights into every engine and log-prob worker, as
        (the engines' part, the learners' and log-prob workers' part)."""
        if self.collective:
            senders = self.learners.each(Learner.broadcast_weights)  # submitted first: every receiver joins it
            return (self.generators.all(Generator.receive_weights, version),
                    [*senders, *self.logprobs.all(LogprobWorker.receive_weights, version)])
        weights = self.learners.full_weights(self.dtype)
        return (self.generators.all(Generator.push_weights, weights[0].ref, version),
                [*weights[1:], *self.logprobs.all(LogprobWorker.push_weights, weights[0].ref, version)])

    def push_now(self, version: int) -> None:
        """push() and wait for all of it."""
        to_generators, others = self.push(version)
        wait([*to_generators, *others], self.timeout_s)

    def push_draft(self, draft_trainer: DraftTrainerHandle, version: int) -> None:
        """The DraftTrainer's head into every engine (through the object store: the head is
        small, and lives outside the learners' group)."""
        head = draft_trainer.weights()
        wait([head, *self.generators.all(Generator.push_draft_weights, head.ref, version)], self.timeout_s)

