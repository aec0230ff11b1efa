"""scripts/bench_history_store.py's variants mode: each device-rule variant replayed on one trace, as
its own replay would measure it, beside the reference stores."""
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
    p = run("variants", "--rollouts", trace, "--k", "3", "--variant", "base", "live3:live_matches=3,min_prob=0.3",
            "--reference", "dict", "--jobs", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(out.read_text())
    assert list(got["variants"]) == ["base", "live3"] and got["variants"]["live3"]["device"] == [
        "live_matches=3", "min_prob=0.3"]
    assert set(got["reference"]) == {"dict"} and got["k"] == 3 and got["steps"] == 2
    for name, device in (("base", []), ("live3", ["live_matches=3", "min_prob=0.3"])):
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


def test_two_variants_of_one_name_are_refused(tmp_path):
    trace = str(write_trace(tmp_path / "rollouts.jsonl"))
    p = run("variants", "--rollouts", trace, "--variant", "a", "a:width=8", "--reference")
    assert p.returncode != 0 and "two variants share a name" in p.stderr

