"""rlspec entry point (Hydra).

    python -m rlspec.train                                   # embedded CPU default (chain_cpu)
    python -m rlspec.train +experiment=rl_zero_qwen3_8b      # a paper experiment
    python -m rlspec.train trainer.max_steps=5 generation.temperature=0.8
    python -m rlspec.train +experiment=rl_zero_qwen3_8b --dry-run   # print the placement plan only

Exit codes: 0 done; 1 an actor failed (named in the message; after cluster.max_restarts
restarts); 2 bad config, model or data; 3 preempted (SIGTERM/SIGUSR1; checkpoint written:
requeue); 4 too many non-finite updates in a row (checkpoint of the last good state written).
"""
from __future__ import annotations

import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from rlspec.cluster.calls import ActorFailure
from rlspec.config import ConfigError, RLSpecConfig, register_configs
from rlspec.checks import resolve_auto, validate
from rlspec.data.loading import DataError, PromptSet, load_split
from rlspec.loops.preemption import EXIT_NUMERICAL, EXIT_PREEMPTED, NumericalDivergence, Preempted
from rlspec.models import ModelError, ModelPaths, check_context, load_tokenizer, resolve_checkpoint
from rlspec.rewards import preload as preload_reward
from rlspec.speculation.checks import check_draft

DEFAULT_EXPERIMENT = "chain_cpu"
EXIT_ACTOR_FAILURE, EXIT_BAD_INPUT = 1, 2
log = logging.getLogger("rlspec")

register_configs()


def with_default_experiment(argv: list[str]) -> list[str]:
    """Select +experiment=chain_cpu when the command line names no experiment; `--dry-run` is
    `cluster.dry_run=true`."""
    if "--dry-run" in argv:
        argv = [a for a in argv if a != "--dry-run"] + ["cluster.dry_run=true"]
    if any(a.lstrip("+~").startswith("experiment=") for a in argv):
        return argv
    # Hydra's overrides are one contiguous run of positional arguments: join it.
    at = next((i for i, a in enumerate(argv) if "=" in a and not a.startswith("-")), len(argv))
    return [*argv[:at], f"+experiment={DEFAULT_EXPERIMENT}", *argv[at:]]


def compose_config(overrides: list[str] = ()) -> RLSpecConfig:
    """The config `python -m rlspec.train OVERRIDES` runs with (its 'auto' settings unresolved),
    composed without the command line: for scripts and tests."""
    from hydra import compose, initialize_config_dir

    register_configs()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=with_default_experiment(list(overrides))))


def load_data(cfg: RLSpecConfig, tokenizer) -> tuple[PromptSet, PromptSet]:
    sets = [load_split(cfg.data, split, tokenizer) for split in ("train", "val")]
    for key, ps in zip(("data.train", "data.val"), sets):
        skipped = f", skipped {sum(ps.skipped.values())} bad rows {dict(ps.skipped)}" if ps.skipped else ""
        print(f"{key}: {len(ps)} prompts from {ps.source}{skipped}", flush=True)
    return sets[0], sets[1]


def resolve_paths(cfg: RLSpecConfig) -> ModelPaths:
    """Every checkpoint the run needs as a local directory; the draft checked against the target."""
    model = resolve_checkpoint(cfg.model.path, "model.path", cfg.model.revision)
    check_context(model, cfg.model.max_model_len)
    tokenizer = resolve_checkpoint(cfg.model.tokenizer, "model.tokenizer") if cfg.model.tokenizer else model
    draft = resolve_checkpoint(cfg.speculation.model, "speculation.model") if cfg.speculation.model else None
    check_draft(cfg.speculation, model, draft)
    return ModelPaths(model, tokenizer, draft)


def dry_run(cfg: RLSpecConfig) -> None:
    """Print what the run would use and its placement plan; start nothing."""
    from rlspec.cluster.memory import gpu_memory
    from rlspec.checks import plan_of

    sp, d = cfg.speculation, cfg.data
    print(f"model {cfg.model.path}; speculation {sp.method}"
          + (f" k={sp.num_speculative_tokens} draft {sp.model}" if sp.method != "none" else "")
          + f"; train {d.train.source}; val {d.val.source}", flush=True)
    plan = plan_of(cfg)
    print(plan.describe(), flush=True)
    t, g = cfg.trainer, cfg.generation
    print(f"dtypes: engine {g.dtype}, learner {t.dtype}; refit {cfg.cluster.refit}; correction "
          f"{cfg.algo.off_policy_correction}; CUDA graphs {'off' if g.enforce_eager else 'on'}; gradient "
          f"checkpointing {'on' if t.gradient_checkpointing else 'off'}", flush=True)
    mem = gpu_memory(cfg, plan)
    if mem is not None:
        print(mem.describe(), flush=True)


