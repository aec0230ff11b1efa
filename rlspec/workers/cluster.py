"""Ray placement and bounded waits. The only module that knows actors are Ray actors: workers are
plain classes wrapped with `ray.remote` here, so tests can build them without Ray."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rlspec.config import RLSpecConfig, recompute_logprobs, resolve_auto


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


def fan_out(name: str, method: str, parts: list[Call], combine: Callable[[list], Any]) -> Call:
    return Call(name, method, None, parts, combine)


@dataclass
class Actors:
    """Every actor of a run. Several Generator engines and LogprobWorkers look like one: prompts
    and batch rows are spread across them and the results joined (rlspec/workers/fanout.py)."""
    generators: list[Any]
    logprobs: list[Any]
    learners: list[Any]
    timeout_s: float
    refit_mode: str = "object_store"
    nodes: dict[str, str] = field(default_factory=dict)  # actor name -> Ray node ID
    draft_trainer: Any = None  # online draft adaptation (speculation.online.enabled)

    @property
    def generator(self) -> Any:
        return self.generators[0]

    def call(self, handle: Any, name: str, method: str, *args, **kwargs) -> Call:
        return Call(name, method, getattr(handle, method).remote(*args, **kwargs))

    def gen(self, method: str, *args, **kwargs) -> Call:
        """generate: prompts (args[0]) spread over the engines, rollouts joined in prompt order;
        any other method: called on every engine, the first engine's answer returned."""
        hs = self.generators
        if method == "generate" and len(hs) > 1:
            from rlspec.workers import fanout  # torch: not imported before the driver starts Ray

            parts = [self.call(hs[e], f"generator[{e}]", method, args[0][lo:hi], *args[1:], **kwargs)
                     for e, (lo, hi) in enumerate(fanout.split(len(args[0]), len(hs))) if hi > lo]
            return fan_out("generator", method, parts, fanout.merge_rollouts)
        parts = [self.call(h, f"generator[{e}]" if len(hs) > 1 else "generator", method, *args, **kwargs)
                 for e, h in enumerate(hs)]
        return parts[0] if len(parts) == 1 else fan_out("generator", method, parts, lambda rs: rs[0])

    def lp(self, method: str, *args, **kwargs) -> Call:
        """compute_logprobs: batch rows spread over the workers and joined; other methods: all."""
        hs = self.logprobs
        if method == "compute_logprobs" and len(hs) > 1:
            from rlspec.workers import fanout

            parts = [self.call(h, f"logprob_worker[{r}]", method, args[0].shard(r, len(hs)), *args[1:], **kwargs)
                     for r, h in enumerate(hs)]
            return fan_out("logprob_worker", method, parts, fanout.merge_logprobs)
        parts = [self.call(h, f"logprob_worker[{r}]" if len(hs) > 1 else "logprob_worker", method, *args, **kwargs)
                 for r, h in enumerate(hs)]
        return parts[0] if len(parts) == 1 else fan_out("logprob_worker", method, parts, lambda rs: rs[0])

    def lp_each(self, method: str, *args, **kwargs) -> list[Call]:
        """lp(method) as a list to wait on with others: empty when no log-prob workers run (a run
        that recomputes nothing starts none)."""
        return [self.lp(method, *args, **kwargs)] if self.logprobs else []

    def learn(self, method: str, *args, **kwargs) -> list[Call]:
        """The same call on every learner rank."""
        return [self.call(h, f"learner[{r}]", method, *args, **kwargs) for r, h in enumerate(self.learners)]

    def learn_sharded(self, method: str, per_rank_args: list[tuple]) -> list[Call]:
        """Rank r gets per_rank_args[r]."""
        return [self.call(h, f"learner[{r}]", method, *per_rank_args[r]) for r, h in enumerate(self.learners)]

    def refit(self, version: int) -> tuple[list[Call], list[Call]]:
        """Calls that put the learners' weights into every engine and log-prob worker:
        (the Generator's part, the learners' and log-prob workers' part)."""
        if self.refit_mode == "broadcast":
            senders = self.learn("broadcast_weights", version)  # submitted first, as every receiver joins it
            # named as every other call names them ("generator" when there is one engine), so a
            # dead engine reads the same whichever call finds it
            return [self.gen("receive_weights", version)], [*senders, *self.lp_each("receive_weights", version)]
        weights = self.learn("full_weights")
        return ([self.gen("push_weights", weights[0].ref, version)],
                [*weights[1:], *self.lp_each("push_weights", weights[0].ref, version)])


