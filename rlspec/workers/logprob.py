"""LogprobWorker: recomputes current-policy (and reference-policy) log-probs for every rollout."""
from __future__ import annotations

import copy

import torch

from rlspec.algo.batching import micro_batches
from rlspec.algo.logprobs import output_logprobs, sequence_logprobs
from rlspec.config import AlgoConfig, GenerationConfig, ModelConfig, TrainerConfig
from rlspec.messages import TrainBatch
from rlspec.models import ModelPaths, load_causal_lm, local_device, release_cached_memory
from rlspec.refit.receiver import HostedReceiver, RefitReceiver


class LogprobWorker(RefitReceiver):
    """capture: {"layer_ids": [...], "topk": K} turns on online draft adaptation's capture: the
    policy's forward pass also keeps the hidden states at those layers and its top-K next-token
    log-probs (rlspec.draft.capture) until `take_features` collects them."""

    def __init__(self, *, paths: ModelPaths, model: ModelConfig, algo: AlgoConfig, trainer: TrainerConfig,
                 generation: GenerationConfig, threads: int, capture: dict | None = None, device: str | None = None):
        """device: where this worker computes (None: the one its placement gives it)."""
        paths.check_visible("LogprobWorker")
        torch.set_num_threads(threads)
        self.device = torch.device(device) if device else local_device()
        # the learner's compute dtype, so a recompute sees what the learner's forward sees
        self.policy = load_causal_lm(paths.model, dtype=getattr(torch, trainer.dtype),
                                     trust_remote_code=model.trust_remote_code).to(self.device).eval()
        # The reference is the initial policy and never moves; only the KL term needs it.
        self.reference = copy.deepcopy(self.policy) if algo.kl_coef > 0 else None
        self.temperature, self.mbs = generation.temperature, trainer.micro_batch_size
        self.chunk_tokens = trainer.logit_chunk_tokens
        self.policy_version = 0
        self.capture = capture
        self.features: list[dict] = []
        # refits arrive in the engines' dtype, through the engines' own transfer backend
        self.receiver = HostedReceiver(self.policy, self.device, getattr(torch, generation.dtype or trainer.dtype))

    @torch.no_grad()
    def _run(self, model, batch: TrainBatch) -> torch.Tensor:
        """[N, T] log-probs of a host batch, computed on this worker's device, on the host."""
        out = torch.zeros(batch.loss_mask.shape)
        for idx, width in micro_batches(batch.attention_mask, self.mbs):
            mb = batch.rows(idx, width).to(self.device)  # micro-batches move in, results come back
            out[idx, : width - 1] = sequence_logprobs(model, mb.input_ids, mb.attention_mask, self.temperature,
                                                      chunk_tokens=self.chunk_tokens).cpu()
        return out * (batch.loss_mask != 0)  # [N, T], zero off the response

    @torch.no_grad()
    def _run_capturing(self, batch: TrainBatch) -> torch.Tensor:
        """The policy's log-probs as `_run` computes them, from a forward pass that also returns
        hidden states; the draft's features are kept aside (compact dtypes), nothing else changes."""
        from rlspec.draft.capture import features_from_output

        out, self.features = torch.zeros(batch.loss_mask.shape), []
        for idx, width in micro_batches(batch.attention_mask, self.mbs):
            host = batch.rows(idx, width)
            mb = host.to(self.device)
            ids, mask = mb.input_ids, mb.attention_mask
            o = self.policy(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
            out[idx, : width - 1] = output_logprobs(self.policy, o, ids[:, 1:], self.temperature,
                                                    self.chunk_tokens).cpu()
            f = features_from_output(o, self.capture["layer_ids"], self.capture["topk"], self.temperature,
                                     out_dtype=torch.bfloat16)
            # to the host: the features leave through the object store for the DraftTrainer
            self.features.append({"ids": host.input_ids.clone(), "mask": host.attention_mask.bool(),
                                  "aux_hidden": f.aux_hidden.cpu(), "topk_ids": f.topk_ids.to("cpu", torch.int32),
                                  "topk_logp": f.topk_logp.to("cpu", torch.float16),
                                  "loss_from": host.prompt_lengths.tolist(), "policy_version": self.policy_version})
        return out * (batch.loss_mask != 0)

    def compute_logprobs(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([N, T] current-policy log-probs, [N, T] reference log-probs or None), on the host."""
        ref = self._run(self.reference, batch) if self.reference is not None else None
        if self.capture is not None and batch.prompt_lengths is not None:
            cur = self._run_capturing(batch)
        else:
            cur = self._run(self.policy, batch)
        release_cached_memory(self.device)
        return cur, ref

    def take_features(self) -> list[dict]:
        """The draft features of the last compute_logprobs call (then forgotten)."""
        out, self.features = self.features, []
        return out

    def refit_target(self) -> HostedReceiver:
        return self.receiver

    def save_reference(self, path: str) -> None:
        if self.reference is not None:
            torch.save(self.reference.state_dict(), path)

    def load_reference(self, path: str) -> None:
        if self.reference is not None:
            self.reference.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def ping(self) -> int:
        return self.policy_version

    def pid(self) -> int:
        import os
        return os.getpid()
