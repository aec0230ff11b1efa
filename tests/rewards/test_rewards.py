import pytest
from hypothesis import given, settings, strategies as st

from rlspec.rewards.math import extract_answer, math_reward


@pytest.mark.parametrize("text", ["7+8=15. Answer: 85", "so \\boxed{85}", "answer: 85.", "Answer: $85$",
                                  "Answer: 85\nsome trailing text", "\\boxed{80} then \\boxed{85}"])
def test_correct_answers_score_one(text):
    assert math_reward(text, "85") == 1.0


@pytest.mark.parametrize("text,truth", [("Answer: \\frac{1}{2}", "0.5"), ("\\boxed{\\dfrac{1}{2}}", "1/2"),
                                        ("Answer: 2^{3}", "8")])
def test_equivalent_forms_verified_by_math_verify(text, truth):
    assert math_reward(text, truth) == 1.0


@pytest.mark.parametrize("text", ["Answer: 84", "\\boxed{58}", "85", "no answer here", "Answer:", "\\boxed{}"])
def test_wrong_or_missing_answers_score_zero(text):
    assert math_reward(text, "85") == 0.0


@pytest.mark.parametrize("text", [None, "", "\x00\x01\x02", "\\boxed{" * 50, "Answer: \\frac{{{{", "9" * 100_000,
                                  "Answer: " + "(" * 5000, b"bytes"])
def test_garbage_never_raises_and_scores_zero(text):
    assert math_reward(text, "85") == 0.0


def test_extract_answer_prefers_last_boxed():
    assert extract_answer("Answer: 1 ... \\boxed{2}") == "2"
    assert extract_answer("Answer: 3. Answer: 4") == "4"
    assert extract_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.one_of(st.text(max_size=20), st.integers().map(str)))
def test_reward_is_in_unit_interval_for_any_text(text, truth):
    assert math_reward(text, truth) in (0.0, 1.0)
