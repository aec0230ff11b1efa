"""Measuring what training keeps in memory, with real layers at real widths: the torch harnesses
rlspec/cluster/memory.py's per-token constants are fitted to (ACT_ELEMENTS, FORWARD_ELEMENTS,
DRAFT_STEP_BYTES). Run by scripts/bench_memory.py and tests/cluster/test_memory.py (and on a GPU by
tests/gpu/test_cuda.py); the memory model itself stays pure Python."""
from __future__ import annotations


def measure_draft_head(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                       draft_vocab: int, tokens: int, steps: int, topk: int = 20) -> float:
    """Bytes one row of `tokens` positions keeps for backward in EAGLE-3 head training (the real
    Eagle3Head.unrolled and ttt_loss over `steps` draft steps, float32), counted with saved-tensor
    hooks: what DRAFT_STEP_BYTES is fitted to. Parameters and buffers are not counted."""
    import torch

    from rlspec.draft.eagle3 import Eagle3Head, ttt_loss

    vocab = 2 * draft_vocab
    cfg = dict(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
               num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, draft_vocab_size=draft_vocab,
               eagle_aux_hidden_state_layer_ids=[1, 2, 3], num_hidden_layers=1, rope_theta=1e6)
    g = torch.Generator().manual_seed(0)
    head = Eagle3Head(cfg, torch.randn(vocab, hidden, generator=g))
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    aux = torch.randn(1, tokens, 3 * hidden, generator=g)
    top_ids, top_logp = (torch.randint(0, vocab, (1, tokens, topk), generator=g),
                         torch.randn(1, tokens, topk, generator=g))
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = head.unrolled(ids, aux, torch.ones(1, tokens, dtype=torch.bool), steps)
        ttt_loss(logits, top_ids, top_logp, torch.zeros(1, dtype=torch.long), torch.tensor([tokens]), 0.8, 1.0,
                 head.draft_of_target())
    skip = {t.untyped_storage().data_ptr() for t in [*head.parameters(), *head.buffers()]}
    return sum(n for ptr, n in kept.items() if ptr not in skip)


def measure_layer(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, tokens: int = 64,
                  checkpointing: bool = False, device: str = "cpu", peak: bool = False,
                  backward: bool = True) -> float:
    """Bytes one token keeps for backward in one real Qwen3 decoder layer (Hugging Face, bfloat16,
    SDPA attention), counted with saved-tensor hooks: what ACT_ELEMENTS is fitted to. Parameters
    and the layer's input are not counted (the input is the previous layer's output, counted
    there); under checkpointing the layer runs inside torch.utils.checkpoint. On a CUDA `device`
    with `peak`: instead, the allocator's peak over a forward and backward, per token, above the
    parameters, their gradients (held from a first pass, as a learner holds them across micro-
    batches), the input and the output's gradient: the saved tensors and backward's transients, one
    weight gradient being accumulated among them. With `peak` and not `backward`: the peak of a
    forward pass without autograd (a log-prob recompute) above the parameters and the input."""
    import torch
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, num_hidden_layers=1, vocab_size=16)
    cfg._attn_implementation = "sdpa"
    layer = Qwen3DecoderLayer(cfg, 0).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    pos = torch.arange(tokens, device=device)[None]
    rope = Qwen3RotaryEmbedding(cfg).to(device)(x, pos)
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def run(h):
        return layer(h, attention_mask=None, position_ids=pos, position_embeddings=rope)

    if peak and not backward:
        with torch.no_grad():
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            run(x.detach())
            torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / tokens
    if peak:
        grad = torch.randn_like(x)

        def step():
            out = torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False) if checkpointing else run(x)
            (out[0] if isinstance(out, tuple) else out).backward(grad)

        step()  # the parameters' gradients exist from here on
        x.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) + x.numel() * x.element_size()  # + the input's gradient
        step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / tokens
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if checkpointing:
            torch.utils.checkpoint.checkpoint(run, x, use_reentrant=False)
        else:
            run(x)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    return sum(n for ptr, n in kept.items() if ptr not in skip) / tokens
