"""rlspec's weight-transfer engine backend as vLLM's factory builds it inside a worker, over a model
that records what it loads: the receiving end of the refit tests (tests/refit/test_engine.py
on the host, tests/gpu/test_cuda.py on a GPU)."""
from __future__ import annotations

from types import SimpleNamespace

import torch


class Recorder(torch.nn.Module):
    """Stands for a vLLM model: remembers what load_weights got, call by call, copied to the host."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def load_weights(self, weights):
        self.calls.append([(n, t.detach().cpu().clone()) for n, t in weights])


def transfer_engine(dtype=torch.float32, rank=0, tied=False, device=torch.device("cpu")):
    """vLLM's factory builds the `rlspec` backend for a worker of `rank` whose model computes in `dtype`."""
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rlspec.refit import engine

    engine.register()
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=rank),
                          model_config=SimpleNamespace(dtype=dtype,
                                                       hf_config=SimpleNamespace(tie_word_embeddings=tied)))
    return WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="rlspec"), cfg, device, Recorder())
