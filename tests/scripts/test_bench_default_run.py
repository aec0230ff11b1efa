"""scripts/bench_default_run.py's bookkeeping on hand-made run directories: epochs, per-epoch
speedups against the same seed's no-speculation run, acceptance, lengths (figures by hand)."""
import json

import pytest

import bench_default_run as bdr


def write_run(path, gen_seconds, spec=None, val=(0.3, 0.5, 0.8), engine=None, lag=(0, 0.0)):
    """A summary.json of len(gen_seconds) steps; spec: per step (drafts, accepted) or None;
    engine: per step (engine steps, rows, engine seconds) or None; lag: (run's max, every step's
    per-token mean)."""
    recs = []
    for i, g in enumerate(gen_seconds):
        d = None if spec is None else {"drafts": spec[i][0], "accepted_tokens": spec[i][1]}
        extra = {"response_length_p50": 10 + i, "response_length_p90": 30 + i, "response_length_max": 50 + 10 * i,
                 "policy_lag_mean": lag[1]}
        if engine is not None:
            extra |= {"engine_steps": engine[i][0], "engine_step_rows": engine[i][1]}
        recs.append({"step": i + 1, "step_seconds": g + 1.0, "stage_seconds": {"generation": g}, "spec": d,
                     "engine_seconds": None if engine is None else engine[i][2], "extra": extra})
    (path / ".hydra").mkdir(parents=True)
    method, k = ("none", 3) if spec is None else ("history", 8)  # the run's composed speculation group
    (path / ".hydra" / "config.yaml").write_text(
        f"speculation:\n  method: {method}\n  num_speculative_tokens: {k}\n  max_speculative_tokens: {k}\n")
    (path / "summary.json").write_text(json.dumps({
        "records": recs, "steps": len(recs), "wall_seconds": 60.0 * len(recs), "step_seconds": 2.0,
        "stage_share": {"generation": 0.6}, "stage_seconds": {"generation": sum(gen_seconds) / len(recs)},
        "val_steps": [0, 2, 4], "val_accuracy": list(val), "val_seconds": [3.0, 1.0, 2.0], "acceptance_length": None,
        "tokens_per_second": 1.0, "policy_lag_max": lag[0]}))
    return path


def test_epochs_speedups_and_acceptance(tmp_path):
    runs = []
    for seed, (base, fast) in enumerate([([2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 1.0, 1.0]),
                                         ([4.0, 4.0, 3.0, 3.0], [4.0, 4.0, 1.0, 2.0])]):
        runs.append(bdr.read_run("none", seed, write_run(tmp_path / f"n{seed}", base), per_epoch=2))
        runs.append(bdr.read_run("history", seed, write_run(tmp_path / f"h{seed}", fast,
                                                            spec=[(10, 5), (10, 15), (4, 12), (0, 0)]),
                                 per_epoch=2))
    h0 = runs[1]
    assert [e["steps"] for e in h0["epochs"]] == [[1, 2], [3, 4]]
    assert [e["generation_seconds"] for e in h0["epochs"]] == [2.0, 1.0]
    # tokens per verification = 1 + accepted / drafts over the epoch's steps
    assert h0["epochs"][0]["acceptance_length"] == pytest.approx(1 + 20 / 20)
    assert h0["epochs"][1]["acceptance_length"] == pytest.approx(1 + 12 / 4)
    assert h0["response_length_first"] == {"p50": 10, "p90": 30, "max": 50}
    assert h0["response_length_run"] == {"p50": 11.5, "p90": 31.5, "max": 80}
    rows = {r["setting"]: r for r in bdr.summarise(runs)}
    hist = rows["history"]
    # epoch 2 speedups per seed: 2.0 / 1.0 and 3.0 / 1.5; epoch 1: 1.0 both
    assert hist["epochs"][1]["speedup_vs_none"][0] == pytest.approx(2.0)
    assert hist["epochs"][1]["speedup_vs_none"][1] == pytest.approx(0.0)
    assert hist["epochs"][0]["speedup_vs_none"] == (pytest.approx(1.0), pytest.approx(0.0))
    assert hist["epochs"][1]["generation_seconds"][0] == pytest.approx(1.25)
    assert rows["none"]["epochs"][0]["acceptance_length"] is None
    assert hist["val_accuracy"] == pytest.approx([0.3, 0.5, 0.8]) and hist["wall_minutes"] == pytest.approx(4.0)
    assert hist["val_seconds"] == pytest.approx(2.0)  # per validation: (3 + 1 + 2) / 3
    text = bdr.table(list(rows.values()))
    assert h0["speculation"] == {"method": "history", "num_speculative_tokens": 8, "max_speculative_tokens": 8}
    assert ("| history (k=8) |" in text and "| none |" in text and "2.00x ± 0.00" in text
            and "epoch 2 (steps 3-4)" in text)


