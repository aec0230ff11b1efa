import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# helpers/procs.py: what this test process started. Set, not defaulted: pytest-xdist's workers
# inherit the controller's environment, which loads this file first, and would share its mark
os.environ["RLSPEC_TEST_SESSION"] = str(os.getpid())
# Tests run side by side (pytest-xdist workers; in each, a run's Generator and learner ranks), so
# the torch threads outnumber the cores: under OpenMP's default spin-wait a thread waiting for a
# descheduled partner burns the core that partner needs (a CLI run's step 5x longer beside another
# run). Threads sleep at once instead; every process a test starts inherits this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


TEST_EXPERIMENT = "+experiment=tiny_cpu"  # the tests' baseline: the fast addition task


def compose(overrides=(), plain=True):
    """The config `python -m rlspec.train +experiment=tiny_cpu OVERRIDES` composes (another
    experiment when the overrides name one), as an RLSpecConfig (its 'auto' settings not yet
    resolved: rlspec.checks.resolve_auto does that). tiny_cpu drafts with the tiny draft model; with
    plain=True (the tests' baseline) rollouts are not speculative unless an override selects a
    `speculation=` method."""
    from rlspec.train import compose_config

    overrides = list(overrides)
    if not any(o.lstrip("+~").startswith("experiment=") for o in overrides):
        overrides.insert(0, TEST_EXPERIMENT)
    if plain and not any(o.startswith("speculation=") for o in overrides):
        overrides.append("speculation=none")
    return compose_config(overrides)


@pytest.fixture(scope="session")
def tiny_policy() -> str:
    return str(ROOT / "rlspec" / "assets" / "tiny" / "policy")


@pytest.fixture(scope="session")
def tokenizer(tiny_policy):
    from rlspec.models import load_tokenizer
    return load_tokenizer(tiny_policy, "model.path")


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray cluster for one test module."""
    from rlspec.cluster.ray_cluster import RayCluster

    with RayCluster(compose()):
        yield


def resolved(overrides=(), plain=True):
    """compose() with its 'auto' settings resolved, as `python -m rlspec.train` runs it."""
    from rlspec.checks import resolve_auto

    return resolve_auto(compose(overrides, plain))


def paths_of(cfg, draft_dir=None, model_path=None):
    """The run's checkpoints (shipped assets here: nothing to resolve)."""
    from rlspec.models import ModelPaths

    model = model_path or cfg.model.path
    return ModelPaths(model, cfg.model.tokenizer or model, draft_dir or cfg.speculation.model)


def tiny_paths(draft: str | None = None):
    """The shipped tiny policy (its own tokenizer), with a shipped draft under rlspec/assets/tiny."""
    from rlspec.models import ModelPaths

    policy = str(ROOT / "rlspec" / "assets" / "tiny" / "policy")
    return ModelPaths(policy, policy, None if draft is None else str(ROOT / "rlspec" / "assets" / "tiny" / draft))


def logprob_worker(micro_batch_size: int, capture=None, device=None):
    """A LogprobWorker (the plain class, no Ray) on the tiny policy at temperature 1, no reference."""
    from rlspec.config import AlgoConfig, GenerationConfig, ModelConfig, TrainerConfig
    from rlspec.workers.logprob import LogprobWorker

    return LogprobWorker(paths=tiny_paths(), model=ModelConfig(), algo=AlgoConfig(),
                         trainer=TrainerConfig(micro_batch_size=micro_batch_size, dtype="float32"),
                         generation=GenerationConfig(temperature=1.0), threads=1, capture=capture, device=device)


def sampling(n: int, temperature: float, max_tokens: int, seed=None):
    from rlspec.messages import Sampling

    return Sampling(n, temperature, max_tokens, seed)


def heldout_prompts(tokenizer, n: int, seed: int = 5) -> list[list[int]]:
    """Token ids of n held-out synthetic prompts under the rl_zero template."""
    from rlspec.config import DatasetConfig, SyntheticConfig
    from rlspec.data.loading import load_prompts

    ps = load_prompts(DatasetConfig(split="test", num_rows=n, seed=seed), SyntheticConfig(), key="data.val",
                      tokenizer=tokenizer, template="rl_zero", max_prompt_tokens=64, on_bad_row="error")
    return [p.token_ids for p in ps.prompts]


def start_generator(overrides=(), draft_dir=None, seed=0, model_path=None, env=None):
    """A Generator in its own Ray actor, configured as `python -m rlspec.train OVERRIDES` would
    (env: environment variables of its process and the engine's)."""
    import ray

    from rlspec.workers.generator import Generator

    cfg = resolved(list(overrides))
    options = {"runtime_env": {"env_vars": env}} if env else {}
    return ray.remote(Generator).options(num_cpus=0, **options).remote(
        paths=paths_of(cfg, draft_dir, model_path), model=cfg.model, generation=cfg.generation,
        speculation=cfg.speculation, seed=seed, threads=2)


def host_batch(seed: int = 0, n: int = 8, group: int = 2):
    """A batch as the driver builds it: host tensors, groups sharing their prompt."""
    import torch

    from rlspec.algo.batching import build_train_batch
    from rlspec.messages import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 282, (int(k),), generator=g).tolist()
               for k in torch.randint(5, 12, (n // group,), generator=g)]
    prompts = [p for p in prompts for _ in range(group)]
    responses = [torch.randint(1, 282, (int(k),), generator=g).tolist()
                 for k in torch.randint(3, 20, (n,), generator=g)]
    ro = RolloutBatch(prompts, responses, [[-1.0] * len(r) for r in responses], [False] * n, policy_version=0)
    adv = torch.linspace(-1, 1, n)
    return build_train_batch(ro, adv, torch.ones(n), 0)


def child_env(*paths) -> dict:
    """The environment for a test's child process: the repo, tests/ and `paths` importable, ahead of
    whatever PYTHONPATH this process already has (packages installed outside the venv stay seen)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), *map(str, paths),
                                                         os.environ.get("PYTHONPATH", "")])}


def rounding_bound(config: dict, layers: int, positions: int, tokens: int, extra: int = 0) -> float:
    """A first-order bound on the relative difference between two float32 computations of one
    result that take their sums in other orders (micro-batches, ranks, ZeRO's partitions, another
    CPU's kernels): K units of rounding (2^-24), K the additions on the result's longest path: back
    through `layers` decoder layers of this Hugging Face `config` (their matrix products' inner
    dimensions: q/k/v/o over hidden_size, the MLP's intermediate_size, attention over `positions`),
    the output layer's vocabulary, the batch's `tokens`, and `extra` (another layer's inner
    dimension). Errors of independent sign add up to about sqrt(K) units instead, what a machine
    shows; a lost micro-batch, a wrong denominator or a missed clip is off by 10% or more."""
    per_layer = 3 * config["hidden_size"] + config["intermediate_size"] + positions
    return (layers * per_layer + config["vocab_size"] + tokens + extra) * 2.0 ** -24


def report(what: str, observed: float, bound: float) -> None:
    """A comparison's observed difference printed beside its bound (the margin on this machine),
    then asserted within it."""
    margin = f"{bound / observed:.0f}x" if observed > 0 else "exact"
    print(f"{what}: observed {observed:.1e}, bound {bound:.1e} ({margin})", flush=True)
    assert observed <= bound, (what, observed, bound)
