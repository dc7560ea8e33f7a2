"""The built-in problem kinds, one :func:`~cppo.tasks.registry.register_task_kind` each: ``gsm8k`` (GSM8K),
``math`` (MATH and MATH-500) and ``arith`` (the seeded arithmetic task). A row's ``kind`` column decides its kind;
of a row without one, GSM8K reads a question whose answer holds ``####`` or is a number, MATH every other question
and every ``problem`` row, arith none (the recognisers do not overlap: :func:`~cppo.tasks.registry.row_kind`)."""

from __future__ import annotations

from . import math_grading
from .data import ARITH_TEST_SIZE, arith_count, arith_split
from .prompts import GSM8K_SYSTEM_PROMPT, MATH_SYSTEM_PROMPT
from .registry import Dataset, plain_problem, register_task_kind, reserve_built_in_kinds
from .rewards import arith_correct, gsm8k_eval_correct, gsm8k_score, last_boxed

__all__ = ["gsm8k_gold", "math_grade"]


# --------------------------------------------------------------------------------------------
# GSM8K
# --------------------------------------------------------------------------------------------


def gsm8k_gold(answer: str) -> str:
    """The official gold (``rewards_gsm.extract_answer_from_dataset``): the text after the first ``####``, stripped,
    commas removed; an answer without ``####`` is kept whole (stripped, commas removed)."""
    parts = answer.split("####")
    return (parts[1] if len(parts) > 1 else answer).strip().replace(",", "")


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True


def _is_gsm8k(row: dict) -> bool:
    """A question row (no ``problem``, no ``kind`` column) whose answer holds ``####`` or is a number."""
    if "problem" in row or "question" not in row or "answer" not in row:
        return False
    answer = str(row["answer"])
    return "####" in answer or _is_number(answer)


def _gsm8k_problem(row: dict, source: str) -> dict:
    problem = plain_problem(row, source)
    return problem | {"answer": gsm8k_gold(problem["answer"])}


# --------------------------------------------------------------------------------------------
# MATH: math-verify in the worker, the kind's completions in one request
# --------------------------------------------------------------------------------------------


def _is_math(row: dict) -> bool:
    """A ``problem`` row, or a question row GSM8K does not read (of a row without a ``kind`` column)."""
    return "problem" in row or ("question" in row and not _is_gsm8k(row))


def _math_problem(row: dict, source: str) -> dict:
    """A MATH row (problem, answer or a solution with ``\\boxed{}``), or a question row of kind math; the gold
    math-verify parses is the full solution (the official reward and evaluation: math-verify, first match)."""
    if "problem" not in row:
        problem = plain_problem(row, source)
        return problem | {"solution": str(row.get("solution") or f"${problem['answer']}$")}
    answer = row.get("answer")
    if answer is None:
        answer = last_boxed(row.get("solution", ""))
    if answer is None:
        raise ValueError(f"{source}: a MATH row needs an 'answer' or a 'solution' with \\boxed{{}}")
    solution = row.get("solution") or f"${answer}$"
    return {"question": row["problem"], "answer": str(answer), "solution": str(solution)}


def math_grade(check: str, completions: list[str], problems: list[dict]) -> list:
    """MATH's checks in one math-verify request: the reward (2.0 / 0, 1.0 for a gold that does not parse), correct
    when it is 2.0 (the reward's verdict, memoised: math-verify is not run again), the evaluation's verdict with the
    gold first (``verify(gold, answer)``; an unparseable gold is wrong)."""
    golds = [p["solution"] if p.get("solution") is not None else f"${p['answer']}$" for p in problems]
    scores = math_grading.verifier().scores("eval" if check == "eval" else "reward", completions, golds)
    if check == "reward":
        return scores
    return [s == (1.0 if check == "eval" else 2.0) for s in scores]


# --------------------------------------------------------------------------------------------
# The registrations
# --------------------------------------------------------------------------------------------

register_task_kind(
    "gsm8k",
    system_prompt=GSM8K_SYSTEM_PROMPT,
    reward=gsm8k_score,  # 2.0 / 1.5 / 0; correct for the metric: a positive reward
    eval_correct=gsm8k_eval_correct,
    normalise=_gsm8k_problem,
    recognise=_is_gsm8k,
    datasets={"gsm8k": Dataset(hub=("openai/gsm8k", "main"), title="GSM8K")},
)
register_task_kind(
    "math",
    system_prompt=MATH_SYSTEM_PROMPT,
    grade=math_grade,
    normalise=_math_problem,
    recognise=_is_math,
    datasets={
        "math": Dataset(
            hub=("DigitalLearningGmbH/MATH-lighteval", None), test="math500", title="the MATH training set"
        ),  # 7,500 problems; its test split is MATH-500, the set the paper's recipe reports
        "math500": Dataset(hub=("HuggingFaceH4/MATH-500", None), eval_only=True, title="MATH-500"),
    },
)
register_task_kind(
    "arith",
    system_prompt=GSM8K_SYSTEM_PROMPT,  # the GSM8K recipe's
    correct=arith_correct,  # the reward 1.0 / 0
    datasets={"arith": Dataset(generate=arith_split, count=arith_count, test_size=ARITH_TEST_SIZE, title="arithmetic")},
)
reserve_built_in_kinds()  # their names are taken: a user's kind is registered under its own
