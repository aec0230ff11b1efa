"""Processes by what their command line holds: what a test checks is gone after a run."""
import os
from pathlib import Path


def processes_with(tag: bytes) -> set[int]:
    """Live processes but this one whose command line holds `tag`."""
    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            if tag in Path(f"/proc/{d}/cmdline").read_bytes():
                out.add(int(d))
        except OSError:
            continue
    return out
