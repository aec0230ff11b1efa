"""Refit over a torch.distributed group (gloo here, NCCL on GPUs): bucketing, and a broadcast
of the target's weights from one Ray actor to several others, bit for bit."""
import pytest
import torch

from rlspec.engines.weight_sync import RefitGroup, TensorMeta, buckets, metas_of, send_state


def test_buckets_split_by_size_and_dtype():
    m = [TensorMeta("a", (256,), torch.float32), TensorMeta("b", (256,), torch.float32),
         TensorMeta("c", (10,), torch.bfloat16), TensorMeta("d", (2048,), torch.float32),
         TensorMeta("e", (1,), torch.float32)]
    assert buckets(m, bucket_bytes=2048) == [[0, 1], [2], [3], [4]]  # d alone: larger than a bucket
    assert buckets(m, bucket_bytes=1 << 20) == [[0, 1], [2], [3, 4]]


def state(seed: int, sizes: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(dt) for k, (s, dt) in sizes.items()}


TARGET = {"embed.weight": ((50, 16), torch.float32), "layers.0.w": ((16, 16), torch.float32),
          "layers.0.norm": ((16,), torch.bfloat16), "head.weight": ((50, 16), torch.float32)}


class Source:
    """Stands for learner rank 0 (the Learner's own path is exercised by the CLI tests)."""

    def __init__(self, addr, port, world):
        self.group = RefitGroup(addr, port, 0, world, "gloo")

    def send(self, seed: int, bucket_bytes: int) -> None:
        items = list(state(seed, TARGET).items())
        metas = metas_of(items)
        send_state(self.group, metas, ([items[i][1] for i in idx] for idx in buckets(metas, bucket_bytes)),
                   bucket_bytes)


class Sink:
    """A receiver as Generator and LogprobWorker are: a BroadcastReceiver member hands each
    round's weights to its push_weights."""

    def join_weight_group(self, *group):
        from rlspec.engines.weight_sync import BroadcastReceiver

        self.receiver = BroadcastReceiver(*group)
        return self.receiver.group.rank

    def receive_weights(self, version):
        return self.receiver.receive_into(self.push_weights, version)

    def push_weights(self, weights, version):
        self.got = (weights, version)

    def received(self):
        return self.got


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_broadcast_reaches_every_actor_exactly(ray_session, bucket_bytes):
    import sys

    import ray
    from ray import cloudpickle

    from rlspec.engines.weight_sync import endpoint

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

    addr, port = ray.get(ray.remote(endpoint).options(num_cpus=0).remote())
    world = 3
    sinks = [ray.remote(Sink).options(num_cpus=0).remote() for _ in range(world - 1)]
    src = ray.remote(Source).options(num_cpus=0).remote(addr, port, world)
    tm = metas_of(state(0, TARGET).items())
    joined = [s.join_weight_group.remote(addr, port, r + 1, world, "gloo", tm, bucket_bytes)
              for r, s in enumerate(sinks)]
    assert ray.get(joined, timeout=120) == [1, 2]
    calls = [src.send.remote(7, bucket_bytes), *[s.receive_weights.remote(5) for s in sinks]]
    ray.get(calls, timeout=120)
    want_t = state(7, TARGET)
    for s in sinks:
        target, version = ray.get(s.received.remote())
        assert version == 5 and set(target) == set(want_t)
        for k in want_t:
            assert target[k].dtype == want_t[k].dtype and torch.equal(target[k], want_t[k]), k
    for a in (*sinks, src):
        ray.kill(a)
