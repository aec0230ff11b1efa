"""Parameter, FLOP and byte counts of a decoder from its shapes (dense or MoE).

Counts are matmul weights; norms and biases are left out (under 0.1% of any model here).
"""
from __future__ import annotations

import json
from pathlib import Path

from rlspec.sim.config import ModelShape


def attn_params(m: ModelShape) -> int:
    qkv_in = m.qkv_input_size or m.hidden_size
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return qkv_in * (q + 2 * kv) + q * m.hidden_size


def expert_params(m: ModelShape) -> int:
    """One routed expert's gate, up and down projections."""
    return 3 * m.hidden_size * m.moe_intermediate_size


def dense_layer_params(m: ModelShape) -> int:
    """Per layer, what every token reads: attention, dense MLP and router."""
    return attn_params(m) + 3 * m.hidden_size * m.intermediate_size + m.hidden_size * m.num_experts


def lm_head_params(m: ModelShape) -> int:
    return m.vocab_size * m.hidden_size


def total_params(m: ModelShape) -> int:
    """Every weight: what a refit ships and an optimizer updates."""
    embed = m.vocab_size * m.hidden_size if m.has_embedding and not m.tie_word_embeddings else 0
    layers = m.num_layers * (dense_layer_params(m) + m.num_experts * expert_params(m))
    return layers + lm_head_params(m) + embed + m.extra_params


def active_params(m: ModelShape) -> int:
    """Weights one token multiplies through (the embedding lookup is a gather, not a matmul)."""
    layers = m.num_layers * (dense_layer_params(m) + m.experts_per_token * expert_params(m))
    return layers + lm_head_params(m) + m.extra_params


def kv_bytes_per_token(m: ModelShape) -> int:
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * m.bytes_per_param


def attn_flops(m: ModelShape, context: float) -> float:
    """Forward FLOPs of one query token attending to `context` keys (QK^T and AV)."""
    return 4.0 * m.num_layers * m.num_heads * m.head_dim * context


def experts_touched(m: ModelShape, tokens: float) -> float:
    """Expected distinct experts per layer that `tokens` tokens visit under uniform routing.
    1 token reads experts_per_token experts; a verification of k+1 tokens reads more, which is
    why a verification costs more than a decode step on an MoE at small batch."""
    if m.num_experts == 0 or tokens <= 0:
        return 0.0
    return m.num_experts * (1.0 - (1.0 - m.experts_per_token / m.num_experts) ** tokens)


def weight_bytes_read(m: ModelShape, tokens: float) -> float:
    """Weight bytes one forward over `tokens` tokens streams from memory (whole engine)."""
    dense = m.num_layers * dense_layer_params(m) + lm_head_params(m) + m.extra_params
    experts = m.num_layers * experts_touched(m, tokens) * expert_params(m)
    return (dense + experts) * m.bytes_per_param


def sequence_flops(m: ModelShape, length: float, length_sq: float) -> float:
    """Forward FLOPs over sequences of mean length `length` and mean squared length `length_sq`
    (causal attention: a token at position t attends to t keys, L^2/2 pairs per sequence)."""
    return 2.0 * active_params(m) * length + attn_flops(m, 1.0) * length_sq / 2


def shape_from_hf_config(path: str | Path, bytes_per_param: int, name: str | None = None) -> ModelShape:
    """A ModelShape from a Hugging Face config.json (Qwen3 / Qwen3-MoE / Llama layouts, and
    EAGLE-3 heads in vLLM's format: one layer over 2 x hidden inputs, fc over 3 hidden states)."""
    path = Path(path)
    c = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    eagle3 = "eagle" in str(c.get("architectures", "")).lower() or c.get("model_type") == "eagle3"
    experts = c.get("num_experts", c.get("num_local_experts", 0)) or 0
    vocab = c.get("draft_vocab_size", c["vocab_size"]) if eagle3 else c["vocab_size"]
    return ModelShape(
        name=name or path.name, hidden_size=hidden, num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads), head_dim=c.get("head_dim") or hidden // heads,
        intermediate_size=0 if experts and not c.get("mlp_only_layers") else c.get("intermediate_size", 0),
        vocab_size=vocab, tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_experts=experts, experts_per_token=c.get("num_experts_per_tok", 0) if experts else 0,
        moe_intermediate_size=c.get("moe_intermediate_size", 0) if experts else 0,
        qkv_input_size=2 * hidden if eagle3 else 0, has_embedding=not eagle3,
        extra_params=3 * hidden * hidden if eagle3 else 0, bytes_per_param=bytes_per_param)
