"""cppo's rewards and evaluation checks against a literal transcription of the official CPPO code
(tests/official_cppo.py): random text over the tags' alphabet, the edge-case classes of issue 10, real GSM8K and
MATH-500 solutions in many layouts, and adversarial inputs of 1 MB (linear time: a quadratic parser would hang)."""

import fidelity_corpus as corpus
import official_cppo as off
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cppo.tasks.data import normalise_row
from cppo.tasks.math_grading import MathVerifier
from cppo.tasks.rewards import (
    extract_answer,
    gsm8k_eval_correct,
    gsm8k_score,
    has_official_format,
    last_number,
    single_number,
)

FRAGMENTS = ["<think>", "</think>", "<answer>", "</answer>", "</think>\n<answer>", "\n", "\r", " ", ",", ".", "...",
             "-", "$", "%", "0", "1", "18", ".5", "a", "####", "\u00a0", "\u0663", "\x00", "\ud800"]  # fmt: skip
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join)


def gold_of(raw: str) -> str:
    return normalise_row({"question": "q", "answer": raw}, source="test")["answer"]


def check_gsm8k(text: str, raw: str) -> None:
    gold = gold_of(raw)
    assert has_official_format(text) == bool(off.format_reward(text)), text
    assert gsm8k_score(text, gold) == off.gsm8k_accuracy_reward(text, raw), (text, raw)
    try:
        official = off.gsm8k_eval_is_correct(text, gold)
    except ValueError:  # float(gold) of a non-numeric gold: the official loop drops the rest of its batch
        float_gold = None
    else:
        assert gsm8k_eval_correct(text, gold) == official, (text, gold)
        return
    assert float_gold is None and gsm8k_eval_correct(text, gold) in (True, False)


@settings(max_examples=600)
@given(text=texts, gold=st.sampled_from(["18", "-3", "0.5", "1234", "7"]), extra=texts)
def test_random_text_scores_as_the_official_code(text, gold, extra):
    check_gsm8k(text, f"{extra}\n#### {gold}")
    assert extract_answer(text) == off.extract_answer_from_model_output(text)
    assert single_number(text) == off.extract_single_number(text)
    assert last_number(text) == off.extract_last_number(text)


@settings(max_examples=300)
@given(text=st.text(max_size=40))
def test_any_unicode_text_scores_as_the_official_code(text):
    check_gsm8k(text, "x\n#### 18")
    assert last_number(text) == off.extract_last_number(text)


@pytest.mark.parametrize(
    "text, gold, format_, accuracy, evaluation",
    [
        ("<think>x</think>\n<answer>18</answer>", "18", 1.0, 2.0, True),
        ("<think>x</think><answer>18</answer>", "18", 0.0, 2.0, True),  # no newline: the old prompt's layout
        ("<think>x</think>\n\n<answer>18</answer>", "18", 0.0, 2.0, True),  # blank line
        ("<think>x</think>\n<answer>18</answer>\nmore", "18", 1.0, 2.0, True),  # text on the next line
        ("<think>x</think>\n<answer>18</answer> more", "18", 0.0, 2.0, True),
        (" <think>x</think>\n<answer>18</answer>", "18", 0.0, 2.0, True),
        ("<think>x</think>\n<answer>18.0000001</answer>", "18", 1.0, 0.0, False),  # no float tolerance
        ("<think>x</think>\n<answer>18.0</answer>", "18", 1.0, 1.5, True),
        ("<think>x</think>\n<answer>.5</answer>", "0.5", 1.0, 1.5, True),  # leading dot
        ("<think>x</think>\n<answer>1, 234</answer>", "1234", 1.0, 0.0, False),  # comma next to a space
        ("<think>x</think>\n<answer>1,234</answer>", "1234", 1.0, 2.0, True),
        ("<think>x</think>\n<answer>9</answer><answer>18", "18", 0.0, 0.0, True),  # unclosed last <answer>
        ("<think><answer>18</answer></think>\n<answer>9</answer>", "18", 1.0, 0.0, False),  # stray <answer>
        ("<think>x</think>\n<answer>...</answer>", "18", 1.0, 0.0, False),
        ("so it is -18", "-18", 0.0, 0.0, True),  # untagged: the last number, signs dropped
        ("so it is 18", "-18", 0.0, 0.0, True),  # the official last-number quirk
        ("$18.00 in total", "18", 0.0, 0.0, True),
        ("<think>x</think>\n<answer>$18</answer>", "18", 1.0, 1.5, True),
        ("<think>x</think>\n<answer>18 or 19</answer>", "18", 1.0, 0.0, False),
    ],
)
def test_edge_case_classes(text, gold, format_, accuracy, evaluation):
    assert (has_official_format(text), gsm8k_score(text, gold), gsm8k_eval_correct(text, gold)) == (
        bool(format_),
        accuracy,
        evaluation,
    )
    check_gsm8k(text, f"steps\n#### {gold}")


