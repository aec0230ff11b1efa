"""Training tensors: length-sorted micro-batches cut to their own longest row, against the
full-width batch they come from (the tiny policy for the log-probs)."""
import torch

from conftest import ROOT, logprob_worker
from rlspec.algo.batching import build_train_batch, micro_batches
from rlspec.messages import RolloutBatch


def ragged_batch(seed: int, n: int = 10):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 282, (int(k),), generator=g).tolist() for k in torch.randint(4, 9, (n,), generator=g)]
    responses = [torch.randint(1, 282, (int(k),), generator=g).tolist()
                 for k in torch.randint(1, 30, (n,), generator=g)]
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
    responses = [torch.randint(1, 282, (int(k),), generator=g).tolist()
                 for k in torch.randint(0, 30, (len(rows),), generator=g)]
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


def test_gradient_rows_are_those_with_an_advantage_and_a_weight_under_an_inert_loss_only():
    from rlspec.algo.batching import gradient_rows

    adv, w = torch.tensor([0.0, 1.2, -0.7, 0.0, 0.5]), torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])
    assert gradient_rows(adv, w, "grpo", 0.0).tolist() == [False, True, True, False, False]
    # the KL term moves a row whatever its advantage; an unregistered loss is not assumed inert
    assert gradient_rows(adv, w, "grpo", 0.01).all() and gradient_rows(adv, w, "my_loss", 0.0).all()


def test_shard_rows_gives_every_rank_the_same_micro_batch_count_and_pads_with_the_shortest():
    from rlspec.algo.batching import shard_rows

    lengths = torch.tensor([30, 5, 40, 7, 9, 60, 3, 11, 20, 8, 6, 50, 2, 12, 4, 15])
    live = torch.zeros(16, dtype=torch.bool)
    # every row live: the plain contiguous split, 16 / (2 ranks x 4) = 2 micro-batches each
    rows, pads, m = shard_rows(~live, lengths, 2, 4)
    assert m == 2 and [r.tolist() for r in rows] == [list(range(8)), list(range(8, 16))] and not any(map(len, pads))
    # 5 live rows over 2 ranks: 1 micro-batch each, split 2 / 3, nothing to pad
    live[[0, 2, 5, 11, 15]] = True
    rows, pads, m = shard_rows(live, lengths, 2, 4)
    assert m == 1 and [r.tolist() for r in rows] == [[0, 2], [5, 11, 15]]
    # 1 live row over 2 ranks: the other rank runs the shortest row that is not live, and 9 live
    # rows over 2 ranks of micro-batches of 4: 2 micro-batches each, so the 4-row rank gets none
    live[:] = False
    live[5] = True
    rows, pads, m = shard_rows(live, lengths, 2, 4)
    assert m == 1 and [r.tolist() for r in rows] == [[12], [5]] and [p.tolist() for p in pads] == [[12], []]
    live[:9] = True
    rows, pads, m = shard_rows(live, lengths, 2, 4)
    assert m == 2 and [len(r) for r in rows] == [4, 5] and not any(map(len, pads))
    # no live row at all: each rank still runs one micro-batch (the optimizer steps as before)
    rows, pads, m = shard_rows(torch.zeros(16, dtype=torch.bool), lengths, 2, 4)
    assert m == 1 and [r.tolist() for r in rows] == [[12], [6]] and rows[0].tolist() == pads[0].tolist()
    for r in rows:
        assert 1 <= len(r) <= m * 4 and len(micro_batches(torch.ones(len(r), 3), 4, m)) == m


def test_mini_batches_keep_the_whole_batch_denominators_and_zero_the_padding_rows_loss():
    from rlspec.loops.step import mini_batches

    b = ragged_batch(2, n=16)
    b.advantages[:] = 0.0
    b.advantages[[3, 9]] = torch.tensor([1.0, -1.0])
    live = b.advantages != 0
    (r0,), (r1,) = mini_batches(b, torch.ones(16), None, 2, live, 4)
    tokens = float(b.loss_mask.sum())
    for part in (r0, r1):
        assert (part.num_tokens, part.num_seqs, part.micro_batches) == (tokens, 16.0, 1)
        assert part.trained_tokens == float(b.loss_mask[[3, 9]].sum()) and part.trained_seqs == 2.0
    assert torch.equal(r0.batch.input_ids, b.rows(torch.tensor([3])).input_ids)
    assert torch.equal(r1.batch.input_ids, b.rows(torch.tensor([9])).input_ids)
    # one live row: the other rank runs the shortest row, its loss mask zeroed, the batch's intact
    (r0,), (r1,) = mini_batches(b, torch.ones(16), None, 2, b.advantages > 0, 4)
    shortest = int(torch.argmin(b.attention_mask.sum(1)))
    assert torch.equal(r0.batch.input_ids, b.rows(torch.tensor([shortest])).input_ids)
    assert r0.batch.loss_mask.sum() == 0 and b.loss_mask[shortest].sum() > 0 and r0.trained_seqs == 1.0
    assert torch.equal(r1.batch.loss_mask, b.rows(torch.tensor([3])).loss_mask)
    # every row live: the contiguous shards of before, no count, no trained denominators
    (a0,), (a1,) = mini_batches(b, torch.ones(16), None, 2)
    assert torch.equal(a1.batch.input_ids, b.shard(1, 2).input_ids) and a1.micro_batches == 0
    assert a1.trained_tokens is None
