"""Model Runner V2, the runner vLLM picks on a GPU for draft models, EAGLE-3, MTP and rlspec's
device drafter, run on this CPU: vLLM's CPU V2 runner with its Triton kernels in Triton's
interpreter (tests/helpers/v2_on_cpu.py), a Generator on it as a run builds one
(tests/helpers/v2_engine.py, a child process each)."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, child_env

pytest.importorskip("vllm")


def _run(runner: str, *overrides: str) -> dict:
    env = {**child_env(), "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "v2_engine.py"), runner, *overrides],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    info = out["runner"]   # no silent fallback to the other runner, to async scheduling, to other ranks
    assert (info["model_runner"], info["async_scheduling"], info["executor"], info["tensor_parallel_size"]) == \
           (runner, False, "uni", 1), info
    return out


@pytest.mark.slow  # two engines, about 30 s each
def test_the_device_drafter_on_model_runner_v2_is_exact_and_drafts_from_history():
    """Greedy: V2 with rlspec's device drafter in its ngram_gpu slot answers as V1 without
    speculation on both calls; the second call drafts from the first's answers (recorded by the
    Generator) and accepts more; the four prompts are no one's siblings."""
    base = _run("V1")
    dev = _run("V2", "speculation=history", "speculation.history.drafter=device")
    assert dev["runner"]["speculation"] == "ngram_gpu"
    want = base["calls"][0]["answers"]
    assert [c["answers"] for c in dev["calls"]] == [want, want]
    first, second = (c["history"] for c in dev["calls"])
    print(f"V2, device drafter: accepted tokens {dev['calls'][0]['accepted']} then {dev['calls'][1]['accepted']}; "
          f"counters {first} / {second}")
    assert second["accepted_history"] > 0 and dev["calls"][1]["accepted"] > dev["calls"][0]["accepted"]
    assert first["drafted_siblings"] == second["drafted_siblings"] == 0