def test_a_step_belongs_to_the_epoch_of_its_first_prompt(tmp_path):
    # 3 problems, 2 prompts a step: step 2 draws the first epoch's last and the second's first
    run = bdr.read_run("none", 0, write_run(tmp_path / "n", [1.0, 2.0, 3.0, 4.0]), per_epoch=1.5)
    assert [e["steps"] for e in run["epochs"]] == [[1, 2], [3, 3], [4, 4]]
    assert [e["generation_seconds"] for e in run["epochs"]] == [1.5, 3.0, 4.0]


def test_one_seed_shows_no_spread(tmp_path):
    runs = [bdr.read_run("none", 0, write_run(tmp_path / "n", [2.0, 2.0, 2.0, 2.0]), per_epoch=2),
            bdr.read_run("history", 0, write_run(tmp_path / "h", [2.0, 2.0, 1.0, 1.0],
                                                 spec=[(10, 5), (10, 15), (4, 12), (0, 0)]), per_epoch=2)]
    text = bdr.table(bdr.summarise(runs))
    assert "±" not in text  # a standard deviation of one seed would read as a measured 0
    assert "| 1.00 s, 2.00x, 4.00 tok/verif. |" in text and "| 0.300 | 0.500 | 0.800 |" in text


def test_label_names_the_k_a_setting_ran_with():
    spec = {"method": "history", "num_speculative_tokens": "auto", "max_speculative_tokens": 8}
    assert bdr.label({"setting": "history:auto", "speculation": spec}) == "history:auto (k <= 8)"
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "max_speculative_tokens": 5}
    assert bdr.label({"setting": "draft_model:3", "speculation": spec}) == "draft_model:3"
    assert bdr.label({"setting": "history"}) == "history"  # files written before runs recorded it


def test_a_setting_may_carry_overrides_of_its_own():
    assert bdr.overrides("none+trainer.skip_zero_gradient_rows=false") == [
        "speculation=none", "trainer.skip_zero_gradient_rows=false"]
    assert bdr.overrides("draft_model:3+a.b=1+c=2") == ["speculation=draft_model",
                                                        "speculation.num_speculative_tokens=3", "a.b=1", "c=2"]


def test_time_to_target_counts_step_seconds_to_the_first_validation_that_reaches_it(tmp_path):
    # steps of 3, 3, 2, 2 s (generation + 1); validations at steps 0, 2 and 4
    runs = [bdr.read_run("none", s, write_run(tmp_path / f"n{s}", [2.0, 2.0, 1.0, 1.0], val=val), per_epoch=2)
            for s, val in enumerate([(0.3, 0.9, 0.95), (0.3, 0.5, 0.92), (0.3, 0.5, 0.6)])]
    assert [r["seconds_at_val"] for r in runs[:1]] == [[0.0, 6.0, 10.0]]
    assert [bdr.to_target(r, 0.9) for r in runs] == [6.0, 10.0, None]
    row = bdr.summarise(runs, target=0.9)[0]
    assert (row["target_seconds"], row["target_reached"]) == (pytest.approx(8.0), 2)
    assert "step s to held-out >= 0.90 (seeds)" in bdr.table([row]) and "8 ± 3 (2/3)" in bdr.table([row])
    assert "never (0/3)" in bdr.table(bdr.summarise(runs, target=0.99))


