import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def compose(overrides=()):
    """The config `python -m rlspec.train OVERRIDES` would run with, as an RLSpecConfig."""
    from hydra import compose as hcompose, initialize_config_dir
    from omegaconf import OmegaConf

    from rlspec.config import register_configs
    from rlspec.train import with_default_experiment

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_object(hcompose("config", overrides=with_default_experiment(list(overrides))))


@pytest.fixture(scope="session")
def tiny_policy() -> str:
    return str(ROOT / "rlspec" / "assets" / "tiny" / "policy")


@pytest.fixture(scope="session")
def tokenizer(tiny_policy):
    from rlspec.models import load_tokenizer
    return load_tokenizer(tiny_policy, "model.path")
