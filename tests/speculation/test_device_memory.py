"""The device history drafter's memory inside vLLM's budget: a step's peak bytes, counted from the
allocator's own events under torch's profiler, held to the plan (rlspec/speculation/
history/device/memory.py) at shapes and settings its constants were not fitted on; the store's planned
bytes equal to its tensors'; vLLM's profile run drafting a step at the engine's largest shape on
both runners; the dry run's memory table taking the drafter from the engine's KV cache."""
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import compose
from rlspec.checks import plan_of, resolve_auto
from rlspec.cluster.memory import device_drafter_gib, gpu_memory
from rlspec.speculation import MAX_SIBLINGS, MAX_VOTERS
from rlspec.speculation.history.device.live import LiveRows
from rlspec.speculation.history.device.store import DeviceHistory
from rlspec.speculation.history.device.kernels import Workspace
from rlspec.speculation.history.device.memory import (COUNT_WIDTH, live_bytes, store_bytes, workspace_bytes,
                                                       working_bytes)
from rlspec.speculation.history.device.proposer import MARK, _proposer_class, _speculator_class, profile_step

DEFAULTS = dict(width=64, max_match=16, prompt_keys=(8, 3, 1), max_siblings=MAX_SIBLINGS, max_voters=MAX_VOTERS,
                global_source=True)


