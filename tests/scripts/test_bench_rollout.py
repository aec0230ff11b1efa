"""bench_rollout: its MoE router (load-balanced where a random gate on raw hidden states is not), and
its tail bookkeeping (decode seconds by running batch, figures by hand)."""
import torch

import bench_rollout


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


def test_decode_seconds_by_running_batch_and_the_tail_table():
    steps = [(48, 1.0), (20, 0.5), (16, 0.25), (5, 0.25), (4, 0.5), (2, 0.5), (1, 1.0), (1, 2.0)]
    assert bench_rollout.by_running(steps) == {"1": 3.0, "2-4": 1.0, "5-16": 0.5, "17+": 1.5}
    rec = lambda method, secs: {"method": method, "k": 5, "batch_size": 48,  # noqa: E731
                                "decode_seconds_by_running": dict(zip(bench_rollout.RUNNING_BUCKETS, secs))}
    text = bench_rollout.tail_table([rec("none", [3.0, 1.0, 0.5, 1.5]), rec("history", [0.0, 0.0, 0.0, 0.0])])
    assert "| 48 | none | 5 | 3.00 s (50%) | 1.00 s (17%) | 0.50 s (8%) | 1.50 s (25%) | 6.00 |" in text
    assert "| 48 | history | 5 | - | - | - | - | 0.00 |" in text  # no decode steps recorded: no shares
