"""Rollout-history drafting: one protocol (history/drafters.py) with a host backend (host/: a numba
store in the engine's process, vLLM's custom proposer) and a device backend (device/: tensors on the
engine's device, vLLM's ngram_gpu slot); one stats schema (stats.py), one save format and merge
(state.py)."""
