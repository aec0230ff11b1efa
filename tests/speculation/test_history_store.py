"""The history store's edges: compiled before any step, importable where numba cannot cache, its
admission limit, no copies of vLLM's token rows, no gaps in a live answer, state saved as it is
drafted from, only on the rank whose drafts vLLM reads, bounds on its size and on drafted ids, and
its insert thread (joined before drafting, a failed insert leaving the store as it was)."""
import os
import shutil
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rlspec.speculation.history.host import proposer as hp
from rlspec.speculation import vllm_hooks
from rlspec.speculation.history.host.index import HistoryIndex
from rlspec.config.speculation import history_config

PROMPT = [1, 2, 3]
HERE = Path(__file__).parent


def index(**kw) -> HistoryIndex:
    """A store keyed on 2 tokens, matching up to 8 (short hand-made rows)."""
    return HistoryIndex(history_config(**{"prompt_keys": [2], "max_match": 8, "max_candidates": 16, **kw}), k_max=5)


def ask(h, rows, sampled, k, keys=None, prompt_len=3):
    return h.propose([np.asarray(r, np.int32) for r in rows], sampled, k, keys=keys,
                     prompt_lens=[prompt_len] * len(rows))


def salt(prompt) -> int:
    from rlspec.speculation.history.host.store import prompt_salt

    a = np.asarray(prompt, np.int32)
    return int(prompt_salt(a, len(a)))


def fake_worker(rank: int = 0, tp: int = 1, vocab: int = 100, rows: int = 8, width: int = 64):
    """What configure and the proposer read of a vLLM worker: its model runner (input batch, drafter)
    and its rank in the engine's workers; the engine's config carries the store's settings."""
    spec = SimpleNamespace(num_speculative_tokens=4)
    model = SimpleNamespace(max_model_len=width, get_vocab_size=lambda: vocab)
    settings = {vllm_hooks.CONFIG_KEY: {"prompt_keys": [2], "max_match": 8}}
    prop = hp.HistoryProposer(SimpleNamespace(speculative_config=spec, model_config=model, additional_config=settings))
    batch = SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(rows, np.int32))
    runner = SimpleNamespace(drafter=prop, input_batch=batch)
    parallel = SimpleNamespace(world_size=tp, tensor_parallel_size=tp, prefill_context_parallel_size=1)
    return SimpleNamespace(model_runner=runner, rank=rank, parallel_config=parallel)


def engine_step(worker, rows: dict, sampled: dict) -> list[list[int]]:
    """One engine step as vLLM's V1 runner calls the proposer: rows {request id: (prompt, tokens so
    far)} in vLLM's int32 arrays, sampled {request id: tokens the step sampled} (none: prefill)."""
    runner = worker.model_runner
    width = runner.drafter.max_model_len
    ids = np.zeros((len(runner.input_batch.num_prompt_tokens), width), np.int32)
    nums = np.zeros(ids.shape[0], np.int32)
    runner.input_batch.req_ids = list(rows)
    for i, (prompt, tokens) in enumerate(rows.values()):
        ids[i, : len(tokens)] = tokens
        nums[i] = len(tokens)
        runner.input_batch.num_prompt_tokens[i] = len(prompt)
    return runner.drafter.propose([sampled.get(key, []) for key in rows], nums, ids)


def a_run(worker) -> list:
    """Two generate calls through the proposer and the Generator's calls (one drafting, one not and
    measured in shadow), recorded, saved and loaded back: every compiled path a run takes."""
    p, q = [5, 6, 7, 8], [9, 9, 9]
    drafts = []
    for draft in (True, False):
        hp.begin_call(worker, draft)
        answers = {"a": [10, 11, 12, 13, 14, 15], "b": [10, 11, 12, 20], "c": [30, 31]}
        prompts = {"a": p, "b": p, "c": q}
        for t in range(1, 7):
            live = {key: (prompts[key], prompts[key] + ans[:t]) for key, ans in answers.items() if t <= len(ans)}
            if t == 1:
                live["c"] = (q, q)   # still in prefill
            drafts.append(engine_step(worker, live, {key: [row[1][-1]] for key, row in live.items() if key != "c"
                                                      or t > 1}))
        hp.finish_call(worker, None if draft else [p, p, q], None if draft else list(answers.values()))
        hp.record(worker, [p, p, q], list(answers.values()))
    hp.load_state_dict(worker, hp.state_dict(worker))
    return drafts


