"""`speculation.history.drafter=device`: the device drafter in vLLM's ngram_gpu slot (Model Runner
V1, the runner vLLM's CPU build runs), through a Generator on the tiny policy; its store's saved
state; and the Model Runner V2 speculator's reading of the runner's request states (V2 does not
run on CPU: its state is built here as the runner holds it)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlspec.speculation import SOURCES
from rlspec.speculation.history.device.store import END, DeviceHistory, prompt_hash
from rlspec.speculation.history.state import merge_states
from rlspec.speculation.history.stats import HistoryStats

SMALL = dict(max_tokens=1 << 12, width=8, max_match=8, prompt_keys=(4, 2, 1))


def test_append_sampled_writes_the_valid_tokens_after_each_row():
    from rlspec.speculation.history.device.call import append_sampled

    ids = torch.zeros(3, 6, dtype=torch.int32)
    ids[:, :2] = torch.tensor([[1, 2], [3, 4], [5, 6]])
    lengths = torch.tensor([2, 2, 5], dtype=torch.int32)
    sampled = torch.tensor([[7, 8, -1], [9, -1, -1], [10, 11, 12]])
    count = torch.tensor([2, 1, 3], dtype=torch.int32)
    new = append_sampled(ids, lengths, sampled, count)
    assert new.tolist() == [4, 3, 8]   # row 3's length is past the buffer: counted, not written
    assert ids.tolist() == [[1, 2, 7, 8, 0, 0], [3, 4, 9, 0, 0, 0], [5, 6, 0, 0, 0, 10]]


def _drafts(store, rows, prompt_lens, k=4):
    L = max(map(len, rows)) + 1
    ids = torch.zeros(len(rows), L, dtype=torch.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    n = torch.tensor([len(r) for r in rows])
    pl = torch.tensor(prompt_lens)
    return store.propose(ids, n, prompt_hash(ids, pl), pl, k)[0].tolist()


def test_a_saved_ring_loads_into_a_fresh_store_and_drafts_the_same():
    """The store's state (its whole sequences, oldest first) loaded into an empty store of the same
    settings drafts as the store did; after the ring wrapped, the sequence that lost its start is
    left out; two engines' states merge into one store holding both."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 50, (6,), generator=g).tolist() for _ in range(12)]
    answers = [torch.randint(0, 50, (int(m),), generator=g).tolist() for m in torch.randint(8, 40, (12,), generator=g)]
    queries = [p + a[:5] for p, a in zip(prompts, answers)]
    for cap in (1 << 12, 256):   # room for all; the ring wrapped
        a = DeviceHistory(**{**SMALL, "max_tokens": cap})
        a.insert(prompts, answers)
        state = a.state_dict()
        ends = np.cumsum(state["stored"]) - 1
        assert np.all(state["arena"][ends] == END) and state["arena"].size <= a.stored()
        b = DeviceHistory(**{**SMALL, "max_tokens": cap})
        b.load_state_dict(state)
        assert _drafts(b, queries, [6] * 12) == _drafts(a, queries, [6] * 12)
    one, two = DeviceHistory(**SMALL), DeviceHistory(**SMALL)
    one.insert(prompts[:6], answers[:6])
    two.insert(prompts[6:], answers[6:])
    both = DeviceHistory(**SMALL)
    both.load_state_dict(merge_states([one.state_dict(), two.state_dict()]))
    whole = DeviceHistory(**SMALL)
    whole.insert(prompts, answers)
    assert _drafts(both, queries, [6] * 12) == _drafts(whole, queries, [6] * 12)
    with pytest.raises(ValueError, match="do not agree"):
        both.load_state_dict({**one.state_dict(), "stored": np.array([3])})
    with pytest.raises(ValueError, match="both speculation.history.drafter backends"):   # one merge for both
        merge_states([one.state_dict(), {"version": 3, "admit_below": "1", "heads": 0}])
    assert _drafts(both, queries, [6] * 12) == _drafts(whole, queries, [6] * 12)   # left as it was


