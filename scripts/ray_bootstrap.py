"""Start a Ray cluster and run `python -m rlspec.train` on it: the logic behind
slurm/multi_node.sbatch, runnable without slurm.

    python scripts/ray_bootstrap.py [options] -- HYDRA_OVERRIDES...

Roles (--role, default auto):
- head: starts the Ray head, waits until --nodes nodes have joined (--join-timeout), runs the
  driver with the user's overrides plus cluster.address/nodes/gpus_per_node, stops Ray after;
- worker: joins the head and serves until the head goes away;
- local: no srun step: starts the head and --nodes - 1 workers on this machine (loopback), then
  runs the driver as the head does. `--dry-run` in the overrides skips Ray and prints the plan.
auto is head or worker inside a slurm step (SLURM_STEP_ID, SLURM_NODEID), local otherwise.

SIGTERM and SIGUSR1 (slurm's preemption notice) are passed to the driver, which checkpoints and
exits with 3 (preempted); the head then requeues the slurm job (`scontrol requeue`).
Exit codes: the driver's (0 done, 1 actor failure, 2 bad input, 3 preempted, 4 numerical stop), 5 the cluster did
not come up (Ray failed to start or nodes did not join in time), 128+N killed by signal N.
Extra overrides also come from RLSPEC_OVERRIDES (shell-quoted). Logs: --log-dir/node<i>-<host>.log.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXIT_PREEMPTED, EXIT_NO_CLUSTER = 3, 5
ROOT = Path(__file__).resolve().parents[1]


class ClusterError(RuntimeError):
    """The Ray cluster did not come up; the message says which node and where its log is."""


def log(msg: str, file=None) -> None:
    line = f"rlspec bootstrap [{socket.gethostname()}]: {msg}"
    print(line, file=sys.stderr, flush=True)
    if file is not None:
        file.write(line + "\n")
        file.flush()


def parse_args(argv: list[str]) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["auto", "head", "worker", "local"], default="auto")
    p.add_argument("--nodes", type=int, default=int(env.get("SLURM_NNODES", 1)))
    p.add_argument("--gpus-per-node", type=int, default=int(env.get("RLSPEC_GPUS_PER_NODE", 0)))
    p.add_argument("--cpus-per-node", type=int, default=None,
                   help="CPUs each Ray node offers (default: SLURM_CPUS_ON_NODE, or this machine's / nodes)")
    p.add_argument("--head", default=None, help="head host (default: first host of SLURM_JOB_NODELIST)")
    p.add_argument("--port", type=int, default=int(env.get("RLSPEC_RAY_PORT", 6379)))
    p.add_argument("--join-timeout", type=float, default=float(env.get("RLSPEC_JOIN_TIMEOUT", 300)))
    p.add_argument("--log-dir", default=env.get("RLSPEC_LOG_DIR"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides for rlspec.train")
    a = p.parse_args(argv)
    a.overrides = [o for o in a.overrides if o != "--"] + shlex.split(env.get("RLSPEC_OVERRIDES", ""))
    if a.role == "auto":
        in_step = "SLURM_STEP_ID" in env and "SLURM_NODEID" in env
        a.role = ("head" if env["SLURM_NODEID"] == "0" else "worker") if in_step else "local"
    a.node_index = int(env.get("SLURM_NODEID", 0)) if a.role in ("head", "worker") else 0
    if a.log_dir is None:
        a.log_dir = str(ROOT / "logs" / f"rlspec-{env.get('SLURM_JOB_ID', time.strftime('%Y%m%d-%H%M%S'))}")
    return a


def expand_nodelist(nodelist: str) -> list[str]:
    """'gpu[01-03,7],login' -> ['gpu01', 'gpu02', 'gpu03', 'gpu7', 'login'] (slurm's compact form)."""
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return hosts


def head_host(a: argparse.Namespace) -> str:
    if a.head:
        return a.head
    if a.role == "local":
        return "127.0.0.1"
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ClusterError("no --head and no SLURM_JOB_NODELIST: cannot tell where the Ray head runs")
    return expand_nodelist(nodelist)[0]


def has_override(overrides: list[str], key: str) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def driver_command(a: argparse.Namespace, address: str | None) -> list[str]:
    """rlspec.train with the user's overrides; the allocation's shape unless the user set it."""
    ours = {"cluster.address": address, "cluster.nodes": a.nodes, "cluster.gpus_per_node": a.gpus_per_node}
    extra = [f"{k}={v}" for k, v in ours.items() if v is not None and not has_override(a.overrides, k)]
    return [a.python, "-m", "rlspec.train", *a.overrides, *extra]


def is_dry_run(overrides: list[str]) -> bool:
    return "--dry-run" in overrides or "cluster.dry_run=true" in overrides


class RayNode:
    """`ray start --block` as a child in its own session, so stopping it stops every Ray
    process it started (and nothing else on the machine)."""

    def __init__(self, args: list[str], log_path: Path):
        self.log_path = log_path
        self.logf = open(log_path, "a")
        env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
        ray = str(Path(sys.executable).with_name("ray"))
        self.proc = subprocess.Popen([ray if os.path.exists(ray) else "ray", "start", "--block",
                                      "--disable-usage-stats", *args], stdout=self.logf,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # ray's daemons outlive `ray start` for a while after SIGTERM
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.logf.close()


def node_args(a: argparse.Namespace, ip: str | None, cpus: int) -> list[str]:
    """ip None: Ray picks this node's address itself."""
    return [*([f"--node-ip-address={ip}"] if ip else []), f"--num-cpus={cpus}", f"--num-gpus={a.gpus_per_node}"]


def cpus_per_node(a: argparse.Namespace) -> int:
    if a.cpus_per_node:
        return a.cpus_per_node
    if a.role != "local" and os.environ.get("SLURM_CPUS_ON_NODE"):
        return int(os.environ["SLURM_CPUS_ON_NODE"])
    return max(1, (os.cpu_count() or 1) // (a.nodes if a.role == "local" else 1))


def wait_for_nodes(address: str, want: int, timeout_s: float, nodes: list[RayNode]) -> None:
    """Block until `want` Ray nodes are alive; ClusterError names what is missing."""
    import ray

    deadline, alive = time.monotonic() + timeout_s, 0
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        while True:  # counted at least once, however long connecting took on a loaded machine
            dead = [n for n in nodes if not n.alive()]
            if dead:
                raise ClusterError(f"a Ray node process exited with {dead[0].proc.returncode} before the cluster "
                                   f"came up; see {dead[0].log_path}")
            alive = sum(n["Alive"] for n in ray.nodes())
            if alive >= want:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(1.0)
    finally:
        ray.shutdown()
    raise ClusterError(f"only {alive} of {want} nodes joined the Ray head at {address} within {timeout_s:.0f}s "
                       "(--join-timeout / RLSPEC_JOIN_TIMEOUT); check the per-node logs for the missing ones")


def run_driver(cmd: list[str], logf) -> int:
    """The driver in the foreground; SIGTERM/SIGUSR1/SIGINT reach it, its exit code comes back."""
    log("driver: " + shlex.join(cmd), logf)
    proc = subprocess.Popen(cmd, cwd=ROOT)
    forward = lambda sig, _frame: proc.send_signal(sig)  # noqa: E731
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def requeue(logf) -> None:
    job = os.environ.get("SLURM_JOB_ID")
    if job and shutil.which("scontrol"):
        log(f"driver preempted (exit {EXIT_PREEMPTED}): checkpoint written, requeueing slurm job {job}", logf)
        subprocess.run(["scontrol", "requeue", job], check=False, timeout=60)
    else:
        log(f"driver preempted (exit {EXIT_PREEMPTED}): checkpoint written; no slurm job to requeue, "
            "rerun the same command to resume", logf)


def run_head(a: argparse.Namespace, logs: Path, logf) -> int:
    local = a.role == "local"
    host = head_host(a)
    ip = "127.0.0.1" if local else socket.gethostbyname(host)
    address = f"{ip}:{a.port}"
    cpus = cpus_per_node(a)
    tmp = tempfile.mkdtemp(prefix="rlspec-ray-", dir="/tmp")  # Ray's socket paths must stay short
    log(f"{a.role} mode: Ray head at {address}, waiting for {a.nodes} node(s) of {cpus} CPUs and "
        f"{a.gpus_per_node} GPUs; logs in {logs}", logf)
    nodes = [RayNode(["--head", f"--port={a.port}", f"--temp-dir={tmp}", "--include-dashboard=false",
                      *node_args(a, ip, cpus)], logs / f"node0-{socket.gethostname()}.log")]
    try:
        if local:  # the other "nodes" are Ray node processes on this machine
            time.sleep(2.0)
            nodes += [RayNode([f"--address={address}", *node_args(a, ip, cpus)],
                              logs / f"node{i}-{socket.gethostname()}.log") for i in range(1, a.nodes)]
        wait_for_nodes(address, a.nodes, a.join_timeout, nodes)
        log(f"all {a.nodes} node(s) joined", logf)
        rc = run_driver(driver_command(a, address), logf)
    finally:
        for n in reversed(nodes):
            n.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if rc == EXIT_PREEMPTED:
        requeue(logf)
    log(f"driver exited with {rc}", logf)
    return rc


def head_reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def run_worker(a: argparse.Namespace, logs: Path, logf, grace_s: float = 30.0) -> int:
    """Join the head (retrying until --join-timeout) and serve until it has been gone grace_s."""
    host = head_host(a)
    deadline = time.monotonic() + a.join_timeout
    while not head_reachable(host, a.port):
        if time.monotonic() > deadline:
            raise ClusterError(f"Ray head {host}:{a.port} not reachable within {a.join_timeout:.0f}s")
        time.sleep(2.0)
    node = RayNode([f"--address={socket.gethostbyname(host)}:{a.port}", *node_args(a, None, cpus_per_node(a))],
                   logs / f"node{a.node_index}-{socket.gethostname()}.log")
    log(f"worker {a.node_index} joining {host}:{a.port}", logf)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the preemption notice is the head's business
    gone_since = None
    try:
        while node.alive():
            if head_reachable(host, a.port):
                gone_since = None
            elif gone_since is None:
                gone_since = time.monotonic()
            elif time.monotonic() - gone_since > grace_s:
                log("head is gone: stopping this node", logf)
                return 0
            time.sleep(5.0)
        raise ClusterError(f"Ray node exited with {node.proc.returncode}; see {node.log_path}")
    finally:
        node.stop()


def _exit_on_signal(sig, _frame):
    raise SystemExit(128 + sig)  # unwinds, so every Ray node this script started is stopped


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, _exit_on_signal)
    if a.role == "local" and is_dry_run(a.overrides):
        log(f"local mode, dry run: {a.nodes} node(s) x {a.gpus_per_node} GPUs, no Ray started")
        return run_driver(driver_command(a, None), None)
    logs = Path(a.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"bootstrap-node{a.node_index}-{socket.gethostname()}.log", "a") as logf:
        try:
            return run_worker(a, logs, logf) if a.role == "worker" else run_head(a, logs, logf)
        except ClusterError as e:
            log(f"error: {e}", logf)
            return EXIT_NO_CLUSTER


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
