"""The shipped tiny assets: reproducible from a seed, loadable through the normal model path."""
import hashlib
import json
import subprocess
import sys

import pytest

from conftest import ROOT


def _digest(d):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir()) if f.is_file()}


@pytest.mark.slow
def test_asset_script_is_reproducible_from_its_seed(tmp_path):
    args = [sys.executable, str(ROOT / "scripts" / "make_tiny_assets.py"), "--texts", "400",
            "--policy-steps", "3", "--draft-steps", "3", "--batch", "8"]
    for name in ("a", "b"):
        subprocess.run([*args, "--out", str(tmp_path / name)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    for kind in ("policy", "draft"):
        assert _digest(tmp_path / "a" / kind) == _digest(tmp_path / "b" / kind)


def test_shipped_assets_share_a_tokenizer_and_start_partly_right():
    tiny = ROOT / "rlspec" / "assets" / "tiny"
    assert (tiny / "policy" / "tokenizer.json").read_bytes() == (tiny / "draft" / "tokenizer.json").read_bytes()
    report = json.loads((tiny / "README.json").read_text())
    assert 0.2 <= report["policy"]["greedy_accuracy"] <= 0.5
    total = sum(f.stat().st_size for f in tiny.rglob("*") if f.is_file())
    assert total < 20 * 2**20


def test_shipped_chain_assets_share_a_tokenizer_and_start_with_room_for_rl():
    """The reasoning-length family (issue #27): greedy held-out accuracy in 15-40%."""
    chain = ROOT / "rlspec" / "assets" / "chain"
    assert (chain / "policy" / "tokenizer.json").read_bytes() == (chain / "draft" / "tokenizer.json").read_bytes()
    report = json.loads((chain / "README.json").read_text())
    assert report["task"] == "chain" and 0.15 <= report["policy"]["greedy_accuracy"] <= 0.4
    assert sum(f.stat().st_size for f in chain.rglob("*") if f.is_file()) < 20 * 2**20
