"""Datasets (GSM8K, MATH, a seeded arithmetic task) and the seeded question sampler (prompts:
:mod:`cppo.tasks.prompts`).

A problem is a dict ``{"question": str, "answer": str, "kind": "gsm8k" | "math" | "arith" | a registered kind}``;
``kind`` picks the accuracy reward and the prompt (:mod:`cppo.tasks.registry`: which kind a row is, its problem, the
datasets each kind provides). MATH problems also carry ``solution``, the text math-verify parses the gold from.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random

import torch

from ..fileio import shown_path
from .registry import DATASETS, KINDS, dataset_kind, dataset_source, row_kind

ARITH_SPLIT_SEED = {"train": 0, "test": 1_000_003}
#: The arithmetic task's test split: this many distinct problems, held out of every training split.
ARITH_TEST_SIZE = 500
#: The arithmetic task's problems: 10,000 unless ``max_questions`` says otherwise, at most ARITH_MAX (there are only
#: 21 * 21 * 3 = 1,323 distinct ones; more only repeats them, and a billion would not fit in memory).
ARITH_DEFAULT = 10_000
ARITH_MAX = 1_000_000


def check_eval_limit(dataset: str, eval_limit: int | None) -> None:
    """A ``ValueError`` naming ``eval_limit`` when a generated dataset (arith) cannot hold that many test problems."""
    source = dataset_source(dataset)
    size = source.test_size if source is not None else None
    if size is not None and eval_limit is not None and eval_limit > size:
        raise ValueError(
            f"eval_limit must be <= {size} for dataset {dataset} (its test split: {size} distinct problems held out "
            f"of training), got {eval_limit}"
        )


#: The name the config's checks import (any generated dataset's bound, not only arith's).
check_arith_eval_limit = check_eval_limit


def check_arith_count(count: int) -> int:
    """``count`` when the arithmetic task can generate it, else a ``ValueError`` naming ``max_questions``."""
    if count > ARITH_MAX:
        raise ValueError(f"max_questions must be <= {ARITH_MAX:,} for dataset arith (it has 1,323 distinct problems)")
    return count


def _arith_problem(rng: random.Random, max_operand: int) -> dict:
    a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice("+-*")
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return {"question": f"What is {a} {op} {b}?", "answer": str(value), "kind": "arith"}


def arithmetic_problems(
    n: int, *, seed: int = 0, max_operand: int = 20, distinct: bool = False, exclude: frozenset[str] = frozenset()
) -> list[dict]:
    """``n`` seeded problems ``a op b`` with op in +, -, * and operands in [0, max_operand]; ``distinct``: no
    question twice (ValueError when fewer than ``n`` exist); ``exclude``: questions never generated."""
    universe = 3 * (max_operand + 1) ** 2 - len(exclude)
    if distinct and n > universe:
        raise ValueError(f"max_questions must be <= {universe:,} for distinct arith problems, got {n:,}")
    rng, problems, seen = random.Random(seed), [], set()
    while len(problems) < n:
        problem = _arith_problem(rng, max_operand)
        if problem["question"] in exclude or (distinct and problem["question"] in seen):
            continue
        seen.add(problem["question"])
        problems.append(problem)
    return problems


@functools.cache
def arith_test_problems() -> tuple[dict, ...]:
    """The arithmetic task's held-out problems: the first :data:`ARITH_TEST_SIZE` distinct ones of the test seed's
    stream. The training split never generates them, so an evaluation never scores a trained question."""
    return tuple(arithmetic_problems(ARITH_TEST_SIZE, seed=ARITH_SPLIT_SEED["test"], distinct=True))


def arith_split(split: str, max_questions: int | None, question_seed: int | None) -> list[dict]:
    """The arithmetic task's problems of ``split`` (its dataset's ``generate``): the test split the first
    ``max_questions`` of :func:`arith_test_problems`; any other ``max_questions`` (default :data:`ARITH_DEFAULT`)
    generated from ``question_seed`` (0 when None), the test problems held out."""
    if split == "test":
        check_eval_limit("arith", max_questions)
        return [dict(p) for p in arith_test_problems()[: max_questions or ARITH_TEST_SIZE]]
    count = check_arith_count(max_questions or ARITH_DEFAULT)
    base = (question_seed or 0) + ARITH_SPLIT_SEED.get(split, 7)
    held_out = frozenset(p["question"] for p in arith_test_problems())
    return arithmetic_problems(count, seed=base, exclude=held_out)


def arith_count(max_questions: int | None) -> int:
    """How many training problems :func:`arith_split` generates for ``max_questions`` (checked, nothing built)."""
    return check_arith_count(max_questions or ARITH_DEFAULT)


def question_id(problem: dict) -> str:
    """A stable id of a problem, the same in every run and split order: its ``unique_id`` (MATH-500) when it has one,
    else the first 12 hex digits of the SHA-1 of its question text."""
    if problem.get("unique_id"):
        return str(problem["unique_id"])
    return hashlib.sha1(problem["question"].encode("utf-8")).hexdigest()[:12]


def normalise_row(row: dict, *, source: str, kind: str | None = None) -> dict:
    """The problem a dataset row holds, normalised by its kind (:func:`cppo.tasks.registry.row_kind`): the one its
    ``kind`` column names, else ``kind`` (the named dataset's: ``dataset: math`` reads MATH rows), else the one kind
    that reads it (a GSM8K row: question, answer with ``#### N`` or a number; a MATH row: problem, answer or solution,
    or a question with another answer; a registered kind's recogniser); ``ValueError`` naming ``source`` for a row no
    kind reads, or several."""
    _check_row(row, source=source)
    kind = row_kind(row, source, default=kind)
    if kind is None:
        raise ValueError(f"{source}: rows need 'question' and 'answer' (GSM8K) or 'problem' and 'answer' (MATH)")
    fields = dict(kind.normalise(row, source))
    problem = {"question": fields.pop("question", None), "answer": fields.pop("answer", None), "kind": kind.name}
    if not isinstance(problem["question"], str) or not isinstance(problem["answer"], str):
        raise ValueError(f"{source}: task kind {kind.name!r} normalised the row without a question and answer text")
    return problem | fields


def _check_row(row: dict, *, source: str) -> None:
    """``ValueError`` naming ``source`` for a row whose text is not a string, answer is not a scalar, or kind is
    unknown (they would fail, or score nothing, in the middle of a run)."""
    for key in ("question", "problem"):
        if key in row and not (isinstance(row[key], str) and row[key].strip()):
            raise ValueError(f"{source}: {key!r} must be a non-empty string, got {row[key]!r}")
    answer = row.get("answer")
    if isinstance(answer, (dict, list, bool)) or (answer is None and "question" in row and "problem" not in row):
        raise ValueError(f"{source}: 'answer' must be a string or a number, got {answer!r}")
    if row.get("kind") is not None and row["kind"] not in KINDS:
        raise ValueError(f"{source}: 'kind' must be one of {KINDS}, got {row['kind']!r}")


def read_jsonl(path: str, *, kind: str | None = None) -> list[dict]:
    """The problems of a JSON-lines file, one JSON object a line (blank lines skipped; ``kind``: of the rows without a
    ``kind`` column, the named dataset's, :func:`normalise_row`); ``ValueError`` naming the
    file and line of a line that is not UTF-8, not a JSON object (or nested past :data:`MAX_NESTING`), not a
    problem, or holding text the tokenizer cannot encode (a lone surrogate such as ``"\\ud800"``)."""
    if not os.path.isfile(path):
        raise ValueError(f"dataset file {shown_path(path)} does not exist")
    problems = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}, line {number}"
            row = _parse_line(raw, where=where)
            if row is not None:
                problems.append(normalise_row(row, source=where, kind=kind))
    return problems


#: Deepest JSON nesting a dataset row may have (a problem is a flat object; json's parser recurses per level).
MAX_NESTING = 64


def _parse_line(raw: bytes, *, where: str) -> dict | None:
    """One row of a JSON-lines file (None for a blank line), checked: UTF-8, JSON, nesting, encodable text."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
    if not line.strip():
        return None
    if _nesting(line) > MAX_NESTING:
        raise ValueError(f"{where}: JSON nested deeper than {MAX_NESTING} levels (a row is one flat object)")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.pos + 1})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    _check_encodable(row, where=where)
    return row


def _nesting(line: str) -> int:
    """The deepest bracket nesting of a JSON text, ignoring brackets inside strings (no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in line:
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _check_encodable(value, *, where: str, key: str | None = None) -> None:
    """``ValueError`` for a string of ``value`` that UTF-8 cannot encode (JSON's ``\\ud800`` escapes decode to lone
    surrogates, which every tokenizer refuses mid-run)."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_encodable(v, where=where, key=k)
    elif isinstance(value, list):
        for v in value:
            _check_encodable(v, where=where, key=key)
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where}: {key!r} holds a lone surrogate (U+{ord(value[e.start]):04X} at character {e.start + 1}), "
                "text no tokenizer can encode"
            ) from None


