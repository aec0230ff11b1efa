"""Ports for listeners started later (a learner rendezvous, a refit group): probed free now, bound by
another process a moment later."""
from __future__ import annotations

import random
import socket

# Ray's workers listen on 10002-19999 by default; the probe stays above them.
_PROBE_FLOOR = 20000
_TRIES = 64


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The OS's range for ports it hands to outgoing connections and port-0 binds (Linux's
    default where the file is absent)."""
    try:
        with open(path) as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on this host now. Drawn below the OS's ephemeral range where there is room: a
    port the OS chose (binding port 0) may be handed to any process's next outgoing connection (Ray's
    and vLLM's processes open many) between this probe and the listener's bind, which then fails
    with EADDRINUSE. Falls back to a port the OS chooses where the range leaves no room below it."""
    lo, _ = ephemeral_range()
    candidates = range(_PROBE_FLOOR, lo)
    for port in random.SystemRandom().sample(candidates, min(_TRIES, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def endpoint() -> tuple[str, int]:
    """(this node's IP, a port free on it) for a rendezvous another process on this node binds."""
    import ray

    return ray.util.get_node_ip_address(), free_port("")
