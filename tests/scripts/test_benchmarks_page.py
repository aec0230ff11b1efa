"""docs/benchmarks.md is generated from its template and docs/bench/*.json (the committed page is the
generated one, the same without git), every placed file's own command is on it and every superseded
one is named, its summary is short, and a file the template does not place, or a placeholder without
a file, is an error naming it.
Also scripts/harness.py, which every benchmark script shares."""
import json
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

import harness
import make_benchmarks_page as page

BENCH = ROOT / "docs" / "bench"


def test_the_committed_page_is_the_generated_one_and_carries_every_command():
    text = page.page(BENCH)
    assert (ROOT / "docs" / "benchmarks.md").read_text() == text, \
        "docs/benchmarks.md is stale: run python scripts/make_benchmarks_page.py"
    kinds = {m[2]: m[1] for m in map(page.PLACEHOLDER.match, page.TEMPLATE.read_text().splitlines()) if m}
    superseded = [p for p in sorted(BENCH.glob("*.json")) if kinds.get(p.name) == "superseded"]
    assert superseded, "the template supersedes no file"
    for p in sorted(BENCH.glob("*.json")):
        r = json.loads(p.read_text())
        assert r["date"] and re.fullmatch(r"\d{4}-\d\d-\d\d", r["date"]), p.name
        if p in superseded:  # named, with its version and date, on a line of its own; its command need not be
            assert f"- `{p.name}` (rlspec {page.version(r)}, {r['date']}), superseded: " in text, p.name
        else:  # placed by {{file}} or {{learner_memory}}: its command is on the page
            assert r["command"] in text and p.name in text, p.name
    # a figure of the current default run's table is on the page
    row = json.loads((BENCH / "default_run_host_counts.json").read_text())["rows"][1]
    assert f"{row['step_seconds']:.2f} ± {row['step_seconds_std']:.2f}" in text


def test_the_summary_is_at_most_twenty_lines_with_a_figure_machine_and_date_each():
    text = page.page(BENCH)
    body = text.split("## Summary\n\n", 1)[1].split("\n\n", 1)[0]  # the table under the heading
    rows = body.splitlines()[2:]
    assert len(body.splitlines()) <= 20 and len(rows) >= len(page.SUMMARY)
    for r in rows:
        area, headline, measured = [c.strip() for c in r.strip("|").split("|")]
        assert re.search(r"\d", headline) and re.search(r"\d{4}-\d\d-\d\d", measured), r


def test_the_page_is_the_same_without_git(tmp_path):
    """As from a tarball: the scripts and docs copied where no .git is, the page comes out the same."""
    for d in ("scripts", "docs"):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "page.md"
    p = subprocess.run([sys.executable, "scripts/make_benchmarks_page.py", "--out", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert not (tmp_path / ".git").exists() and out.read_text() == (ROOT / "docs" / "benchmarks.md").read_text()


def test_an_unplaced_file_and_a_placeholder_without_a_file_are_named(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    shutil.copy(BENCH / "memory.json", bench)
    template = tmp_path / "t.md"
    template.write_text("# T\n\n{{file memory.json}}\n")
    assert "python scripts/bench_memory.py --out docs/bench/memory.json" in page.page(bench, template)
    shutil.copy(BENCH / "minibatch_chain.json", bench)
    with pytest.raises(page.PageError, match="no placeholder for minibatch_chain.json"):
        page.page(bench, template)
    template.write_text("# T\n\n{{file memory.json}}\n{{file minibatch_chain.json}}\n{{file gone.json}}\n")
    with pytest.raises(page.PageError, match=r"t\.md:5: \{\{file gone\.json\}\} names no file"):
        page.page(bench, template)


def test_a_superseded_file_is_one_line_and_a_commented_placeholder_is_left_out(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    for name in ("memory.json", "minibatch_chain.json"):
        shutil.copy(BENCH / name, bench)
    minibatch = json.loads((bench / "minibatch_chain.json").read_text())
    template = tmp_path / "t.md"
    template.write_text("# T\n\n{{file memory.json}}\n\n<!-- {{file gone.json}} -->\n"
                        "{{superseded minibatch_chain.json: re-measured in memory.json}}\n")
    text = page.page(bench, template)
    assert text.endswith(f"\n\n- `minibatch_chain.json` (rlspec {minibatch['version']}, {minibatch['date']}), "
                         "superseded: re-measured in memory.json\n")   # after memory.json's section
    assert text.count("minibatch_chain.json") == 1 and minibatch["command"] not in text
    assert "gone.json" not in text and "<!--" not in text
    template.write_text("# T\n\n{{file memory.json}}\n{{superseded minibatch_chain.json}}\n")
    with pytest.raises(page.PageError, match=r"t\.md:4: unknown placeholder '\{\{superseded minibatch_chain"):
        page.page(bench, template)   # a reason is required
    template.write_text("# T\n\n{{file memory.json}}\n{{superseded minibatch_chain.json: why}}\n"
                        "{{superseded gone.json: why}}\n")
    with pytest.raises(page.PageError, match=r"t\.md:5: \{\{superseded gone\.json\}\} names no file"):
        page.page(bench, template)


def test_harness_mean_std_and_command():
    assert harness.mean_std([1.0, None, 3.0]) == (2.0, pytest.approx(2 ** 0.5))
    assert harness.mean_std([4.0]) == (4.0, 0.0) and harness.mean_std([None]) == (None, None)
    assert harness.command([str(ROOT / "scripts" / "bench_async.py"), "--set", "a=b c"]) == \
        "python scripts/bench_async.py --set 'a=b c'"
    cmd = harness.train_command(["trainer.seed=1"], ROOT / "run")
    assert cmd[1:4] == ["-m", "rlspec.train", "trainer.seed=1"] and "trainer.save_final=false" in cmd
    assert set(harness.QUIET) <= set(cmd) and cmd[-1] == f"hydra.run.dir={ROOT / 'run'}"
    assert "trainer.resume=never" in cmd   # a run directory left by an interrupted benchmark is not resumed
    assert "trainer.resume=never" not in harness.train_command(["trainer.resume=auto"], ROOT / "run")
    stamp = harness.stamp()
    assert set(stamp) == {"version", "date", "cpu", "cpu_count", "command"}