def load_problems(
    dataset: str,
    *,
    split: str = "train",
    dataset_path: str | None = None,
    max_questions: int | None = None,
    question_seed: int | None = None,
) -> list[dict]:
    """Problems of ``dataset``: a name a task kind provides (:class:`cppo.tasks.registry.Dataset`): "arith"
    (generated; the test split is :func:`arith_test_problems`, distinct and held out of training), "gsm8k" / "math"
    / "math500" (from ``dataset_path``, a .jsonl file or a folder with ``{split}.jsonl``, else the hub through
    ``datasets``); a .jsonl path, or a hub dataset name. ``max_questions`` caps the count: the first ones, or with
    ``question_seed`` a sample of that many drawn by it (in file order); arith's training problems are generated
    from ``question_seed`` (0 when None). The trainer passes the run's ``question_seed`` for the training split, so that
    runs of other seeds train other questions; evaluation keeps the first (the same for every run).

    "math500" is an evaluation set only: asking for its train split is an error (train on "math", the MATH
    training set). The test split of "math" is MATH-500, the set the paper's recipe reports."""
    source = dataset_source(dataset)
    if source is not None and source.eval_only and split != "test":
        raise ValueError(_eval_only(dataset, source.title))
    if source is not None and source.test is not None and split == "test":
        dataset, source = source.test, dataset_source(source.test)
    if source is not None and source.generate is not None:
        problems = source.generate(split, max_questions, question_seed)
        if not problems:
            raise ValueError(f"dataset {dataset!r} ({split}) has no problems")
        return problems
    if dataset.endswith(".jsonl"):
        problems = read_jsonl(dataset)
    elif dataset_path is not None:
        path = dataset_path
        if os.path.isdir(path):
            path = os.path.join(path, f"{split}.jsonl")
        problems = read_jsonl(path, kind=dataset_kind(dataset))
    else:
        problems = _load_hub(dataset, split, source.hub if source is not None else (dataset, None))
    if not problems:
        raise ValueError(f"dataset {dataset!r} ({split}) has no problems")
    if max_questions and question_seed is not None and max_questions < len(problems):
        picked = sorted(random.Random(question_seed).sample(range(len(problems)), max_questions))
        return [problems[i] for i in picked]
    return problems[:max_questions] if max_questions else problems