# -- 1. compiled at configure --------------------------------------------------------------------------
def compiles_nothing_after_configure() -> None:
    """(run in a fresh process) After configure, a run compiles no store function: none of numba's
    compilation (seconds) falls into an engine step, where propose_timing would charge it to drafting."""
    from numba.core.dispatcher import Dispatcher

    from rlspec.speculation.history.host import store
    from rlspec.speculation.history.host import live as store_live

    def compiled():
        return {name: len(f.signatures) for module in (store, store_live) for name, f in vars(module).items()
                if isinstance(f, Dispatcher)}

    worker = fake_worker()
    hp.configure(worker)
    before = compiled()
    drafts = a_run(worker)
    assert compiled() == before, (before, compiled())
    assert any(drafts), drafts
    print("compiled at configure:", sorted(name for name, n in before.items() if n))


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]), **extra}


def test_configure_compiles_the_store_before_any_engine_step():
    code = "from test_history_store import compiles_nothing_after_configure as f; f()"
    r = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=child_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "propose_rows" in r.stdout and "insert_sequences" in r.stdout and "draft_one" in r.stdout, r.stdout


# -- 2. numba's cache, numba missing -------------------------------------------------------------------
def test_the_store_imports_where_numba_cannot_write_its_cache(tmp_path):
    """A read-only install (no writable __pycache__ beside the package's modules) and an unwritable
    home and NUMBA_CACHE_DIR: the store still imports, and caches in a temporary folder."""
    pkg = tmp_path / "install"
    shutil.copytree(Path(__file__).parents[2] / "rlspec", pkg / "rlspec",
                    ignore=shutil.ignore_patterns("__pycache__", "assets"))
    for folder in [pkg / "rlspec", *(d for d in (pkg / "rlspec").rglob("*") if d.is_dir())]:
        (folder / "__pycache__").write_text("")   # not a folder: nothing can be written there
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    code = ("import numba, numpy as np; import rlspec.speculation.history.host.store as s; "
            "assert s.__file__.startswith(%r); "
            "assert s.prompt_salt(np.arange(4, dtype=np.int32), 4) != 0; print(numba.config.CACHE_DIR)" % str(pkg))
    r = subprocess.run([sys.executable, "-c", code], cwd=pkg, capture_output=True, text=True, timeout=600,
                       env={**child_env(HOME=str(blocked / "home"), XDG_CACHE_HOME=str(blocked / "cache"),
                                        NUMBA_CACHE_DIR=str(blocked / "numba")), "PYTHONPATH": str(pkg)})
    assert r.returncode == 0, r.stderr[-3000:]
    cache = r.stdout.strip().splitlines()[-1]
    assert cache.startswith(str(Path(os.environ.get("TMPDIR", "/tmp")))) or "rlspec-numba" in cache, cache


