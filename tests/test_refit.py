"""Refit over a torch.distributed group (gloo here, NCCL on GPUs): bucketing, and a broadcast
of target and draft weights from one Ray actor to several others, bit for bit."""
import pytest
import torch

from rlspec.refit import RefitGroup, TensorMeta, buckets, metas_of, send_state


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
DRAFT = {"fc.weight": ((16, 32), torch.float32), "midlayer.w": ((16, 16), torch.float32)}


class Source:
    """Stands for learner rank 0 (the Learner's own path is exercised by the CLI tests)."""

    def __init__(self, addr, port, world):
        self.group = RefitGroup(addr, port, 0, world, "gloo")

    def send(self, seed: int, bucket_bytes: int) -> None:
        for sd in (state(seed, TARGET), state(seed + 1, DRAFT)):
            items = list(sd.items())
            metas = metas_of(items)
            send_state(self.group, metas, ([items[i][1] for i in idx] for idx in buckets(metas, bucket_bytes)),
                       bucket_bytes)


class Sink:
    """A receiver with the same push_weights signature as Generator."""

    def push_weights(self, weights, version, draft_weights=None):
        self.got = (weights, version, draft_weights)

    def received(self):
        return self.got


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_broadcast_of_target_and_draft_reaches_every_actor_exactly(ray_session, bucket_bytes):
    import sys

    import ray
    from ray import cloudpickle

    from rlspec.refit import RefitReceiver, endpoint
    from rlspec.workers.cluster import with_refit

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

    addr, port = ray.get(ray.remote(endpoint).options(num_cpus=0).remote())
    world = 3
    sinks = [ray.remote(with_refit(Sink, RefitReceiver)).options(num_cpus=0).remote() for _ in range(world - 1)]
    src = ray.remote(Source).options(num_cpus=0).remote(addr, port, world)
    tm, dm = metas_of(state(0, TARGET).items()), metas_of(state(0, DRAFT).items())
    joined = [s.join_refit_group.remote(addr, port, r + 1, world, "gloo", tm, dm, bucket_bytes)
              for r, s in enumerate(sinks)]
    assert ray.get(joined, timeout=120) == [1, 2]
    calls = [src.send.remote(7, bucket_bytes), *[s.receive_weights.remote(5, with_draft=True) for s in sinks]]
    ray.get(calls, timeout=120)
    want_t, want_d = state(7, TARGET), state(8, DRAFT)
    for s in sinks:
        target, version, draft = ray.get(s.received.remote())
        assert version == 5 and set(target) == set(want_t) and set(draft) == set(want_d)
        for k in want_t:
            assert target[k].dtype == want_t[k].dtype and torch.equal(target[k], want_t[k]), k
        for k in want_d:
            assert torch.equal(draft[k], want_d[k]), k
    for a in (*sinks, src):
        ray.kill(a)
