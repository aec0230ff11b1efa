"""Per-token log-probs of given tokens under a causal LM, at the sampling temperature."""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V], targets [B, T] -> log p(target) [B, T] of softmax(logits / temperature)."""
    logp = (logits.float() / temperature).log_softmax(dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V] -> entropy [B, T] of softmax(logits / temperature)."""
    logp = (logits.float() / temperature).log_softmax(dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def sequence_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float = 1.0, with_entropy: bool = False):
    """input_ids [B, T+1] -> log-probs [B, T] of input_ids[:, 1:] (and entropy [B, T])."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    lp = token_logprobs(logits, input_ids[:, 1:], temperature)
    if not with_entropy:
        return lp
    with torch.no_grad():
        return lp, token_entropy(logits, temperature)
