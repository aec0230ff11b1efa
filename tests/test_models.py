import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from rlspec.models import ModelError, resolve_checkpoint


def test_local_checkpoint_resolves(tiny_policy):
    assert resolve_checkpoint(tiny_policy, "model.path") == tiny_policy


def test_missing_path_is_named():
    with pytest.raises(ModelError, match=r"model\.path='/no/such/ckpt'"):
        resolve_checkpoint("/no/such/ckpt", "model.path")


def test_hub_id_offline_fails_clearly():
    with pytest.raises(ModelError, match=r"model\.path='Qwen/Qwen3-8B-Base' is not a local directory.*offline"):
        resolve_checkpoint("Qwen/Qwen3-8B-Base", "model.path")


def test_cli_missing_model_fails_before_ray_starts(tmp_path):
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "rlspec.train", "model.path=/no/such/model",
                        f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "model.path='/no/such/model'" in p.stderr
    assert "ray" not in p.stdout.lower() + p.stderr.lower().replace("ray_", "")
    assert time.time() - t0 < 60


def test_cli_misspelled_key_fails_naming_it(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlspec.train", "trainer.max_stepz=3",
                        f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "max_stepz" in p.stderr


def test_a_checkpoint_a_node_cannot_read_is_named_with_the_node(tmp_path):
    """Paths resolve on the driver; an actor on a node that does not mount them stops at once,
    naming its node, the key and the path."""
    import socket

    from rlspec.models import ModelError, ModelPaths

    ok = str(tmp_path)
    ModelPaths(ok, ok).check_visible("Learner")
    missing = str(tmp_path / "only-on-the-head-node")
    with pytest.raises(ModelError, match=rf"Generator on node {socket.gethostname()} cannot read "
                                         rf"speculation.model: {missing} \(resolved on the driver's node\)"):
        ModelPaths(ok, ok, missing).check_visible("Generator")


def test_a_context_longer_than_the_checkpoint_allows_is_named(tmp_path, tiny_policy):
    """vLLM refuses it only inside the Generator; rlspec refuses it before any actor starts."""
    import json
    import shutil

    from rlspec.models import check_context

    limit = json.loads((Path(tiny_policy) / "config.json").read_text())["max_position_embeddings"]
    check_context(tiny_policy, limit)
    with pytest.raises(ModelError, match=rf"model\.max_model_len={limit + 1} is longer than the {limit} positions "
                                         rf".*config\.json allows \(max_position_embeddings {limit}\)"):
        check_context(tiny_policy, limit + 1)
    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_policy, scaled)
    cfg = json.loads((scaled / "config.json").read_text())
    (scaled / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    check_context(str(scaled), 4 * limit)
    with pytest.raises(ModelError, match=r"x rope_scaling factor 4\)"):
        check_context(str(scaled), 4 * limit + 1)
    p = subprocess.run([sys.executable, "-m", "rlspec.train", f"model.max_model_len={limit + 64}",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"model.max_model_len={limit + 64} is longer than" in p.stderr, p.stderr[-2000:]
