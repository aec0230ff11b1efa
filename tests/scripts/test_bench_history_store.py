"""scripts/bench_history_store.py's variants mode (each device-rule variant replayed on one trace, as
its own replay would measure it, beside the reference stores) and crosscheck mode (every store's
drafts at one driver's states)."""
import json
import random
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_history_store.py"


def write_trace(path: Path) -> Path:
    """Two epochs of three prompts, four answers each; an epoch-2 answer repeats one of epoch 1's."""
    g = random.Random(0)
    prompts = [[g.randrange(3, 40) for _ in range(6)] for _ in range(3)]
    first = [[[g.randrange(3, 12) for _ in range(g.randrange(10, 30))] for _ in range(4)] for _ in prompts]
    steps = [[{"prompt": p, "responses": rs} for p, rs in zip(prompts, first)],
             [{"prompt": p, "responses": [g.choice(rs) for _ in rs]} for p, rs in zip(prompts, first)]]
    path.write_text("".join(json.dumps({"groups": s}) + "\n" for s in steps))
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_variants_equal_their_own_replays_beside_the_reference_stores(tmp_path):
    trace = str(write_trace(tmp_path / "rollouts.jsonl"))
    out = tmp_path / "variants.json"
    p = run("variants", "--rollouts", trace, "--k", "3", "--variant", "base", "m8:max_match=8,min_prob=0.3",
            "--reference", "dict", "--jobs", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(out.read_text())
    assert list(got["variants"]) == ["base", "m8"] and got["variants"]["m8"]["device"] == [
        "max_match=8", "min_prob=0.3"]
    assert set(got["reference"]) == {"dict"} and got["k"] == 3 and got["steps"] == 2
    for name, device in (("base", []), ("m8", ["max_match=8", "min_prob=0.3"])):
        alone = tmp_path / f"{name}.json"
        q = run("replay", "--rollouts", trace, "--k", "3", "--stores", "device", "--device", *device,
                "--out", str(alone))
        assert q.returncode == 0, q.stderr[-2000:]
        want = json.loads(alone.read_text())["stores"]["device"]
        v = got["variants"][name]
        assert v["tokens_per_verification"] == want["tokens_per_verification"]
        assert v["drafted_per_verification"] == want["drafted_per_verification"]
    # epoch 2 repeats epoch 1's answers: the stored answers draft, and drafts are accepted
    assert got["variants"]["base"]["tokens_per_verification"]["2"] > 1.5


def test_crosscheck_holds_the_states_of_each_driver(tmp_path):
    trace = str(write_trace(tmp_path / "rollouts.jsonl"))
    out = tmp_path / "cross.json"
    p = run("crosscheck", "--rollouts", trace, "--k", "3", "--drive", "device", "dict", "--stores", "device", "dict",
            "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(out.read_text())["drives"]
    for drive in ("device", "dict"):
        alone = tmp_path / f"{drive}.json"
        q = run("replay", "--rollouts", trace, "--k", "3", "--stores", drive, "--out", str(alone))
        assert q.returncode == 0, q.stderr[-2000:]
        # the driver's own figure is its replay's, to rounding (a sum of accepted tokens over verifications)
        want = json.loads(alone.read_text())["stores"][drive]["tokens_per_verification"]
        assert got[drive][drive].keys() == want.keys()
        assert all(abs(got[drive][drive][e] - want[e]) < 1e-9 for e in want)
    # at the same states the two rules draft differently: a probe's figure is its own, not the driver's
    assert got["device"]["dict"] != got["device"]["device"] and got["dict"]["device"] != got["dict"]["dict"]


def test_two_variants_of_one_name_are_refused(tmp_path):
    trace = str(write_trace(tmp_path / "rollouts.jsonl"))
    p = run("variants", "--rollouts", trace, "--variant", "a", "a:width=8", "--reference")
    assert p.returncode != 0 and "two variants share a name" in p.stderr



def test_suffix_finished_reads_another_request_only_once_it_has_finished():
    """vLLM's suffix decoding reads a running answer's tokens for every request; suffix_finished, as
    rlspec's stores, only a finished one's."""
    import bench_history_store as b
    import numpy as np

    a, other = [1, 2, 5, 6, 7, 8, 5, 6, 7], [3, 4, 5, 6]
    ids = np.zeros((2, 12), np.int32)
    ids[0, : len(a)], ids[1, : len(other)] = a, other
    nums, new, plens = np.array([len(a), len(other)]), np.array([len(a) - 2, 2]), np.array([2, 2])
    stock, finished = b.make_store("suffix", 3, 10_000, 10), b.make_store("suffix_finished", 3, 10_000, 10)
    assert stock.step(ids, nums, new, ["a", "b"], plens, 3)[1][:1] == [7]   # a's running answer drafts for b
    got = finished.step(ids, nums, new, ["a", "b"], plens, 3)
    assert got[1] == [] and got[0][:1] == [8]   # b reads nothing; a reads its own tree (7 -> 8)
    finished.finish("a", a[:2], a[2:])
    nums, new = np.array([len(other)]), np.array([0])
    assert finished.step(ids[1:], nums, new, ["b"], plens[1:], 3)[0][:1] == [7]   # a has finished: b reads it


def test_device_suffix_takes_the_trees_draft_only_where_its_match_is_longer():
    """The prototype global source: a suffix tree over finished answers, drafting where its match
    is longer than the prompt's own sources' longest; the device rule's own draft otherwise."""
    import bench_history_store as b
    import numpy as np

    store = b.make_store("device_suffix", 2, 10_000, 10)
    store.record([[7, 7]], [[40, 41, 42, 43, 44]])   # another prompt's finished answer
    rows = [[1, 2, 3, 9, 40, 41, 42],                 # nothing of its own matches 40 41 42
            [40, 41, 42, 50, 51, 40, 41, 42]]         # its prompt continues 40 41 42 with 50 51
    plens = np.array([3, 5])
    ids = np.zeros((2, 10), np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    nums = np.array([len(r) for r in rows])
    got = store.step(ids, nums, np.array([1, 1]), ["a", "b"], plens, 2)
    assert got == [[43, 44], [50, 51]]