def _states(plen):
    """Model Runner V2's request states as the speculator reads them (8 slots, 64 tokens wide);
    vLLM's own classes drive it in test_the_v2_speculator_on_vllms_own_request_states_on_this_cpu."""
    states = SimpleNamespace(all_token_ids=SimpleNamespace(gpu=torch.zeros(8, 64, dtype=torch.int32)),
                             total_len=SimpleNamespace(gpu=torch.zeros(8, dtype=torch.int32)),
                             prompt_len=SimpleNamespace(gpu=torch.from_numpy(plen), np=plen),
                             req_id_to_index={}, remove_request=lambda req_id: None)
    return states


def _v2_speculator(states, k=4):
    from vllm.v1.worker.gpu.spec_decode.ngram import speculator

    from rlspec.speculation.history.device.proposer import MARK, _speculator_class

    cls = _speculator_class(speculator.NgramGPUSpeculator)
    cfg = SimpleNamespace(speculative_config=SimpleNamespace(model=MARK, num_speculative_tokens=k),
                          scheduler_config=SimpleNamespace(max_num_seqs=8),
                          model_config=SimpleNamespace(max_model_len=64, get_vocab_size=lambda: 100))
    return cls(cfg, torch.device("cpu"), states)


def test_the_v2_speculator_drafts_from_the_runners_request_states():
    """Model Runner V2's slot reads each batch row's tokens, length and prompt length through the
    batch's idx_mapping into the runner's request states; a row the history has no draft for is
    filled with its last sampled token (V2 verifies K a row)."""
    pytest.importorskip("vllm")
    states = _states(np.zeros(8, dtype=np.int32))
    spec = _v2_speculator(states)
    prompt, answer = [5, 6, 7, 8], [10, 11, 12, 13, 14, 15, 16, 17]
    spec.history.insert([prompt], [answer])
    rows = {3: prompt + answer[:3], 6: [9, 9, 9, 9, 40]}   # request-state slots: one with history, one without
    for slot, r in rows.items():
        states.all_token_ids.gpu[slot, : len(r)] = torch.tensor(r)
        states.total_len.gpu[slot] = len(r)
        states.prompt_len.np[slot] = 4
    batch = SimpleNamespace(num_reqs=2, idx_mapping=torch.tensor([6, 3]), idx_mapping_np=np.array([6, 3]),
                            req_ids=["r6", "r3"])
    last = torch.zeros(8, 1, dtype=torch.int64)
    last[3, 0], last[6, 0] = 12, 40
    out = spec.propose(batch, None, None, None, None, torch.tensor([1, 1]), torch.zeros(2), last, None, None, None)
    assert out.tolist() == [[40] * 4, [13, 14, 15, 16]]
    st = spec.stats.finish(0, 0).as_dict()
    assert st["drafted_tokens"] == 4 and (st["drafted_history"], st["drafted_global"]) == (4, 0)
    z = [0] * 4   # the host drafter's schema (HistoryIndex's stats at k_max 4)
    assert st.keys() == HistoryStats(drafted_pos=z, shadow_drafted_pos=z, shadow_accepted_pos=z).as_dict().keys()
    # 'auto': the step's k (V2 passes it; it keeps that many drafts a row); k=0 looks nothing up.
    # The next step's verification of slot 3 sampled 3 tokens: 2 of its history draft accepted
    out = spec.propose(batch, None, None, None, None, torch.tensor([1, 3]), torch.zeros(2), last, None, None, None,
                       num_speculative_tokens=2)
    assert out[:, :2].tolist() == [[40] * 2, [13, 14]]
    st = spec.stats.finish(0, 0).as_dict()
    assert st["drafted_tokens"] == 6 and [st[f"drafts_ge_{i}"] for i in range(1, 5)] == [2, 2, 1, 1]
    assert (st["accepted_history"], sum(st[f"accepted_{s}"] for s in SOURCES)) == (2, 2)
    # the batch's rows swapped: credits follow the request states; slot 3 sampled 5 tokens, but its
    # last draft was 2 long
    swapped = SimpleNamespace(num_reqs=2, idx_mapping=torch.tensor([3, 6]), idx_mapping_np=np.array([3, 6]),
                              req_ids=["r3", "r6"])
    out = spec.propose(swapped, None, None, None, None, torch.tensor([5, 1]), torch.zeros(2), last, None, None, None,
                       num_speculative_tokens=0)
    st = spec.stats.finish(0, 0).as_dict()
    assert out.tolist() == [[12] * 4, [40] * 4] and st["drafted_tokens"] == 6 and st["accepted_history"] == 4
    # a step that drafted nothing leaves nothing to credit
    spec.propose(swapped, None, None, None, None, torch.tensor([5, 5]), torch.zeros(2), last, None, None, None)
    assert spec.stats.finish(0, 0).as_dict()["accepted_history"] == 4


