"""bench_rollout's MoE router: load-balanced where a random gate on raw hidden states is not."""
import sys

import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_rollout  # noqa: E402


def _hidden_states(n: int, dim: int = 64, seed: int = 0) -> torch.Tensor:
    """Router inputs shaped like a transformer's: a large direction every token shares, plus
    correlated variation of very different scales across dimensions."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) * torch.logspace(0, -2, dim)
    return 8.0 * torch.randn(dim, generator=g) + torch.randn(n, dim, generator=g) @ mix


def test_balanced_gate_spreads_tokens_over_the_experts():
    experts, top_k = 256, 2
    x = _hidden_states(6000)
    fit, held = x[:4000], x[4000:]   # the gate is fit on some tokens, judged on others
    g = torch.Generator().manual_seed(0)
    balanced = bench_rollout.balanced_gate(fit, experts, g)
    random = torch.randn(experts, fit.shape[1], generator=g)
    assert balanced.shape == (experts, fit.shape[1])
    # the mean direction is projected out: tokens' shared component moves no router logit
    assert (balanced @ fit.mean(0)).abs().max() < 1e-3 * (fit @ balanced.T).abs().mean()
    touched_bal = bench_rollout.experts_touched(held, balanced, top_k, tokens=256)
    touched_rnd = bench_rollout.experts_touched(held, random, top_k, tokens=256)
    uniform = experts * (1 - (1 - top_k / experts) ** 256)   # 222 of 256
    assert touched_bal > 0.8 * uniform > 2 * touched_rnd
