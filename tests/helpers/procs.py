"""Processes by what their command line holds: what a test checks is gone after a run."""
import os
from pathlib import Path

# conftest sets it once per test session (each pytest-xdist worker its own): the processes a
# session starts inherit it, so a check for leftovers does not see another session's processes
SESSION = "RLSPEC_TEST_SESSION"


def processes_with(tag: bytes, this_session: bool = True) -> set[int]:
    """Live processes but this one whose command line holds `tag`: those of this test session
    (their environment holds its SESSION mark) or, with this_session=False, any (a process that
    does not inherit the environment, a sandboxed program)."""
    mark = f"\0{SESSION}={os.environ[SESSION]}\0".encode()
    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            if tag in Path(f"/proc/{d}/cmdline").read_bytes() and \
                    (not this_session or mark in b"\0" + Path(f"/proc/{d}/environ").read_bytes()):
                out.add(int(d))
        except OSError:
            continue
    return out
