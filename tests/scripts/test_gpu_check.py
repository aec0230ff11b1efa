"""`make gpu-check` (scripts/gpu_check.py) runs here, on CPU (with -m slow: `make test-all`), so it
keeps working for the first GPU run: every check passes and the JSON holds the figures."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow  # the default suite stays under 30 minutes on 2 cores
def test_gpu_check_passes_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    p = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(out), "--samples", "600"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    r = json.loads(out.read_text())
    assert r["passed"] and len(r["checks"]) == 6 and all(c["passed"] for c in r["checks"])
    assert r["platform"]["engine_dtype"] == "float32" and r["platform"]["device"] == "cpu"
    step = next(c for c in r["checks"] if c["check"].startswith("GRPO step"))
    assert step["policy_version"] == 1 and step["logprob_mismatch"] < 1e-3
    assert "all passed" in p.stdout
