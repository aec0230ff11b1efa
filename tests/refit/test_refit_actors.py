"""Refit over rlspec's group transport (gloo here, NCCL on GPUs): bucketing, and a round driven by
learner-side vLLM trainer engine (RefitSender) through ActorClient from one Ray actor into
several others, each a RefitReceiver whose target is the engine backend hosted around its model
(as a LogprobWorker's is), bit for bit."""
import pytest
import torch
from vllm.distributed.weight_transfer.base import ParamMeta

from rlspec.refit.group import buckets
from rlspec.refit.receiver import RefitReceiver


def test_buckets_split_by_size_and_dtype():
    m = [ParamMeta("a", torch.float32, (256,)), ParamMeta("b", torch.float32, (256,)),
         ParamMeta("c", torch.bfloat16, (10,)), ParamMeta("d", torch.float32, (2048,)),
         ParamMeta("e", torch.float32, (1,))]
    assert buckets(m, bucket_bytes=2048) == [[0, 1], [2], [3], [4]]  # d alone: larger than a bucket
    assert buckets(m, bucket_bytes=1 << 20) == [[0, 1], [2], [3, 4]]


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 50))


class Source:
    """Stands for learner rank 0 (the Learner's own path is run by the CLI and fan-out tests)."""

    def __init__(self, seed, receivers, addr, port, world, bucket_bytes):
        from rlspec.refit.sender import RefitSender
        from rlspec.refit.source import LearnerSource

        self.sender = RefitSender("group", LearnerSource(model(seed), False, torch.float32, bucket_bytes), receivers,
                                  0, addr, port, world, bucket_bytes, "gloo", timeout_s=120)

    def send(self, version):
        return self.sender.send(version)


class Sink(RefitReceiver):
    """A receiver as a LogprobWorker is: the engine backend hosted around its own model."""

    def __init__(self, seed):
        from rlspec.refit.receiver import HostedReceiver

        self.module = model(seed)
        self.receiver = HostedReceiver(self.module, torch.device("cpu"), torch.float32)
        self.policy_version = 0

    def refit_target(self):
        return self.receiver

    def received(self):
        return self.module.state_dict(), self.policy_version


@pytest.mark.slow  # the default suite stays under 30 minutes on 2 cores
@pytest.mark.parametrize("bucket_bytes", [64])  # every tensor its own bucket, most in one
def test_a_round_reaches_every_actor_exactly(ray_session, bucket_bytes):
    import sys

    import ray
    from ray import cloudpickle

    from rlspec.refit.ports import endpoint

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

    addr, port = ray.get(ray.remote(endpoint).options(num_cpus=0).remote())
    sinks = [ray.remote(Sink).options(num_cpus=0).remote(seed) for seed in (1, 2)]
    receivers = [(f"sink[{i}]", s, i + 1) for i, s in enumerate(sinks)]
    src = ray.remote(Source).options(num_cpus=0).remote(7, receivers, addr, port, 3, bucket_bytes)
    assert ray.get(src.send.remote(5), timeout=120) > 0
    want = model(7).state_dict()
    for s in sinks:
        got, version = ray.get(s.received.remote())
        assert version == 5 and set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
    for a in (*sinks, src):
        ray.kill(a)


def test_a_receiver_that_does_not_answer_is_named(ray_session):
    import ray

    from rlspec.refit.sender import ActorClient

    @ray.remote(num_cpus=0)
    class Stuck:
        def start_weight_update(self, draft=False):
            import time
            time.sleep(30)

    stuck = Stuck.remote()
    client = ActorClient("group", [("generator[3]", stuck, 1)], timeout_s=1)
    with pytest.raises(TimeoutError, match=r"generator\[3\] did not answer start_weight_update within 1s"):
        client.start_weight_update()
    ray.kill(stuck)


class Dying(Sink):
    """A receiver whose process ends as the weights start to arrive (a Generator killed mid-refit)."""

    def update_weights(self, update_info):
        import os
        os._exit(1)


def relay_round(receivers: list[tuple[str, type, int]], addr, port, timeout_s=60):
    """Learner rank 0's refit into `receivers` (name, class, seed), waited on by the driver as the
    loop waits on Learner.refit."""
    import sys

    import ray
    from ray import cloudpickle

    from rlspec.cluster.calls import Call, wait

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    actors = [ray.remote(cls).options(num_cpus=0).remote(seed) for _, cls, seed in receivers]
    named = [(name, a, i + 1) for i, ((name, _, _), a) in enumerate(zip(receivers, actors))]
    src = ray.remote(Source).options(num_cpus=0).remote(7, named, addr, port, len(named) + 1, 1 << 20)
    try:
        return wait(Call("learner[0]", "refit", src.send.remote(1)), timeout_s)
    finally:
        for a in (*actors, src):
            ray.kill(a)


def test_a_receiver_that_dies_mid_round_is_named_by_the_driver(ray_session):
    """The learner notices the dead Generator (its refit call fails), yet the driver's ActorFailure
    names the Generator, as it does when its own call to the Generator fails."""
    import ray

    from rlspec.cluster.calls import ActorFailure
    from rlspec.refit.ports import endpoint

    addr, port = ray.get(ray.remote(endpoint).options(num_cpus=0).remote())
    with pytest.raises(ActorFailure, match=r"^generator\[1\] died during update_weights "
                                           r"\(seen by learner\[0\]\.refit\): \w+Error"):
        relay_round([("generator[0]", Sink, 1), ("generator[1]", Dying, 2)], addr, port)
