"""Training tensors: length-sorted micro-batches cut to their own longest row, against the
full-width batch they come from (the tiny policy for the log-probs)."""
import torch

from conftest import ROOT, logprob_worker
from rlspec.algo.batching import build_train_batch, micro_batches
from rlspec.messages import RolloutBatch


def ragged_batch(seed: int, n: int = 10):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 282, (int(k),), generator=g).tolist() for k in torch.randint(4, 9, (n,), generator=g)]
    responses = [torch.randint(1, 282, (int(k),), generator=g).tolist() for k in torch.randint(1, 30, (n,), generator=g)]
    logprobs = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
    ro = RolloutBatch(prompts, responses, logprobs, [False] * n, policy_version=3)
    return build_train_batch(ro, torch.randn(n, generator=g), torch.ones(n), 0)


def test_micro_batches_take_longest_rows_first_and_cover_every_row_once():
    mask = torch.zeros(7, 12, dtype=torch.long)
    for i, n in enumerate([3, 12, 5, 5, 9, 1, 7]):
        mask[i, :n] = 1
    chunks = micro_batches(mask, 3)
    assert [idx.tolist() for idx, _ in chunks] == [[1, 4, 6], [2, 3, 0], [5]]  # ties keep row order
    assert [w for _, w in chunks] == [12, 5, 1]


def test_rows_cut_every_tensor_to_the_width_and_keep_the_rows():
    b = ragged_batch(0)
    idx = torch.tensor([7, 2, 5])
    width = int(b.attention_mask[idx].sum(1).max())
    sub = b.rows(idx, width)
    assert sub.input_ids.shape == (3, width) and sub.loss_mask.shape == (3, width - 1)
    assert torch.equal(sub.input_ids, b.input_ids[idx, :width])
    assert torch.equal(sub.behaviour_logprobs, b.behaviour_logprobs[idx, : width - 1])
    assert torch.equal(sub.advantages, b.advantages[idx]) and sub.policy_version == 3
    # nothing that carries loss or attention is cut off
    assert sub.loss_mask.sum() == b.loss_mask[idx].sum() and sub.attention_mask.sum() == b.attention_mask[idx].sum()
    assert torch.equal(b.shard(1, 2).input_ids, b.input_ids[5:])


def test_trimmed_micro_batches_give_the_full_width_logprobs():
    """The LogprobWorker's sorted, trimmed micro-batches against one forward pass over the whole
    padded batch: the same log-prob on every response token, zero elsewhere."""
    from rlspec.algo.logprobs import sequence_logprobs

    b = ragged_batch(1, n=12)
    w = logprob_worker(4)
    widths = [width for _, width in micro_batches(b.attention_mask, 4)]
    assert widths[-1] < b.input_ids.shape[1]  # some micro-batch really is cut
    got = w._run(w.policy, b).cpu()
    on = b.to(w.device)  # the policy's device (a GPU where one is visible)
    with torch.no_grad():
        full = sequence_logprobs(w.policy, on.input_ids, on.attention_mask, 1.0).cpu() * (b.loss_mask != 0)
    assert got.shape == full.shape
    assert torch.allclose(got, full, atol=1e-5, rtol=0)
    assert bool((got[b.loss_mask == 0] == 0).all()) and bool((got[b.loss_mask != 0] != 0).all())


def grouped_batch(seed: int, prompts: int = 4, group: int = 3):
    """GRPO-shaped: each prompt (4-8 tokens) repeated for `group` responses of 0-29 tokens."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randint(1, 282, (int(k),), generator=g).tolist() for k in torch.randint(4, 9, (prompts,), generator=g)]
    rows = [p for p in ps for _ in range(group)]
    responses = [torch.randint(1, 282, (int(k),), generator=g).tolist() for k in torch.randint(0, 30, (len(rows),), generator=g)]
    responses[1] = []  # an empty response carries no loss and must not break the pass
    logprobs = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
    ro = RolloutBatch(rows, responses, logprobs, [False] * len(rows), policy_version=0)
    return build_train_batch(ro, torch.randn(len(rows), generator=g), torch.ones(len(rows)), 0)


def test_shared_prompt_forward_gives_the_full_rows_logprobs_entropy_and_gradients():
    """Each prompt forwarded once, responses against its cache: the same log-probs and entropy on
    every response token as the whole rows' forward, 0 elsewhere, and the same gradient."""
    from rlspec.algo.logprobs import prompt_cache_supported, sequence_logprobs
    from rlspec.models import load_causal_lm

    b = grouped_batch(2)
    model = load_causal_lm(str(ROOT / "rlspec" / "assets" / "tiny" / "policy"))
    assert prompt_cache_supported(model)
    resp = b.loss_mask != 0
    out = {}
    for shared in (False, True):
        model.zero_grad()
        lp, ent = sequence_logprobs(model, b.input_ids, b.attention_mask, 0.7, with_entropy=True,
                                    prompt_lengths=b.prompt_lengths if shared else None)
        (lp * b.loss_mask * b.advantages[:, None]).sum().backward()
        out[shared] = lp.detach(), ent, torch.cat([p.grad.flatten() for p in model.parameters()])
    (lp0, ent0, g0), (lp1, ent1, g1) = out[False], out[True]
    assert lp1.shape == lp0.shape
    assert torch.allclose(lp1[resp], lp0[resp], atol=1e-5, rtol=0)
    assert torch.allclose(ent1[resp], ent0[resp], atol=1e-5, rtol=0)
    assert bool((lp1[~resp] == 0).all()) and bool((ent1[~resp] == 0).all())
    assert float((g1 - g0).norm() / g0.norm()) < 1e-5


def test_prompt_cache_supported_refuses_sliding_window_layers():
    from transformers import Qwen3Config

    from rlspec.algo.logprobs import prompt_cache_supported

    class Stub:  # the check reads only the config
        def __init__(self, config):
            self.config = config

    full = Qwen3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32, vocab_size=100)
    sliding = Qwen3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=32, vocab_size=100, use_sliding_window=True,
                          sliding_window=8, max_window_layers=0)
    assert prompt_cache_supported(Stub(full))
    assert not prompt_cache_supported(Stub(sliding))
