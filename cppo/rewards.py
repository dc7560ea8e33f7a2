"""Reward functions ``(prompts, completions, **row) -> list[float]``.

``row`` holds the problem's columns as lists aligned with ``completions`` (``answer``, ``kind``, ...). Built in:

- ``format``: 1.0 when the completion is exactly ``<think>...</think>`` then ``<answer>...</answer>``
  (whitespace allowed between and around), else 0;
- ``accuracy``: by problem kind: GSM8K on the paper's scale (2.0 when the text of the last ``<answer>``, commas
  removed, equals the gold string; 1.5 when it holds exactly one number equal to the gold number; else 0),
  MATH through ``math-verify`` (2.0 when the answer is equivalent, else 0), arithmetic 0/1;
- ``accuracy01``: 1.0 for a correct answer (any kind), else 0;
- ``tag_count``: 0.25 for each of the four tags present once (a dense format signal for small models);
- ``digits``: the fraction of the completion's characters that are digits (a dense signal that even a randomly
  initialised tiny model can climb: the smoke runs use it).
"""

from __future__ import annotations

import re
from collections.abc import Callable

RewardFn = Callable[..., list[float]]

FORMAT_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(completion: str) -> str | None:
    """The stripped text inside the last ``<answer>...</answer>``, or None."""
    found = ANSWER_RE.findall(completion)
    return found[-1].strip() if found else None


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-6
    except ValueError:
        return False


def gsm8k_score(completion: str, gold: str) -> float:
    """2.0 exact string match of the extracted answer, 1.5 when it holds exactly one number equal to gold, else 0."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    answer = answer.replace(",", "").strip()
    gold = gold.replace(",", "").strip()
    if answer == gold:
        return 2.0
    numbers = NUMBER_RE.findall(answer)
    return 1.5 if len(numbers) == 1 and _same_number(numbers[0], gold) else 0.0


def math_correct(completion: str, gold: str) -> bool:
    """math-verify equivalence of the answer (boxed inside the answer tags, or the answer text) with the gold."""
    from math_verify import parse, verify

    answer = extract_answer(completion)
    if answer is None:
        return False
    boxed = last_boxed(answer)
    target = parse(f"${gold}$")
    candidate = parse(f"$\\boxed{{{boxed}}}$" if boxed is not None else f"${answer}$")
    return bool(candidate) and bool(target) and bool(verify(target, candidate))


def arith_correct(completion: str, gold: str) -> bool:
    """The answer tag's text (else the completion's last number) equals the gold integer."""
    answer = extract_answer(completion)
    if answer is not None:
        numbers = NUMBER_RE.findall(answer)
        return len(numbers) == 1 and _same_number(numbers[0], gold)
    numbers = NUMBER_RE.findall(completion)
    return bool(numbers) and _same_number(numbers[-1], gold)


def is_correct(kind: str, completion: str, gold: str) -> bool:
    """Whether a completion answers a problem of ``kind`` correctly (the accuracy used by eval and metrics)."""
    if kind == "gsm8k":
        return gsm8k_score(completion, gold) > 0
    if kind == "math":
        return math_correct(completion, gold)
    if kind == "arith":
        return arith_correct(completion, gold)
    raise ValueError(f"unknown problem kind {kind!r}")


def format_reward(prompts: list[str], completions: list[str], **row) -> list[float]:
    return [1.0 if FORMAT_RE.match(c) else 0.0 for c in completions]


def tag_count_reward(prompts: list[str], completions: list[str], **row) -> list[float]:
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    return [sum(0.25 for t in tags if c.count(t) == 1) for c in completions]


def accuracy_reward(prompts: list[str], completions: list[str], *, answer: list[str], kind: list[str], **row):
    scores = []
    for c, gold, k in zip(completions, answer, kind, strict=True):
        if k == "gsm8k":
            scores.append(gsm8k_score(c, gold))
        elif k == "math":
            scores.append(2.0 if math_correct(c, gold) else 0.0)
        else:
            scores.append(1.0 if is_correct(k, c, gold) else 0.0)
    return scores


def accuracy01_reward(prompts: list[str], completions: list[str], *, answer: list[str], kind: list[str], **row):
    return [1.0 if is_correct(k, c, gold) else 0.0 for c, gold, k in zip(completions, answer, kind, strict=True)]


def digits_reward(prompts: list[str], completions: list[str], **row) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


REWARDS: dict[str, RewardFn] = {
    "format": format_reward,
    "accuracy": accuracy_reward,
    "accuracy01": accuracy01_reward,
    "tag_count": tag_count_reward,
    "digits": digits_reward,
}


def register_reward(name: str, fn: RewardFn) -> None:
    """Makes ``fn`` available to ``TrainConfig.rewards`` under ``name``."""
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
