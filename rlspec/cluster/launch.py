"""Launch: place every role by the plan, start the actors, wait until each is up, and build the
refit between them. The only module that wraps worker classes with `ray.remote`: workers are
plain classes, so tests build them without Ray."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from rlspec.cluster.calls import wait
from rlspec.cluster.groups import actor_nodes, actor_options, create_placement_groups, slot_endpoint
from rlspec.cluster.handles import DraftTrainerHandle, Generators, Learners, LogprobWorkers
from rlspec.cluster.plan import DRAFT, GEN, LEARNER, LOGPROB
from rlspec.cluster.ray_cluster import ACTOR_ENV_DEFAULTS
from rlspec.config import RLSpecConfig
from rlspec.checks import plan_of
from rlspec.models import ModelPaths
from rlspec.refit.driver import Refit
from rlspec.workers.draft_trainer import DraftTrainer
from rlspec.workers.generator import Generator
from rlspec.workers.learner import Learner
from rlspec.workers.logprob import LogprobWorker


@dataclass
class Actors:
    """Every actor of a run, and the refit between them."""
    generators: Generators
    logprobs: LogprobWorkers
    learners: Learners
    refit: Refit
    timeout_s: float
    draft_trainer: DraftTrainerHandle | None = None  # online draft adaptation (speculation.online.enabled)
    nodes: dict[str, str] = field(default_factory=dict)  # actor name -> Ray node ID


def launch_actors(cfg: RLSpecConfig, paths: ModelPaths) -> Actors:
    """Place every role by the plan (one placement group per node), start the Generator engines,
    LogprobWorkers and learner ranks, wait until each is up, and connect the refit.
    `cfg` is resolved (rlspec.checks.resolve_auto)."""
    import ray

    c, g, t = cfg.cluster, cfg.generation, cfg.trainer
    if cfg.algo.recompute_logprobs is None:
        raise ValueError("algo.recompute_logprobs is unresolved: resolve_auto(cfg) before launch_actors")
    plan = plan_of(cfg)
    placed = create_placement_groups(plan, c.actor_timeout_s)
    # Actors on a cluster started elsewhere get the driver's settings passed; those of the local
    # Ray that RayCluster started have them already. A runtime_env costs a fresh worker process,
    # slower to start than one of the workers Ray keeps ready.
    env_vars = {**ACTOR_ENV_DEFAULTS, **{k: v for k, v in os.environ.items()
                                         if k.startswith(("HF_", "VLLM_", "TORCH_", "DS_", "TRANSFORMERS_"))}} \
        if c.address else {}

    def runtime_env(extra: dict[str, str]) -> dict:
        return {"runtime_env": {"env_vars": {**env_vars, **extra}}} if env_vars or extra else {}

    def start(cls, role: str, i: int, **kwargs):
        o = actor_options(plan, placed, role, i)
        return ray.remote(cls).options(name=f"{role}_{i}", max_restarts=0, **runtime_env(o["env"]),
                                       **o["options"]).remote(**kwargs)

    threads = c.threads_per_actor
    generators = Generators([start(Generator, GEN, e, paths=paths, model=cfg.model, generation=g,
                                   speculation=cfg.speculation, seed=t.seed, threads=c.generator_threads or threads,
                                   nice=c.generator_nice) for e in range(c.num_generators)],
                            sticky=cfg.speculation.method == "history")
    if plan.on_gpu:
        # vLLM sizes its KV cache from the memory free while it starts (and, under sleep mode,
        # releases it until the first call): learners and log-prob workers sharing its GPUs start
        # after it, so the engine never counts memory they are about to take.
        wait(generators.ping(), c.actor_timeout_s)
    draft_trainer, capture = None, None
    if cfg.speculation.online.enabled:
        # in its slot of the plan (the last learner rank's): its head trains on that GPU
        draft_trainer = DraftTrainerHandle([start(DraftTrainer, DRAFT, 0, paths=paths, speculation=cfg.speculation,
                                                  generation=g, seed=t.seed, threads=threads)])
        capture = wait(draft_trainer.one(0, DraftTrainer.capture_spec), c.actor_timeout_s)
    # Without a recompute (algo.recompute_logprobs) nothing calls the log-prob workers: their slots
    # stay in the plan, their processes are not started.
    logprobs = LogprobWorkers([start(LogprobWorker, LOGPROB, r, paths=paths, model=cfg.model, algo=cfg.algo,
                                     trainer=t, generation=g, threads=threads, capture=capture)
                               for r in range(c.logprob_world_size if cfg.algo.recompute_logprobs else 0)])
    # DeepSpeed's rendezvous runs on learner 0's node: its port is probed there.
    rendezvous = slot_endpoint(placed, plan.roles[LEARNER].slots[0][0], c.actor_timeout_s)
    learners = Learners([start(Learner, LEARNER, r, paths=paths, model=cfg.model, algo=cfg.algo, trainer=t,
                               generation=g, rank=r, world_size=c.learner_world_size, rendezvous=rendezvous,
                               threads=threads, timeout_s=c.actor_timeout_s) for r in range(c.learner_world_size)])
    wait([*generators.ping(), *logprobs.ping(), *learners.ping()], c.actor_timeout_s)
    refit = Refit(c.refit, learners, generators, logprobs, c.actor_timeout_s, c.refit_bucket_mb << 20, g.dtype,
                  g.tensor_parallel_size)
    actors = Actors(generators, logprobs, learners, refit, c.actor_timeout_s, draft_trainer,
                    actor_nodes({**generators.names(), **logprobs.names(), **learners.names()}))
    refit.connect()
    return actors
