"""Ray placement and bounded waits. The only module that knows actors are Ray actors: workers are
plain classes wrapped with `ray.remote` here, so tests can build them without Ray."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from rlspec.config import RLSpecConfig


class ActorFailure(RuntimeError):
    """An actor died, raised, or did not answer in time; the message names it."""


@dataclass
class Call:
    actor: str    # role name, e.g. "learner[0]"
    method: str
    ref: Any      # ray.ObjectRef


@dataclass
class Actors:
    generator: Any
    logprob: Any
    learners: list[Any]
    timeout_s: float
    names: dict[int, str] = field(default_factory=dict)

    def call(self, handle: Any, name: str, method: str, *args, **kwargs) -> Call:
        return Call(name, method, getattr(handle, method).remote(*args, **kwargs))

    def gen(self, method: str, *args, **kwargs) -> Call:
        return self.call(self.generator, "generator", method, *args, **kwargs)

    def lp(self, method: str, *args, **kwargs) -> Call:
        return self.call(self.logprob, "logprob_worker", method, *args, **kwargs)

    def learn(self, method: str, *args, **kwargs) -> list[Call]:
        """The same call on every learner rank."""
        return [self.call(h, f"learner[{r}]", method, *args, **kwargs) for r, h in enumerate(self.learners)]

    def learn_sharded(self, method: str, per_rank_args: list[tuple]) -> list[Call]:
        """Rank r gets per_rank_args[r]."""
        return [self.call(h, f"learner[{r}]", method, *per_rank_args[r]) for r, h in enumerate(self.learners)]


def wait(calls: Call | list[Call], timeout_s: float) -> Any:
    """Results of `calls` in order. The first failure, or silence past `timeout_s` in total,
    raises ActorFailure naming the actor, the method and the cause."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    single = isinstance(calls, Call)
    calls = [calls] if single else calls
    by_ref = {c.ref: c for c in calls}
    pending = list(by_ref)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
        if not ready:
            names = ", ".join(f"{by_ref[r].actor}.{by_ref[r].method}" for r in pending)
            raise ActorFailure(f"{names} did not answer within {timeout_s:.0f}s "
                               "(cluster.actor_timeout_s)")
        c = by_ref[ready[0]]
        try:
            ray.get(ready[0], timeout=0)
        except RayActorError as e:
            raise ActorFailure(f"{c.actor} died during {c.method}: {_first_line(e)}") from None
        except RayTaskError as e:
            raise ActorFailure(f"{c.actor} raised in {c.method}: {_first_line(e.cause or e)}") from None
        except GetTimeoutError:
            raise ActorFailure(f"{c.actor}.{c.method} did not answer") from None
    results = ray.get([c.ref for c in calls])
    return results[0] if single else results


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # Ray's messages start with context; the cause is usually the last non-empty line.
    return f"{type(e).__name__}: {lines[-1] if lines else text}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster:
    """Context manager: connects to cluster.address or starts a local Ray; shuts it down after."""

    def __init__(self, cfg: RLSpecConfig):
        self.cfg = cfg
        self.tmp: str | None = None

    def __enter__(self) -> "RayCluster":
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_DEDUP_LOGS", "1")
        c = self.cfg.cluster
        if c.address:
            ray.init(address=c.address, log_to_driver=True)
            return self
        # Ray's socket paths must stay short: keep its session directory out of the run dir.
        self.tmp = tempfile.mkdtemp(prefix="rlspec-ray-", dir="/tmp")
        needed = 2 + c.learner_world_size
        ray.init(num_cpus=max(c.num_cpus or os.cpu_count() or 1, needed), include_dashboard=False,
                 _temp_dir=self.tmp, object_store_memory=1 << 30, log_to_driver=True,
                 configure_logging=True, logging_level="WARNING")
        return self

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


def launch_actors(cfg: RLSpecConfig, model_dir: str, tokenizer_dir: str, draft_dir: str | None = None) -> Actors:
    """Start Generator, LogprobWorker and the learner ranks; wait until each is up."""
    import ray

    from rlspec.workers.generator import Generator
    from rlspec.workers.learner import Learner
    from rlspec.workers.logprob import LogprobWorker

    c, g, t = cfg.cluster, cfg.generation, cfg.trainer
    env_vars = {k: v for k, v in os.environ.items() if k.startswith(("HF_", "VLLM_", "TORCH_", "DS_", "TRANSFORMERS_"))}
    # Engine start-up chatter (tcmalloc hints, thread-binding notes) drowns the progress bar;
    # set VLLM_LOGGING_LEVEL=INFO to see it.
    env_vars.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env_vars.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
    env = {"env_vars": env_vars}
    threads = c.threads_per_actor
    opts = dict(num_cpus=1, max_restarts=0, runtime_env=env)
    generator = ray.remote(Generator).options(name="generator", num_gpus=0, **opts).remote(
        model_dir, g, cfg.speculation, cfg.model.max_model_len, t.seed, threads, tokenizer_dir, draft_dir)
    logprob = ray.remote(LogprobWorker).options(name="logprob_worker", num_gpus=0,
                                                 **opts).remote(
        model_dir, cfg.algo.kl_coef > 0, g.temperature, t.micro_batch_size, threads, cfg.model.trust_remote_code)
    samples = g.num_prompts_per_step * g.num_generations_per_prompt
    port = free_port()
    learners = [ray.remote(Learner).options(name=f"learner_{r}", num_gpus=0, **opts).remote(
        model_dir, cfg.algo, t, g.temperature, samples, r, c.learner_world_size, "127.0.0.1", port, threads,
        cfg.model.trust_remote_code) for r in range(c.learner_world_size)]
    actors = Actors(generator, logprob, learners, c.actor_timeout_s)
    wait([actors.gen("ping"), actors.lp("ping"), *actors.learn("ping")], c.actor_timeout_s)
    return actors
