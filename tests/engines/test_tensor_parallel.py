"""Tensor-parallel engines (generation.tensor_parallel_size=2) on this CPU, through vLLM's Ray
executor as a GPU cluster runs them: rlspec's plan and placement groups (one bundle a rank, named to
vLLM in VLLM_RAY_BUNDLE_INDICES) on a Ray cluster declaring 2 GPUs, none needed; vLLM's CPU
platform given a Ray device key (tests/helpers/ray_on_cpu.py), the ranks talking over gloo. One
child process (tests/helpers/tp_engine.py) runs TP=1 without speculation, then TP=2 with each
drafter rlspec builds on vLLM (history on the device under async scheduling, a GPU's default, and
on the host; a draft model; EAGLE-3), on Model Runner V1; a second runs TP=2 on Model Runner V2
scheduling asynchronously, as a GPU runs it, each engine's ranks on two Ray nodes. vLLM's own
n-gram drafter ran here too (tp_engine.py ngram) and is left out of the suite for time: it drafts
on the host from the token ids alone, as at TP=1."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, child_env

pytest.importorskip("vllm")

METHODS = ("history_device_async", "history", "draft_model", "eagle3")
V2_METHODS = ("history_device_async", "eagle3_async", "draft_model_async")


def _run(methods, runner: str, **env) -> tuple[dict, dict]:
    """tests/helpers/tp_engine.py for `methods` at TP=2 on Model Runner `runner`: the TP=1
    reference (V1, no speculation) and the engines by method, each checked against the reference
    (greedy answers on every call, the refit included) and for a silent fallback."""
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "tp_engine.py"), *methods],
                         env={**child_env(), **env}, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    ref, *engines = json.loads(run.stdout.strip().splitlines()[-1])
    assert (ref["runner"]["model_runner"], ref["runner"]["executor"], ref["runner"]["tensor_parallel_size"]) == \
           ("V1", "uni", 1), ref["runner"]
    assert ref["refit_on_rank"] == [True]
    want = [c["answers"] for c in ref["calls"]]
    assert want[2] != want[0]   # the refit changed the policy's answers
    by = {e["method"]: e for e in engines}
    assert list(by) == list(methods)
    for m, e in by.items():
        r = e["runner"]   # no silent fallback to one rank, another executor, another runner
        assert (r["model_runner"], r["async_scheduling"], r["executor"], r["tensor_parallel_size"]) == \
               (runner, m.endswith("_async"), "ray", 2), (m, r)
        assert e["bundles"] == "0,1", m   # one rank in each of the engine's two bundles
        assert [c["answers"] for c in e["calls"]] == [want[0], want[0], want[2]][:len(e["calls"])], m
    return ref, by


def _device_drafter_ranks_agree(dev: dict) -> None:
    """The device drafter's refit, settings and store on both ranks, and their equal counters
    every call, the second drafting from the first's answers (under async scheduling each rank
    drafts its own inputs: ranks that disagreed would break the engine)."""
    assert dev["refit_on_rank"] == [True, True]
    assert dev["settings_by_rank"] == [[65536, 7], [65536, 7]]
    assert dev["stores_equal"]
    for ranks in dev["history_by_rank"]:
        assert len(ranks) == 2 and ranks[0] == ranks[1], ranks
    assert dev["history_by_rank"][1][0]["accepted_history"] > 0


@pytest.mark.slow  # five engines, four of them two ranks: about 4 minutes
def test_tensor_parallel_engines_on_vllms_ray_executor_answer_as_one_rank():
    """Greedy: every TP=2 engine answers as the TP=1 engine without speculation, on every call (the
    float sums of two ranks' partial products are taken in another order than one rank's; the
    answers' greedy margins on these prompts hold through it). The refit reaches both ranks (the
    weight read back equal on each) and the answers after it equal TP=1's after the same refit. Both
    history drafters' settings (vLLM's additional_config) reach both ranks; the device drafter's
    ranks draft the same (equal counters every call), from the history on the second call, and hold
    the same store (the checkpoint saves the first's), under async scheduling."""
    _, by = _run(METHODS, "V1")
    assert {m: by[m]["runner"]["speculation"] for m in METHODS} == {
        "history_device_async": "ngram_gpu", "history": "custom_class",
        "draft_model": "draft_model", "eagle3": "eagle3"}
    assert all(c["accepted"] > 0 for m in ("draft_model", "eagle3") for c in by[m]["calls"])

    _device_drafter_ranks_agree(by["history_device_async"])
    # the host drafter drafts on one rank (the other holds no store) and from the history too
    host = by["history"]["history_by_rank"]
    assert by["history"]["settings_by_rank"] == [[65536, 7], [65536, 7]]   # vLLM's additional_config, every rank
    assert [len(r) for r in host] == [2, 2] and all(r[1] is None for r in host)
    assert host[1][0]["accepted_history"] > 0


@pytest.mark.slow  # four engines, three of them two ranks on Model Runner V2: about 2 minutes
def test_tensor_parallel_engines_across_two_nodes_on_model_runner_v2_answer_as_one_rank():
    """What a GPU cluster runs for a model that needs tensor parallelism over nodes: two Ray nodes
    (on loopback, one declared GPU each), TP=2 through vLLM's Ray executor with a rank on each node,
    Model Runner V2 in both ranks (its Triton kernels in Triton's interpreter, set up in every Ray
    worker: tests/helpers/ray_on_cpu.py), scheduling asynchronously, with the device drafter,
    EAGLE-3 and a draft model. Greedy answers equal TP=1's on V1 without speculation on every call,
    the refit included; drafts are accepted; the device drafter's ranks agree as on one node."""
    _, by = _run(V2_METHODS, "V2", VLLM_USE_V2_MODEL_RUNNER="1", TRITON_INTERPRET="1", TP_NODES="2")
    for m, e in by.items():   # one rank on each node
        assert len(set(e["node_by_rank"])) == 2, (m, e["node_by_rank"])
    assert {m: by[m]["runner"]["speculation"] for m in V2_METHODS} == {
        "history_device_async": "ngram_gpu", "eagle3_async": "eagle3", "draft_model_async": "draft_model"}
    assert all(c["accepted"] > 0 for m in ("eagle3_async", "draft_model_async") for c in by[m]["calls"])
    _device_drafter_ranks_agree(by["history_device_async"])
