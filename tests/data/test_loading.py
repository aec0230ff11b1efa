import glob
import json
import subprocess
import sys

import pytest

from conftest import ROOT
from helpers.cli import left_behind, ray_processes
from rlspec.config import DatasetConfig, SyntheticConfig
from rlspec.data.loading import DataError, PromptSampler, load_prompts, normalise_row
from rlspec.data.synthetic import Problem, is_heldout, make_split, solution


def load(ds, tokenizer, on_bad_row="skip", max_prompt_tokens=64, template="rl_zero"):
    return load_prompts(ds, SyntheticConfig(), key="data.train", tokenizer=tokenizer, template=template,
                        max_prompt_tokens=max_prompt_tokens, on_bad_row=on_bad_row)


def test_solution_is_correct_without_slips_and_consistent_with_them():
    import random
    p = Problem(478, 65)
    assert solution(p) == "8+5=13, 7+6+1=14, 4+0+1=5. Answer: 543"
    slipped = solution(p, slip_prob=1.0, rng=random.Random(0))
    assert slipped == "8+5=13, 7+6=13, 4+0=4. Answer: 433"


def test_train_and_heldout_splits_are_disjoint_and_reproducible():
    train = make_split(0, 2000, 2, 3, heldout=False)
    val = make_split(1, 200, 2, 3, heldout=True)
    assert not set(train) & set(val)
    assert all(is_heldout(p) for p in val) and not any(is_heldout(p) for p in train)
    assert make_split(1, 200, 2, 3, heldout=True) == val


def test_schemas_normalise():
    assert normalise_row({"prompt": "1+1?", "answer": 2}, "auto") == ("1+1?", "2")
    dapo = {"data_source": "math_dapo", "prompt": [{"role": "user", "content": "Solve x."}],
            "reward_model": {"ground_truth": "34", "style": "rule-lean"}}
    assert normalise_row(dapo, "auto") == ("Solve x.", "34")
    assert normalise_row({"problem": "AIME?", "answer": 204}, "auto") == ("AIME?", "204")
    assert normalise_row({"question": "Q?", "answer": "7"}, "aime") == ("Q?", "7")


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")


BAD_ROWS = [
    {"prompt": "Compute 1+2.", "answer": "3"},            # 1 good
    {"answer": "3"},                                       # 2 missing prompt
    {"prompt": 12, "answer": "3"},                         # 3 non-string prompt
    {"prompt": "   ", "answer": "3"},                      # 4 empty prompt
    {"prompt": "Compute " + "9" * 500 + ".", "answer": "1"},  # 5 longer than the context
    "{not json",                                           # 6 invalid JSON
    {"prompt": "Compute 4+4.", "answer": None},            # 7 missing answer
    ["a", "list"],                                         # 8 not an object
    {"prompt": "Compute 2+2.", "answer": "4"},            # 9 good
]


def test_bad_rows_are_skipped_and_counted(tmp_path, tokenizer):
    f = tmp_path / "d.jsonl"
    write_jsonl(f, BAD_ROWS)
    ps = load(DatasetConfig(source=str(f)), tokenizer)
    assert [p.row for p in ps.prompts] == [1, 9]
    assert dict(ps.skipped) == {"missing_prompt": 1, "prompt_not_string": 1, "empty_prompt": 1,
                                "prompt_too_long": 1, "invalid_json": 1, "missing_answer": 1,
                                "not_an_object": 1}


@pytest.mark.parametrize("row,line,what", [(1, 2, "missing prompt"), (2, 3, "not a string"),
                                           (3, 4, "empty prompt"), (4, 5, "tokens"), (5, 6, "invalid JSON")])
def test_bad_row_errors_name_file_and_row(tmp_path, tokenizer, row, line, what):
    f = tmp_path / "d.jsonl"
    write_jsonl(f, [BAD_ROWS[0], BAD_ROWS[row]])
    with pytest.raises(DataError) as e:
        load(DatasetConfig(source=str(f)), tokenizer, on_bad_row="error")
    assert str(f) in str(e.value) and "row 2" in str(e.value) and what in str(e.value)


def test_cli_bad_row_exits_2_naming_it_and_stops_the_ray_it_started(tmp_path):
    """The driver reads data while Ray starts: a bad row still ends the run with exit 2 before any
    actor starts, and the Ray it brought up is shut down with its session directory."""
    f = tmp_path / "d.jsonl"
    write_jsonl(f, [BAD_ROWS[0], BAD_ROWS[5]])
    before = ray_processes()
    p = subprocess.Popen([sys.executable, "-m", "rlspec.train", f"data.train.source={f}", "data.on_bad_row=error",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=180)
    finally:
        p.kill()
    assert p.returncode == 2, err[-2000:]
    assert f"{f}, row 2: invalid JSON" in err and "data.on_bad_row=error" in err
    assert "Generator" not in out + err and "Learner" not in out + err
    assert not glob.glob(f"/tmp/rlspec-ray-{p.pid}-*")  # its session directory removed
    assert not left_behind(before)


def test_parquet_and_saved_dataset_load_through_datasets(tmp_path, tokenizer):
    import datasets
    rows = [{"problem": f"Compute {i}+1.", "answer": str(i + 1)} for i in range(5)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    assert len(load(DatasetConfig(source=str(tmp_path / "d.parquet")), tokenizer)) == 5
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    ps = load(DatasetConfig(source=str(tmp_path / "saved"), limit=3), tokenizer)
    assert [p.answer for p in ps.prompts] == ["1", "2", "3"]


def test_hub_dataset_offline_fails_with_clear_message(tokenizer):
    with pytest.raises(DataError, match=r"data\.train\.source='BytedTsinghua-SIA/DAPO-Math-17k'"):
        load(DatasetConfig(source="BytedTsinghua-SIA/DAPO-Math-17k"), tokenizer)


def test_missing_local_file_is_named(tokenizer):
    with pytest.raises(DataError, match="nope.jsonl"):
        load(DatasetConfig(source="./nope.jsonl"), tokenizer)


def test_all_rows_bad_is_an_error(tmp_path, tokenizer):
    f = tmp_path / "d.jsonl"
    write_jsonl(f, [{"x": 1}])
    with pytest.raises(DataError, match="no usable rows"):
        load(DatasetConfig(source=str(f)), tokenizer)


def test_rl_think_template_uses_chat_template(tokenizer):
    ps = load(DatasetConfig(num_rows=3), tokenizer, template="rl_think")
    text = tokenizer.decode(ps.prompts[0].token_ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


def test_sampler_is_seeded_and_covers_each_epoch(tokenizer):
    ps = load(DatasetConfig(num_rows=10), tokenizer)
    a, b = PromptSampler(ps, seed=3), PromptSampler(ps, seed=3)
    first = a.next_batch(10)
    assert sorted(p.row for p in first) == list(range(1, 11))
    assert [p.row for p in b.next_batch(10)] == [p.row for p in first]
    assert a.next_batch(4) and a.epoch == 1