def count_local_problems(
    dataset: str, *, dataset_path: str | None = None, max_questions: int | None = None
) -> int | None:
    """How many training problems ``dataset`` has when it is local (generated, as arith, a .jsonl file, or
    ``dataset_path``: read, so a bad row is found), or None for a hub dataset (not downloaded). For dry runs."""
    source = dataset_source(dataset)
    if source is not None and source.generate is not None:  # generated on demand: counted, not built
        return source.count(max_questions)
    if not (dataset.endswith(".jsonl") or dataset_path is not None):
        return None
    return len(load_problems(dataset, split="train", dataset_path=dataset_path, max_questions=max_questions))


def _eval_only(dataset: str, title: str) -> str:
    """Why ``dataset``, an evaluation set, cannot train: what to train on instead (a dataset whose test split it
    is, else a .jsonl path)."""
    instead = next(
        (f"dataset={n} ({dataset_source(n).title}) or " for n in DATASETS if dataset_source(n).test == dataset), ""
    )
    named = f" ({title})" if title else ""
    return (
        f"dataset {dataset!r}{named} is an evaluation set: train on {instead}a .jsonl path, and evaluate on {dataset}"
    )


def _load_hub(dataset: str, split: str, hub: tuple[str, str | None]) -> list[dict]:
    """The rows of ``hub`` (id, config) for ``split``, each normalised (a named dataset's as its kind's)."""
    try:
        import datasets
    except ImportError as e:
        raise ValueError(
            f"dataset {dataset!r}: pass dataset_path (a .jsonl file or a folder of them), or install `datasets` to "
            "load it from the hub"
        ) from e
    name, config = hub
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except (OSError, ConnectionError, ValueError) as e:  # no network, no cache, no such dataset
        raise ValueError(
            f"dataset {dataset!r}: {name} cannot be loaded from the hub ({type(e).__name__}): pass dataset_path, a "
            ".jsonl file or a folder of train.jsonl / test.jsonl"
        ) from None
    return [normalise_row(dict(r), source=name, kind=dataset_kind(dataset)) for r in rows]


