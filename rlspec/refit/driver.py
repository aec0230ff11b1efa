"""The refit as the loop calls it: one Refit, built at launch, owns the transport (cluster.refit);
nothing else knows which runs:
- nccl, ipc, group: learner rank 0 drives vLLM's RL weight-transfer API (init, start, update,
  finish) on every receiver through vLLM's trainer-side engines (refit/sender.py): vLLM's `nccl`
  for receivers on GPUs of their own, vLLM's `ipc` (CUDA IPC) for receivers on the learners' GPUs,
  rlspec's `group` (gloo on CPU machines). A round is one call per learner rank, which returns when
  every receiver has the weights;
- object_store: rank 0's full weights go through Ray's object store to each receiver, which
  takes them after the calls already queued on it.
Weights travel in the engines' dtype.
"""
from __future__ import annotations

from rlspec.cluster.calls import Call, wait
from rlspec.cluster.handles import DraftTrainerHandle, Generators, Learners, LogprobWorkers
from rlspec.refit import COLLECTIVE, TRANSPORTS
from rlspec.refit.receiver import RefitReceiver
from rlspec.workers.learner import Learner


class Refit:
    def __init__(self, transport: str, learners: Learners, generators: Generators, logprobs: LogprobWorkers,
                 timeout_s: float, bucket_bytes: int, dtype: str, tensor_parallel_size: int = 1):
        """dtype: what the engines compute in (generation.dtype): weights travel in it.
        tensor_parallel_size: workers per engine, each a receiving rank."""
        if transport not in TRANSPORTS:
            raise ValueError(f"cluster.refit={transport!r} not in {TRANSPORTS}")
        self.transport = transport
        self.learners, self.generators, self.logprobs = learners, generators, logprobs
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.dtype, self.tp = dtype, tensor_parallel_size

    @property
    def collective(self) -> bool:
        """Whether a round takes every engine at once: the learner would block in it until every
        engine had finished the calls queued before it."""
        return self.transport in COLLECTIVE

    def receivers(self) -> tuple[list[tuple[str, object, int]], int]:
        """((name, actor, first rank) of every receiver, the group's size): rank 0 is learner 0,
        then every engine's workers (tp each), then the log-prob workers."""
        out = [(self.generators.name(e), h, 1 + e * self.tp) for e, h in enumerate(self.generators.handles)]
        first_lp = 1 + len(self.generators) * self.tp
        out += [(self.logprobs.name(r), h, first_lp + r) for r, h in enumerate(self.logprobs.handles)]
        return out, first_lp + len(self.logprobs)

    def connect(self) -> None:
        """Every learner rank builds its end of the transport; rank 0 meets the receivers."""
        if not self.collective:
            return
        address, port = wait(self.learners.one(0, Learner.refit_endpoint), self.timeout_s)
        receivers, world = self.receivers()
        wait(self.learners.each(Learner.join_refit, self.transport, receivers, address, port, world,
                                self.dtype, self.bucket_bytes, self.timeout_s), self.timeout_s)

    def calls(self, version: int) -> tuple[list[Call], list[Call]]:
        """Calls that put the learners' weights into every engine and log-prob worker, as
        (the engines' part, the learners' and log-prob workers' part). Collective transports have
        no engines' part: learner rank 0's call returns when every receiver has the weights."""
        if self.collective:
            return [], self.learners.each(Learner.refit, version)
        weights = self.learners.full_weights(self.dtype)
        return (self.generators.all(RefitReceiver.refit_tensors, weights[0].ref, version),
                [*weights[1:], *self.logprobs.all(RefitReceiver.refit_tensors, weights[0].ref, version)])

    def run(self, version: int) -> None:
        """calls() and wait for all of them."""
        to_generators, others = self.calls(version)
        wait([*to_generators, *others], self.timeout_s)

    def draft(self, draft_trainer: DraftTrainerHandle, version: int) -> None:
        """The DraftTrainer's head into every engine (through the object store: the head is
        small, and lives outside the learners' group)."""
        head = draft_trainer.weights()
        wait([head, *self.generators.all(RefitReceiver.refit_tensors, head.ref, version, True)], self.timeout_s)