def test_add_grows_a_grid_run_by_run_and_keeps_what_is_done(tmp_path, monkeypatch):
    made = []

    def fake_run_one(setting, seed, extra, work, per_epoch, timeout):  # the training run itself is not the subject
        made.append((setting, seed))
        gen = [2.0, 2.0, 2.0, 2.0] if setting == "none" else [2.0, 2.0, 1.0, 1.0]
        return {**bdr.read_run(setting, seed, write_run(work / f"{setting}{seed}", gen), per_epoch=2),
                "process_seconds": 1.0}

    monkeypatch.setattr(bdr, "run_one", fake_run_one)
    monkeypatch.setattr(bdr, "epoch_steps", lambda extra: 2)
    out = tmp_path / "grid.json"
    argv = ["bench_default_run.py", "--work", str(tmp_path / "w"), "--out", str(out), "--add"]
    monkeypatch.setattr("sys.argv", [*argv, "--settings", "none", "history", "--seeds", "0"])
    bdr.main()
    assert made == [("none", 0), ("history", 0)]
    monkeypatch.setattr("sys.argv", [*argv, "--settings", "none", "history", "--seeds", "0", "1"])
    bdr.main()  # seed 0 is on file: only seed 1 runs
    assert made[2:] == [("none", 1), ("history", 1)]
    grid = json.loads(out.read_text())
    assert [(r["setting"], r["seed"]) for r in grid["runs"]] == [("none", 0), ("history", 0), ("none", 1),
                                                                 ("history", 1)]
    assert grid["seeds"] == [0, 1] and [r["seeds"] for r in grid["rows"]] == [[0, 1], [0, 1]]
    assert grid["versions"] == [grid["version"]] and all(r["version"] == grid["version"] for r in grid["runs"])
    assert all(r["machine_seconds"] > 0 for r in grid["runs"])  # each run records the machine it found
    line = bdr.machines([*grid["runs"], {"setting": "none", "seed": 2}])
    assert "seed 0: " in line and "(2 of 2 runs)" in line and "seed 2: not recorded (1 runs)" in line
    assert bdr.machines([{"setting": "none", "seed": 0}]) == ""
    monkeypatch.setattr("sys.argv", [*argv, "--settings", "none", "--seeds", "2", "--set", "trainer.max_steps=4"])
    with pytest.raises(SystemExit, match="grid.json: its runs were made with --set"):
        bdr.main()  # another set of overrides is another grid: nothing is mixed or lost
    assert len(json.loads(out.read_text())["runs"]) == 4 and len(made) == 4


def test_batch_fill_over_every_step_lag_and_the_engine_cost_fit(tmp_path):
    """Fill over every engine step = rows per step / the rows a call holds (P x G: 2 x 3 here);
    the lag is the run's largest and the mean of the steps'; the engine cost fit pools an arm's
    runs with and without partial rollouts and recovers a step's and a row's cost where the
    seconds are exactly a x steps + b x rows (a = 2 ms, b = 0.1 ms)."""
    cost = lambda steps, rows: (steps, rows, 2e-3 * steps + 1e-4 * rows)  # noqa: E731
    (tmp_path / "h").mkdir()
    whole = write_run(tmp_path / "w", [1.0, 1.0], engine=[cost(10, 30), cost(20, 30)])
    part = write_run(tmp_path / "p", [1.0, 1.0], engine=[cost(5, 30), cost(5, 25)], lag=(3, 0.5))
    for d in (whole, part):
        (d / ".hydra" / "config.yaml").write_text((d / ".hydra" / "config.yaml").read_text() + (
            "generation:\n  num_prompts_per_step: 2\n  num_generations_per_prompt: 3\n"
            "  partial:\n    enabled: false\n    over_provision: 1.5\n"))
    runs = [bdr.read_run("none", 0, whole, per_epoch=2), bdr.read_run("none+generation.partial.x=1", 0, part, 2)]
    assert runs[0]["epochs"][0]["batch_fill_all"] == pytest.approx(60 / 30 / 6)
    assert runs[1]["epochs"][0]["batch_fill_all"] == pytest.approx(55 / 10 / 6)
    assert runs[1]["policy_lag"] == {"max": 3, "mean": 0.5}
    rows = bdr.summarise(runs)
    fit = rows[1]["engine_cost"]
    assert rows[0]["engine_cost"] == fit   # one fit for the arm
    assert fit["per_step_ms"] == pytest.approx(2.0) and fit["per_row_ms"] == pytest.approx(0.1)
    assert fit["r2"] == pytest.approx(1.0)
    assert fit["row_share"] == pytest.approx(1e-4 * 115 / (2e-3 * 40 + 1e-4 * 115))
    text = bdr.table(rows)
    assert "batch 33% full |" in text and "| none | 2.00 | 0.100 | 1.00 |" in text  # no decode steps timed
