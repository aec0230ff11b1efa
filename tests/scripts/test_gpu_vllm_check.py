"""scripts/gpu_vllm_check.py, the one prepared check of vLLM's engine on a GPU: a run cut short
keeps what ran. The whole check runs on the CPU engine in tests/scripts/test_gpu_kit_shadow.py,
where only the lent machine's packages and the kit are importable."""
import json
import subprocess
import sys
import time

from conftest import ROOT


def test_a_killed_check_keeps_the_checks_that_ran(tmp_path):
    """SIGKILL once the JSON holds the first check: it still parses and holds it."""
    out = tmp_path / "check.json"
    p = subprocess.Popen([sys.executable, "scripts/gpu_vllm_check.py", "--out", str(out), "--methods", ""], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    try:
        while not (out.exists() and json.loads(out.read_text())["checks"]):
            assert p.poll() is None and time.monotonic() - t0 < 600, "no check written"
            time.sleep(0.2)
    finally:
        p.kill()
        p.wait()
    r = json.loads(out.read_text())
    assert not r["complete"] and not r["passed"]
    assert r["checks"][0]["check"].startswith("runner") and r["checks"][0]["passed"], r["checks"]


def test_the_stop_marks_the_running_check_interrupted_and_writes_it(tmp_path):
    out = tmp_path / "check.json"
    p = subprocess.run([sys.executable, "scripts/gpu_vllm_check.py", "--out", str(out), "--stop-s", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 3, (p.stdout + p.stderr)[-3000:]
    r = json.loads(out.read_text())
    assert [c["check"].split(":")[0] for c in r["checks"]] == ["runner"] and r["checks"][0]["interrupted"], r
    assert "STOPPED at --stop-s 0: runner" in p.stdout
