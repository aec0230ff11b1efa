"""What a draft learns from: the target's hidden states at the EAGLE-3 layers and its next-token
distribution, kept compact as top-k log-probs. One function for offline draft training and for
the online path (the LogprobWorker's forward pass over every rollout)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TargetFeatures:
    aux_hidden: torch.Tensor   # [B, T, len(layer_ids)*H] concat of hidden_states[i] for i in layer_ids
    topk_ids: torch.Tensor     # [B, T, K] the target's K most likely next tokens at each position
    topk_logp: torch.Tensor    # [B, T, K] their log-probs (at `temperature`)


@torch.no_grad()
def target_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids,
                    topk: int, temperature: float = 1.0, out_dtype: torch.dtype = torch.float32) -> TargetFeatures:
    """Run the target (a Hugging Face causal LM) once over right-padded sequences.
    hidden_states[i] is the residual stream after i decoder layers, before the final norm, the
    tensor vLLM hands an EAGLE-3 head for layer id i."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return features_from_output(out, layer_ids, topk, temperature, out_dtype)


def features_from_output(out, layer_ids, topk: int, temperature: float = 1.0,
                         out_dtype: torch.dtype = torch.float32) -> TargetFeatures:
    """TargetFeatures from a forward pass already run with output_hidden_states=True."""
    n_layers = len(out.hidden_states) - 1
    if not all(0 < i < n_layers for i in layer_ids):
        raise ValueError(f"EAGLE-3 layer ids {list(layer_ids)} outside 1..{n_layers - 1} of the target")
    aux = torch.cat([out.hidden_states[i] for i in layer_ids], -1)
    with torch.no_grad():
        logp = (out.logits.detach().float() / max(temperature, 1e-6)).log_softmax(-1)
        top = logp.topk(min(topk, logp.shape[-1]), dim=-1)
    return TargetFeatures(aux.detach().to(out_dtype), top.indices, top.values)
