"""Everything rlspec reads, writes or fills inside vLLM, in one place: the attributes and methods it
uses per class (VLLM_SURFACE, checked against the installed wheel in both model runners by
tests/speculation/test_runner_api.py), and the slots the device history drafter plugs into (SLOTS,
checked at a run's start by `require_slots`, and by the plugin before it installs anything). The
runner a GPU engine gets per method is rlspec/speculation/vllm_config.py's `gpu_model_runner`; the
environment that would force another is refused by rlspec/config/checks.py."""
from __future__ import annotations

V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
# speculation.history, as the Generator passes it to either history drafter, in vLLM's
# additional_config: the config for plugins, which every executor hands its workers with the rest
# of the engine's config (a process environment variable would not reach Ray's workers)
CONFIG_KEY = "rlspec_history"


def history_settings(vllm_config) -> dict:
    """speculation.history's fields as the engine was given them ({}: an engine built without)."""
    extra = getattr(vllm_config, "additional_config", None)
    return dict(extra.get(CONFIG_KEY) or {}) if isinstance(extra, dict) else {}

# Attribute or method -> the vLLM classes (module:class) that must have it, for each use in speculation/ and
# rlspec/engines/vllm_engine.py.
VLLM_SURFACE = {
    "dynamic_sd_lookup": ["vllm.v1.core.sched.scheduler:Scheduler"],          # k per batch size
    "running": ["vllm.v1.core.sched.scheduler:Scheduler"],                    # step timing
    "waiting": ["vllm.v1.core.sched.scheduler:Scheduler"],
    "use_v2_model_runner": ["vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.cpu_worker:CPUWorker"],
    "propose_draft_token_ids": ["vllm.v1.worker.gpu_model_runner:GPUModelRunner",   # V1 only
                                "vllm.v1.worker.cpu_model_runner:CPUModelRunner"],
    "input_batch": ["vllm.v1.worker.gpu_model_runner:GPUModelRunner"],          # V1 only
    # the history drafter matches rows to requests as vLLM's suffix proposer does (V1 only)
    **{m: ["vllm.v1.worker.gpu_input_batch:InputBatch"] for m in ("req_ids", "num_prompt_tokens")},
    "drafter": ["vllm.v1.worker.gpu_model_runner:GPUModelRunner"],  # V1 (speculation=history runs there)
    # the device history drafter's width of drafts on V1 (history/device/proposer.py)
    "use_async_scheduling": ["vllm.v1.worker.gpu_model_runner:GPUModelRunner"],
    "step": ["vllm.v1.engine.llm_engine:LLMEngine"],
    "has_unfinished_requests": ["vllm.v1.engine.llm_engine:LLMEngine"],
    "add_request": ["vllm.v1.engine.llm_engine:LLMEngine"],
    "abort_request": ["vllm.v1.engine.llm_engine:LLMEngine"],
    # the RL weight-update API every refit goes through (both runners' workers)
    **{m: ["vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.cpu_worker:CPUWorker"]
       for m in ("init_weight_transfer_engine", "start_weight_update", "start_draft_weight_update",
                 "update_weights", "finish_weight_update", "get_draft_model")},
    **{m: ["vllm:LLM"] for m in ("init_weight_transfer_engine", "start_weight_update", "start_draft_weight_update",
                                  "update_weights", "finish_weight_update", "collective_rpc", "get_metrics",
                                  "reset_prefix_cache", "sleep", "wake_up")},
    # the weight-transfer engines rlspec hosts (engine side) and drives (trainer side)
    **{m: ["vllm.distributed.weight_transfer.nccl_engine:NCCLWeightTransferEngine",
           "vllm.distributed.weight_transfer.ipc_engine:IPCWeightTransferEngine"]
       for m in ("parse_init_info", "parse_update_info", "init_transfer_engine", "receive_weights",
                 "start_weight_update", "finish_weight_update", "set_weight_update_target",
                 "reset_weight_update_target", "shutdown")},
    "send_weights": ["vllm.distributed.weight_transfer.nccl_engine:NCCLTrainerWeightTransferEngine",
                     "vllm.distributed.weight_transfer.ipc_engine:IPCTrainerWeightTransferEngine"],
    "trainer_init": ["vllm.distributed.weight_transfer.factory:WeightTransferTrainerFactory",
                     "vllm.distributed.weight_transfer.nccl_engine:NCCLTrainerWeightTransferEngine",
                     "vllm.distributed.weight_transfer.ipc_engine:IPCTrainerWeightTransferEngine"],
    "register_engine": ["vllm.distributed.weight_transfer.factory:WeightTransferTrainerFactory",
                        "vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory"],
}
# Methods the V1-only hooks skip on Model Runner V2, where they do not exist.
V1_ONLY = ("propose_draft_token_ids", "input_batch")


# The device history drafter's slots (rlspec/speculation/history/device/proposer.py), as vLLM 0.32 has them:
# modules, names and propose() parameters
PINNED_VLLM = "0.32"
V1_PROPOSE = ("num_speculative_tokens", "num_tokens_no_spec", "token_ids_gpu", "valid_sampled_token_ids_gpu",
              "valid_sampled_tokens_count")
V2_PROPOSE = ("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states",
              "num_sampled", "num_rejected", "last_sampled", "next_prefill_tokens", "temperature", "seeds")
SLOTS = (("vllm.v1.spec_decode.ngram_proposer_gpu", "NgramProposerGPU", V1_PROPOSE),
         ("vllm.v1.worker.gpu.spec_decode.ngram.speculator", "NgramGPUSpeculator", V2_PROPOSE),
         (V1_RUNNER, "NgramProposerGPU", None),   # the name V1's runner builds its ngram_gpu drafter from
         (V1_RUNNER, "update_ngram_gpu_tensors_incremental", None),   # the CPU stand-ins replace these two
         (V1_RUNNER, "copy_num_valid_draft_tokens", None),
         # where a finished request's row is kept: V1's hook for request-scoped state, V2's slot freeing
         (V1_RUNNER, "GPUModelRunner._on_request_state_removed", None),
         ("vllm.v1.worker.gpu.states", "RequestState.remove_request", None))


def slots_changed(runner: bool = True) -> list[str]:
    """How the installed vLLM's ngram_gpu slots differ from those this drafter plugs into ([]: they
    are the same): a module, a name or a propose() parameter list that moved. runner=False: the two
    drafter classes only (V1's runner module is not imported)."""
    import importlib
    import inspect

    out = []
    for module, name, params in SLOTS if runner else SLOTS[:2]:
        try:
            obj = importlib.import_module(module)
            for part in name.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            out.append(f"{module}.{name} is gone ({type(exc).__name__}: {exc})")
            continue
        if params is not None:
            got = tuple(inspect.signature(getattr(obj, "propose")).parameters)[1: 1 + len(params)]
            if got != params:
                out.append(f"{module}.{name}.propose takes {got}, not {params}")
    return out


def require_slots() -> None:
    """At a run's start (speculation.history.drafter=device): a clear error where vLLM's slots moved."""
    problems = slots_changed()
    if problems:
        import vllm

        raise RuntimeError(f"speculation.history.drafter=device plugs into vLLM {PINNED_VLLM}'s ngram_gpu slots, and "
                           f"the installed vLLM {vllm.__version__} differs: " + "; ".join(problems)
                           + ". Use speculation.history.drafter=host, or the vLLM version pyproject.toml pins.")

