"""Reward functions ``(prompts, completions, **row) -> list[float]`` and the correctness checks of the metrics and the
evaluation.

``row`` holds the problem's columns as lists aligned with ``completions``: ``answer`` (the gold answer), ``kind``
("gsm8k", "math", "arith" or a registered kind) and ``solution`` (MATH: the text math-verify parses the gold from;
else None). ``accuracy`` and the correctness checks ask each completion's kind (:mod:`cppo.tasks.registry`; the
built-in kinds' checks are registered in :mod:`cppo.tasks.kinds`).

``format`` and ``accuracy`` are the official CPPO rewards (lzhxmu/CPPO ``src/open_r1/rewards_gsm.py`` and
``rewards_math.py``), reproduced to the letter, quirks included, but in linear time (the official regular expressions
backtrack quadratically on long adversarial text) and never raising on odd text:

- ``format``: 1.0 iff ``re.match(r"^<think>.*?</think>\\n<answer>.*?</answer>$", text, re.DOTALL | re.MULTILINE)``;
- ``accuracy``: GSM8K 2.0 when the text after the last ``<answer>`` up to the next ``</answer>`` (stripped, commas
  removed, "..." counting as none) equals the gold string, 1.5 when it and the gold each hold exactly one number
  (``-?\\d*\\.?\\d+``) and these are equal as floats, else 0; MATH: math-verify over the whole completion against
  the gold parsed from the full solution, x2 (1.0 when the gold does not parse), graded in a worker process with a
  hard deadline (:mod:`cppo.tasks.math_grading`: a time-out scores 0); arithmetic (not in the official code): 1.0 / 0.

Also built in (not in the official recipes): ``accuracy01`` (1.0 for a correct answer), ``tag_count`` (0.25 for each
of the four tags present exactly once: a dense format signal for small models; Open-R1's function of that name
counts the tags with their newlines), ``digits`` (the fraction of characters that are digits: a signal even a
randomly initialised tiny model can climb).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from .registry import grade

RewardFn = Callable[..., list[float]]

_THINK, _SEPARATOR, _OPEN, _CLOSE = "<think>", "</think>\n<answer>", "<answer>", "</answer>"
_CLOSE_AT_LINE_END = re.compile(r"</answer>(?=\n|\Z)")  # what "</answer>$" matches under re.MULTILINE
_SINGLE_NUMBER = re.compile(r"-?\d*\.?\d+")  # rewards_gsm.extract_single_number
_LAST_NUMBER = re.compile(r"\d+\.?\d*")  # the numbers r".*?(\d+\.?\d*)" finds (rewards_gsm.extract_last_number)
_ARITH_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


# --------------------------------------------------------------------------------------------
# The official parsing, in linear time
# --------------------------------------------------------------------------------------------


def has_official_format(text: str) -> bool:
    """Whether ``re.match(r"^<think>.*?</think>\\n<answer>.*?</answer>$", text, re.DOTALL | re.MULTILINE)`` matches:
    ``text`` starts with ``<think>``, a ``</think>\\n<answer>`` follows, and after it some ``</answer>`` ends a line
    (a newline or the end of the text follows it). The earliest separator leaves the most room, so it is the only
    one to try: linear time."""
    if not text.startswith(_THINK):
        return False
    separator = text.find(_SEPARATOR, len(_THINK))
    return separator >= 0 and _CLOSE_AT_LINE_END.search(text, separator + len(_SEPARATOR)) is not None


def extract_answer(text: str) -> str | None:
    """``rewards_gsm.extract_answer_from_model_output``: the text after the last ``<answer>`` up to the next
    ``</answer>``, stripped, commas removed; None without a closed last ``<answer>`` or when it is "..."."""
    start = text.rfind(_OPEN)
    if start < 0:
        return None
    end = text.find(_CLOSE, start + len(_OPEN))
    if end < 0:
        return None
    answer = text[start + len(_OPEN) : end].strip().replace(",", "")
    return None if answer == "..." else answer


def single_number(text: str) -> float | None:
    """``rewards_gsm.extract_single_number``: the float of the only match of ``-?\\d*\\.?\\d+``, else None."""
    matches = []
    for m in _SINGLE_NUMBER.finditer(text):
        matches.append(m.group())
        if len(matches) > 1:
            return None
    return float(matches[0]) if matches else None


def last_number(text: str) -> float | None:
    """``rewards_gsm.extract_last_number``: ``$``, ``%`` and ``,`` removed, the float of the last match of
    ``\\d+\\.?\\d*`` (no minus sign), else None. ``re.findall(r".*?(\\d+\\.?\\d*)", text)`` captures exactly the
    matches of ``\\d+\\.?\\d*`` (the lazy prefix only skips to the next digit), without its quadratic backtracking."""
    text = text.replace("$", "").replace("%", "").replace(",", "")
    last = None
    for last in _LAST_NUMBER.finditer(text):  # noqa: B007
        pass
    return None if last is None else float(last.group())


def gsm8k_score(completion: str, gold: str) -> float:
    """The official GSM8K accuracy reward of one completion (``rewards_gsm.accuracy_reward``): 2.0 when the extracted
    answer equals ``gold`` exactly, 1.5 when both hold a single number and these are equal floats, else 0."""
    answer = extract_answer(completion)
    if answer == gold:
        return 2.0
    got, want = single_number(str(answer)), single_number(str(gold))
    return 1.5 if got is not None and want is not None and got == want else 0.0


def _eval_match(predicted: str, gold: str) -> bool:
    """One matching pass of the official GSM8K evaluation: exact string, else a single number equal to
    ``float(gold)``, else equal last numbers (as :func:`last_number` reads them: signs dropped)."""
    if predicted == gold:
        return True
    got = single_number(predicted)
    try:
        if got is not None and got == float(gold):
            return True
    except ValueError:  # the official loop raises here (and loses its batch); a non-numeric gold just fails
        pass
    got, want = last_number(predicted), last_number(gold)
    return got is not None and want is not None and got == want


def gsm8k_eval_correct(completion: str, gold: str) -> bool:
    """The official GSM8K test check (``GRPOTrainer.evaluate`` in ``grpo_trainer_gsm.py``): the tagged answer
    (:func:`extract_answer`) when there is one, else the whole text, through :func:`_eval_match`. (The official loop
    matches the whole text first and lets the tagged answer override it: the same verdict.)"""
    answer = extract_answer(completion)
    return _eval_match(completion if answer is None else answer, gold)


def arith_correct(completion: str, gold: str) -> bool:
    """The tagged answer holds one number equal to the gold integer (else the completion's last number does)."""
    answer = extract_answer(completion)
    if answer is not None:
        numbers = _ARITH_NUMBER.findall(answer)
        return len(numbers) == 1 and _same_number(numbers[0], gold)
    last = None
    for last in _ARITH_NUMBER.finditer(completion):  # noqa: B007
        pass
    return last is not None and _same_number(last.group(), gold)


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return False


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (balanced braces), or None (used to read a MATH row's answer)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


# --------------------------------------------------------------------------------------------
# Batched scoring and correctness (MATH completions go to math-verify in one request)
# --------------------------------------------------------------------------------------------


def accuracy_reward(
    prompts: list[str], completions: list[str], *, answer: list[str], kind: list[str], solution=None, **row
) -> list[float]:
    """The ``accuracy`` reward (see the module docstring): each completion's kind's reward."""
    return [float(s) for s in grade("reward", completions, answer=answer, kind=kind, solution=solution, **row)]


def training_correct(completions: list[str], *, answer: list[str], kind: list[str], solution=None, **row) -> list[bool]:
    """Whether each completion is correct, for the training metric: GSM8K a positive official reward, MATH
    math-verify's verdict (the reward's, memoised: math-verify is not run again), arithmetic :func:`arith_correct`
    (each kind's ``correct``)."""
    return [bool(c) for c in grade("correct", completions, answer=answer, kind=kind, solution=solution, **row)]


def eval_correct(completions: list[str], *, answer: list[str], kind: list[str], solution=None, **row) -> list[bool]:
    """Whether each completion is correct under the official evaluation: GSM8K :func:`gsm8k_eval_correct`, MATH
    math-verify with the gold first (``verify(gold, answer)``; an unparseable gold is wrong), arithmetic
    :func:`arith_correct` (each kind's ``eval_correct``)."""
    return [bool(c) for c in grade("eval", completions, answer=answer, kind=kind, solution=solution, **row)]


def format_reward(prompts: list[str], completions: list[str], **row) -> list[float]:
    return [float(has_official_format(c)) for c in completions]


def accuracy01_reward(prompts: list[str], completions: list[str], *, answer: list[str], kind: list[str], **row):
    return [float(ok) for ok in training_correct(completions, answer=answer, kind=kind, **row)]


def tag_count_reward(prompts: list[str], completions: list[str], **row) -> list[float]:
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    return [sum(0.25 for t in tags if c.count(t) == 1) for c in completions]


def digits_reward(prompts: list[str], completions: list[str], **row) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


REWARDS: dict[str, RewardFn] = {
    "format": format_reward,
    "accuracy": accuracy_reward,
    "accuracy01": accuracy01_reward,
    "tag_count": tag_count_reward,
    "digits": digits_reward,
}
#: The built-in rewards' names, which :func:`register_reward` may not replace.
_BUILT_IN = frozenset(REWARDS)


def register_reward(name: str, fn: RewardFn) -> None:
    """Makes ``fn`` available to ``TrainConfig.rewards`` under ``name``: a name your code registered again is
    replaced; a built-in reward's name is refused (``ValueError``; the metrics and the presets mean the built-in)."""
    if name in _BUILT_IN:
        raise ValueError(f"reward {name!r} is built in: register yours under another name")
    if not callable(fn):
        raise ValueError(f"reward {name!r} must be callable, got {type(fn).__name__}")
    REWARDS[name] = fn


def get_rewards(names: list[str]) -> dict[str, RewardFn]:
    """Reward functions by name; ``ValueError`` naming an unknown one."""
    unknown = [n for n in names if n not in REWARDS]
    if unknown:
        raise ValueError(f"rewards: unknown reward {unknown[0]!r}; built in: {sorted(REWARDS)}")
    return {n: REWARDS[n] for n in names}


def score_all(fns: dict[str, RewardFn], prompts: list[str], completions: list[str], **row) -> dict[str, list[float]]:
    """Each named reward function's scores, per completion (checked to be one float per completion)."""
    scores = {}
    for name, fn in fns.items():
        values = [float(v) for v in fn(prompts, completions, **row)]
        if len(values) != len(completions):
            raise ValueError(f"reward {name!r} returned {len(values)} scores for {len(completions)} completions")
        scores[name] = values
    return scores