def train(cfg: RLSpecConfig, run_dir: str) -> dict:
    """Resolve models and data (failing before any actor starts), then run the loop on Ray actors;
    after an actor failure, restart everything from the latest checkpoint up to
    cluster.max_restarts times."""
    from rlspec.cluster.calls import wait
    from rlspec.cluster.ray_cluster import RayCluster
    from rlspec.loops.preemption import StopRequest

    validate(cfg)
    resolve_auto(cfg)  # once, here: every actor and summary.json read the resolved values
    if cfg.speculation.adaptive and cfg.speculation.auto_step_costs is not None:
        from rlspec.speculation.adaptive import load_step_costs

        try:   # the Generator loads them again; a bad file fails here, before any actor starts
            load_step_costs(cfg.speculation.auto_step_costs, cfg.speculation.k_max)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.cluster.dry_run:
        dry_run(cfg)
        return {}
    paths = resolve_paths(cfg)

    def read_inputs():
        tok = load_tokenizer(paths.tokenizer, "model.tokenizer" if cfg.model.tokenizer else "model.path",
                             cfg.model.trust_remote_code)
        preload_reward(cfg.data.reward)
        return (tok, *load_data(cfg, tok))

    # The driver reads the tokenizer and data (and imports torch) while Ray starts, which is
    # mostly a wait on Ray's own processes; bad data still fails before any actor starts.
    cluster = RayCluster(cfg)
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(read_inputs)
        try:
            cluster.open()
            tokenizer, train_set, val_set = reading.result()
        except BaseException:
            cluster.close()
            raise
    from rlspec.cluster.launch import launch_actors
    from rlspec.loops.checkpoint import resolve_resume
    from rlspec.loops.runlog import RunLog
    from rlspec.loops.state import Run
    from rlspec.loops.sync import run_loop

    ckpt_root = cfg.trainer.checkpoint_dir or os.path.join(run_dir, "checkpoints")
    resume = resolve_resume(cfg.trainer.resume, ckpt_root)
    runlog = RunLog(run_dir, OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
                    cfg.trainer.max_steps, cfg.logging)
    runlog.notes["bad_rows"] = {"train": dict(train_set.skipped), "val": dict(val_set.skipped)}
    runlog.notes["train_metrics_over"] = train_metrics_over(cfg)
    stop, restarts = StopRequest(), 0
    while True:
        try:
            with cluster:
                stop.install()  # after ray.init, which installs handlers of its own
                actors = launch_actors(cfg, paths)
                runlog.notes["placement"] = actors.nodes  # actor -> Ray node ID, as Ray reports it
                report_engines(runlog, wait(actors.generators.runner_info(), actors.timeout_s))
                run_loop(Run(cfg, actors, tokenizer, train_set, val_set, runlog, ckpt_root, stop), resume, restarts)
                if cfg.trainer.save_final:
                    final = os.path.join(run_dir, "final")
                    wait(actors.learners.save_pretrained(final, paths.tokenizer), actors.timeout_s)
                    runlog.notes["final_policy"] = final
            break
        except ActorFailure as e:
            if restarts >= cfg.cluster.max_restarts:
                raise
            restarts += 1
            cluster = RayCluster(cfg)
            runlog.notes["restarts"] = restarts
            resume = resolve_resume("auto", ckpt_root)
            print(f"rlspec: actor failure: {e}; restart {restarts}/{cfg.cluster.max_restarts} from "
                  f"{resume or 'the start (no checkpoint yet)'}", file=sys.stderr, flush=True)
            if resume is None:
                runlog.records, runlog.val = [], []
    summary = runlog.finish(cfg.logging.plot)
    print(f"run directory: {run_dir}", flush=True)
    return summary


def train_metrics_over(cfg) -> str:
    """Which rows a step's learner metrics (entropy, ratio_mean, clip and dual-clip fractions,
    logprob_mismatch, importance_weight) average over: 'all_rows', or 'rows_trained' where the
    rows of zero gradient are left out (trainer.skip_zero_gradient_rows under a loss inert at zero
    advantage without KL), whose share is each record's rows_skipped. The loss is the whole batch's
    either way."""
    from rlspec.algo.losses import INERT_AT_ZERO_ADVANTAGE

    subset = (cfg.trainer.skip_zero_gradient_rows and cfg.algo.kl_coef == 0
              and cfg.algo.loss in INERT_AT_ZERO_ADVANTAGE)
    return "rows_trained" if subset else "all_rows"


def report_engines(runlog, infos: list[dict]) -> None:
    """Each engine's model runner (vLLM falls back from V2 to V1 for drafters V2 lacks, and V1 turns
    async scheduling off) into summary.json and the run's log."""
    runlog.notes["engines"] = infos
    kinds = sorted({(i["model_runner"], i["async_scheduling"], i["cuda_graphs"]) for i in infos})
    runlog.write("engines: " + "; ".join(
        f"{sum((i['model_runner'], i['async_scheduling'], i['cuda_graphs']) == k for i in infos)} on Model Runner "
        f"{k[0]}, async scheduling {'on' if k[1] else 'off'}, CUDA graphs {'on' if k[2] else 'off'}" for k in kinds))


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(dcfg: DictConfig) -> None:
    cfg: RLSpecConfig = OmegaConf.to_object(dcfg)
    try:
        train(cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, ModelError, DataError) as e:
        print(f"rlspec: error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)
    except ActorFailure as e:
        print(f"rlspec: actor failure: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_ACTOR_FAILURE)
    except Preempted as e:
        print(f"rlspec: preempted by {e}; exit {EXIT_PREEMPTED} (requeue)", file=sys.stderr, flush=True)
        sys.exit(EXIT_PREEMPTED)
    except NumericalDivergence as e:
        print(f"rlspec: stopped: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_NUMERICAL)


if __name__ == "__main__":
    sys.argv = [sys.argv[0], *with_default_experiment(sys.argv[1:])]
    main()
