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
        V, Vd = draft.get("vocab_size"), draft.get("draft_vocab_size")
        if V is not None and V != target.get("vocab_size"):
            raise ConfigError(f"speculation.model: the EAGLE-3 head {draft_dir} maps into a vocabulary of {V} "
                              f"tokens, the target's has vocab_size={target.get('vocab_size')}")
        if Vd is not None and V is not None and not 0 < Vd <= V:
            raise ConfigError(f"speculation.model: the EAGLE-3 head {draft_dir} has draft_vocab_size={Vd}, "
                              f"outside 1..{V}")
        layers = target.get("num_hidden_layers", 0)
        aux = draft.get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and not all(0 < i < layers for i in aux):
            raise ConfigError(f"speculation.model: the EAGLE-3 head {draft_dir} reads target layers {aux}, the "
                              f"target has {layers}")
        if aux is None and layers < 4:  # EAGLE-3's default layers need at least 4
            raise ConfigError(f"speculation.model: the EAGLE-3 head {draft_dir} names no "
                              f"eagle_aux_hidden_state_layer_ids and the target's {layers} layers have no default")
    if spec.method == "draft_model" and draft.get("vocab_size") != target.get("vocab_size"):
        raise ConfigError(f"speculation.model: draft vocab_size={draft.get('vocab_size')} differs from the "
                          f"target's {target.get('vocab_size')}: draft and target must share a tokenizer")
