"""LogprobWorker: recomputes current-policy (and reference-policy) log-probs for every rollout."""
from __future__ import annotations

import copy

import torch

from rlspec.algo.logprobs import sequence_logprobs
from rlspec.messages import TrainBatch


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)


class LogprobWorker:
    def __init__(self, model_path: str, with_reference: bool, temperature: float, micro_batch_size: int,
                 threads: int, trust_remote_code: bool = False):
        torch.set_num_threads(threads)
        self.policy = load_causal_lm(model_path, trust_remote_code=trust_remote_code).eval()
        # The reference is the initial policy and never moves.
        self.reference = copy.deepcopy(self.policy) if with_reference else None
        self.temperature, self.mbs = temperature, micro_batch_size
        self.policy_version = 0

    @torch.no_grad()
    def _run(self, model, batch: TrainBatch) -> torch.Tensor:
        out = [sequence_logprobs(model, batch.input_ids[i: i + self.mbs],
                                 batch.attention_mask[i: i + self.mbs], self.temperature)
               for i in range(0, len(batch), self.mbs)]
        return torch.cat(out) * (batch.loss_mask != 0)  # [N, T], zero off the response

    def compute_logprobs(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([N, T] current-policy log-probs, [N, T] reference log-probs or None)."""
        ref = self._run(self.reference, batch) if self.reference is not None else None
        return self._run(self.policy, batch), ref

    def push_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        missing, unexpected = self.policy.load_state_dict(weights, strict=False)
        if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
            raise RuntimeError(f"weight refit mismatch: missing {missing}, unexpected {unexpected}")
        self.policy_version = version

    def save_reference(self, path: str) -> None:
        if self.reference is not None:
            torch.save(self.reference.state_dict(), path)

    def load_reference(self, path: str) -> None:
        if self.reference is not None:
            self.reference.load_state_dict(torch.load(path, weights_only=True))

    def ping(self) -> int:
        return self.policy_version

    def pid(self) -> int:
        import os
        return os.getpid()
