"""The checks a draft must pass against its target before any actor starts (config.json files only)."""
from __future__ import annotations

import json
from pathlib import Path

from rlspec.config import ConfigError, SpeculationConfig


def _hf_config(d: str) -> dict:
    return json.loads((Path(d) / "config.json").read_text())


def check_draft(spec: SpeculationConfig, target_dir: str, draft_dir: str | None) -> None:
    """Raise ConfigError when the draft cannot serve the target (checked on config.json files)."""
    if spec.method == "none":
        return
    target = _hf_config(target_dir)
    if spec.method == "mtp":
        layers = target.get("num_nextn_predict_layers") or target.get("mtp_num_hidden_layers") or 0
        if not layers:
            raise ConfigError(f"speculation.method: mtp needs a target with MTP layers, but "
                              f"{target_dir}/config.json has no num_nextn_predict_layers")
    if draft_dir is None:
        return
    draft = _hf_config(draft_dir)
    if spec.method == "eagle3":
        want = draft.get("target_hidden_size", draft.get("hidden_size"))
        if want != target.get("hidden_size"):
            raise ConfigError(f"speculation.model: the EAGLE-3 head {draft_dir} expects target hidden size "
                              f"{want}, but the target has hidden_size={target.get('hidden_size')}")
    if spec.method == "draft_model" and draft.get("vocab_size") != target.get("vocab_size"):
        raise ConfigError(f"speculation.model: draft vocab_size={draft.get('vocab_size')} differs from the "
                          f"target's {target.get('vocab_size')}: draft and target must share a tokenizer")
