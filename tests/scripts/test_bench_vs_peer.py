"""scripts/bench_vs_peer.py's bookkeeping (time axis, time-to-accuracy, ratios) on hand-made runs."""
import json

import pytest


import bench_vs_peer as bvp


def test_curve_takes_validation_time_out_of_the_time_axis():
    val = [{"step": 0, "accuracy": 0.3, "started_at": 110.0, "seconds": 4.0},
           {"step": 4, "accuracy": 0.5, "started_at": 130.0, "seconds": 2.0},
           {"step": 8, "accuracy": 0.9, "started_at": 150.0, "seconds": 2.0}]
    c = bvp.curve(val, launched=100.0)
    assert [x["seconds"] for x in c] == [10.0, 26.0, 44.0]  # 30 - 4; 50 - 4 - 2


def run(mode, seed, accs, secs, step_s, mem=1.0, tps=1000.0, finished_at=None):
    return {"mode": mode, "seed": seed, "steady_step_seconds": step_s, "tokens_per_second": tps,
            "finished_at": 3600.0 * seed if finished_at is None else finished_at,  # one block per seed
            "peak_memory_gib": mem, "final_accuracy": accs[-1], "time_to_last_step": secs[-1], "wall_seconds": 0.0,
            "stage_seconds": {"generation": 1.0},
            "curve": [{"step": 4 * i, "accuracy": a, "seconds": s} for i, (a, s) in enumerate(zip(accs, secs))]}


def test_time_to_target_and_ratios():
    fast = "rlspec sync / spec"
    runs = [run(bvp.PEER, 0, [0.3, 0.5, 0.9], [20, 40, 60], 5.0, mem=1.0),
            run(bvp.PEER, 1, [0.3, 0.7, 0.9], [20, 40, 60], 5.0, mem=1.0),
            run(fast, 0, [0.3, 0.9, 1.0], [30, 40, 50], 2.5, mem=3.0),
            run(fast, 1, [0.3, 0.95, 1.0], [30, 50, 60], 2.5, mem=3.0)]
    s = bvp.summarise(runs, target=None)
    rows = {r["mode"]: r for r in s["rows"]}
    assert s["target_accuracy"] == pytest.approx(0.9)  # TRL's final seed mean
    assert rows[bvp.PEER]["time_to_target"] == 60 and rows[bvp.PEER]["step_to_target"] == 8
    # seed-mean curve 0.3, 0.925, 1.0 at 30, 45, 55 s: the target is first met at step 4
    assert rows[fast]["time_to_target"] == 45 and rows[fast]["step_to_target"] == 4
    assert rows[fast]["time_to_target_ratio_vs_peer"] == pytest.approx(60 / 45)
    assert rows[fast]["step_time_ratio_vs_peer"] == pytest.approx(2.0)
    assert rows[fast]["step_time_ratio_by_seed"] == {"0": pytest.approx(2.0), "1": pytest.approx(2.0)}
    assert s["best_rlspec_mode"] == fast
    # the peer is better at memory and start-up; not at step time or time-to-accuracy
    assert any(x.startswith("peak memory") for x in s["peer_better_at"][bvp.PEER])
    assert any(x.startswith("start-up") for x in s["peer_better_at"][bvp.PEER])
    assert not any(x.startswith(("per-step", "time to target")) for x in s["peer_better_at"][bvp.PEER])
    # a target nobody reaches: no time, no ratio, no best mode
    s = bvp.summarise(runs, target=1.01)
    assert all(r["time_to_target"] is None for r in s["rows"]) and s["best_rlspec_mode"] is None
    assert "| rlspec sync / spec | 2.50 ± 0.00 | 2.00x (2.00-2.00 by seed) |" in bvp.table(s)


