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


def test_k3_kl_is_bounded_as_verl_bounds_it():
    """A token the reference finds e^15 times likelier than the policy: k3 would be e^15 - 16
    (3.3e6); it is held at K3_MAX, with no gradient there, while a token under the bound keeps its
    value and gradient."""
    from rlspec.algo.losses import K3_MAX

    logp = torch.tensor([-16.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.5])
    kl = k3_kl(logp, ref)
    assert kl[0].item() == K3_MAX == 10.0
    assert kl[1].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-6)
    kl.sum().backward()
    assert logp.grad[0].item() == 0.0 and logp.grad[1].item() == pytest.approx(1 - math.exp(-0.5), abs=1e-6)


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


def test_a_flat_group_gets_exactly_zero_advantage_whatever_its_reward():
    """Fractional rewards (the code reward: fraction of tests passed) whose mean is not exact in
    float: every estimator gives such a group exactly 0, not noise divided by eps."""
    from rlspec.algo import compute_advantages

    rewards = torch.tensor([[0.7] * 8, [0.1, 0.9, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4]])
    for name in ("grpo", "loo"):
        for std in (True, False):
            adv = compute_advantages(name, rewards, std)
            assert torch.equal(adv[0], torch.zeros(8)), (name, std)
            assert adv[1].abs().sum() > 0


def test_dual_clip_bounds_a_negative_advantage_at_c_times_its_size():
    """A = -1, ratios 0.5 / 1.0 / 2.0 / 10.0, clip [0.8, 1.28], c = 3: per-token losses
    max(-A r, -A clip(r)) = 0.8 / 1.0 / 2.0 / 10.0, the last bounded to 3; a positive advantage
    is never dual-clipped."""
    from rlspec.algo.losses import LossInputs, ppo_clip_loss

    ratio = torch.tensor([[0.5, 1.0, 2.0, 10.0]])
    x = LossInputs(logp=ratio.log(), old_logp=torch.zeros(1, 4), advantages=torch.tensor([-1.0]), mask=torch.ones(1, 4))
    loss, m = ppo_clip_loss(x, 0.2, 0.28, 0.0, "token_mean", 4.0, 1.0, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((0.8 + 1.0 + 2.0 + 3.0) / 4)
    assert m["dual_clip_frac"].item() == pytest.approx(0.25)
    off, _ = ppo_clip_loss(x, 0.2, 0.28, 0.0, "token_mean", 4.0, 1.0, clip_ratio_c=None)
    assert off.item() == pytest.approx((0.8 + 1.0 + 2.0 + 10.0) / 4)
    pos = LossInputs(logp=ratio.log(), old_logp=torch.zeros(1, 4), advantages=torch.tensor([1.0]),
                     mask=torch.ones(1, 4))
    _, mp = ppo_clip_loss(pos, 0.2, 0.28, 0.0, "token_mean", 4.0, 1.0, clip_ratio_c=3.0)
    assert mp["dual_clip_frac"].item() == 0.0


def test_micro_batched_and_two_rank_gradients_equal_one_full_batch_backward():
    """The learner's accumulation on the tiny policy: micro-batches of 2 rows (global token count as
    denominator, gradients summed) and two ranks of 4 rows (each loss x world size, gradients
    averaged as DeepSpeed's all-reduce does) against one backward over all 8 rows. Largest
    relative error printed; under 1e-5."""
    from rlspec.algo.logprobs import sequence_logprobs
    from rlspec.algo.losses import LossInputs, ppo_clip_loss
    from rlspec.models import load_causal_lm

    from conftest import tiny_paths

    model = load_causal_lm(tiny_paths().model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, 200, (8, 14), generator=g)
    mask = torch.zeros(8, 13)
    mask[:, 5:] = 1
    mask[3, 9:] = 0  # rows of different lengths
    adv, old = torch.randn(8, generator=g), -2 * torch.rand(8, 13, generator=g) * mask
    tokens = float(mask.sum())

    def grads(groups, scale=1.0):
        model.zero_grad()
        for rows in groups:
            x = LossInputs(logp=sequence_logprobs(model, ids[rows], torch.ones_like(ids[rows])), old_logp=old[rows],
                           advantages=adv[rows], mask=mask[rows])
            (ppo_clip_loss(x, 0.2, 0.28, 0.0, "token_mean", tokens, 8.0, clip_ratio_c=3.0)[0] * scale).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    full = grads([slice(0, 8)])
    micro = grads([slice(i, i + 2) for i in range(0, 8, 2)])
    ranks = [grads([slice(0, 2), slice(2, 4)], scale=2.0), grads([slice(4, 6), slice(6, 8)], scale=2.0)]
    two_rank = (ranks[0] + ranks[1]) / 2
    rel = lambda a: float((a - full).norm() / full.norm())  # noqa: E731
    print(f"relative gradient error: micro-batched {rel(micro):.1e}, two ranks {rel(two_rank):.1e}")
    assert rel(micro) < 1e-5 and rel(two_rank) < 1e-5