def test_without_numba_only_history_drafting_fails_and_says_why():
    """Every Generator imports the proposer module, whatever its method: it must import without
    numba; building the history drafter then names what is missing."""
    code = ("import sys; sys.modules['numba'] = None\n"
            "import rlspec.speculation.history.host.proposer as hp\n"
            "try:\n    import rlspec.speculation.history.host.store\nexcept ImportError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=child_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "speculation=history needs numba" in r.stdout, r.stdout


# -- 3. the admission limit -------------------------------------------------------------------------
def epoch(h, prompts, length, tag):
    h.record(prompts, [[tag] * length for _ in prompts], wait=True)


def test_admission_rises_again_when_the_store_is_far_under_max_tokens():
    """An epoch of long answers over 20 prompts fills the store: whole prompts go and are refused.
    Answers get short: the prompts kept hold a tenth of max_tokens, and the next epochs store
    prompts again, up to max_tokens (a fixed set by rank: the lowest ranks)."""
    prompts = [[40 + i, 41, 42] for i in range(20)]
    h = index(max_rollouts_per_prompt=1, min_rollouts_per_prompt=1, max_tokens=100)
    epoch(h, prompts, 20, 7)
    kept = set(h.prompts)
    assert len(kept) == 4 and h.admit_below < 1 << 64
    for e in range(3):
        epoch(h, prompts, 2, 8 + e)
    assert len(h.prompts) > 2 * len(kept) and kept <= set(h.prompts) and h.tokens() <= 100
    ranks = sorted(salt(p) for p in prompts)
    assert sorted(h.prompts) == ranks[: len(h.prompts)]   # the lowest ranks


def test_a_loaded_store_takes_the_limit_of_its_new_bound():
    """A checkpoint of a full store resumed with a larger max_tokens: prompts refused before are
    stored again."""
    prompts = [[40 + i, 41, 42] for i in range(20)]
    h = index(max_rollouts_per_prompt=1, min_rollouts_per_prompt=1, max_tokens=100)
    epoch(h, prompts, 20, 7)
    refused = [p for p in prompts if salt(p) not in h.prompts]
    g = index(max_rollouts_per_prompt=1, min_rollouts_per_prompt=1, max_tokens=10_000)
    g.load_state_dict(h.state_dict())
    epoch(g, refused, 20, 7)
    assert len(g.prompts) == len(prompts)


# -- 4. no copies of vLLM's token rows -------------------------------------------------------------------
def test_rows_in_prefill_copy_no_token_rows():
    """vLLM passes its whole max_num_reqs x max_model_len token array; half the rows in prefill,
    a step allocates less than one row of it (it reads the rows where they are)."""
    h = index()
    h.record([PROMPT], [[10, 11, 12, 13]], wait=True)
    h.begin_call()
    rows, width = 64, 1 << 15
    ids = np.zeros((rows, width), np.int32)
    ids[:, :5] = PROMPT + [10, 11]
    keys = [f"r{i}" for i in range(rows)]
    decoding = np.arange(rows) % 2 == 0
    h.propose_rows(ids, [5] * rows, decoding.astype(int), keys, [3] * rows, 3)
    ids[:, 5] = 12
    tracemalloc.start()
    drafts = h.propose_rows(ids, [6] * rows, decoding.astype(int), keys, [3] * rows, 3)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert drafts[0] == [13] and drafts[1] == []
    assert peak < ids.nbytes // rows, peak


# -- 5. no gaps when vLLM skipped drafting for a step ------------------------------------------------------
def test_a_step_that_skipped_drafting_leaves_no_gap_in_the_live_answer():
    """vLLM drafts nothing at a step where a row is near max_model_len (the proposer is not
    called): the next call holds that step's tokens too, and they join the live answer."""
    h = index(global_source=False)
    h.begin_call()
    ask(h, [PROMPT + [30]], [[30]], 3, keys=["a"])
    ask(h, [PROMPT + [30, 31]], [[31]], 3, keys=["a"])
    # the step that sampled 32 was not shown to the proposer
    ask(h, [PROMPT + [30, 31, 32, 33]], [[33]], 3, keys=["a"])
    ask(h, [PROMPT + [30, 31, 32, 33, 34]], [[34]], 3, keys=["a"])
    assert ask(h, [PROMPT + [30, 31]], [[31]], 3, keys=["b"]) == [[32, 33, 34]]


def test_a_draft_verified_at_a_step_that_skipped_drafting_is_counted():
    h = index()
    h.record([PROMPT], [[10, 11, 12, 13, 14]], wait=True)
    h.begin_call()
    assert ask(h, [PROMPT + [10, 11]], [[11]], 3) == [[12, 13, 14]]
    # 12 13 accepted, 99 sampled in place of 14 at a step the proposer was not called; then 7
    ask(h, [PROMPT + [10, 11, 12, 13, 99, 7]], [[7]], 3)
    assert h.stats.accepted == [2, 0, 0, 0]


# -- 7. only where vLLM reads the drafts ------------------------------------------------------------------
def test_only_the_rank_whose_drafts_vllm_reads_stores_and_drafts():
    """Tensor parallel: vLLM schedules the drafts of the first worker of the last pipeline stage;
    the other workers keep no store and draft nothing."""
    got = {}
    for rank in (0, 1):
        worker = fake_worker(rank=rank, tp=2)
        hp.configure(worker)
        hp.record(worker, [PROMPT], [[10, 11, 12, 13]])
        hp.begin_call(worker)
        got[rank] = (engine_step(worker, {"a": (PROMPT, PROMPT + [10, 11])}, {"a": [11]}),
                     worker.model_runner.drafter.index)
    assert got[0][0] == [[12, 13]] and got[0][1].tokens() == 4
    assert got[1] == ([[]], None)


# -- 8. bounds (max_tokens in validation: test_history.py's test_settings_are_validated_by_key) ------------
def test_an_arena_past_int32_positions_is_refused_before_it_is_allocated():
    from rlspec.speculation.history.host.arena import HistoryArena, LiveArena

    with pytest.raises(OverflowError, match="speculation.history.host.max_tokens"):
        HistoryArena(plevels=3, levels=2, capacity=1 << 31)
    live = LiveArena()
    with pytest.raises(OverflowError, match="int32"):
        live.reserve(1 << 31, 1)


def test_drafts_hold_only_ids_of_the_vocabulary():
    """A stored token outside the model's vocabulary (a store loaded from another model) ends the
    draft before it."""
    worker = fake_worker(vocab=50)
    hp.configure(worker)
    hp.record(worker, [PROMPT], [[10, 11, 12, 60, 13]])
    hp.begin_call(worker)
    assert engine_step(worker, {"a": (PROMPT, PROMPT + [10, 11])}, {"a": [11]}) == [[12]]


# -- 9. the insert thread ---------------------------------------------------------------------------------
def test_drafting_waits_for_the_responses_being_recorded():
    """Responses recorded during a call (the insert runs in the background): the next engine step
    drafts from them, whatever the order of the calls."""
    gate = threading.Event()

    class Gated(HistoryIndex):
        def _record(self, work):
            gate.wait()
            super()._record(work)

    h = Gated(history_config(prompt_keys=[2], max_match=8), k_max=5)
    h.begin_call()
    h.record([PROMPT], [[10, 11, 12, 13]])
    worker, join = h._worker, h._worker.join
    worker.join = lambda *a, **kw: (gate.set(), join(*a, **kw))[1]   # the insert goes on once joined
    try:
        assert ask(h, [PROMPT + [10, 11]], [[11]], 3) == [[12, 13]]
    finally:
        gate.set()
        h.flush()




def test_a_failed_insert_leaves_the_store_as_it_was():
    """A record whose second response cannot be stored (an id outside int32, a negative id, which
    would read as the store's END or DEAD): it raises, in the caller or at the next flush, and the
    store is as before (its token total, every sequence placed, its state, its drafts)."""
    h = index()
    h.record([PROMPT], [[10, 11, 12]], wait=True)
    before, total = h.state_dict(), h.tokens()
    for bad in ([1 << 40], [5, -1]):
        with pytest.raises((OverflowError, ValueError)):
            h.record([PROMPT, [5, 6]], [[10, 11, 13], bad], wait=True)
        h.record([PROMPT, [5, 6]], [[10, 11, 13], bad])
        with pytest.raises((OverflowError, ValueError)):
            h.flush()
    assert h.tokens() == total and all(q.start >= 0 for r in h.prompts.values() for q in r.seqs)
    from helpers.states import same_state  # this module is also imported where tests/ is not on the path

    assert same_state(h.state_dict(), before)
    h.begin_call()
    assert ask(h, [PROMPT + [10, 11]], [[11]], 3) == [[12]]


def test_an_insert_that_cannot_allocate_leaves_the_store_as_it_was(monkeypatch):
    """Over max_tokens (whole prompts evicted) and past the arena's room (a new arena): the
    allocation fails, and the store keeps its prompts, total, admission limit and drafts."""
    from rlspec.speculation.history.host import index as history

    h = index(max_tokens=400)
    prompts = [[40 + i, 41, 42] for i in range(8)]
    h.record(prompts, [[10 + i] * 40 for i in range(8)], wait=True)
    before, held, limit = h.state_dict(), dict(h.prompts), h.admit_below

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(history, "HistoryArena", no_memory)
    monkeypatch.setattr(h.arena, "grown", no_memory)
    with pytest.raises(MemoryError):
        h.record([[7, 7, 7]] * 4, [[9] * 20_000] * 4, wait=True)
    from helpers.states import same_state

    assert same_state(h.state_dict(), before) and h.prompts == held and h.admit_below == limit
    assert h.tokens() == 320


# -- drafts near max_model_len ------------------------------------------------------------------------
def test_a_draft_cut_at_max_model_len_is_counted_as_vllm_verifies_it():
    """A row 3 tokens short of max_model_len drafts 2 of the history's tokens (vLLM verifies no
    more): the counters hold those 2, and the token after them, the bonus, is not counted as an
    accepted draft token."""
    worker = fake_worker(width=8)
    hp.configure(worker)
    hp.record(worker, [PROMPT], [[10, 11, 12, 13, 14, 15]])
    hp.begin_call(worker)
    assert engine_step(worker, {"a": (PROMPT, PROMPT + [10, 11])}, {"a": [11]}) == [[12, 13]]
    engine_step(worker, {"a": (PROMPT, PROMPT + [10, 11, 12, 13, 14])}, {"a": [12, 13, 14]})
    stats = hp.finish_call(worker, None, None)
    assert (stats["drafted_history"], stats["accepted_history"]) == (2, 2), stats