def test_the_v2_speculator_drafts_a_resumed_answer_under_its_own_prompt():
    """Partial rollouts: vLLM holds a resumed answer as a request whose prompt is the original
    prompt plus the answer so far; given prompt_len_of (rlspec's request id -> its prompt's length),
    V2's slot drafts it as it drafts the same tokens of a request that never stopped, and reads the
    other rows' prompt lengths from the runner's request states."""
    pytest.importorskip("vllm")
    plen = np.zeros(8, dtype=np.int32)
    states = _states(plen)
    spec = _v2_speculator(states)
    # two prompts whose answers continue the same tokens differently: the prompt decides the draft
    a, b = [5, 6, 7, 8], [1, 2, 3, 4]
    spec.history.insert([a, b, b], [[10, 11, 12, 13, 14, 15, 16, 17], [10, 11, 12, 30, 31, 32, 33, 34],
                                    [10, 11, 12, 30, 31, 32, 33, 34]])
    # slot 2: prompt a, never stopped; slot 5: the same tokens, resumed (vLLM's prompt a + [10, 11])
    for slot, vllm_prompt_len in ((2, 4), (5, 6)):
        states.all_token_ids.gpu[slot, :7] = torch.tensor(a + [10, 11, 12])
        states.total_len.gpu[slot] = 7
        plen[slot] = vllm_prompt_len
    batch = SimpleNamespace(num_reqs=2, idx_mapping=torch.tensor([2, 5]), idx_mapping_np=np.array([2, 5]),
                            req_ids=["0-0-abcdefgh", "1-0-ijklmnop"])
    last = torch.full((8, 1), 12, dtype=torch.int64)
    seen, propose = [], spec.history.propose

    def noting(ids, n, salts, pl, *rest, **kw):   # the prompt lengths the store is asked under
        seen.append(pl.tolist())
        return propose(ids, n, salts, pl, *rest, **kw)

    spec.history.propose = noting
    spec.prompt_len_of = {"1-0": 4}   # the Generator's begin_call: the resumed answers' own prompt lengths
    out = spec.propose(batch, None, None, None, None, torch.tensor([1, 1]), torch.zeros(2), last, None, None, None)
    assert seen[-1] == [4, 4] and out.tolist() == [[13, 14, 15, 16]] * 2
    spec.prompt_len_of = {}   # without it: vLLM's prompt lengths, as a call with nothing resumed reads them
    spec.live.clear()         # (a new call: its rows join again, their prompt lengths read then)
    spec.propose(batch, None, None, None, None, torch.tensor([1, 1]), torch.zeros(2), last, None, None, None)
    assert seen[-1] == [4, 6]


def test_a_vllm_whose_slots_moved_stops_the_run_naming_what_moved(monkeypatch):
    """The installed vLLM has the slots the drafter plugs into; one whose V1 drafter's propose()
    changed, or whose runner lost a name, stops a device-history run at its start naming it, and
    the plugin then installs nothing (vLLM's own drafter stays)."""
    pytest.importorskip("vllm")
    from vllm.v1.spec_decode import ngram_proposer_gpu
    from vllm.v1.worker import gpu_model_runner

    from rlspec.speculation import vllm_hooks
    from rlspec.speculation.history.device import proposer as device_proposer

    assert vllm_hooks.slots_changed() == []

    class Moved:
        drafting = None

        def propose(self, num_speculative_tokens, token_ids, lengths):
            pass

    monkeypatch.setattr(ngram_proposer_gpu, "NgramProposerGPU", Moved)
    monkeypatch.delattr(gpu_model_runner, "copy_num_valid_draft_tokens")
    with pytest.raises(RuntimeError) as err:
        vllm_hooks.require_slots()
    msg = str(err.value)
    assert "vllm.v1.spec_decode.ngram_proposer_gpu.NgramProposerGPU.propose takes" in msg, msg
    assert "vllm.v1.worker.gpu_model_runner.copy_num_valid_draft_tokens is gone" in msg, msg
    assert "speculation.history.drafter=host" in msg
    device_proposer.install()
    assert ngram_proposer_gpu.NgramProposerGPU is Moved


