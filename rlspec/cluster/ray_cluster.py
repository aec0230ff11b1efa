"""Starting and stopping Ray (a cluster started elsewhere, or a local one), and the environment
the actors of a local Ray get."""
from __future__ import annotations

import os
import shutil
import tempfile

from rlspec.config import RLSpecConfig
from rlspec.checks import plan_of


# Engine start-up chatter (tcmalloc hints, thread-binding notes) drowns the progress bar; set
# VLLM_LOGGING_LEVEL=INFO to see it.
ACTOR_ENV_DEFAULTS = {"VLLM_LOGGING_LEVEL": "ERROR",
                      "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning"}


def local_actor_env(cfg: RLSpecConfig) -> dict[str, str]:
    """What the actors of a Ray the driver starts get in their environment (values the user set
    win). Under async GRPO the engines and learners compute at the same time; with more torch
    threads than cores, OpenMP's default spin-wait has a thread whose partner is descheduled burn
    the core that partner needs, so threads sleep at once (OMP_WAIT_POLICY=PASSIVE), which
    shortens the async step. Not in the sync loop: one stage runs at a time there, and the spin
    keeps its threads hot between small kernels (PASSIVE lengthens that step)."""
    env = dict(ACTOR_ENV_DEFAULTS)
    if cfg.async_grpo.enabled and actor_threads(cfg) > (cfg.cluster.num_cpus or os.cpu_count() or 1):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


def actor_threads(cfg: RLSpecConfig) -> int:
    """Torch threads of every actor launch_actors starts, added up."""
    c = cfg.cluster
    logprob_workers = c.logprob_world_size if cfg.algo.recompute_logprobs else 0
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
        # Ray's socket paths must stay short: keep its session directory out of the run dir. The
        # folder names this process: which run left one behind.
        self.tmp = tempfile.mkdtemp(prefix=f"rlspec-ray-{os.getpid()}-", dir="/tmp")
        plan = plan_of(self.cfg)
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