def peak_bytes(fn) -> int:
    """The most bytes fn's tensors held at once on the CPU allocator (its allocation and free
    events, in order, as the profiler records them)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def planned(rows, L, k, s) -> int:
    return working_bytes(rows, L, k, len(s["prompt_keys"]), s["width"], s["max_match"], s["max_siblings"],
                         s["max_voters"], s["global_source"], COUNT_WIDTH)


@pytest.mark.parametrize("settings,k", [
    ({}, 5), ({"width": 16}, 3), ({"max_match": 24, "prompt_keys": (12, 4, 2)}, 7),
    ({"max_siblings": 4, "max_voters": 16, "width": 2}, 4), ({"global_source": False, "prompt_keys": (3,)}, 2)])
@pytest.mark.parametrize("rows,L", [(2, 48), (12, 320), (24, 1536), (6, 6144)])
def test_a_steps_peak_bytes_are_within_the_plan(settings, k, rows, L):
    """profile_step (what vLLM's profile run executes) at rows x L: measured <= planned, and the
    plan, an upper bound adding the step's phases, at most 4x the measured peak; where the rows'
    windows dominate (L of thousands) at most 2.25x."""
    s = {**DEFAULTS, **settings}
    h = DeviceHistory(max_tokens=1 << 12, vocab_size=1000, **{x: s[x] for x in DEFAULTS})
    h.insert([[1, 2, 3]] * 4, [list(range(5, 60))] * 4)
    live = LiveRows(rows, rows, L, h.prompt_keys, "cpu", table=False)
    p = SimpleNamespace(history=h, live=live, work=None, max_model_len=L, device=torch.device("cpu"), k=k)
    measured, plan = peak_bytes(lambda: profile_step(p, rows)), planned(rows, L, k, s)
    print(f"{settings} k={k} rows={rows} L={L}: measured {measured} planned {plan} ({plan / measured:.2f}x)")
    assert measured <= plan <= 4 * measured
    if L >= 4096:
        assert plan <= 2.25 * measured
    assert not live.done and not live.n.any()   # the profile's rows are not the call's


@pytest.mark.parametrize("settings", [{}, {"width": 16, "global_source": False}, {"prompt_keys": (4, 1)}])
def test_the_planned_store_is_the_stores_tensors(settings):
    s = {**DEFAULTS, **settings}
    h = DeviceHistory(max_tokens=3 << 12, **{x: s[x] for x in DEFAULTS})
    assert store_bytes(3 << 12, len(s["prompt_keys"]), s["width"], s["global_source"], COUNT_WIDTH) == h.nbytes
    for table in (False, True):
        live = LiveRows(5, 5, 300, s["prompt_keys"], "cpu", table)
        assert live_bytes(5, 300, len(s["prompt_keys"]), table) == live.nbytes
    for k in (1, 5):   # a kernel step's memory, allocated with the drafter
        assert workspace_bytes(5, k, len(s["prompt_keys"]), s["max_match"], s["max_siblings"]) == \
            Workspace(h, live, k).nbytes


def _vllm_config(rows=3, L=200, k=4):
    return SimpleNamespace(speculative_config=SimpleNamespace(model=MARK, num_speculative_tokens=k),
                           scheduler_config=SimpleNamespace(max_num_seqs=rows),
                           model_config=SimpleNamespace(max_model_len=L, get_vocab_size=lambda: 100))


def test_vllms_profile_run_drafts_a_step_at_the_engines_largest_shape_on_both_runners():
    """Model Runner V1's profile run (which calls no ngram_gpu drafter) drafts a step after its own;
    V2's calls its speculator with is_profile, which drafts one; V2's other dummy runs (CUDA graph
    capture) draft nothing. The step's peak is the plan's working set at max_num_seqs x
    max_model_len."""
    pytest.importorskip("vllm")
    from vllm.v1.spec_decode.ngram_proposer_gpu import NgramProposerGPU
    from vllm.v1.worker.gpu.spec_decode.ngram import speculator

    rows, L, k = 3, 200, 4
    ran = []
    runner = SimpleNamespace(_on_request_state_removed=lambda req_id, state: None,
                             profile_run=lambda *a, **kw: ran.append("model"))
    v1 = _proposer_class(NgramProposerGPU)(_vllm_config(rows, L, k), torch.device("cpu"), runner)
    v1_peak = peak_bytes(runner.profile_run)
    assert ran == ["model"] and not v1.live.done
    states = SimpleNamespace(remove_request=lambda req_id: None)
    v2 = _speculator_class(speculator.NgramGPUSpeculator)(_vllm_config(rows, L, k), torch.device("cpu"), states)
    batch = SimpleNamespace(num_reqs=2)

    def dummy(**kw):
        return v2.propose(batch, None, None, None, None, None, None, None, None, None, None, dummy_run=True, **kw)
    v2_peak = peak_bytes(lambda: dummy(is_profile=True))
    s = {**DEFAULTS, "prompt_keys": (8, 3, 1)}
    assert planned(rows, L, k, s) >= v2_peak == v1_peak >= 4 * 2 * rows * L   # at least the rows' tokens
    assert peak_bytes(lambda: dummy(is_profile=False)) < 1024


def test_the_dry_run_takes_the_device_drafters_memory_from_the_engines_kv_cache():
    """rl_zero_qwen3_8b on GB200s with the device drafter: its store, the call's rows and a step
    at 1,024 rows (vLLM's default max_num_seqs on a GPU of 70 GiB or more) x max_model_len are
    counted inside the engine's share, and the store and the rows stay while the engine
    sleeps through the train stage (colocated); the host drafter (in the engine's host process)
    counts none."""
    over = ["+experiment=rl_zero_qwen3_8b", "speculation.method=history", "speculation.model=null"]
    device = resolve_auto(compose([*over, "speculation.history.drafter=device"], plain=False))
    host = resolve_auto(compose(over, plain=False))
    dm, hm = gpu_memory(device, plan_of(device)), gpu_memory(host, plan_of(host))
    d, h = dm.roles[0], hm.roles[0]
    hist, L = device.speculation.history, device.model.max_model_len
    rows = 1024
    # on a GPU the step runs in kernels, their memory allocated with the drafter (kernels.Workspace)
    resident = (store_bytes(hist.device.max_tokens, 3, hist.max_candidates, True, COUNT_WIDTH)
                + live_bytes(rows, L, 3, False)
                + workspace_bytes(rows, device.speculation.k_max, 3, hist.max_match, MAX_SIBLINGS)) / 2**30
    working = planned(rows, L, device.speculation.k_max, DEFAULTS) / 2**30
    assert device_drafter_gib(device) == pytest.approx((resident, working)) and d.drafter == pytest.approx(
        resident + working) and d.drafter > 1.0
    # with the live table, a step in the kernels allocates nothing beside them; in torch it would
    on_table = [*over, "speculation.history.drafter=device", "speculation.history.device.lookup=table"]
    table = resolve_auto(compose(on_table, plain=False))
    assert device_drafter_gib(table)[1] == 0.0 and device_drafter_gib(table)[0] > resident
    torch_table = resolve_auto(compose([*on_table, "speculation.history.device.kernels=false"], plain=False))
    assert device_drafter_gib(torch_table)[1] == pytest.approx(working)
    assert h.drafter == 0.0 and d.engine == pytest.approx(h.engine - d.drafter) and d.total == pytest.approx(h.total)
    assert device.generation.sleep_mode and device.cluster.placement == "colocated"
    assert dm.stages["train"] - hm.stages["train"] == pytest.approx(resident)
    assert dm.stages["generation"] == pytest.approx(hm.stages["generation"])
    print(dm.describe())