# -- through real vLLM (V1's ngram_gpu slot), in a Generator actor ---------------------------------------
@pytest.fixture(scope="module")
def prompts(tokenizer):
    from conftest import heldout_prompts

    return heldout_prompts(tokenizer, 12)


def _gen(actor, prompts, n, temperature, max_tokens=48):
    import ray

    from conftest import sampling

    return ray.get(actor.generate.remote(prompts, sampling(n, temperature, max_tokens)), timeout=600)


@pytest.mark.parametrize("lookup,kernels", [("scan", "auto"), pytest.param("table", "auto", marks=pytest.mark.slow),
                                            # (about five minutes: every step's kernels in the interpreter)
                                            pytest.param("table", "true", marks=pytest.mark.slow)])
def test_greedy_device_drafting_is_exact_and_drafts_from_history(ray_session, prompts, lookup, kernels):
    """Greedy: every call equals no speculation token for token; the engine runs vLLM's ngram_gpu
    path; the second call drafts from the first's responses and accepts more than the first; a new
    engine loaded with the saved store drafts as the first did on its second call. With either
    lookup of the running rows' matches (the whole-row scan, the live table), and with the step a
    GPU runs (kernels=true: kernels.py's kernels, in Triton's interpreter in the engine's process)."""
    import ray

    from conftest import start_generator

    plain = start_generator([])
    base = _gen(plain, prompts, 1, 0.0)
    ray.kill(plain)
    # settings other than the defaults, which reach the engine's workers in vLLM's additional_config
    over = ["speculation=history", "speculation.history.drafter=device", "speculation.history.device.max_tokens=65536",
            "speculation.history.shadow_rows=7", f"speculation.history.device.lookup={lookup}",
            f"speculation.history.device.kernels={kernels}"]
    env = {"TRITON_INTERPRET": "1"} if kernels == "true" else None
    dev = start_generator(over, env=env)
    assert ray.get(dev.runner_info.remote(), timeout=600)["speculation"] == "ngram_gpu"   # waits for the engine

    def store_settings(gen):
        def read(worker):
            p = worker.model_runner.drafter
            return p.history.capacity, p.shadow_rows, p.live.table is not None, p.history.kernels
        return gen.engine.llm.collective_rpc(read)

    assert ray.get(dev.__ray_call__.remote(store_settings), timeout=60) == [(65536, 7, lookup == "table",
                                                                             kernels == "true")]
    first = _gen(dev, prompts, 1, 0.0)
    second = _gen(dev, prompts, 1, 0.0)
    assert first.response_ids == base.response_ids and second.response_ids == base.response_ids
    print(f"acceptance length: first call {first.spec.acceptance_length:.2f}, second "
          f"{second.spec.acceptance_length:.2f}; counters {first.history} / {second.history}")
    assert second.history["history_tokens"] > 0 and second.spec.accepted_tokens > 0
    assert second.spec.acceptance_length > first.spec.acceptance_length + 0.5, (first.spec, second.spec)
    # vLLM verified the rows the drafter drafted for, save those drafted at a request's last step
    # (it finished there); it counts k tokens a verified draft (the scheduler's, before the runner
    # trims a draft to its valid tokens), and accepts no more than were drafted
    h = second.history
    assert h["matched"] - len(prompts) <= second.spec.drafts <= h["matched"], (second.spec, h)
    assert second.spec.accepted_tokens <= h["drafted_tokens"], (second.spec, h)
    assert sum(h[f"drafted_{s}"] for s in SOURCES) == h["drafted_tokens"] and h["drafted_history"] > 0, h
    # accepted by source: what vLLM accepted, and at a request's last verification up to k more (it
    # counts them before vLLM cuts the answer at its stop)
    accepted = sum(h[f"accepted_{s}"] for s in SOURCES)
    assert h["accepted_history"] > 0 and all(h[f"accepted_{s}"] <= h[f"drafted_{s}"] for s in SOURCES), h
    assert second.spec.accepted_tokens <= accepted <= second.spec.accepted_tokens + 5 * len(prompts), (second.spec, h)
    if kernels == "true":   # (the saved store's path is the torch drafter's: the case above)
        ray.kill(dev)
        return
    state = ray.get(dev.history_state.remote(), timeout=60)
    ray.kill(dev)
    resumed = start_generator(over)
    ray.get(resumed.load_history_state.remote(state), timeout=600)   # the first call waits for the engine
    again = _gen(resumed, prompts, 1, 0.0)
    assert again.response_ids == base.response_ids
    assert again.spec.accepted_tokens == second.spec.accepted_tokens
    ray.kill(resumed)


