"""What rlspec touches inside vLLM exists where it is used, in both model runners: vLLM picks
Model Runner V2 on every GPU (this CPU build runs V1 only), so the classes are read from the
installed wheel rather than run. Also: which runner a GPU gets for each speculation method,
against vLLM's own rule."""
import importlib
import inspect
from types import SimpleNamespace

import pytest

from rlspec.config import SpeculationConfig
from rlspec.speculation.vllm_hooks import V1_ONLY, VLLM_SURFACE
from rlspec.speculation.vllm_config import gpu_model_runner, vllm_speculative_config

V2_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"


def load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def has(cls, attr: str) -> bool:
    """A class attribute or method, or an attribute its constructor (or a parent's) assigns."""
    if hasattr(cls, attr):
        return True
    return any(f"self.{attr} =" in src or f"self.{attr}:" in src
               for src in (inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("vllm")))


@pytest.mark.parametrize("attr,classes", sorted(VLLM_SURFACE.items()))
def test_every_vllm_attribute_rlspec_touches_exists(attr, classes):
    for path in classes:
        assert has(load(path), attr), f"{path} has no {attr}"


def test_v1_only_hooks_are_absent_from_v2_and_guarded():
    """The V2 runner has none of the V1-only attributes; the hook that uses them returns at once
    on a V2 worker (it never reads the runner)."""
    from rlspec.speculation.calibration import _set_drafting

    v2 = load(V2_RUNNER)
    assert not any(has(v2, a) for a in V1_ONLY)
    assert has(v2, "get_draft_model") and has(v2, "speculator")

    class NoRunner:
        use_v2_model_runner = True

        @property
        def model_runner(self):
            raise AssertionError("the V1 hook read a V2 runner")

    _set_drafting(NoRunner(), False)


def unsupported_on_v2(method: str) -> list[str]:
    """vLLM's own list of features V2 lacks, for a GPU engine with this speculation method."""
    from vllm.config.vllm import VllmConfig

    spec = None if method == "none" else SimpleNamespace(method=method, parallel_drafting=False,
                                                          use_heterogeneous_vocab=False)
    cfg = SimpleNamespace(speculative_config=spec, parallel_config=SimpleNamespace(
        distributed_executor_backend="ray", pipeline_parallel_size=1, use_ubatching=False))
    return VllmConfig._get_v2_model_runner_unsupported_features(cfg)


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "eagle3", "mtp", "custom_class", "suffix"])
def test_gpu_runner_choice_matches_vllm(method):
    want = "V1" if unsupported_on_v2(method) else "V2"
    assert gpu_model_runner(SpeculationConfig(method=method)) == want
    assert want == ("V1" if method in ("custom_class", "suffix") else "V2")


def test_history_drafter_is_a_vllm_custom_proposer_run_by_v1():
    """speculation=history is vLLM's 'custom_class' method, which V2 does not take (GPUs fall back
    to V1); V1 calls it with the batch's token rows, and vLLM's factory builds it from its path."""
    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer

    from rlspec.speculation.history.host.proposer import PROPOSER, HistoryProposer

    spec = SpeculationConfig(method="history", num_speculative_tokens=3)
    assert vllm_speculative_config(spec, None) == {"method": "custom_class", "model": PROPOSER,
                                                   "num_speculative_tokens": 3}
    assert gpu_model_runner(spec) == "V1" and unsupported_on_v2("custom_class")
    src = inspect.getsource(load("vllm.v1.worker.gpu_model_runner:GPUModelRunner").propose_draft_token_ids)
    call = src[src.index('spec_config.method == "custom_class"'):][:400]
    assert all(a in call for a in ("sampled_token_ids,", "self.input_batch.num_tokens_no_spec,",
                                   "self.input_batch.token_ids_cpu,"))
    assert list(inspect.signature(HistoryProposer.propose).parameters)[1:4] == [
        "sampled_token_ids", "num_tokens_no_spec", "token_ids_cpu"]
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(model=PROPOSER, num_speculative_tokens=3),
                          model_config=SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 1000))
    assert isinstance(create_custom_proposer(cfg), HistoryProposer)


