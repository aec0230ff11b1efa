"""Runs inside the sandbox process (passed as `python -I -S -c SOURCE`; stdlib only, no rlspec
imports). argv: sandbox_dir, isolation ('namespace' | 'audit'), audit hook on ('1' | '0'),
per-test seconds, output byte cap, python prefix directories to expose read-only.

Namespace mode (we are root of a fresh user, mount, net and pid namespace): build a tmpfs root
holding only read-only binds of the system libraries and Python, plus the sandbox directory at
/sandbox, and chroot into it; the project, home directories and /proc do not exist there. Then,
in both modes, an audit hook refuses files outside the sandbox (reads: also the Python install),
sockets, new processes, signals, ctypes and rlimit changes. Each test's stdin is fed to a fresh
exec of main.py with stdout captured (bounded); the outputs go to fd 1 as one JSON line."""
import io
import json
import os
import signal
import sys

SANDBOX, ISOLATION, AUDIT = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
PER_TEST_S, OUTPUT_CAP = float(sys.argv[4]), int(sys.argv[5])
PY_DIRS = [d for d in sys.argv[6:] if d]


def _chroot_into_minimal_root() -> str:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
        1, 2, 4, 8, 32, 4096, 16384, 1 << 18)

    def mount(src, dst, fstype, flags, data=None):
        if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                      data and data.encode()) != 0:
            raise OSError(ctypes.get_errno(), f"mount {src} -> {dst}")

    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = os.path.join(SANDBOX, ".root")
    os.mkdir(root)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=755")
    binds = [(d, d, True) for d in ("/usr", "/lib", "/lib64", "/bin", *PY_DIRS) if os.path.isdir(d)]
    binds.append((os.path.join(SANDBOX, "work"), "/sandbox", False))
    for src, dst, read_only in binds:
        target = root + dst
        os.makedirs(target, exist_ok=True)
        mount(src, target, None, MS_BIND | MS_REC)
        if read_only:
            # A remount must repeat the flags the outer mount locks (nosuid, nodev, noexec).
            st = os.statvfs(src).f_flag
            locked = (MS_NOSUID if st & os.ST_NOSUID else 0) | (MS_NODEV if st & os.ST_NODEV else 0) | (
                MS_NOEXEC if st & os.ST_NOEXEC else 0)
            mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | locked)
    os.chroot(root)
    os.chdir("/sandbox")
    del sys.modules["ctypes"]
    return "/sandbox"


if ISOLATION == "namespace":
    WORK = _chroot_into_minimal_root()
else:
    WORK = os.path.join(SANDBOX, "work")
    os.chdir(WORK)

READ_ROOTS = [WORK, *(os.path.realpath(d) for d in PY_DIRS), "/usr/lib", "/usr/local/lib"]
DENY_EVENTS = ("socket.", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system",
               "subprocess.", "pty.", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.",
               "resource.setrlimit", "os.chroot", "mmap.", "sys.setprofile", "sys.settrace", "winreg.")
DENY_MODULES = {"ctypes", "_ctypes", "socket", "_socket", "_posixsubprocess", "subprocess", "multiprocessing",
                "_multiprocessing", "ssl", "_ssl", "select", "selectors", "asyncio", "pty", "resource"}


def _inside(path, roots) -> bool:
    p = os.path.realpath(path)
    return any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)


def _hook(event, args):
    if event.startswith(DENY_EVENTS):
        raise PermissionError(f"sandbox: {event} refused")
    if event == "import" and args[0].split(".")[0] in DENY_MODULES:
        raise PermissionError(f"sandbox: import {args[0]} refused")
    if event == "open" and isinstance(args[0], (str, bytes)):
        path = os.fsdecode(args[0])
        mode = args[1] if isinstance(args[1], str) else ""
        writing = any(c in mode for c in "wax+") or (isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR))
        if not _inside(path, [WORK] if writing else READ_ROOTS):
            raise PermissionError(f"sandbox: open {path!r} refused")
    if event in ("os.listdir", "os.scandir", "os.chdir", "os.symlink", "os.link", "os.rename", "os.remove",
                 "os.rmdir", "os.mkdir", "shutil.rmtree", "os.chmod", "os.chown", "os.truncate", "os.utime"):
        for a in args:
            if isinstance(a, (str, bytes)) and not _inside(os.fsdecode(a), [WORK]):
                raise PermissionError(f"sandbox: {event} {os.fsdecode(a)!r} refused")


class _Timeout(BaseException):
    pass


class _Capped(io.StringIO):
    def write(self, s):
        if self.tell() + len(s) > OUTPUT_CAP:
            raise MemoryError("sandbox: output cap reached")
        return super().write(s)


def _alarm(signum, frame):
    raise _Timeout()


def main() -> None:
    with open("main.py", encoding="utf-8") as f:
        code = compile(f.read(), "main.py", "exec")
    with open("inputs.json", encoding="utf-8") as f:
        inputs = json.load(f)
    real_stdout = sys.stdout
    signal.signal(signal.SIGALRM, _alarm)
    if AUDIT:
        sys.addaudithook(_hook)
    results = []
    for stdin in inputs:
        out = _Capped()
        sys.stdin, sys.stdout = io.StringIO(stdin), out
        status = "ok"
        signal.setitimer(signal.ITIMER_REAL, PER_TEST_S)
        try:
            exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as e:
            status = "ok" if e.code in (None, 0) else "exit"
        except _Timeout:
            status = "timeout"
        except BaseException as e:  # noqa: BLE001 - the program's own failure is a result
            status = type(e).__name__
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        results.append({"status": status, "stdout": out.getvalue()})
    sys.stdout = real_stdout
    real_stdout.write(json.dumps(results) + "\n")
    real_stdout.flush()


main()
