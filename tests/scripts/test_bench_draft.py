"""scripts/bench_draft.py's generic head: the draft trainer's command the shipped domain head's
train_log.json records, same budget, on unrelated text; and the page's command for a file."""
import json

import pytest

from conftest import ROOT

import bench_draft


@pytest.mark.parametrize("assets", ["chain", "tiny"])
def test_the_generic_head_is_the_domain_heads_command_on_text(assets, tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import rlspec.draft.train  # noqa: F401  (registers the draft trainer's schema)

    log = json.loads((ROOT / "rlspec" / "assets" / assets / "eagle3" / "train_log.json").read_text())
    cmd = bench_draft.generic_head_command(log, tmp_path / "g.txt", tmp_path / "head", tmp_path)
    assert cmd[1:3] == ["-m", "rlspec.draft.train"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = OmegaConf.to_object(compose("draft_train", overrides=[o for o in cmd[3:] if not o.startswith("hydra.")]))
    rec = log["config"]
    assert c.model.path == str(ROOT / "rlspec" / "assets" / assets / "policy")
    assert c.model.max_model_len == rec["model"]["max_model_len"]
    assert (c.draft.corpus, c.draft.text_file, c.draft.out_dir) == ("text", str(tmp_path / "g.txt"),
                                                                    str(tmp_path / "head"))
    draft = OmegaConf.to_container(OmegaConf.structured(c.draft))
    assert {k: draft[k] for k in rec["draft"] if k not in ("corpus", "text_file", "out_dir")} == \
        {k: v for k, v in rec["draft"].items() if k not in ("corpus", "text_file", "out_dir")}
    data = OmegaConf.to_container(OmegaConf.structured(c.data))
    assert {k: data[k] for k in ("train", "val", "template", "max_prompt_tokens")} == \
        {k: rec["data"][k] for k in ("train", "val", "template", "max_prompt_tokens")}
    assert c.generation.max_new_tokens == rec["generation"]["max_new_tokens"]


def test_recorded_strings_reach_hydra_as_they_were(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import rlspec.draft.train  # noqa: F401

    odd = "a,b=c ${x} it's [1] \\' a\\b \\"  # a sweep, an interpolation, quotes, a list, backslashes
    over = bench_draft.leaves({"template": odd, "max_prompt_tokens": 40, "train": {"limit": None}}, "data.")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        c = OmegaConf.to_object(compose("draft_train", overrides=over))
    assert (c.data.template, c.data.max_prompt_tokens, c.data.train.limit) == (odd, 40, None)
