"""The weight sync: after every update the learners' weights go into every Generator engine and
LogprobWorker (policy version += 1), and online draft training's head into every engine. One
WeightSync, built at launch, owns the transport; nothing else knows which one runs:
- broadcast: learner rank 0 streams the gathered weights over a torch.distributed group it
  shares with every engine and log-prob worker (NCCL on GPUs, gloo on CPU;
  rlspec/engines/weight_sync.py); a push is a collective every receiver joins at once;
- object_store: rank 0's full weights go through Ray's object store to each receiver, which
  takes them after the calls already queued on it.
"""
from __future__ import annotations

from rlspec.cluster.calls import Call, wait
from rlspec.cluster.handles import DraftTrainerHandle, Generators, Learners, LogprobWorkers
from rlspec.workers.generator import Generator
from rlspec.workers.learner import Learner
from rlspec.workers.logprob import LogprobWorker

TRANSPORTS = ("broadcast", "object_store")


class WeightSync:
    def __init__(self, transport: str, learners: Learners, generators: Generators, logprobs: LogprobWorkers,
                 timeout_s: float, bucket_bytes: int):
        if transport not in TRANSPORTS:
            raise ValueError(f"cluster.refit={transport!r} not in {TRANSPORTS}")
        self.transport = transport
        self.learners, self.generators, self.logprobs = learners, generators, logprobs
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes

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
        (addr, port), metas = wait([self.learners.weight_group_endpoint(), self.learners.weight_metas()],
                                   self.timeout_s)
        world = 1 + len(self.generators) + len(self.logprobs)
        ranks = iter(range(1, world))
        calls = self.learners.each(Learner.join_weight_group, addr, port, world, backend, self.bucket_bytes)
        for group, join in ((self.generators, Generator.join_weight_group),
                            (self.logprobs, LogprobWorker.join_weight_group)):
            calls += [group.one(i, join, addr, port, next(ranks), world, backend, metas, self.bucket_bytes)
                      for i in range(len(group))]
        wait(calls, self.timeout_s)

    def push(self, version: int) -> tuple[list[Call], list[Call]]:
        """Calls that put the learners' weights into every engine and log-prob worker, as
        (the engines' part, the learners' and log-prob workers' part)."""
        if self.collective:
            senders = self.learners.each(Learner.broadcast_weights)  # submitted first: every receiver joins it
            return (self.generators.all(Generator.receive_weights, version),
                    [*senders, *self.logprobs.all(LogprobWorker.receive_weights, version)])
        weights = self.learners.full_weights()
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