def test_real_gsm8k_solutions_in_many_layouts():
    rows = corpus.gsm8k_rows("test")
    pairs = corpus.gsm8k_corpus(rows, per_row=3) + [(t, "x\n#### 18") for t in corpus.random_texts(3000)]
    for text, raw in pairs:
        check_gsm8k(text, raw)
    assert len(pairs) == 3000 + 3 * len(rows)


ADVERSARIAL = [
    "<think>" + "</think>\n<answer>" * 100_000,  # the official format regex: quadratic
    "<answer>" * 130_000,  # a lazy <answer>(.*?)</answer>: quadratic
    "x" * 1_000_000,  # the official last-number regex: quadratic without digits
    "1." * 500_000,
    "-" * 1_000_000,
    "<think>" + "a" * 999_000 + "</think>\n<answer>1</answer>",
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_a_megabyte_of_adversarial_text_scores_in_linear_time(text):
    gold = "1"
    assert has_official_format(text) == (text.startswith("<think>a") and text.endswith("</answer>"))
    assert gsm8k_score(text, gold) in (0.0, 1.5, 2.0)
    assert gsm8k_eval_correct(text, gold) in (True, False)


# --------------------------------------------------------------------------------------------
# MATH: math-verify in the worker against the official in-process calls
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout=2.0)
    yield v
    v.close()


MATH_CASES = [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "so $\\boxed{\\frac12}$", 2.0),  # boxed, outside the tags
    ("<think>x</think>\n<answer>\\boxed{0.5}</answer>", "$\\boxed{\\frac{1}{2}}$", 2.0),
    ("<think>x</think>\n<answer>1/2</answer>", "$\\boxed{\\frac{1}{2}}$", 0.0),  # plain, unboxed answer
    ("<think>x</think>\n<answer>\\boxed{3}</answer>", "$\\boxed{4}$", 0.0),
    ("<think>x</think>\n<answer>\\boxed{3}</answer>", "no LaTeX in this solution", 1.0),  # unparseable gold
    ("", "$\\boxed{4}$", 0.0),
    ("\ud800 \x00 \\boxed{4}", "$\\boxed{4}$", 2.0),
]


def test_math_reward_and_evaluation_match_the_official_calls(verifier):
    rows = corpus.math500_rows()[:12]
    pairs = [(t, s) for t, s, _ in MATH_CASES] + corpus.math_corpus(rows, per_row=2)
    rewards = verifier.scores("reward", [t for t, _ in pairs], [s for _, s in pairs])
    evals = verifier.scores("eval", [t for t, _ in pairs], [s for _, s in pairs])
    assert rewards[: len(MATH_CASES)] == [want for _, _, want in MATH_CASES]
    for (text, solution), reward, correct in zip(pairs, rewards, evals):
        assert reward == off.math_accuracy_reward(text, solution), text
        assert correct == float(off.math_eval_is_correct(text, solution)), text
    assert verifier.timeouts == 0
