"""Off-policy correction (rlspec/algo/offpolicy.py) against hand-computed values."""
import math

import pytest
import torch

from rlspec.algo import (behaviour_weights, merge_weight_sums, policy_loss, ratio_reference, weight_stats,
                         weight_sums)
from rlspec.algo.losses import LossInputs
from rlspec.config import RLSpecConfig, off_policy_correction

L = math.log
# pi_prox / pi_behav of three tokens: 0.5/0.25 = 2, 0.2/0.5 = 0.4, 0.9/0.9 = 1
PROX = torch.tensor([[L(0.5), L(0.2), L(0.9)]])
BEHAV = torch.tensor([[L(0.25), L(0.5), L(0.9)]])
ONES = torch.ones(1, 3)


def close(a, b):
    return torch.allclose(a, torch.tensor(b), atol=1e-6)


def test_decoupled_ppo_masks_tokens_over_the_cap():
    w, keep = behaviour_weights(PROX, BEHAV, ONES, "decoupled_ppo", cap=1.5)
    assert close(w, [[0.0, 0.4, 1.0]]) and close(keep, [[0.0, 1.0, 1.0]])


def test_tis_truncates_the_weight_and_keeps_every_token():
    w, keep = behaviour_weights(PROX, BEHAV, ONES, "tis", cap=1.5)
    assert close(w, [[1.5, 0.4, 1.0]]) and close(keep, [[1.0, 1.0, 1.0]])


