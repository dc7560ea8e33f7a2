"""Reward functions: format, GSM8K accuracy on the paper's scale, MATH through math-verify, arithmetic."""

import pytest

from cppo.rewards import (
    REWARDS,
    extract_answer,
    format_reward,
    get_rewards,
    gsm8k_score,
    is_correct,
    last_boxed,
    register_reward,
    score_all,
)


@pytest.mark.parametrize(
    "text, want",
    [
        ("<think>a</think>\n<answer>3</answer>", 1.0),
        ("<think>\nmulti\nline\n</think><answer>3</answer>", 1.0),
        ("  <think>a</think> <answer>3</answer>\n", 1.0),
        ("<answer>3</answer>", 0.0),
        ("<think>a</think>", 0.0),
        ("so <think>a</think><answer>3</answer>", 0.0),
        ("<think>a</think><answer>3</answer> trailing", 0.0),
        ("<answer>3</answer><think>a</think>", 0.0),
    ],
)
def test_format_reward(text, want):
    assert format_reward([""], [text]) == [want]


@pytest.mark.parametrize(
    "text, gold, want",
    [
        ("<answer>1,234</answer>", "1234", 2.0),
        ("<answer> 72 </answer>", "72", 2.0),
        ("<answer>72 dollars</answer>", "72", 1.5),
        ("<answer>$72.0</answer>", "72", 1.5),
        ("<answer>72 or 73</answer>", "72", 0.0),
        ("<answer>71</answer>", "72", 0.0),
        ("the answer is 72", "72", 0.0),
        ("<answer>5</answer> then <answer>72</answer>", "72", 2.0),
        ("<answer>-3</answer>", "-3", 2.0),
    ],
)
def test_gsm8k_scale(text, gold, want):
    assert gsm8k_score(text, gold) == want
    assert REWARDS["accuracy"]([""], [text], answer=[gold], kind=["gsm8k"]) == [want]
    assert REWARDS["accuracy01"]([""], [text], answer=[gold], kind=["gsm8k"]) == [float(want > 0)]


@pytest.mark.parametrize(
    "text, gold, want",
    [
        ("<answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}", True),
        ("<answer>\\boxed{0.5}</answer>", "\\frac12", True),
        ("<answer>The answer is \\boxed{3\\sqrt{2}}.</answer>", "3\\sqrt{2}", True),
        ("<answer>\\boxed{3}</answer>", "4", False),
        ("\\boxed{4}", "4", False),  # no answer tags
    ],
)
def test_math_verify(text, gold, want):
    assert is_correct("math", text, gold) is want
    assert REWARDS["accuracy"]([""], [text], answer=[gold], kind=["math"]) == [2.0 if want else 0.0]


@pytest.mark.parametrize(
    "text, want",
    [("<answer>42</answer>", True), ("<answer>41</answer>", False), ("so 6 * 7 = 42", True), ("42 or 41", False)],
)
def test_arith(text, want):
    assert is_correct("arith", text, "42") is want


def test_helpers():
    assert extract_answer("<answer> a </answer><answer>b</answer>") == "b"
    assert extract_answer("none") is None
    assert last_boxed("x \\boxed{a{b}c} y \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{open") is None


def test_pluggable_rewards_and_bad_names():
    register_reward("length_test", lambda prompts, completions, **row: [len(c) for c in completions])
    fns = get_rewards(["length_test", "format"])
    assert score_all(fns, ["p", "p"], ["ab", "<think>x</think><answer>1</answer>"]) == {
        "length_test": [2.0, 34.0],
        "format": [0.0, 1.0],
    }
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_rewards(["nope"])
    register_reward("broken_test", lambda prompts, completions, **row: [1.0])
    with pytest.raises(ValueError, match="broken_test"):
        score_all(get_rewards(["broken_test"]), ["p", "p"], ["a", "b"])
