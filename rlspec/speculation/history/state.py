"""The history store's saved state (HistoryIndex.state_dict): its format, checks, and the merge of
several engines' stores into one. Version 3 holds the stored sequences in arena order as numpy
arrays: loaded back, the chains hold the same positions in the same order, so the drafts are the
same. Version 2 grouped them by prompt as Python lists; before it, ([prompt, [responses]] per
prompt) the responses are recorded afresh."""
from __future__ import annotations

import numpy as np

from rlspec.speculation.history.host.store import END

STATE_VERSION = 3
# What a saved state's numpy arrays unpickle through: a file written by torch.save loads with
# torch.load(path, weights_only=True) under torch.serialization.safe_globals(STATE_GLOBALS).
STATE_GLOBALS = [np.zeros(0).__reduce__()[0], np.ndarray, np.dtype,
                 *(type(np.dtype(t)) for t in (np.int32, np.int64, np.uint64, np.bool_))]


SEQUENCES = {"salt": np.uint64, "tokens": np.int64, "stored": np.int64, "arena": np.int32}


def merge_states(states: list[dict]) -> dict:
    """Several engines' saved stores (state_dict, one per Generator; either drafter's: the device
    drafter saves its sequences in this layout too, format "device") as one state load_state_dict
    takes: their sequences one store after another, each in its own order, the most permissive
    admission limit and the largest chain-head count (loading applies the bounds). Every state must
    be of one drafter and one format version."""
    if len(states) == 1:   # one engine's store: as saved (its count table, the ring as held)
        return states[0]
    if len({s.get("format", "host") for s in states}) > 1:
        raise ValueError("history stores saved by both speculation.history.drafter backends cannot merge")
    if states[0].get("format") == "device":
        return {"format": "device", **_concatenated(states)}
    versions = {s.get("version") for s in states}
    if len(versions) > 1:
        raise ValueError(f"history stores of different format versions {sorted(map(str, versions))} cannot merge")
    version = versions.pop() if versions else STATE_VERSION
    admit = str(max((int(s.get("admit_below", 1 << 64)) for s in states), default=1 << 64))
    if version != STATE_VERSION:
        out = {"prompts": [x for s in states for x in s["prompts"]]}
        return out if version is None else {**out, "version": version, "admit_below": admit}
    return {"version": version, "admit_below": admit, "heads": max((int(s["heads"]) for s in states), default=0),
            **_concatenated(states)}


def _concatenated(states: list[dict]) -> dict:
    """The states' sequences (SEQUENCES' arrays), one state's after another."""
    return {key: np.concatenate([np.zeros(0, t)] + [np.asarray(s[key], t) for s in states])
            for key, t in SEQUENCES.items()}


def _arrays_of_v2(state: dict) -> dict:
    """A version-2 state ([salt, [[response tokens, stored sequence], ...]] per prompt) in version
    3's arrays, sequences grouped by prompt as saved."""
    seqs = [(int(salt), tokens, body) for salt, held in state["prompts"] for tokens, body in held]
    return {"admit_below": state.get("admit_below", str(1 << 64)), "heads": 0,
            "salt": np.array([x[0] for x in seqs], np.uint64), "tokens": np.array([x[1] for x in seqs], np.int64),
            "stored": np.array([len(x[2]) for x in seqs], np.int64),
            "arena": np.concatenate([np.zeros(0, np.int32)] + [np.asarray(x[2], np.int32) for x in seqs])}


def _arrays_of(state: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A version-3 state's arrays (prompt salts, response tokens, stored lengths, the sequences
    concatenated), checked against each other: ValueError where they disagree."""
    salts = np.asarray(state["salt"], np.uint64)
    tokens, stored = np.asarray(state["tokens"], np.int64), np.asarray(state["stored"], np.int64)
    body = np.asarray(state["arena"], np.int32)
    if not len(salts) == len(tokens) == len(stored) or body.size != stored.sum() or \
            (body.size and (body.min() < END or np.any(stored <= tokens))):
        raise ValueError("history state: sequences and arena do not agree")
    return salts, tokens, stored, body


def loadable(state: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """A saved state's arrays (_arrays_of), version 2's converted; None for the first format, whose
    responses are recorded afresh. ValueError for a version this rlspec does not read."""
    version = state.get("version")
    if version in (2, STATE_VERSION):
        return _arrays_of(state if version == STATE_VERSION else _arrays_of_v2(state))
    if version is None:
        return None
    raise ValueError(f"history state of format version {version}: this rlspec reads 2 and {STATE_VERSION}")
