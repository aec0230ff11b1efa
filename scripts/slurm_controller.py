"""A throwaway slurm controller on this machine, shaped like a GB200 cluster, to check job scripts
against the real slurmctld: `sbatch --test-only` validates every #SBATCH directive and says where
the job would start, without running anything.

    python scripts/slurm_controller.py --nodes 8 --gpus-per-node 4 -- \\
        sbatch --test-only slurm/multi_node.sbatch +experiment=rl_zero_qwen3_8b

It starts munged and slurmctld from Debian's packages (`apt-get install slurmctld slurm-client
munge`) in a temporary folder, on free loopback ports, with `--nodes` cloud nodes of
`--gpus-per-node` GPUs (cloud nodes in power save count as available, so no slurmd is needed),
runs the command with SLURM_CONF pointing at it, prints its output and exits with its status.
Both daemons are stopped on the way out; every wait is bounded.
"""
from __future__ import annotations

import argparse
import getpass
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "sbatch", "sinfo")
INSTALL = "apt-get install slurmctld slurm-client munge"


def missing() -> list[str]:
    """The programs this needs that are not on PATH (munged and slurmctld live in /usr/sbin)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [d for d in DAEMONS if shutil.which(d, path=path) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(d: Path, nodes: int, gpus: int, cpus: int, memory_mb: int) -> str:
    user = getpass.getuser()
    names = f"gb200-[{1:04d}-{nodes:04d}]" if nodes > 1 else "gb200-0001"
    return "\n".join([
        "ClusterName=rlspec-check",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "AuthType=auth/munge",
        f"AuthInfo=socket={d / 'munge' / 'socket'}",
        "CredType=cred/munge",
        f"SlurmUser={user}",
        f"StateSaveLocation={d / 'state'}",
        f"SlurmdSpoolDir={d / 'spool'}",
        f"SlurmctldPidFile={d / 'slurmctld.pid'}",
        f"SlurmctldLogFile={d / 'slurmctld.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        # cloud nodes, powered down until a job needs them: schedulable without a slurmd
        "SuspendProgram=/bin/true",
        "ResumeProgram=/bin/true",
        "SuspendTime=600",
        "ResumeTimeout=600",
        f"NodeName={names} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb}"
        + (f" Gres=gpu:{gpus}" if gpus else "") + " State=CLOUD",
        "PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ""])


def _stop(p: subprocess.Popen | None) -> None:
    if p is None or p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(timeout=10)


@contextmanager
def controller(nodes: int, gpus_per_node: int, cpus: int = 72, memory_mb: int = 800_000,
               timeout_s: float = 30.0):
    """Yield the environment (SLURM_CONF set) of a running controller with `nodes` nodes."""
    gone = missing()
    if gone:
        raise RuntimeError(f"{', '.join(gone)} not found: {INSTALL}")
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    # a short path: munge's socket name must fit in a unix socket address
    d = Path(tempfile.mkdtemp(prefix="rlspec-slurm-", dir="/tmp"))
    munged = ctld = None
    try:
        for sub in ("munge", "state", "spool"):
            (d / sub).mkdir(mode=0o700)
        key = d / "munge" / "key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o600)
        (d / "slurm.conf").write_text(_conf(d, nodes, gpus_per_node, cpus, memory_mb))
        env = {**os.environ, "PATH": path, "SLURM_CONF": str(d / "slurm.conf")}
        log = open(d / "daemons.log", "w")
        munged = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={d / 'munge' / 'socket'}", f"--key-file={key}",
             f"--log-file={d / 'munged.log'}", f"--pid-file={d / 'munge' / 'pid'}",
             f"--seed-file={d / 'munge' / 'seed'}"], env=env, stdout=log, stderr=subprocess.STDOUT)
        ctld = subprocess.Popen(["slurmctld", "-D", "-i"], env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            ok = subprocess.run(["sinfo", "-h"], env=env, capture_output=True, text=True, timeout=timeout_s)
            if ok.returncode == 0 and ok.stdout.strip():
                break
            if time.monotonic() > deadline or ctld.poll() is not None or munged.poll() is not None:
                logs = "".join((d / f).read_text()[-2000:] for f in ("daemons.log", "slurmctld.log", "munged.log")
                               if (d / f).exists())
                raise RuntimeError(f"slurmctld did not answer within {timeout_s:.0f} s:\n{logs}")
            time.sleep(0.2)
        yield env
    finally:
        _stop(ctld)
        _stop(munged)
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=4)
    p.add_argument("--cpus-per-node", type=int, default=72)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the daemons and for the command")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command (sbatch --test-only ...)")
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("give the command to run after --")
    try:
        with controller(a.nodes, a.gpus_per_node, a.cpus_per_node, timeout_s=a.timeout) as env:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    except RuntimeError as e:
        print(f"slurm_controller: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