_PLAIN: dict = {}


@pytest.mark.parametrize("scheduling", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_device_drafting_with_auto_k_is_exact_and_drafts_the_k_it_is_given(ray_session, prompts, scheduling):
    """Under 'auto' the scheduler's k per batch size reaches the device drafter, and its drafts are
    that wide (vLLM's synchronous scheduler places every column it is given; its async scheduler
    places the scheduler's k of rows k_max wide): at k=1 every verified draft is one token, at k=0
    and with speculation off vLLM verifies none; greedy answers equal no speculation's throughout,
    with vLLM's async scheduling too (the engine says it scheduled asynchronously)."""
    import ray

    from conftest import sampling, start_generator
    from helpers.auto_k import auto_calls_keep_to_their_schedule

    key = tuple(map(tuple, prompts))
    if key not in _PLAIN:   # the greedy answers without speculation, once for both schedulers
        plain = start_generator([])
        _PLAIN[key] = _gen(plain, prompts, 1, 0.0)
        ray.kill(plain)
    base = _PLAIN[key]
    auto = start_generator(["speculation=history", "speculation.history.drafter=device",
                            "speculation.num_speculative_tokens=auto", "speculation.max_speculative_tokens=3",
                            "speculation.auto_buckets=[1,4]",
                            *(["generation.async_scheduling=true"] if scheduling == "async" else [])])
    assert ray.get(auto.runner_info.remote(), timeout=600)["async_scheduling"] == (scheduling == "async")
    # the planner read the drafter's per-position counters
    auto_calls_keep_to_their_schedule(auto, lambda a: _gen(a, prompts, 1, 0.0), base.response_ids)

    def generate_at(gen, k, prompts, s):  # the engine alone, at a k set as 'auto' sets it
        from rlspec.speculation.history.device import proposer as device_proposer
        from rlspec.speculation.adaptive import OFF

        gen.adaptive.set_k(OFF if k == OFF else (lambda b: k))
        gen.engine.llm.collective_rpc(device_proposer.begin_call, args=(True,))
        ro = gen.engine.generate(prompts, s, 0)
        return ro, gen.engine.llm.collective_rpc(device_proposer.finish_call)[0]

    for k in (1, 0, -1):
        ro, h = ray.get(auto.__ray_call__.remote(generate_at, k, prompts, sampling(1, 0.0, 48)), timeout=600)
        assert ro.response_ids == base.response_ids
        if k == 1:
            assert ro.spec.drafts > 0 and ro.spec.draft_tokens == ro.spec.drafts and h["drafts_ge_2"] == 0, h
            assert ro.spec.accepted_tokens <= sum(h[f"accepted_{s}"] for s in SOURCES) > 0, (ro.spec, h)
        else:  # k=0 everywhere, or 'auto' off: no lookup, nothing placed for vLLM to verify
            assert ro.spec.draft_tokens == 0 and h["drafted_tokens"] == 0, (ro.spec, h)
    ray.kill(auto)


def test_a_store_saved_by_the_other_drafter_is_refused(tmp_path):
    """Generator.load_history: a run resumes with the drafter its stores were saved by; a host
    store given to the device drafter (and the reverse) stops the resume naming both."""
    from rlspec.speculation.history.device import proposer as device_proposer
    from rlspec.speculation.history.host import proposer as history_proposer
    from rlspec.workers.generator import Generator

    dev = DeviceHistory(**SMALL)
    dev.insert([[1, 2, 3]], [[4, 5, 6]])
    torch.save(dev.state_dict(), tmp_path / "device.pt")
    torch.save({"format": 3, "prompts": {}}, tmp_path / "host.pt")
    loaded = []
    for drafter, path in ((history_proposer, "device.pt"), (device_proposer, "host.pt")):
        stand_in = SimpleNamespace(drafter=drafter, load_history_state=loaded.append)
        with pytest.raises(ValueError, match="saved by another speculation.history.drafter"):
            Generator.load_history(stand_in, [str(tmp_path / path)])
    # a mixed pair is refused too; a matching one loads
    stand_in = SimpleNamespace(drafter=device_proposer, load_history_state=loaded.append)
    with pytest.raises(ValueError, match="saved by another"):
        Generator.load_history(stand_in, [str(tmp_path / "device.pt"), str(tmp_path / "host.pt")])
    Generator.load_history(stand_in, [str(tmp_path / "device.pt")])
    assert len(loaded) == 1 and loaded[0]["tokens"].tolist() == dev.state_dict()["tokens"].tolist()


def test_the_cpu_stand_ins_touch_only_this_drafters_runners():
    """On vLLM's CPU platform the plugin swaps unpinned buffers and a no-op CUDA event in while a
    runner of the device drafter's engine is built, and nothing for any other engine: vLLM's own
    placeholders stay (its runner builds torch.cuda.Event(blocking=True) under async scheduling,
    which the stand-in takes too)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the stand-ins are for vLLM's CPU platform")
    from vllm.v1.worker import cpu_model_runner

    from rlspec.speculation.history.device.cpu import Event
    from rlspec.speculation.history.device.proposer import install

    install()
    event, zeros = torch.cuda.Event, torch.zeros
    with cpu_model_runner._torch_cuda_wrapper():   # no runner of this drafter being built
        assert torch.cuda.Event is event and torch.zeros is zeros
    e = Event(blocking=True)
    e.record()
    e.synchronize()
    assert e.query()


@pytest.mark.parametrize("seed", range(4))
def test_the_cpu_row_copy_keeps_the_rows_as_vllms_incremental_update_does(seed, monkeypatch):
    """The CPU stand-in for vLLM's update_ngram_gpu_tensors_incremental leaves the token rows and
    lengths vLLM's own function leaves (run here with its pinned staging swapped for plain host
    tensors), step after step of requests arriving, finishing and moving, under async scheduling:
    the input batch's host copy holds placeholders (-1) for the tokens the drafter appended on the
    device. A stand-in that copied every row from the host wiped those tokens, and the drafter
    read no siblings under async scheduling."""
    pytest.importorskip("vllm")
    import random

    from vllm.v1.spec_decode import ngram_proposer_gpu as ngp

    from rlspec.speculation.history.device.cpu import copy_rows

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setattr(ngp, "async_tensor_h2d", lambda data, dtype=None, device=None: torch.tensor(data, dtype=dtype))
    g = random.Random(seed)
    rows, width = 6, 40
    host = torch.full((rows, width), -7, dtype=torch.int32)
    lens = np.zeros(rows, np.int32)
    batch = SimpleNamespace(token_ids_cpu_tensor=host, num_tokens_no_spec=lens,
                            num_tokens_no_spec_cpu_tensor=torch.from_numpy(lens),
                            req_id_to_index={}, prev_req_id_to_index=None)
    theirs = (torch.full((rows, width), -9, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32))
    ours = (theirs[0].clone(), theirs[1].clone())
    truth: dict[str, list[int]] = {}   # each request's tokens, as the device has them
    for step in range(12):
        batch.prev_req_id_to_index = dict(batch.req_id_to_index) if step else None
        ids = [r for r in batch.req_id_to_index if g.random() > 0.2]   # some finish
        new = [f"r{step}-{j}" for j in range(g.randrange(0, rows - len(ids) + 1))]
        for r in new:
            truth[r] = [g.randrange(50) for _ in range(g.randrange(2, 8))]
        running = ids + new
        g.shuffle(running)   # rows move
        batch.req_id_to_index = {r: i for i, r in enumerate(running)}
        for r, i in batch.req_id_to_index.items():   # the host copy: placeholders for the last tokens
            t = truth[r]
            lag = 0 if r in new else min(len(t) - 1, g.randrange(0, 3))
            host[i, : len(t)] = torch.tensor(t[: len(t) - lag] + [-1] * lag, dtype=torch.int32)
            lens[i] = len(t)
        reqs = [SimpleNamespace(req_id=r) for r in new]
        staging = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.int32)
        ngp.update_ngram_gpu_tensors_incremental(batch, *theirs, reqs, torch.device("cpu"), *staging)
        copy_rows(batch, *ours, reqs, torch.device("cpu"))
        live = list(batch.req_id_to_index.values())
        assert torch.equal(ours[1][live], theirs[1][live]), step
        for r, i in batch.req_id_to_index.items():
            n = len(truth[r])
            assert ours[0][i, :n].tolist() == theirs[0][i, :n].tolist(), (step, r)
        for r, i in batch.req_id_to_index.items():   # the drafter appends each row's sampled tokens
            more = [g.randrange(50) for _ in range(g.randrange(1, 3))]
            n = len(truth[r])
            if n + len(more) <= width:
                for buf, _ in (theirs, ours):
                    buf[i, n: n + len(more)] = torch.tensor(more, dtype=torch.int32)
                truth[r] += more
        assert any(len(t) > 2 for t in truth.values())
    # and the rows hold the requests' true tokens (none of the host copy's placeholders)
    for r, i in batch.req_id_to_index.items():
        n = int(lens[i])
        assert ours[0][i, :n].tolist() == truth[r][:n]


@pytest.mark.parametrize("lookup,kernels", [("scan", "auto"), ("table", "auto"), ("table", "true")])
def test_the_v2_speculator_on_vllms_own_request_states_on_this_cpu(lookup, kernels):
    """Model Runner V2's RequestState, InputBatch and post_update kernel (vLLM's Triton kernels in
    Triton's interpreter: tests/helpers/v2_on_cpu.py) drive the device speculator as V2's runner
    does: requests added, sampled tokens posted, propose; the batch reordered; a request freed and
    its slot taken by the next; the next call, whose first step frees the last call's requests.
    Drafts come from the history, from a running sibling further on, and from a finished sibling
    whose slot was already reused, never from the last call's requests; a row with nothing to draft
    is filled with its last sampled token. With kernels=true, the speculator's step is the one a
    GPU runs (kernels.advance and kernels.step, in the interpreter)."""
    import json
    import subprocess
    import sys

    from conftest import ROOT, child_env

    pytest.importorskip("vllm")
    env = {**child_env(), "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "v2_on_cpu.py"), lookup, kernels],
                         env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["has_triton"] and out["slot_reused"]   # vLLM's kernels ran (no placeholders); V2 reused b's slot
    assert out["table"] == (lookup == "table") and out["kernels"] == (kernels == "true")
    assert out["steps"] == [
        [[21, 22, 23, 24], [21, 22, 23, 24], [40] * 4],   # a, b: the history; c: nothing (its last token)
        [[41] * 4, [30] * 4, [24, 25, 26, 23]],            # c, b (left the history), a (the history ends)
        [[26, 25, 25, 25], [33] * 4],
        [[26] * 4, [21, 22, 23, 24]],                      # d: the history and a, running further on
        [[27] * 4, [31, 32, 33, 30]],                      # d follows b's answer: b finished, its slot reused
        [[33, 32, 32, 32]],
        [[21, 22, 23, 24]],                                # the next call: e drafts from the history ...
        [[30] * 4]]                                        # ... and not from the last call's answers
    st, nxt = out["stats"], out["next_call"]
    assert (st["drafted_history"], st["drafted_siblings"], st["drafted_tokens"]) == (12, 8, 20), st
    assert (nxt["drafted_history"], nxt["drafted_siblings"], nxt["drafted_tokens"]) == (4, 0, 4), nxt
