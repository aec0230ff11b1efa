"""scripts/sweep_report.py on a hand-made two-job sweep plus a baseline (figures checked by hand)."""
import json
import subprocess
import sys

import yaml

from conftest import ROOT


def job(d, method, k, tps, recs, seed=0, gen=1.0, acc=0.9):
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"speculation": {"method": method,
                                                                                "num_speculative_tokens": k},
                                                              "trainer": {"seed": seed}}))
    (d / "summary.json").write_text(json.dumps({
        "tokens_per_second": tps, "step_seconds": 2.0, "val_accuracy": [0.3, acc],
        "stage_seconds": {"generation": gen}, "records": recs}))


def test_report_speedups_and_acceptance(tmp_path):
    spec = lambda drafts, acc, pos: {"spec": {"drafts": drafts, "accepted_tokens": acc,  # noqa: E731
                                              "acceptance_per_pos": pos}}
    job(tmp_path / "sweep" / "0", "draft_model", 1, 800.0, [spec(100, 50, [0.5]), spec(300, 150, [0.5])])
    job(tmp_path / "sweep" / "1", "draft_model", 3, 1500.0, [spec(100, 240, [0.9, 0.8, 0.7])])
    job(tmp_path / "base", "none", 3, 1000.0, [{"spec": None}])
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_report.py"), str(tmp_path / "sweep"),
                          "--baseline", str(tmp_path / "base")], capture_output=True, text=True, check=True).stdout
    rows = [ln for ln in out.splitlines() if ln.startswith("| draft_model")]
    assert "| 1 | 800 | 0.80x |" in rows[0] and "| 1.50 |" in rows[0] and "0.50" in rows[0]
    assert "| 3 | 1500 | 1.50x |" in rows[1] and "| 3.40 |" in rows[1] and "0.90, 0.80, 0.70" in rows[1]
    assert (tmp_path / "sweep" / "REPORT.md").exists() and (tmp_path / "sweep" / "sweep.png").stat().st_size > 0


def test_report_over_seeds(tmp_path):
    """Jobs differing only in seed: mean +- stdev [min, max] per configuration (k=auto included)."""
    none = {"spec": None}
    auto = {"spec": {"drafts": 10, "accepted_tokens": 20, "acceptance_per_pos": [0.9, 0.7, 0.4]}}
    for i, (seed, gen, acc) in enumerate([(0, 1.0, 0.9), (1, 2.0, 0.8), (2, 3.0, 1.0)]):
        job(tmp_path / "s" / str(i), "none", 3, 1000.0, [none], seed=seed, gen=gen, acc=acc)
        job(tmp_path / "s" / str(3 + i), "draft_model", "auto", 1200.0, [auto], seed=seed, gen=gen / 2, acc=acc)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep_report.py"), str(tmp_path / "s")],
                         capture_output=True, text=True, check=True).stdout
    seeds = out.split("Over seeds")[1]
    row = next(ln for ln in seeds.splitlines() if ln.startswith("| none"))
    assert "| 0, 1, 2 | 2.000 +- 1.000 [1.000, 3.000] |" in row and "0.900 +- 0.100 [0.800, 1.000]" in row
    row = next(ln for ln in seeds.splitlines() if ln.startswith("| draft_model"))
    assert "| auto | 0, 1, 2 | 1.000 +- 0.500 [0.500, 1.500] |" in row