"""Calls to actors and the one bounded wait for their results. No Ray import at module level: the
driver imports this before Ray starts."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable


class Abandoned(Exception):
    """A stop request (`abort`) arrived while the driver waited on calls that may be redone."""


class ActorFailure(RuntimeError):
    """An actor died, raised, or did not answer in time; the message names it."""


@dataclass
class Call:
    actor: str    # role name, e.g. "learner[0]"
    method: str
    ref: Any      # ray.ObjectRef (None for a fan-out)
    # A fan-out over several actors: `wait` returns combine([result of each part]).
    parts: list["Call"] = field(default_factory=list)
    combine: Callable[[list], Any] | None = None


def remote(actor: str, handle: Any, method: Callable, *args, **kwargs) -> Call:
    """`method` of the actor behind `handle`, named by the worker class's own function
    (`remote("generator", h, Generator.generate, ...)`), so an editor follows the call."""
    name = method.__name__
    return Call(actor, name, getattr(handle, name).remote(*args, **kwargs))


def fan_out(name: str, method: str, parts: list[Call], combine: Callable[[list], Any]) -> Call:
    return Call(name, method, None, parts, combine)


def wait(calls: Call | list[Call], timeout_s: float, abort: Callable[[], bool] | None = None) -> Any:
    """Results of `calls` in order. The first failure, or silence past `timeout_s` in total,
    raises ActorFailure naming the actor, the method and the cause; `abort()` turning true (checked
    every second) raises Abandoned, leaving the calls running."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    from rlspec.messages import PeerDied, error_line

    single = isinstance(calls, Call)
    calls = [calls] if single else calls
    leaves = [p for c in calls for p in (c.parts or [c])]
    by_ref = {c.ref: c for c in leaves}
    pending = list(by_ref)
    deadline = time.monotonic() + timeout_s
    while pending:
        if abort is not None and abort():
            raise Abandoned()
        left = deadline - time.monotonic()
        # Short slices: signal handlers run (and abort is seen) while the driver waits.
        ready, pending = ray.wait(pending, num_returns=1, timeout=min(max(left, 0), 1.0))
        if not ready and left > 1.0:
            continue
        if not ready:
            names = ", ".join(f"{by_ref[r].actor}.{by_ref[r].method}" for r in pending)
            raise ActorFailure(f"{names} did not answer within {timeout_s:.0f}s "
                               "(cluster.actor_timeout_s)")
        c = by_ref[ready[0]]
        try:
            ray.get(ready[0], timeout=0)
        except RayActorError as e:
            raise ActorFailure(f"{c.actor} died during {c.method}: {error_line(e)}") from None
        except RayTaskError as e:
            cause = e.cause or e
            if isinstance(cause, PeerDied):
                raise ActorFailure(f"{cause.actor} died during {cause.method} (seen by {c.actor}.{c.method}): "
                                   f"{cause.detail}") from None
            raise ActorFailure(f"{c.actor} raised in {c.method}: {error_line(cause)}") from None
        except GetTimeoutError:
            raise ActorFailure(f"{c.actor}.{c.method} did not answer") from None
    got = dict(zip(by_ref, ray.get(list(by_ref))))
    results = [c.combine([got[p.ref] for p in c.parts]) if c.parts else got[c.ref] for c in calls]
    return results[0] if single else results