def wait(calls: Call | list[Call], timeout_s: float, abort: Callable[[], bool] | None = None) -> Any:
    """Results of `calls` in order. The first failure, or silence past `timeout_s` in total,
    raises ActorFailure naming the actor, the method and the cause; `abort()` turning true (checked
    every second) raises Abandoned, leaving the calls running."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    from rlspec.preemption import Abandoned

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
            raise ActorFailure(f"{c.actor} died during {c.method}: {_first_line(e)}") from None
        except RayTaskError as e:
            raise ActorFailure(f"{c.actor} raised in {c.method}: {_first_line(e.cause or e)}") from None
        except GetTimeoutError:
            raise ActorFailure(f"{c.actor}.{c.method} did not answer") from None
    got = dict(zip(by_ref, ray.get(list(by_ref))))
    results = [c.combine([got[p.ref] for p in c.parts]) if c.parts else got[c.ref] for c in calls]
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


# Engine start-up chatter (tcmalloc hints, thread-binding notes) drowns the progress bar; set
# VLLM_LOGGING_LEVEL=INFO to see it.
ACTOR_ENV_DEFAULTS = {"VLLM_LOGGING_LEVEL": "ERROR",
                      "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning"}


def local_actor_env(cfg: RLSpecConfig) -> dict[str, str]:
    """What the actors of a Ray the driver starts get in their environment (values the user set
    win). Under async GRPO the engines and learners compute at the same time; with more torch
    threads than cores, OpenMP's default spin-wait has a thread whose partner is descheduled burn
    the core that partner needs, and sleeping at once (OMP_WAIT_POLICY=PASSIVE) took the default
    async step from 3.5 to 3.0 s on 2 cores. Not in the sync loop: one stage runs at a time there,
    and the spin keeps its threads hot between small kernels (PASSIVE made that step 2.9 -> 3.8 s)."""
    env = dict(ACTOR_ENV_DEFAULTS)
    if cfg.async_grpo.enabled and actor_threads(cfg) > (cfg.cluster.num_cpus or os.cpu_count() or 1):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def actor_threads(cfg: RLSpecConfig) -> int:
    """Torch threads of every actor launch_actors starts, added up."""
    c = cfg.cluster
    logprob_workers = c.logprob_world_size if recompute_logprobs(cfg) else 0
    return (c.num_generators * (c.generator_threads or c.threads_per_actor)
            + (c.learner_world_size + logprob_workers) * c.threads_per_actor)


class RayCluster:
    """Context manager: connects to cluster.address or starts a local Ray; shuts it down after.
    `open()` starts it ahead of the `with` (entering then does nothing more). Call it from the
    main thread: Ray's processes die with the thread that started them (PR_SET_PDEATHSIG)."""

    def __init__(self, cfg: RLSpecConfig):
        self.cfg = cfg
        self.tmp: str | None = None
        self.up = False
        self.env_set: list[str] = []  # variables open() put in this process's environment

    def __enter__(self) -> "RayCluster":
        self.open()
        return self

    def open(self) -> None:
        import ray

        if self.up:
            return
        self.up = True
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_DEDUP_LOGS", "1")
        c = self.cfg.cluster
        if c.address:
            ray.init(address=c.address, log_to_driver=True, logging_level="WARNING")
            return
        # The local Ray's processes, actors included, inherit this environment: launch_actors
        # then passes actors no runtime_env, and they start in the workers Ray keeps ready.
        env = local_actor_env(self.cfg)
        self.env_set = [k for k in env if k not in os.environ]
        os.environ.update({k: env[k] for k in self.env_set})
        # Ray's socket paths must stay short: keep its session directory out of the run dir.
        self.tmp = tempfile.mkdtemp(prefix="rlspec-ray-", dir="/tmp")
        from rlspec.placement import make_plan

        plan = make_plan(c, self.cfg.generation.tensor_parallel_size, self.cfg.generation.expert_parallel)
        needed = sum(plan.slots_per_node) * c.cpus_per_slot
        ray.init(num_cpus=max(c.num_cpus or os.cpu_count() or 1, needed), include_dashboard=False,
                 _temp_dir=self.tmp, object_store_memory=1 << 30, log_to_driver=True,
                 configure_logging=True, logging_level="WARNING")

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.up = False
        for k in self.env_set:  # a later run in this process decides afresh
            os.environ.pop(k, None)
        self.env_set = []
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def with_refit(cls: type, mixin: type) -> type:
    """`cls` with the refit group's methods (rlspec/refit.py); keeps the class's name for Ray."""
    return type(cls.__name__, (mixin, cls), {"__doc__": cls.__doc__})


