"""Reward functions: the official format and accuracy (GSM8K 2.0 / 1.5 / 0, MATH via math-verify x2), arithmetic,
the small-model signals, and the reward registry. (tests/test_fidelity_rewards.py compares them with the official
code on large corpora.)"""

import pytest

from cppo.tasks.rewards import (
    REWARDS,
    eval_correct,
    extract_answer,
    format_reward,
    get_rewards,
    gsm8k_score,
    last_boxed,
    register_reward,
    score_all,
    training_correct,
)


@pytest.mark.parametrize(
    "text, want",
    [
        ("<think>a</think>\n<answer>3</answer>", 1.0),
        ("<think>\nmulti\nline\n</think>\n<answer>\n3\n</answer>", 1.0),
        ("<think>a</think>\n<answer>3</answer>\nafter, on the next line", 1.0),  # re.MULTILINE's $
        ("<think>a</think><answer>3</answer>", 0.0),  # the official layout needs the newline
        ("  <think>a</think>\n<answer>3</answer>", 0.0),
        ("<answer>3</answer>", 0.0),
        ("<think>a</think>", 0.0),
        ("<think>a</think>\n<answer>3</answer> trailing", 0.0),
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
        ("<answer>72.0000001</answer>", "72", 0.0),  # floats compared exactly
    ],
)
def test_gsm8k_scale(text, gold, want):
    row = dict(answer=[gold], kind=["gsm8k"], solution=[None])
    assert gsm8k_score(text, gold) == want
    assert REWARDS["accuracy"]([""], [text], **row) == [want]
    assert REWARDS["accuracy01"]([""], [text], **row) == [float(want > 0)]


@pytest.mark.parametrize(
    "text, solution, want",
    [
        ("<answer>\\boxed{\\frac{1}{2}}</answer>", "so $\\boxed{\\frac{1}{2}}$", 2.0),
        ("<answer>\\boxed{0.5}</answer>", "$\\boxed{\\frac12}$", 2.0),
        ("<answer>The answer is \\boxed{3\\sqrt{2}}.</answer>", "$\\boxed{3\\sqrt{2}}$", 2.0),
        ("<answer>\\boxed{3}</answer>", "$\\boxed{4}$", 0.0),
        ("\\boxed{4}", "$\\boxed{4}$", 2.0),  # math-verify reads the whole completion, tags or not
        ("<answer>4</answer>", "$\\boxed{4}$", 0.0),  # an unboxed answer is not extracted
    ],
)
def test_math_verify(text, solution, want):
    row = dict(answer=["x"], kind=["math"], solution=[solution])
    assert REWARDS["accuracy"]([""], [text], **row) == [want]
    assert training_correct([text], **row) == [want == 2.0]
    assert eval_correct([text], **row) == [want == 2.0]


@pytest.mark.parametrize(
    "text, want",
    [("<answer>42</answer>", True), ("<answer>41</answer>", False), ("so 6 * 7 = 42", True), ("42 or 41", False)],
)
def test_arith(text, want):
    row = dict(answer=["42"], kind=["arith"])
    assert training_correct([text], **row) == eval_correct([text], **row) == [want]


def test_helpers():
    assert extract_answer("<answer> a </answer><answer>b</answer>") == "b"
    assert extract_answer("<answer>1,000</answer> and <answer>2") is None  # the last <answer> is not closed
    assert extract_answer("none") is None
    assert last_boxed("x \\boxed{a{b}c} y \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{open") is None
    with pytest.raises(ValueError, match="kind 'chess'"):
        training_correct(["x"], answer=["1"], kind=["chess"])


def test_pluggable_rewards_and_bad_names():
    register_reward("length_test", lambda prompts, completions, **row: [len(c) for c in completions])
    fns = get_rewards(["length_test", "format"])
    assert score_all(fns, ["p", "p"], ["ab", "<think>x</think>\n<answer>1</answer>"]) == {
        "length_test": [2.0, 35.0],
        "format": [0.0, 1.0],
    }
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_rewards(["nope"])
    register_reward("broken_test", lambda prompts, completions, **row: [1.0])
    with pytest.raises(ValueError, match="broken_test"):
        score_all(get_rewards(["broken_test"]), ["p", "p"], ["a", "b"])


def test_a_built_in_reward_is_not_replaced_a_user_s_reward_is(monkeypatch):
    """A built-in name is refused in one line (``accuracy`` replaced would leave the metrics' correctness graded by
    the kind, not by it); a name the user registered is replaced by a later registration."""
    for name in ("format", "accuracy", "accuracy01", "tag_count", "digits"):
        with pytest.raises(ValueError, match=rf"^reward {name!r} is built in: register yours under another name$"):
            register_reward(name, lambda prompts, completions, **row: [0.0] * len(completions))
    assert REWARDS["format"] is format_reward
    monkeypatch.setitem(REWARDS, "mine_test", None)  # restored after the test
    register_reward("mine_test", lambda prompts, completions, **row: [1.0] * len(completions))
    register_reward("mine_test", lambda prompts, completions, **row: [2.0] * len(completions))
    assert get_rewards(["mine_test"])["mine_test"](["p"], ["c"]) == [2.0]
