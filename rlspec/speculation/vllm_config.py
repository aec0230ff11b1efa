"""rlspec's `speculation` config to the `speculative_config` dict vLLM's LLM takes."""
from __future__ import annotations

from rlspec.config import SpeculationConfig


def vllm_speculative_config(spec: SpeculationConfig, draft_dir: str | None) -> dict | None:
    """The dict vLLM's LLM(speculative_config=...) takes, or None without speculation."""
    if spec.method == "none":
        return None
    out: dict = {"method": spec.method, "num_speculative_tokens": spec.k_max}
    if spec.adaptive:
        # Built for the largest k; the scheduler's batch-size schedule (rewritten every call by
        # rlspec.speculation.calibration) picks the k each engine step uses.
        out["num_speculative_tokens_per_batch_size"] = [[1, 1 << 20, spec.k_max]]
    if spec.method in ("draft_model", "eagle3"):
        out["model"] = draft_dir
        out["draft_sample_method"] = spec.draft_sample_method
        if spec.draft_tensor_parallel_size:
            out["draft_tensor_parallel_size"] = spec.draft_tensor_parallel_size
    if spec.method == "mtp":
        out["draft_sample_method"] = spec.draft_sample_method
    if spec.method == "ngram":
        out["prompt_lookup_min"] = spec.prompt_lookup_min
        out["prompt_lookup_max"] = spec.prompt_lookup_max
    return out
