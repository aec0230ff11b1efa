"""The learner's weights as vLLM's `WeightSource` (what vLLM's trainer-side weight-transfer engines
send from): full Hugging Face-named tensors in the engines' dtype, on the learner's device,
gathered one bucket at a time under ZeRO-3 (every rank iterates: the gathers are collectives; only
rank 0 sends)."""
from __future__ import annotations

from typing import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from rlspec.refit.group import buckets


class LearnerSource(WeightSource):
    """A learner's weights as vLLM's trainer-side engines take them. Names are the Hugging Face
    checkpoint names; a tied output layer is sent as `lm_head.weight` too (an engine's in-place
    reload would otherwise keep the old head). Tensors come in `dtype` (the engines'), on the
    parameters' device; under ZeRO-3 each bucket of about `bucket_bytes` is gathered on every rank
    while it is iterated, and copied out before its gather closes."""

    def __init__(self, module: torch.nn.Module, zero3: bool, dtype: torch.dtype | None, bucket_bytes: int,
                 tied_head: bool = True):
        """tied_head: False sends the parameters alone (a checkpoint, which ties on load)."""
        self.zero3, self.dtype, self.bucket_bytes = zero3, dtype, bucket_bytes
        self.params = list(module.named_parameters())
        cfg = getattr(module, "config", None)
        if tied_head and getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" not in dict(self.params):
            embed = dict(self.params).get("model.embed_tokens.weight")
            if embed is not None:
                self.params.append(("lm_head.weight", embed))

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, self.dtype or p.dtype, tuple(getattr(p, "ds_shape", p.shape))) for n, p in self.params]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        import deepspeed

        for idx in buckets(self.metadata(), self.bucket_bytes):
            ps = [self.params[i] for i in idx]
            with deepspeed.zero.GatheredParameters([p for _, p in ps], modifier_rank=None, enabled=self.zero3):
                for name, p in ps:
                    t = p.data.detach().to(self.dtype or p.dtype)
                    # a gathered partition is freed when its gather closes: keep a copy of its own
                    yield name, (t.clone() if self.zero3 and t.data_ptr() == p.data.data_ptr() else t)
