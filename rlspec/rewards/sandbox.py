"""Run model-written Python against stdin inputs in a sandboxed subprocess.

Layers, outermost first (each would stop the escape tests on its own where noted):
- a fresh temporary directory as the only writable place and the working directory; the
  environment is replaced (PATH, LANG, HOME/TMPDIR = the sandbox), so no secret reaches it;
- `unshare --user --map-root-user --net --mount --pid --fork` when an unprivileged process may
  create namespaces (`isolation='namespace'`): no network interface but a downed loopback, a
  chroot holding only read-only system libraries, Python and the sandbox (no project files, no
  home directories, no /proc), and its own pid namespace, so killing its first process kills
  every process the program started, `setsid` or not;
- otherwise (`isolation='audit'`, the documented fallback) the process runs in its own session
  and, when started as root, as user nobody (if nobody can run the interpreter); the audit hook
  below is then the file/network fence;
- in both modes an audit hook in the interpreter refuses files outside the sandbox, sockets,
  new processes, signals, ctypes and rlimit changes (sandbox_boot.py);
- rlimits: CPU seconds, address space, file size (caps output), open files, no core dumps, and
  a process count (for non-root users);
- a wall-clock timeout after which the whole process group and every descendant get SIGKILL.
"""
from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BOOT = Path(__file__).with_name("sandbox_boot.py")
UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child"]
NOBODY = 65534


@dataclass
class Limits:
    wall_s: float = 10.0           # the whole run, all test inputs
    per_test_s: float = 2.0        # one input (SIGALRM inside; the wall timeout backs it up)
    cpu_s: int = 10
    memory_bytes: int = 1 << 30    # address space
    output_bytes: int = 1 << 20    # per test's captured stdout, and the results file
    open_files: int = 64
    processes: int = 64            # RLIMIT_NPROC, for non-root users only (root ignores it)


@dataclass
class SandboxResult:
    outputs: list[str | None]  # per input: captured stdout, None when that input failed
    statuses: list[str]        # per input: ok, exit, timeout, an exception name, or 'killed'
    timed_out: bool
    isolation: str
    seconds: float


@functools.lru_cache(maxsize=1)
def namespaces_available() -> bool:
    """Whether this process may build the namespace sandbox (user namespaces enabled)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _python_dirs() -> list[str]:
    """Directories the interpreter needs: its real binary's prefix and the stdlib."""
    dirs = {os.path.realpath(sys.base_prefix), os.path.realpath(sysconfig.get_paths()["stdlib"])}
    return sorted(dirs)


def _world_executable(path: str) -> bool:
    """Whether user nobody could run `path` (every parent directory searchable by others)."""
    p = Path(path)
    return all(os.stat(d).st_mode & 0o001 for d in p.parents) and bool(os.stat(p).st_mode & 0o001)


def _limit(limits: Limits, drop_to_nobody: bool):
    def preexec() -> None:
        os.setsid()
        for res, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_bytes),
                           (resource.RLIMIT_FSIZE, limits.output_bytes + 4096),
                           (resource.RLIMIT_NOFILE, limits.open_files), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(res, (value, value))
        if drop_to_nobody:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        if os.geteuid() != 0:
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    return preexec


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the process group and every descendant (found before any of them dies)."""
    pids = _descendants(proc.pid)
    for sig_target in (lambda: os.killpg(proc.pid, signal.SIGKILL), *(
            functools.partial(os.kill, p, signal.SIGKILL) for p in pids)):
        try:
            sig_target()
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def run_python(source: str, inputs: list[str], limits: Limits | None = None, isolation: str = "auto",
               audit_hook: bool = True) -> SandboxResult:
    """Run `source` once per stdin in `inputs`, sandboxed; never raises on the program's behaviour."""
    limits = limits or Limits()
    if isolation == "auto":
        isolation = "namespace" if namespaces_available() else "audit"
    t0 = time.perf_counter()
    top = tempfile.mkdtemp(prefix="rlspec-sandbox-")
    try:
        work = os.path.join(top, "work")
        os.mkdir(work)
        Path(work, "main.py").write_text(source, encoding="utf-8", errors="replace")
        Path(work, "inputs.json").write_text(json.dumps(inputs))
        python = os.path.realpath(sys.executable)
        drop = isolation == "audit" and os.geteuid() == 0 and _world_executable(python)
        if drop:
            for p in (top, work, *(os.path.join(work, f) for f in os.listdir(work))):
                os.chown(p, NOBODY, NOBODY)
        cmd = [python, "-I", "-S", "-B", "-c", BOOT.read_text(), top, isolation, "1" if audit_hook else "0",
               str(limits.per_test_s), str(limits.output_bytes), *_python_dirs()]
        if isolation == "namespace":
            cmd = [*UNSHARE, *cmd]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.DEVNULL,
                                    cwd=work, env=env, preexec_fn=_limit(limits, drop), close_fds=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_all(proc)  # also when it exited: a child it left behind must not outlive it
            out.seek(0)
            raw = out.read(limits.output_bytes * (len(inputs) + 1) + 4096)
        results = _parse(raw, len(inputs))
    finally:
        shutil.rmtree(top, ignore_errors=True)
    if results is None:
        results = [{"status": "timeout" if timed_out else "killed", "stdout": None}] * len(inputs)
    return SandboxResult([r["stdout"] if r["status"] == "ok" else None for r in results],
                         [r["status"] for r in results], timed_out, isolation, time.perf_counter() - t0)


def _parse(raw: bytes, n: int) -> list[dict] | None:
    """The boot script's one JSON line; anything else (crash, garbage on fd 1) is None."""
    try:
        lines = raw.decode("utf-8", errors="replace").strip().splitlines()
        results = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    if not isinstance(results, list) or len(results) != n or not all(
            isinstance(r, dict) and isinstance(r.get("status"), str) and isinstance(r.get("stdout"), str)
            for r in results):
        return None
    return results
