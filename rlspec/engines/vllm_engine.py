"""vLLM engine set-up and in-place weight refit. The engine runs in-process (no engine
sub-process), so a refit is a plain `reload_weights` call on the same tensors' memory."""
from __future__ import annotations

import gc
import os
import time
from typing import Iterable

import torch

from rlspec.config import GenerationConfig


def engine_env(gen: GenerationConfig) -> None:
    """Environment vLLM reads at import/start; set before `import vllm`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(gen.cpu_kv_cache_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def make_llm(model_path: str, gen: GenerationConfig, max_model_len: int, seed: int,
             tokenizer: str | None = None, speculative_config: dict | None = None):
    engine_env(gen)
    from vllm import LLM

    # Engine start-up runs gc.collect() seven times over the heap that vLLM's imports left (2.5 s
    # of a 5 s start on the tiny CPU model). That heap lives as long as the process: take it out
    # of the collector's sight first (vLLM freezes its own heap the same way once it is up).
    gc.freeze()

    kwargs = dict(
        model=model_path, tokenizer=tokenizer or model_path, dtype=gen.dtype, seed=seed,
        max_model_len=max_model_len, enforce_eager=gen.enforce_eager,
        tensor_parallel_size=gen.tensor_parallel_size,
        # Returned log-probs are those of the distribution actually sampled from (temperature,
        # top-k/top-p applied): the behaviour policy an RL trainer needs.
        logprobs_mode="processed_logprobs",
        disable_log_stats=False,  # spec-decode counters come from get_metrics()
        enable_prefix_caching=False,
    )
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = gen.gpu_memory_utilization
    if gen.tensor_parallel_size > 1:
        # TP workers are Ray actors in the bundles placement chose (VLLM_RAY_BUNDLE_INDICES).
        kwargs["distributed_executor_backend"] = "ray"
    if gen.expert_parallel:
        kwargs["enable_expert_parallel"] = True
    if gen.sleep_mode:
        from vllm.platforms import current_platform

        if not current_platform.is_sleep_mode_available():
            raise RuntimeError(f"generation.sleep_mode=true: vLLM has no sleep mode on this platform "
                               f"({current_platform.device_name}); it needs a CUDA or ROCm GPU "
                               "(set generation.sleep_mode=false)")
        kwargs["enable_sleep_mode"] = True
    if speculative_config:
        kwargs["speculative_config"] = speculative_config
    return LLM(**kwargs)


def with_tied_head(weights: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """An in-place reload unties vLLM's lm_head from the embedding: send it explicitly, or the
    engine keeps sampling from the old output layer."""
    if tied and "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
        return {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
    return weights


def reload_weights(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Copy Hugging Face-named weights into the running engine; returns seconds taken."""
    t0 = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights)})
    llm.reset_prefix_cache()
    return time.perf_counter() - t0


def _reload_drafter(worker, weights: dict[str, torch.Tensor]) -> None:
    from vllm.model_executor.model_loader.reload.inplace import reload_weights as vllm_reload

    runner = worker.model_runner
    model = runner.drafter.model
    weights = with_tied_head(weights, getattr(model.config, "tie_word_embeddings", False))
    vllm_reload(runner.vllm_config, model, weights_iterator=list(weights.items()), weights_path=None,
                is_checkpoint_format=True)


def reload_draft_weights(llm, weights: dict[str, torch.Tensor]) -> float:
    """Copy Hugging Face-named draft weights into the engine's drafter, in place."""
    t0 = time.perf_counter()
    llm.collective_rpc(_reload_drafter, args=(weights,))
    llm.reset_prefix_cache()
    return time.perf_counter() - t0
