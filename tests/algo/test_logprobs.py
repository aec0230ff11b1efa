"""Log-probs through the output layer in chunks: the same values, entropy and gradients as the
model's own logits, without holding the [B, T, V] logits (or a float32 copy) for backward."""
import torch

from rlspec.algo.logprobs import head_logprobs, sequence_logprobs, split_head, token_entropy, token_logprobs


def wide_vocab_model(vocab: int = 50_000, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                        tie_word_embeddings=False))


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while fn runs."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_chunked_head_matches_the_models_logits_values_entropy_and_gradients():
    model = wide_vocab_model(vocab=300)
    ids = torch.randint(0, 300, (3, 40))
    mask = torch.ones_like(ids)
    assert split_head(model) is not None
    lp, ent = sequence_logprobs(model, ids, mask, 0.7, with_entropy=True, chunk_tokens=16)
    (lp.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    ref = token_logprobs(logits, ids[:, 1:], 0.7)
    ref.sum().backward()
    assert torch.allclose(lp, ref, atol=1e-5) and torch.allclose(ent, token_entropy(logits, 0.7), atol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-5, rtol=1e-4), n


def test_chunked_head_keeps_no_vocabulary_sized_tensor_for_backward():
    """B=2, T=256, V=50k: the model's own logits path keeps them (and their float32 log-softmax)
    for backward, about 100 MB; the chunked head keeps the hidden states, under 1% of that."""
    model = wide_vocab_model()
    ids = torch.randint(0, 50_000, (2, 257))
    hidden = model.model(input_ids=ids).last_hidden_state.detach().requires_grad_()
    full = saved_bytes(lambda: token_logprobs(model.lm_head(hidden[:, :-1]), ids[:, 1:]).sum().backward())
    chunked = saved_bytes(lambda: head_logprobs(hidden[:, :-1], model.lm_head, ids[:, 1:], 1.0, 128).sum().backward())
    logits_bytes = 2 * 256 * 50_000 * 4
    print(f"saved for backward: model's logits {full / 2**20:.1f} MiB, chunked head {chunked / 2**20:.2f} MiB")
    assert full >= logits_bytes and chunked < 0.01 * full


def test_models_that_post_process_logits_use_their_own_forward():
    model = wide_vocab_model(vocab=300)
    model.config.final_logit_softcapping = 30.0
    assert split_head(model) is None


def test_gradient_checkpointing_keeps_gradients_and_drops_layer_activations():
    """What trainer.gradient_checkpointing turns on: the same log-probs and gradients, and for
    backward only each layer's input kept (the tiny policy's 4 layers, 8 rows of 64 tokens)."""
    from transformers import AutoModelForCausalLM

    from conftest import tiny_paths

    model = AutoModelForCausalLM.from_pretrained(tiny_paths().model, dtype=torch.float32).train()
    ids = torch.randint(1, 282, (8, 65))
    mask = torch.ones_like(ids)

    def run():
        model.zero_grad()
        sequence_logprobs(model, ids, mask, 1.0).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_bytes = saved_bytes(run)
    plain = run()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt_bytes = saved_bytes(run)
    ckpt = run()
    print(f"saved for backward: {plain_bytes / 2**20:.2f} MiB plain, {ckpt_bytes / 2**20:.2f} MiB checkpointed")
    assert all(torch.allclose(plain[n], ckpt[n], atol=1e-6, rtol=1e-5) for n in plain)
    assert ckpt_bytes < 0.25 * plain_bytes