def test_adaptive_schedule_names_every_k_and_parses_in_vllm():
    """Under 'auto' the configured schedule holds every k from 1 to k_max (each a captured CUDA
    graph shape) and is one vLLM accepts."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    spec = SpeculationConfig(method="draft_model", num_speculative_tokens="auto", max_speculative_tokens=5)
    sched = vllm_speculative_config(spec, "/draft")["num_speculative_tokens_per_batch_size"]
    dense = build_dynamic_sd_schedule_lookup(sched, 256, 5)
    assert set(dense[1:]) == {1, 2, 3, 4, 5} and len(dense) == 257


def test_the_device_history_drafter_takes_ngram_gpus_slot_in_both_runners():
    """speculation.history.drafter=device is vLLM's ngram_gpu method (V2 takes it: GPUs run V2);
    rlspec's plugin puts its subclasses under the names both runners build ngram_gpu from: V1's
    NgramProposerGPU (called with the runner's device token rows) and V2's NgramGPUSpeculator
    (imported by init_speculator when it builds one)."""
    from vllm.v1.spec_decode import ngram_proposer_gpu
    from vllm.v1.worker.gpu.spec_decode import init_speculator
    from vllm.v1.worker.gpu.spec_decode.ngram import speculator

    from rlspec.speculation.history.device.proposer import MARK, install

    spec = SpeculationConfig(method="history", num_speculative_tokens=3)
    spec.history.drafter = "device"
    assert vllm_speculative_config(spec, None) == {"method": "ngram_gpu", "model": MARK, "num_speculative_tokens": 3,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 1}
    assert gpu_model_runner(spec) == "V2" and not unsupported_on_v2("ngram_gpu")
    install()
    runner = load("vllm.v1.worker.gpu_model_runner:GPUModelRunner")
    import vllm.v1.worker.gpu_model_runner as v1

    assert v1.NgramProposerGPU is ngram_proposer_gpu.NgramProposerGPU
    assert v1.NgramProposerGPU.__name__ == "DeviceHistoryProposer"
    assert speculator.NgramGPUSpeculator.__name__ == "DeviceHistorySpeculator"
    src = inspect.getsource(runner.propose_draft_token_ids)
    call = src[src.index("draft_token_ids, num_valid_draft_tokens = self.drafter.propose("):][:400]
    assert all(a in call for a in ("num_spec_tokens_to_schedule,", "self.num_tokens_no_spec_gpu[:batch_size],",
                                   "self.token_ids_gpu_tensor[:batch_size],", "valid_sampled_token_ids_gpu,",
                                   "valid_sampled_tokens_count,"))
    src = inspect.getsource(init_speculator)
    assert "from vllm.v1.worker.gpu.spec_decode.ngram.speculator import" in src and "use_ngram()" in src


def test_both_history_drafters_answer_the_generators_calls_and_are_chosen_from_the_engines_config():
    """The Generator reaches either backend through the same entry points (drafters.DRAFTER_CALLS,
    the same parameters), and picks the backend from the speculative_config it gives vLLM, as
    'auto' calibration does."""
    import inspect

    from rlspec.speculation.history.device import proposer as device_proposer
    from rlspec.speculation.history.host import proposer as history_proposer
    from rlspec.speculation.history.drafters import DRAFTER_CALLS, history_drafter

    for name in DRAFTER_CALLS:
        host, device = getattr(history_proposer, name), getattr(device_proposer, name)
        assert list(inspect.signature(host).parameters) == list(inspect.signature(device).parameters), name
    spec = SpeculationConfig(method="history", num_speculative_tokens=3)
    assert history_drafter(vllm_speculative_config(spec, None)) is history_proposer
    spec.history.drafter = "device"
    assert history_drafter(vllm_speculative_config(spec, None)) is device_proposer
    assert history_drafter(vllm_speculative_config(SpeculationConfig(method="ngram"), None)) is None
    assert history_drafter(None) is None