def test_none_is_weight_one_and_weights_are_zero_off_the_mask():
    w, keep = behaviour_weights(PROX, BEHAV, ONES, "none", cap=1.5)
    assert close(w, [[1.0, 1.0, 1.0]]) and close(keep, [[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    for method in ("none", "decoupled_ppo", "tis", "behaviour_ppo"):
        w, keep = behaviour_weights(PROX, BEHAV, mask, method, cap=5.0)
        assert w[0, 1] == 0 and keep[0, 1] == 0
    with pytest.raises(ValueError, match="unknown off-policy correction"):
        behaviour_weights(PROX, BEHAV, ONES, "vtrace", cap=2.0)


def test_weight_stats_over_loss_tokens_merged_across_micro_batches():
    s = weight_sums(PROX, BEHAV, ONES, cap=1.5)
    assert s == pytest.approx({"iw_sum": 3.4, "iw_max": 2.0, "iw_capped": 1.0, "iw_tokens": 3.0})
    assert weight_stats(s) == pytest.approx({"mean": 3.4 / 3, "max": 2.0, "capped_frac": 1 / 3})
    # the same tokens split over two micro-batches (or ranks) give the same figures
    a = weight_sums(PROX, BEHAV, torch.tensor([[1.0, 0.0, 0.0]]), cap=1.5)
    b = weight_sums(PROX, BEHAV, torch.tensor([[0.0, 1.0, 1.0]]), cap=1.5)
    assert weight_stats(merge_weight_sums(merge_weight_sums({}, b), a)) == pytest.approx(weight_stats(s))
    assert weight_stats(b) == pytest.approx({"mean": 0.7, "max": 1.0, "capped_frac": 0.0})
    empty = weight_sums(PROX, BEHAV, torch.zeros(1, 3), cap=1.5)
    assert weight_stats(empty) == {"mean": 1.0, "max": 1.0, "capped_frac": 0.0}


def _loss(logp, method, cap=1.5, adv=1.0):
    w, keep = behaviour_weights(PROX, BEHAV, ONES, method, cap)
    x = LossInputs(logp=logp, old_logp=ratio_reference(PROX, BEHAV, method), advantages=torch.tensor([adv]),
                   mask=keep, weight=w)
    return policy_loss("grpo", x, clip_low=0.2, clip_high=0.28, kl_coef=0.0, agg="token_mean",
                       num_tokens=3.0, num_seqs=1.0)[0].item()


def test_behaviour_weight_multiplies_the_clipped_surrogate():
    # At pi_theta = pi_prox (ratio 1) the token loss is -A * w; decoupled drops the token over the cap.
    assert _loss(PROX, "decoupled_ppo") == pytest.approx(-(0.4 + 1.0) / 3)
    assert _loss(PROX, "tis") == pytest.approx(-(1.5 + 0.4 + 1.0) / 3)
    assert _loss(PROX, "none") == pytest.approx(-3.0 / 3)
    # pi_theta = 1.5 pi_prox on token 2 (0.3 vs 0.2): the ratio is clipped at 1 + 0.28 before the
    # behaviour weight 0.4 applies: -1.28 * 0.4; the other tokens as above.
    logp = PROX.clone()
    logp[0, 1] = L(0.3)
    assert _loss(logp, "decoupled_ppo") == pytest.approx(-(1.28 * 0.4 + 1.0) / 3)
    # A negative advantage is not clipped from above: token 2 costs -A * ratio * w = 1.5 * 0.4,
    # token 1 its truncated weight 1.5, token 3 one.
    assert _loss(logp, "tis", adv=-1.0) == pytest.approx((1.5 + 1.5 * 0.4 + 1.0) / 3)


def test_behaviour_ppo_clips_the_ratio_against_the_sampler():
    assert torch.equal(ratio_reference(PROX, BEHAV, "behaviour_ppo"), BEHAV)
    assert torch.equal(ratio_reference(PROX, BEHAV, "decoupled_ppo"), PROX)
    w, keep = behaviour_weights(PROX, BEHAV, ONES, "behaviour_ppo", cap=1.5)
    assert close(w, [[1.0, 1.0, 1.0]]) and close(keep, [[1.0, 1.0, 1.0]])
    # At pi_theta = pi_prox the ratios are pi_prox / pi_behav = 2, 0.4, 1. A = +1: token 1 is
    # clipped at 1.28, token 2 (0.4, below 1 - 0.2) is not clipped for a positive advantage.
    assert _loss(PROX, "behaviour_ppo") == pytest.approx(-(1.28 + 0.4 + 1.0) / 3)
    # A = -1: token 2 is clipped at 0.8; token 1 keeps its ratio 2 (no upper clip for A < 0).
    assert _loss(PROX, "behaviour_ppo", adv=-1.0) == pytest.approx((2.0 + 0.8 + 1.0) / 3)
    # The clipped token gets no gradient: the weights have already moved it past the trust region.
    for adv, clipped in ((1.0, 0), (-1.0, 1)):
        logp = PROX.clone().requires_grad_(True)
        x = LossInputs(logp=logp, old_logp=BEHAV, advantages=torch.tensor([adv]), mask=ONES)
        policy_loss("grpo", x, clip_low=0.2, clip_high=0.28, kl_coef=0.0, agg="token_mean",
                    num_tokens=3.0, num_seqs=1.0)[0].backward()
        grad = logp.grad[0]
        assert grad[clipped] == 0 and all(grad[i] != 0 for i in range(3) if i != clipped)
        # unclipped tokens: d/dlogp of -A * ratio / 3 = -A * ratio / 3
        ratio = [2.0, 0.4, 1.0]
        assert all(grad[i].item() == pytest.approx(-adv * ratio[i] / 3) for i in range(3) if i != clipped)


def test_auto_correction_follows_the_async_config():
    cfg = RLSpecConfig()
    assert off_policy_correction(cfg) == "none"
    cfg.async_grpo.enabled = True
    assert off_policy_correction(cfg) == "behaviour_ppo"
    cfg.async_grpo.max_policy_lag = 0
    assert off_policy_correction(cfg) == "none"
    cfg.algo.off_policy_correction = "tis"
    assert off_policy_correction(cfg) == "tis"


def test_importance_weights_and_their_stats_against_hand_values():
    """pi_prox / pi_behav at log-prob gaps 0, ln 2, -ln 4, ln 3 (the last token masked off):
    weights 1, 2, 0.25; mean 3.25/3, max 2, one of three above a cap of 1.5."""
    import math

    from rlspec.algo import importance_weights, weight_stats, weight_sums

    prox = torch.tensor([[0.0, math.log(2.0), -math.log(4.0), math.log(3.0)]])
    behav = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert torch.allclose(importance_weights(prox, behav), torch.tensor([[1.0, 2.0, 0.25, 3.0]]))
    st = weight_stats(weight_sums(prox, behav, mask, cap=1.5))
    assert st["mean"] == pytest.approx(3.25 / 3) and st["max"] == pytest.approx(2.0)
    assert st["capped_frac"] == pytest.approx(1 / 3)
