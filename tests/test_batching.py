"""Training tensors: length-sorted micro-batches cut to their own longest row, against the
full-width batch they come from (the tiny policy for the log-probs)."""
import torch

from conftest import ROOT
from rlspec.batching import build_train_batch, micro_batches
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
    from rlspec.workers.logprob import LogprobWorker

    b = ragged_batch(1, n=12)
    w = LogprobWorker(str(ROOT / "rlspec" / "assets" / "tiny" / "policy"), False, 1.0, 4, 1)
    widths = [width for _, width in micro_batches(b.attention_mask, 4)]
    assert widths[-1] < b.input_ids.shape[1]  # some micro-batch really is cut
    got = w._run(w.policy, b)
    with torch.no_grad():
        full = sequence_logprobs(w.policy, b.input_ids, b.attention_mask, 1.0) * (b.loss_mask != 0)
    assert got.shape == full.shape
    assert torch.allclose(got, full, atol=1e-5, rtol=0)
    assert bool((got[b.loss_mask == 0] == 0).all()) and bool((got[b.loss_mask != 0] != 0).all())
