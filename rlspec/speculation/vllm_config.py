"""rlspec's `speculation` config to the `speculative_config` dict vLLM's LLM takes."""
from __future__ import annotations

from rlspec.config import SpeculationConfig
from rlspec.config.schema import V1_ONLY_METHODS


def vllm_speculative_config(spec: SpeculationConfig, draft_dir: str | None) -> dict | None:
    """The dict vLLM's LLM(speculative_config=...) takes, or None without speculation."""
    if spec.method == "none":
        return None
    out: dict = {"method": spec.method, "num_speculative_tokens": spec.k_max}
    if spec.method == "history" and spec.history.drafter == "device":
        # rlspec's drafter on the engine's device, in vLLM's ngram_gpu slot (its n-gram settings unread)
        from rlspec.speculation.history.device.proposer import MARK

        out.update(method="ngram_gpu", model=MARK, prompt_lookup_min=1, prompt_lookup_max=1)
    elif spec.method == "history":  # rlspec's own drafter, hosted as vLLM's custom proposer
        from rlspec.speculation.history.host.proposer import PROPOSER

        out.update(method="custom_class", model=PROPOSER)
    if spec.adaptive:
        # Built for the largest k; the scheduler's batch-size schedule (rewritten every call by
        # rlspec.speculation.calibration) picks the k each engine step uses. Every k from 1 to
        # k_max appears in the configured schedule, so under CUDA graphs vLLM captures a decode
        # shape for each k the planner may write (k=0 is a plain decode step, always captured).
        out["num_speculative_tokens_per_batch_size"] = adaptive_schedule(spec.k_max)
    if spec.method in ("draft_model", "eagle3"):
        out["model"] = draft_dir
        out["draft_sample_method"] = spec.draft_sample_method
        if spec.draft_tensor_parallel_size:
            out["draft_tensor_parallel_size"] = spec.draft_tensor_parallel_size
    if spec.method == "mtp":
        out["draft_sample_method"] = spec.draft_sample_method
    if spec.method == "suffix":  # vLLM's suffix decoding (arctic-inference: make suffix-install)
        sx = spec.suffix
        out.update(suffix_decoding_max_tree_depth=sx.max_tree_depth, suffix_decoding_max_spec_factor=sx.max_spec_factor,
                   suffix_decoding_min_token_prob=sx.min_token_prob,
                   suffix_decoding_max_cached_requests=sx.max_cached_requests)
    if spec.method == "ngram":
        out["prompt_lookup_min"] = spec.prompt_lookup_min
        out["prompt_lookup_max"] = spec.prompt_lookup_max
    return out


def adaptive_schedule(k_max: int) -> list[list[int]]:
    """vLLM's (first batch size, last batch size, k) ranges naming every k in k_max..1 once: the
    planner overwrites the k per batch size before every call, the ranges only make vLLM capture
    (and accept) each k."""
    return [[b, b, k_max + 1 - b] for b in range(1, k_max)] + [[k_max, 1 << 20, 1]]




def gpu_model_runner(spec: SpeculationConfig) -> str:
    """The model runner vLLM picks for this speculation on a GPU ("V1" or "V2"): V2 wherever
    Triton runs, except for the methods V2 does not implement (vLLM's own rule, checked against
    the installed wheel by tests/speculation/test_runner_api.py): the host history drafter is a
    custom proposer, the device one vLLM's ngram_gpu. The CPU build always runs V1."""
    host_history = spec.method == "history" and spec.history.drafter == "host"
    return "V1" if spec.method in V1_ONLY_METHODS or host_history else "V2"

