"""The sending end of the refit, on every learner rank: vLLM's trainer-side engine for the transport
(refit/engine.py's trainer_init_info) over the learner's weights (refit/source.py), and the client
through which it reaches every receiving actor (refit/receiver.py's RefitReceiver calls)."""
from __future__ import annotations

import time
from typing import Any, Callable

from rlspec.messages import PeerDied, error_line
from rlspec.refit.engine import register, trainer_init_info
from rlspec.refit.receiver import RefitReceiver


class ActorClient:
    """vLLM's `VLLMWeightSyncClient` over rlspec's receiving actors: each call goes to every
    receiver and waits at most timeout_s. vLLM's trainer engines address one engine at
    rank_offset 1; receiver i gets its own first rank. `draft` and `version` are this round's:
    set them before the engine's `send_weights`."""

    def __init__(self, transport: str, receivers: list[tuple[str, Any, int]], timeout_s: float):
        """receivers: (name, Ray actor handle of a RefitReceiver, its first rank in the group)."""
        self.transport, self.receivers, self.timeout_s = transport, receivers, timeout_s
        self.draft, self.version = False, 0

    def _all(self, method: Callable, args_of: Callable[[int], tuple]) -> list:
        """`method` (a RefitReceiver call) on every receiver, args_of(its first rank) its arguments;
        results in receiver order. The first receiver found dead raises PeerDied naming it (the
        driver reports that receiver's death, not a failure of the learner that called it)."""
        import ray
        from ray.exceptions import RayActorError

        name = method.__name__
        refs = [getattr(h, name).remote(*args_of(first)) for _, h, first in self.receivers]
        name_of = {r: actor for (actor, _, _), r in zip(self.receivers, refs)}
        pending, deadline, got = list(refs), time.monotonic() + self.timeout_s, {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise TimeoutError(f"weight refit: {', '.join(name_of[r] for r in pending)} did not answer "
                                   f"{name} within {self.timeout_s:.0f}s (cluster.actor_timeout_s)")
            try:
                got[ready[0]] = ray.get(ready[0], timeout=0)
            except RayActorError as e:
                raise PeerDied(name_of[ready[0]], name, error_line(e)) from None
        return [got[r] for r in refs]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        def payload(first: int) -> tuple:
            inner = {**init_info, "rank_offset": first} if "rank_offset" in init_info else dict(init_info)
            return ({"transport": self.transport, "inner": inner},)
        self._all(RefitReceiver.init_weight_transfer_engine, payload)

    def start_weight_update(self) -> None:
        self._all(RefitReceiver.start_weight_update, lambda _: (self.draft,))

    def update_weights(self, update_info: dict) -> None:
        self._all(RefitReceiver.update_weights, lambda _: ({"mode": self.transport, "inner": update_info},))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(RefitReceiver.finish_weight_update, lambda _: (self.version, self.draft))


class RefitSender:
    """A learner rank's end of the refit: vLLM's trainer engine for `transport` over `source`
    (every rank holds one; rank 0 sends)."""

    def __init__(self, transport: str, source, receivers: list[tuple[str, Any, int]], rank: int, address: str,
                 port: int, world_size: int, bucket_bytes: int, group_backend: str, timeout_s: float):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        register()
        self.client = ActorClient(transport, receivers, timeout_s)
        info = trainer_init_info(transport, rank=rank, address=address, port=port, world_size=world_size,
                                 bucket_bytes=bucket_bytes, group_backend=group_backend, timeout_s=timeout_s,
                                 source=source)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=source)

    def send(self, version: int) -> float:
        """One round; seconds taken."""
        t0 = time.perf_counter()
        self.client.version, self.client.draft = version, False
        self.engine.send_weights()
        return time.perf_counter() - t0
