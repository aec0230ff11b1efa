"""GRPO math against hand-computed tensors."""
import math

import pytest
import torch

from rlspec.algo import (aggregate, compute_advantages, k3_kl, overlong_mask, policy_loss,
                         zero_variance_groups)
from rlspec.algo.losses import LossInputs


def test_grpo_advantage_is_group_zscore_with_unbiased_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = compute_advantages("grpo", r)
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s + 1e-6))
    assert torch.equal(a[1], torch.zeros(4))  # all agree -> no signal


def test_grpo_advantage_without_std_is_centred_reward():
    r = torch.tensor([[3.0, 1.0]])
    assert torch.allclose(compute_advantages("grpo", r, normalize_std=False), torch.tensor([[1.0, -1.0]]))


def test_leave_one_out_baseline_is_mean_of_the_others():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    a = compute_advantages("loo", r, normalize_std=False)
    assert torch.allclose(a, torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))
    s = torch.tensor([1.0, 0, 0, 0]).std().item()
    assert torch.allclose(compute_advantages("loo", r), a / (s + 1e-6))


def test_advantage_rejects_groups_of_one():
    with pytest.raises(ValueError):
        compute_advantages("grpo", torch.tensor([[1.0], [0.0]]))


def _inputs(ratios, adv, mask=None):
    ratios = torch.tensor(ratios)
    old = torch.zeros_like(ratios)
    return LossInputs(logp=ratios.log(), old_logp=old, advantages=torch.tensor(adv),
                      mask=torch.ones_like(ratios) if mask is None else torch.tensor(mask))


def test_clip_higher_per_token_values():
    # rows: A=+1 and A=-1; ratios 1.5, 0.5, 1.0; clip range [0.8, 1.28]
    x = _inputs([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]], [1.0, -1.0])
    loss, m = policy_loss("grpo", x, clip_low=0.2, clip_high=0.28, kl_coef=0.0, agg="token_mean",
                          num_tokens=6, num_seqs=2)
    # A=+1: max(-r, -clip(r)) = [-1.28, -0.5, -1.0]; A=-1: max(r, clip(r)) = [1.5, 0.8, 1.0]
    expected = (-1.28 - 0.5 - 1.0 + 1.5 + 0.8 + 1.0) / 6
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(2 / 6)  # 1.5 with A>0 and 0.5 with A<0


def test_symmetric_clip_differs_from_clip_higher():
    x = _inputs([[1.5]], [1.0])
    lo, _ = policy_loss("grpo", x, clip_low=0.2, clip_high=0.2, kl_coef=0.0, agg="token_mean",
                        num_tokens=1, num_seqs=1)
    hi, _ = policy_loss("grpo", x, clip_low=0.2, clip_high=0.28, kl_coef=0.0, agg="token_mean",
                        num_tokens=1, num_seqs=1)
    assert lo.item() == pytest.approx(-1.2) and hi.item() == pytest.approx(-1.28)


def test_token_mean_weighs_tokens_seq_mean_weighs_sequences():
    v = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate("token_mean", v, m, 5, 2).item() == pytest.approx(8 / 5)
    assert aggregate("seq_mean", v, m, 5, 2).item() == pytest.approx((1.0 + 4.0) / 2)


def test_micro_batches_add_up_to_full_batch_loss():
    torch.manual_seed(0)
    logp = torch.randn(4, 5) * 0.1 - 1
    x = LossInputs(logp=logp, old_logp=logp + torch.randn(4, 5) * 0.2, advantages=torch.randn(4),
                   mask=(torch.rand(4, 5) > 0.3).float())
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.0, agg="token_mean", num_tokens=float(x.mask.sum()), num_seqs=4)
    full, _ = policy_loss("grpo", x, **kw)
    parts = sum(policy_loss("grpo", LossInputs(x.logp[s], x.old_logp[s], x.advantages[s], x.mask[s]), **kw)[0]
                for s in (slice(0, 1), slice(1, 4)))
    assert parts.item() == pytest.approx(full.item(), abs=1e-6)


def test_k3_kl_hand_value_and_zero_at_equality():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # exp(ref - logp) - (ref - logp) - 1 = 0.5 + ln 2 - 1
    assert k3_kl(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert k3_kl(ref, ref).item() == 0.0


def test_kl_term_enters_loss_with_its_coefficient():
    x = _inputs([[1.0]], [0.0])
    x.ref_logp = torch.tensor([[math.log(0.5)]])  # logp = 0 (ratio 1, old 0)
    loss, m = policy_loss("grpo", x, clip_low=0.2, clip_high=0.28, kl_coef=0.1, agg="token_mean",
                          num_tokens=1, num_seqs=1)
    assert loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1), abs=1e-6)
    with pytest.raises(ValueError):
        policy_loss("grpo", _inputs([[1.0]], [0.0]), clip_low=0.2, clip_high=0.28, kl_coef=0.1,
                    agg="token_mean", num_tokens=1, num_seqs=1)


def test_gradient_of_unclipped_token_is_minus_advantage_over_tokens():
    logp = torch.zeros(1, 2, requires_grad=True)
    x = LossInputs(logp=logp, old_logp=torch.zeros(1, 2), advantages=torch.tensor([2.0]), mask=torch.ones(1, 2))
    loss, _ = policy_loss("grpo", x, clip_low=0.2, clip_high=0.28, kl_coef=0.0, agg="token_mean",
                          num_tokens=2, num_seqs=1)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0]]))  # d(-A r)/dlogp = -A r / N


def test_filters():
    r = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    assert zero_variance_groups(r).tolist() == [True, False, True]
    assert overlong_mask(torch.tensor([True, False])).tolist() == [0.0, 1.0]