class QuestionSampler:
    """Seeded, epoch-wise shuffled question order; ``draw(n)`` returns this rank's share of the next n questions.

    Every rank walks the same global order; rank r takes the r-th of ``world_size`` equal slices of each draw
    (``n`` must divide by ``world_size``). A draw that crosses an epoch end continues in the next epoch's order.
    """

    def __init__(self, num_questions: int, *, seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if num_questions < 1:
            raise ValueError(f"num_questions must be >= 1, got {num_questions}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.num_questions, self.seed, self.rank, self.world_size = num_questions, seed, rank, world_size
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_questions, generator=g).tolist()

    def draw(self, n: int, skip=None) -> list[int]:
        """This rank's share of the next ``n`` questions. ``skip(question, epoch, position) -> bool`` (GRESO,
        :class:`cppo.tasks.greso.SelectiveRollout`) passes over questions before they are drawn, the draw walking on
        until it has ``n``; after a whole epoch's worth of skips in one draw it stops asking. The questions passed
        over are :attr:`skipped` (all ranks'), the ones considered :attr:`considered`."""
        if n % self.world_size:
            raise ValueError(f"questions per step ({n}) must divide by world_size ({self.world_size})")
        picked: list[int] = []
        self.skipped: list[int] = []
        order = self._order(self.epoch)
        while len(picked) < n:
            if self.position == self.num_questions:
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order(self.epoch)
            if skip is None or len(self.skipped) >= self.num_questions:
                take = min(n - len(picked), self.num_questions - self.position)
                picked += order[self.position : self.position + take]
                self.position += take
                continue
            question = order[self.position]
            (self.skipped if skip(question, self.epoch, self.position) else picked).append(question)
            self.position += 1
        self.considered = n + len(self.skipped)
        share = n // self.world_size
        return picked[self.rank * share : (self.rank + 1) * share]

    @property
    def passed(self) -> int:
        """Questions passed so far over all epochs (drawn or skipped by GRESO): ``num_epochs`` epochs are used up
        when it reaches ``num_epochs * num_questions``."""
        return self.epoch * self.num_questions + self.position

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