def launch_actors(cfg: RLSpecConfig, model_dir: str, tokenizer_dir: str, draft_dir: str | None = None) -> Actors:
    """Place every role by the plan (one placement group per node), start the Generator engines,
    LogprobWorkers and learner ranks, wait until each is up, and join the refit group."""
    import ray

    from rlspec.placement import GEN, LEARNER, LOGPROB, make_plan
    from rlspec.refit import RefitReceiver, RefitSender
    from rlspec.workers.generator import Generator
    from rlspec.workers.learner import Learner
    from rlspec.workers.logprob import LogprobWorker
    from rlspec.workers.placement_groups import actor_nodes, actor_options, create_placement_groups, slot_ip

    c, g, t = cfg.cluster, cfg.generation, cfg.trainer
    algo = resolve_auto(cfg).algo  # train() did this already; a stack built directly has not
    plan = make_plan(c, g.tensor_parallel_size, g.expert_parallel)
    placed = create_placement_groups(plan, c.actor_timeout_s)
    # Actors on a cluster started elsewhere get the driver's settings passed; those of the local
    # Ray that RayCluster started have them already. A runtime_env costs a fresh worker process
    # (~1.2 s to an actor's start on 2 cores, against ~0.4 s in one of the workers Ray prestarts).
    env_vars = {**ACTOR_ENV_DEFAULTS, **{k: v for k, v in os.environ.items()
                                         if k.startswith(("HF_", "VLLM_", "TORCH_", "DS_", "TRANSFORMERS_"))}} \
        if c.address else {}

    def runtime_env(extra: dict[str, str]) -> dict:
        return {"runtime_env": {"env_vars": {**env_vars, **extra}}} if env_vars or extra else {}

    threads, broadcast = c.threads_per_actor, c.refit == "broadcast"

    def start(cls, role: str, i: int, *args):
        o = actor_options(plan, placed, role, i)
        return ray.remote(cls).options(name=f"{role}_{i}", max_restarts=0, **runtime_env(o["env"]),
                                       **o["options"]).remote(*args)

    gen_cls = with_refit(Generator, RefitReceiver) if broadcast else Generator
    lp_cls = with_refit(LogprobWorker, RefitReceiver) if broadcast else LogprobWorker
    gen_threads = c.generator_threads or threads
    generators = [start(gen_cls, GEN, e, model_dir, g, cfg.speculation, cfg.model.max_model_len, t.seed, gen_threads,
                        tokenizer_dir, draft_dir, c.generator_nice) for e in range(c.num_generators)]
    draft_trainer, capture = None, None
    if cfg.speculation.online.enabled:
        from rlspec.workers.draft_trainer import DraftTrainer

        sp = cfg.speculation
        k = sp.max_speculative_tokens if sp.num_speculative_tokens == "auto" else int(sp.num_speculative_tokens)
        # beside the driver, outside the placement plan: it needs no accelerator on this scale
        draft_trainer = ray.remote(DraftTrainer).options(name="draft_trainer", num_cpus=0, max_restarts=0,
                                                         **runtime_env({})).remote(
            draft_dir, model_dir, sp.online, k, t.seed, threads, g.temperature)
        capture = wait(Call("draft_trainer", "capture_spec", draft_trainer.capture_spec.remote()), c.actor_timeout_s)
    # Without a recompute (algo.recompute_logprobs) nothing calls the log-prob workers: their slots
    # stay in the plan, their processes are not started.
    logprobs = [start(lp_cls, LOGPROB, r, model_dir, cfg.algo.kl_coef > 0, g.temperature, t.micro_batch_size,
                      threads, cfg.model.trust_remote_code, capture)
                for r in range(c.logprob_world_size if algo.recompute_logprobs else 0)]
    samples = g.num_prompts_per_step * g.num_generations_per_prompt
    # DeepSpeed's rendezvous runs on learner 0's node.
    master = slot_ip(placed, plan.roles[LEARNER].slots[0][0])
    port = free_port()
    learners = [start(with_refit(Learner, RefitSender) if broadcast else Learner, LEARNER, r, model_dir, algo, t,
                      g.temperature, samples, r, c.learner_world_size, master, port, threads,
                      cfg.model.trust_remote_code) for r in range(c.learner_world_size)]
    actors = Actors(generators, logprobs, learners, c.actor_timeout_s, c.refit, draft_trainer=draft_trainer)
    wait([actors.gen("ping"), *actors.lp_each("ping"), *actors.learn("ping")], c.actor_timeout_s)
    names = {**{f"generator[{e}]": h for e, h in enumerate(generators)},
             **{f"logprob_worker[{r}]": h for r, h in enumerate(logprobs)},
             **{f"learner[{r}]": h for r, h in enumerate(learners)}}
    actors.nodes = actor_nodes(names)
    if broadcast:
        join_refit_group(actors, c.refit_bucket_mb << 20)
    return actors


def join_refit_group(actors: Actors, bucket_bytes: int) -> None:
    """Learner 0 (rank 0), then every engine and log-prob worker, in one torch.distributed group."""
    import torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    (addr, port), metas = wait([actors.call(actors.learners[0], "learner[0]", "refit_endpoint"),
                                actors.call(actors.learners[0], "learner[0]", "refit_metas")], actors.timeout_s)
    receivers = [(f"generator[{e}]", h) for e, h in enumerate(actors.generators)] + \
                [(f"logprob_worker[{r}]", h) for r, h in enumerate(actors.logprobs)]
    world = 1 + len(receivers)
    wait([*actors.learn("join_refit_group", addr, port, world, backend, bucket_bytes),
          *[actors.call(h, name, "join_refit_group", addr, port, 1 + i, world, backend, metas, None, bucket_bytes)
            for i, (name, h) in enumerate(receivers)]], actors.timeout_s)
