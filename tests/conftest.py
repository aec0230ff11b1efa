import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def compose(overrides=(), plain=True):
    """The config `python -m rlspec.train OVERRIDES` would run with, as an RLSpecConfig. The
    default experiment drafts with the tiny draft model; with plain=True (the tests' baseline)
    rollouts are not speculative unless an override selects a `speculation=` method."""
    from hydra import compose as hcompose, initialize_config_dir
    from omegaconf import OmegaConf

    from rlspec.config import register_configs
    from rlspec.train import with_default_experiment

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        overrides = list(overrides)
        if plain and not any(o.startswith("speculation=") for o in overrides):
            overrides.append("speculation=none")
        return OmegaConf.to_object(hcompose("config", overrides=with_default_experiment(overrides)))


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
    from rlspec.workers.cluster import RayCluster

    with RayCluster(compose()):
        yield


def heldout_prompts(tokenizer, n: int, seed: int = 5) -> list[list[int]]:
    """Token ids of n held-out synthetic prompts under the rl_zero template."""
    from rlspec.config import DatasetConfig, SyntheticConfig
    from rlspec.data.loading import load_prompts

    ps = load_prompts(DatasetConfig(split="test", num_rows=n, seed=seed), SyntheticConfig(), key="data.val",
                      tokenizer=tokenizer, template="rl_zero", max_prompt_tokens=64, on_bad_row="error")
    return [p.token_ids for p in ps.prompts]


def start_generator(overrides=(), draft_dir=None, seed=0, model_path=None):
    """A Generator in its own Ray actor, configured as `python -m rlspec.train OVERRIDES` would."""
    import ray

    from rlspec.workers.generator import Generator

    cfg = compose(list(overrides))
    if draft_dir is None and cfg.speculation.model:
        draft_dir = cfg.speculation.model
    return ray.remote(Generator).options(num_cpus=0).remote(
        model_path or cfg.model.path, cfg.generation, cfg.speculation, cfg.model.max_model_len, seed, 2, None, draft_dir)
