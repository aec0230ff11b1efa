"""rlspec's weight-transfer backend as vLLM builds it: found through vLLM's factory by name, its
init and update infos parsed from the dicts vLLM passes, a broadcast round received bucket by
bucket into the model's load_weights, a tensors round loaded as given, and a tensor in another
dtype than the engine's refused. (The engines' own tests run it inside real vLLM workers.)"""
import threading
from types import SimpleNamespace

import pytest
import torch

from rlspec.cluster.ray_cluster import free_port
from rlspec.engines.weight_sync import RefitGroup, buckets, metas_of, metas_to_wire, send_state


class Recorder(torch.nn.Module):
    """Stands for a vLLM model: remembers what load_weights got, call by call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def load_weights(self, weights):
        self.calls.append([(n, t.clone()) for n, t in weights])


def update(e, info: dict) -> None:
    """What vLLM's update_weights does minus its device synchronize (no accelerator here; vLLM's CPU
    worker patches it in its own process)."""
    e.receive_weights(e.parse_update_info(info))


def engine(dtype=torch.float32, tied=False):
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rlspec.engines import vllm_transfer

    vllm_transfer.register()
    vllm_transfer.register()  # idempotent
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                          model_config=SimpleNamespace(dtype=dtype, hf_config=SimpleNamespace(tie_word_embeddings=tied)))
    return WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="rlspec"), cfg, torch.device("cpu"),
                                                     Recorder())


WEIGHTS = {"model.embed_tokens.weight": torch.randn(50, 8), "model.layers.0.w": torch.randn(8, 8),
           "model.norm.weight": torch.randn(8)}


def test_a_tensors_round_loads_as_given_and_ties_the_head():
    e = engine(tied=True)
    update(e, {"mode": "tensors", "names": list(WEIGHTS), "tensors": list(WEIGHTS.values())})
    (got,) = e.model.calls
    names = [n for n, _ in got]
    assert names == [*WEIGHTS, "lm_head.weight"]
    assert torch.equal(dict(got)["lm_head.weight"], WEIGHTS["model.embed_tokens.weight"])


def test_a_tensor_in_another_dtype_than_the_engines_is_refused_by_name():
    e = engine(dtype=torch.float32)
    with pytest.raises(TypeError, match="model.layers.0.w arrives as torch.bfloat16, the engine computes in torch.float32"):
        update(e, {"mode": "tensors", "names": ["model.layers.0.w"], "tensors": [WEIGHTS["model.layers.0.w"].bfloat16()]})
    with pytest.raises(ValueError, match="broadcast or tensors"):
        update(e, {"mode": "carrier_pigeon"})


def test_a_broadcast_round_arrives_bucket_by_bucket():
    """Rank 0 (the learner's side) sends in 1 KiB buckets; the engine, rank 1 of the group, loads
    each bucket as it lands: several load_weights calls, together every tensor, bit for bit."""
    bucket = 1024
    port = free_port()
    items = list(WEIGHTS.items())
    metas = metas_of(items)
    e = engine()

    def source():
        g = RefitGroup("127.0.0.1", port, 0, 2, "gloo")
        send_state(g, metas, ([items[i][1] for i in idx] for idx in buckets(metas, bucket)), bucket)

    t = threading.Thread(target=source)
    t.start()
    e.init_transfer_engine(e.parse_init_info(dict(addr="127.0.0.1", port=port, rank_offset=1, world=2,
                                                  backend="gloo", metas=metas_to_wire(metas), bucket_bytes=bucket)))
    update(e, {"mode": "broadcast"})
    t.join(timeout=60)
    assert len(e.model.calls) == len(buckets(metas, bucket)) > 1
    got = dict(x for call in e.model.calls for x in call)
    assert set(got) == set(WEIGHTS) and all(torch.equal(got[k], v) for k, v in WEIGHTS.items())