def test_a_seeds_ratio_counts_only_runs_of_one_block():
    # seed 1 of the rlspec mode ran hours after TRL's seed 1 (--resume kept TRL's), on a slower machine
    late = "rlspec sync / no spec"
    runs = [run(bvp.PEER, 0, [0.3, 0.9], [20, 60], 6.0), run(bvp.PEER, 1, [0.3, 0.9], [20, 60], 6.0),
            run(late, 0, [0.3, 0.9], [20, 60], 3.0), run(late, 1, [0.3, 0.9], [20, 60], 4.0, finished_at=86400.0)]
    s = bvp.summarise(runs, target=None)
    row = next(r for r in s["rows"] if r["mode"] == late)
    assert row["step_time_ratio_by_seed"] == {"0": pytest.approx(2.0)}
    assert row["step_time_ratio_vs_peer"] == pytest.approx(6.0 / 3.5)  # the ratio of seed means keeps both
    assert f"| {late} | 3.50 ± 0.71 | 1.71x (2.00 on seed 0, 1 of 2 seeds) |" in bvp.table(s)


def test_trls_vllm_path_is_a_peer_not_an_rlspec_mode():
    fast = "rlspec sync / spec"
    runs = [run(bvp.PEER, 0, [0.3, 0.5, 0.9], [20, 40, 60], 5.0),
            run(bvp.PEER_VLLM, 0, [0.3, 0.9, 1.0], [10, 20, 30], 1.0, mem=0.5, tps=9000.0),
            run(fast, 0, [0.3, 0.9, 1.0], [30, 40, 50], 2.5, mem=3.0)]
    s = bvp.summarise(runs, target=None)
    rows = {r["mode"]: r for r in s["rows"]}
    assert s["target_accuracy"] == pytest.approx(0.9)  # the transformers peer's final accuracy
    assert s["best_rlspec_mode"] == fast  # the vLLM peer reaches it sooner, but is no rlspec mode
    assert rows[bvp.PEER_VLLM]["step_time_ratio_vs_peer"] == pytest.approx(5.0)  # ratios: against TRL generate
    better = s["peer_better_at"]
    assert set(better) == {bvp.PEER, bvp.PEER_VLLM}
    assert any(x.startswith("per-step") for x in better[bvp.PEER_VLLM])
    assert not any(x.startswith("per-step") for x in better[bvp.PEER])
    assert f"Where {bvp.PEER_VLLM} is better" in bvp.report({"summary": s, "steps": 8, "seeds": [0], "val_every": 4})


def test_resume_takes_a_finished_run_made_by_the_same_command(tmp_path, monkeypatch):
    """An interrupted benchmark goes on where it stopped: a run whose row is kept in its directory,
    made by the same command, is taken as it stands; one made by another command is run again."""
    from types import SimpleNamespace

    launches = []

    def launch(cmd, log, timeout):
        launches.append(cmd)
        raise RuntimeError("launched")

    monkeypatch.setattr(bvp, "launch", launch)
    a = SimpleNamespace(set=["+experiment=tiny_cpu"], steps=2, val_every=1, resume=True, timeout=1)
    mode = "rlspec sync / spec"
    with pytest.raises(RuntimeError, match="launched"):  # nothing kept yet: it launches
        bvp.run_one(mode, 0, a, tmp_path)
    kept = tmp_path / "rlspec_sync_spec_seed0" / "bench_row.json"
    kept.write_text(json.dumps({"mode": mode, "seed": 0, "command": launches[-1], "x": 1}))
    assert bvp.run_one(mode, 0, a, tmp_path)["x"] == 1 and len(launches) == 1
    with pytest.raises(RuntimeError, match="launched"):
        bvp.run_one(mode, 0, SimpleNamespace(**{**vars(a), "steps": 3}), tmp_path)
    assert len(launches) == 2 and not kept.exists()  # a stale row is not left to be taken later


def test_same_weights_in_names_the_engine_dtype(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"dtype": "bfloat16", "hidden_size": 8}))
    (src / "model.safetensors").write_bytes(b"weights")
    out = bvp.same_weights_in(str(src), "float32", tmp_path / "out")
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out == str(tmp_path / "out") and c["dtype"] == c["torch_dtype"] == "float32" and c["hidden_size"] == 8
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"weights"
