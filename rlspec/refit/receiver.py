"""The receiving end of the refit, written once for every receiving actor.

RefitReceiver gives a Ray actor the four calls of vLLM's weight-sync client protocol
(`VLLMWeightSyncClient`: init, start, update, finish), which learner rank 0's sender drives
(refit/sender.py), and `refit_tensors`, one whole round with the tensors themselves (the
object-store transport, online draft training's head). Each call goes to the actor's
RefitTarget, the one thing that differs between receivers:
- a Generator's vLLM engine (engines/vllm_engine.py: into every worker of the engine, through
  vLLM's LLM and the `rlspec` backend vLLM builds in each, refit/engine.py);
- a LogprobWorker's model (HostedReceiver: the same backend class, built here around the model)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class RefitTarget(Protocol):
    """Where one receiver's refit lands. `init_refit` joins the transport its dict names
    (RLSpecInitInfo's fields); a round is `start_refit`, `receive` (RLSpecUpdateInfo's fields)
    and `finish_refit`, after which the receiver computes with the new weights."""

    def init_refit(self, init_info: dict) -> None: ...

    def start_refit(self, draft: bool) -> None: ...

    def receive(self, update_info: dict) -> None: ...

    def finish_refit(self, version: int, draft: bool) -> None: ...


class RefitReceiver:
    """The receiving calls of a Ray actor whose `refit_target()` says where weights land. Sets the
    actor's `policy_version` (or `draft_version`, for a draft round) when a round finishes."""

    policy_version: int
    draft_version: int
    _refit_t0: float = 0.0

    def refit_target(self) -> RefitTarget:
        raise NotImplementedError

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.refit_target().init_refit(init_info)

    def start_weight_update(self, draft: bool = False) -> None:
        self.refit_target().start_refit(draft)
        self._refit_t0 = time.perf_counter()

    def update_weights(self, update_info: dict) -> None:
        self.refit_target().receive(update_info)

    def finish_weight_update(self, version: int, draft: bool = False) -> float:
        """The round is in: this actor computes with `version` (seconds since the round started)."""
        self.refit_target().finish_refit(version, draft)
        if draft:
            self.draft_version = version
        else:
            self.policy_version = version
        return time.perf_counter() - self._refit_t0

    def refit_tensors(self, weights: dict[str, torch.Tensor], version: int, draft: bool = False) -> float:
        """One round carrying the tensors (Hugging Face names, the engines' dtype); seconds taken.
        draft: the engine's draft model or head alone."""
        names = list(weights)
        self.start_weight_update(draft)
        self.update_weights({"mode": "tensors", "names": names, "tensors": [weights[n] for n in names]})
        return self.finish_weight_update(version, draft)


@dataclass
class _ModelConfig:
    dtype: torch.dtype
    hf_config: Any = None


@dataclass
class _HostConfig:
    """What the backend reads of vLLM's config, for a receiver outside vLLM: one rank, and the dtype
    weights arrive in."""
    model_config: _ModelConfig
    parallel_config: Any = None  # vLLM's ParallelConfig (one rank)


class HostedReceiver:
    """A RefitTarget outside vLLM (a LogprobWorker's model): rlspec's backend class built around a
    loader whose `load_weights` copies into the model (cast to the model's dtype: weights travel in
    the engines'). A round that leaves a parameter out is refused at its finish."""

    def __init__(self, module: torch.nn.Module, device: torch.device, wire_dtype: torch.dtype):
        self.params = dict(module.state_dict(keep_vars=True))
        self.required = set(dict(module.named_parameters()))  # a tied head is the embedding's
        self.loaded: set[str] = set()
        outer = self

        class Loader(torch.nn.Module):
            def load_weights(self, weights):
                for name, t in weights:
                    if name not in outer.params:
                        raise RuntimeError(f"weight refit: {name} is not a parameter of the log-prob worker's model")
                    with torch.no_grad():
                        outer.params[name].copy_(t)
                    outer.loaded.add(name)

        # vLLM loads here, not where the module is imported: a driver imports the receiving actors' classes
        from vllm.config import ParallelConfig, WeightTransferConfig

        from rlspec.refit.engine import BACKEND, RLSpecTransferEngine
        self.engine = RLSpecTransferEngine(WeightTransferConfig(backend=BACKEND),
                                           _HostConfig(_ModelConfig(wire_dtype), ParallelConfig()), device, Loader())

    def init_refit(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_refit(self, draft: bool) -> None:
        """Opens a round as a vLLM worker does: vLLM's own engine (nccl, ipc) starts its own."""
        if draft:
            raise RuntimeError("a log-prob worker holds no draft model")
        self.loaded = set()
        if self.engine.inner is not None:
            self.engine.inner.start_weight_update()

    def receive(self, update_info: dict) -> None:
        self.engine.receive_weights(self.engine.parse_update_info(update_info))
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def finish_refit(self, version: int, draft: bool) -> None:
        """Closes it: under ipc vLLM's engine releases the learner's buffers this round mapped
        (left open, the log-prob worker would hold them until the next round)."""
        if self.engine.inner is not None:
            self.engine.inner.finish_weight_update()
        if missing := sorted(self.required - self.loaded):
            more = " ..." if len(missing) > 3 else ""
            raise RuntimeError(f"weight refit {version}: the round left out {len(missing)} parameters of the "
                               f"log-prob worker's model ({', '.join(missing[:3])}{more})")
