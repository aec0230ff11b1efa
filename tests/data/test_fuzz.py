"""Bad input, fuzzed: dataset rows of random types and sizes, prompts with control characters and
huge numbers, malformed LaTeX answers. The loader never crashes (a DataError saying no row was
usable is its one allowed failure) and the math reward stays in [0, 1]."""
import json
import sys
from contextlib import contextmanager

from hypothesis import HealthCheck, given, settings, strategies as st

from rlspec.config import DatasetConfig, SyntheticConfig
from rlspec.data.loading import BadRow, DataError, load_prompts, normalise_row
from rlspec.rewards.math import math_reward



@contextmanager
def any_int_digits():
    """Lift Python's 4300-digit int <-> str limit (test side only: building the inputs)."""
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        yield
    finally:
        sys.set_int_max_str_digits(old)


def big_str(n: int) -> str:
    with any_int_digits():
        return str(n)


CONTROL = st.characters(min_codepoint=0, max_codepoint=31) | st.sampled_from("\x7f\u200b\u202e\ufeff\ud7ff")
HUGE = st.integers(30, 6000).flatmap(lambda d: st.integers(10**d, 10**(d + 1)) | st.integers(-(10**(d + 1)), -(10**d)))
NASTY_TEXT = st.lists(st.text(max_size=20) | CONTROL | HUGE.map(big_str) | st.just("\\boxed{"),
                      max_size=12).map("".join)
SCALAR = (st.none() | st.booleans() | st.integers() | HUGE | st.floats(allow_nan=True, allow_infinity=True)
          | st.text(max_size=50) | NASTY_TEXT | st.binary(max_size=20))
JSONISH = st.recursive(SCALAR, lambda kids: st.lists(kids, max_size=4)
                       | st.dictionaries(st.sampled_from(["prompt", "answer", "problem", "question", "role",
                                                          "content", "reward_model", "ground_truth", "x"]),
                                         kids, max_size=5), max_leaves=12)
ROW = JSONISH | st.fixed_dictionaries({"prompt": SCALAR | NASTY_TEXT | JSONISH, "answer": SCALAR | JSONISH})

LATEX_PIECES = ["\\frac{", "\\dfrac", "{", "}", "\\sqrt[", "]", "^", "_", "\\left(", "\\right)", "\\boxed{",
                "$", "\\\\", "\\begin{pmatrix}", "&", "\\end{", "\\infty", "\\pi", "e", "x", "=", "+", "-",
                "/", ".", ",", "\\text{", "\\%", "10^{10^{10}}", "Answer:", "\\mathbb{R}", "\\cup", "(", ")"]
LATEX = st.lists(st.sampled_from(LATEX_PIECES) | st.integers(-10**9, 10**9).map(str) | HUGE.map(big_str)
                 | CONTROL, max_size=30).map("".join)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])


def _line(row) -> str:
    """One jsonl line; values JSON cannot hold (bytes, NaN under strict parsers) become their repr."""
    with any_int_digits():
        try:
            return json.dumps(row)
        except (TypeError, ValueError):
            return repr(row)


@FUZZ
@given(st.lists(ROW, min_size=1, max_size=8))
def test_loader_never_crashes_on_random_rows(tmp_path_factory, tokenizer, rows):
    path = tmp_path_factory.mktemp("fuzz") / "rows.jsonl"
    path.write_text("\n".join(_line(r) for r in rows) + "\n", encoding="utf-8", errors="surrogatepass")
    try:
        ps = load_prompts(DatasetConfig(source=str(path)), SyntheticConfig(), key="data.train", tokenizer=tokenizer,
                          template="rl_zero", max_prompt_tokens=64, on_bad_row="skip")
    except DataError as e:
        assert "no usable rows" in str(e)
        return
    assert len(ps) + sum(ps.skipped.values()) <= len(rows)
    for p in ps.prompts:
        assert isinstance(p.text, str) and p.text.strip() and isinstance(p.answer, str) and p.answer
        assert 0 < len(p.token_ids) <= 64


@FUZZ
@given(ROW | st.builds(object) | st.tuples(SCALAR))
def test_normalise_row_returns_strings_or_raises_bad_row(row):
    try:
        prompt, answer = normalise_row(row, "auto")
    except BadRow:
        return
    assert isinstance(prompt, str) and isinstance(answer, str)


def test_huge_numbers_and_lone_surrogates_are_rows_not_crashes(tmp_path, tokenizer):
    """Python refuses int <-> str conversions above 4300 digits and the tokenizer refuses lone
    surrogates: a huge integer answer stays a (valid) digit string, a surrogate prompt a bad row."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "Compute 1+1.", "answer": ' + "9" * 5000 + "}\n"
                    '{"prompt": "Compute 2+2.", "answer": "4"}\n'
                    '{"prompt": "Compute \\ud800.", "answer": "4"}\n'
                    '{"prompt": "Compute 3+3.", "answer": 1e999}\n')
    ps = load_prompts(DatasetConfig(source=str(path)), SyntheticConfig(), key="data.train", tokenizer=tokenizer,
                      template="rl_zero", max_prompt_tokens=64, on_bad_row="skip")
    assert [p.answer for p in ps.prompts] == ["9" * 5000, "4"]
    assert dict(ps.skipped) == {"invalid_unicode": 1, "answer_not_finite": 1}
    assert normalise_row({"prompt": "q", "answer": 10**5000}, "auto")[1].startswith("1000")


@FUZZ
@given(LATEX | NASTY_TEXT, LATEX | HUGE.map(big_str) | SCALAR)
def test_math_reward_stays_in_unit_interval_on_malformed_latex(response, truth):
    r = math_reward(response, truth)
    assert isinstance(r, float) and 0.0 <= r <= 1.0


@FUZZ
@given(HUGE, HUGE)
def test_math_reward_on_huge_numbers(a, b):
    sa, sb = big_str(a), big_str(b)
    assert math_reward(f"Answer: {sa}", sa) == 1.0
    assert math_reward(f"\\boxed{{{sa}}}", sb) == (1.0 if a == b else 0.0)
