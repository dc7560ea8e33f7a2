"""The registry of problem kinds: what a ``kind`` (``gsm8k``, ``math``, ``arith``, or one a user registers) means to
the rest of the trainer, in one :class:`TaskKind` each: which rows of a dataset are of it and how they become
problems, its system prompt, how a completion is scored and checked, and the dataset names it provides. The
built-in kinds are registered in :mod:`cppo.tasks.kinds`; a new kind is one :func:`register_task_kind` call.

Everything that depends on the kind asks here: :func:`cppo.tasks.normalise_row` (which kind a row is, its problem),
:func:`cppo.tasks.system_prompt_for`, the ``accuracy`` reward and the correctness checks of the metrics and the
evaluation (:func:`grade`), :func:`cppo.tasks.load_problems` for a dataset name (:func:`dataset_source`), and the
config's ``DATASETS``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from ..config import Names

#: What :func:`grade` and :attr:`TaskKind.grade` check: the ``accuracy`` reward (floats), whether each completion is
#: correct for the training metric, or under the evaluation's protocol (bools).
CHECKS = ("reward", "correct", "eval")


@dataclass(frozen=True)
class Dataset:
    """A name ``dataset`` takes, provided by a task kind: loaded from the hub (``hub``: its id and config; also
    read from ``dataset_path``) or generated (``generate``).

    ``generate(split, max_questions, question_seed) -> problems``; ``count(max_questions) -> int``: how many training
    problems it would generate, checked, nothing built (dry runs); ``test_size``: its test split's problems, the
    bound of ``eval_limit``. ``test``: the dataset whose problems are this one's test split (``math`` -> ``math500``);
    ``eval_only``: only a test split (training on it is refused); ``title``: its name in words, for messages."""

    hub: tuple[str, str | None] | None = None
    generate: Callable[[str, int | None, int | None], list[dict]] | None = None
    count: Callable[[int | None], int] | None = None
    test_size: int | None = None
    test: str | None = None
    eval_only: bool = False
    title: str = ""

    def __post_init__(self) -> None:
        if (self.hub is None) == (self.generate is None):
            raise ValueError("a Dataset is either loaded from the hub (hub=(id, config)) or generated (generate=fn)")
        if self.generate is not None and self.count is None:
            raise ValueError("a generated Dataset needs count(max_questions) (dry runs count it without building)")


def plain_problem(row: dict, source: str) -> dict:
    """The default normaliser: the row's ``question`` (else its ``problem``) and its ``answer`` as text
    (``ValueError`` naming ``source`` without them)."""
    question = row.get("question", row.get("problem"))
    if question is None or "answer" not in row:
        raise ValueError(f"{source}: rows need 'question' and 'answer' (GSM8K) or 'problem' and 'answer' (MATH)")
    return {"question": question, "answer": str(row["answer"])}


@dataclass(frozen=True)
class TaskKind:
    """A kind of problem: everything the trainer does differently for it.

    - ``system_prompt``: the default system prompt of its chat prompt (``system_prompt`` in the config replaces it);
    - ``correct(completion, answer) -> bool``: whether a completion is right, for the accuracy metric;
      ``reward(completion, answer) -> float``: its ``accuracy`` reward (default 1.0 when ``correct``, else 0.0;
      without ``correct``, correct means a positive reward); ``eval_correct(completion, answer) -> bool``: the
      evaluation's check (default ``correct``). Or ``grade(check, completions, problems) -> list``, one batched call
      for all three (``check`` in :data:`CHECKS`; ``problems``: each completion's problem columns, ``answer``,
      ``solution``, ...), for a kind that grades in bulk (MATH: one request to the math-verify worker);
    - ``normalise(row, source) -> dict``: the problem a dataset row holds, ``question`` and ``answer`` (text) and
      any column of its own (default :func:`plain_problem`); ``kind`` is added;
    - ``recognise(row) -> bool``: whether a row without a ``kind`` column is of this kind (default: never; such a
      kind's rows name it in their ``kind`` column). A row's ``kind`` column decides whatever any recogniser says;
      a row without one is the kind whose recogniser alone reads it (several: an error naming them, see
      :func:`row_kind`), so no kind shadows another, built in or not;
    - ``datasets``: the names ``dataset`` takes for it (:class:`Dataset`)."""

    name: str
    system_prompt: str
    correct: Callable[[str, str], bool] | None = None
    reward: Callable[[str, str], float] | None = None
    eval_correct: Callable[[str, str], bool] | None = None
    grade: Callable[[str, list[str], list[dict]], list] | None = None
    normalise: Callable[[dict, str], dict] = plain_problem
    recognise: Callable[[dict], bool] | None = None
    datasets: Mapping[str, Dataset] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"a task kind's name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.system_prompt, str):
            raise ValueError(f"task kind {self.name!r}: system_prompt must be a string")
        if self.correct is None and self.reward is None and self.grade is None:
            raise ValueError(f"task kind {self.name!r} needs correct, reward or grade (how a completion is scored)")
        for key in ("correct", "reward", "eval_correct", "grade", "normalise", "recognise"):
            value = getattr(self, key)
            if value is not None and not callable(value):
                raise ValueError(f"task kind {self.name!r}: {key} must be callable, got {type(value).__name__}")
        for name, source in self.datasets.items():
            if not isinstance(source, Dataset):
                raise ValueError(f"task kind {self.name!r}: dataset {name!r} must be a Dataset")

    def owns(self, row: dict) -> bool:
        """Whether ``row`` is of this kind: its ``kind`` column names this one, or it has none and
        :attr:`recognise` reads it."""
        if row.get("kind") is not None:
            return row["kind"] == self.name
        return self.recognise is not None and bool(self.recognise(row))

    def scores(self, check: str, completions: list[str], problems: list[dict]) -> list:
        """The ``check`` (:data:`CHECKS`) of each completion against its problem."""
        if self.grade is not None:
            return list(self.grade(check, completions, problems))
        if check == "reward":
            fn = self.reward or (lambda c, a: float(self.correct(c, a)))
        elif check == "correct" or self.eval_correct is None:
            fn = self.correct or (lambda c, a: self.reward(c, a) > 0)
        else:
            fn = self.eval_correct
        return [fn(c, p["answer"]) for c, p in zip(completions, problems, strict=True)]


#: The registered kinds, by name, in registration order.
TASK_KINDS: dict[str, TaskKind] = {}
#: The built-in kinds' names (:mod:`cppo.tasks.kinds`), which a registration may not replace.
_BUILT_IN: set[str] = set()


def register_task_kind(name: str, **fields) -> TaskKind:
    """Makes ``TaskKind(name, **fields)`` the kind ``name``: its rows load, its prompt builds and its completions
    score through the same functions as the built-in kinds'. A name your code registered again is replaced; a
    built-in kind's name is refused (its rows, metrics and presets mean that kind: register yours under another
    name). ``ValueError`` for either refusal and for a dataset name another kind provides."""
    if name in _BUILT_IN:
        raise ValueError(f"task kind {name!r} is built in: register yours under another name (and name it in rows)")
    kind = TaskKind(name, **fields)
    for other in TASK_KINDS.values():
        taken = set(kind.datasets) & set(other.datasets)
        if other.name != name and taken:
            raise ValueError(f"task kind {name!r}: task kind {other.name!r} provides dataset {sorted(taken)[0]!r}")
    TASK_KINDS[name] = kind
    return kind


def task_kind(name: str) -> TaskKind:
    """The kind ``name``; ``ValueError`` naming the registered ones."""
    if name not in TASK_KINDS:
        raise ValueError(f"unknown problem kind {name!r}; kinds: {sorted(TASK_KINDS)}")
    return TASK_KINDS[name]


def reserve_built_in_kinds() -> None:
    """Marks every kind registered so far as built in (:mod:`cppo.tasks.kinds` calls it once, after its kinds)."""
    _BUILT_IN.update(TASK_KINDS)


def row_kind(row: dict, source: str = "row", *, default: str | None = None) -> TaskKind | None:
    """The kind ``row`` names in its ``kind`` column, else ``default`` (the kind of the dataset it was loaded as),
    else the one kind whose recogniser reads it, or None. ``ValueError`` naming ``source`` and the kinds when several
    read a row nothing names the kind of (the order of registration decides nothing), or when a recogniser fails."""
    if row.get("kind") is not None or default is not None:
        return task_kind(row.get("kind") or default)
    claims = []
    for kind in TASK_KINDS.values():
        try:
            owns = kind.owns(row)
        except Exception as exc:  # a user's recogniser, asked of every row without a kind column
            raise ValueError(
                f"{source}: task kind {kind.name!r} could not read the row (recognise: {type(exc).__name__} {exc})"
            ) from None
        if owns:
            claims.append(kind)
    if len(claims) > 1:
        names = sorted(kind.name for kind in claims)
        raise ValueError(
            f"{source}: task kinds {names} each read this row; say which it is in a 'kind' column (one of {names})"
        )
    return claims[0] if claims else None


def dataset_kind(name: str) -> str | None:
    """The kind that provides dataset ``name`` (``math500`` -> ``math``), or None (a .jsonl path, a hub name)."""
    return next((k.name for k in TASK_KINDS.values() if name in k.datasets), None)


def dataset_source(name: str) -> Dataset | None:
    """The :class:`Dataset` a kind provides under ``name``, or None (a .jsonl path, a hub name)."""
    return next((k.datasets[name] for k in TASK_KINDS.values() if name in k.datasets), None)


def grade(check: str, completions: list[str], *, answer: list[str], kind: list[str], **columns) -> list:
    """``check`` (:data:`CHECKS`) of each completion by its problem's kind, each kind's completions in one call.
    ``answer``, ``kind`` and ``columns`` (``solution``, ...): the problems' columns as lists aligned with
    ``completions`` (a column that is not such a list, as None, is left out; ``solution`` is None where absent).
    ``ValueError`` naming an unknown kind, before any is graded."""
    if not len(completions) == len(answer) == len(kind):
        raise ValueError(f"{len(completions)} completions, {len(answer)} answers and {len(kind)} kinds: not aligned")
    kinds = {name: task_kind(name) for name in dict.fromkeys(kind)}
    columns = {"answer": answer, "solution": [None] * len(completions)} | {
        key: value for key, value in columns.items() if isinstance(value, (list, tuple)) and len(value) == len(kind)
    }
    out: list = [None] * len(completions)
    for name, task in kinds.items():
        index = [i for i, k in enumerate(kind) if k == name]
        problems = [{key: value[i] for key, value in columns.items()} for i in index]
        scores = task.scores(check, [completions[i] for i in index], problems)
        if len(scores) != len(index):
            raise ValueError(f"task kind {name!r} graded {len(scores)} of {len(index)} completions ({check})")
        for i, score in zip(index, scores, strict=True):
            out[i] = score
    return out


class SystemPrompts(Mapping):
    """Each registered kind's default system prompt, by kind (read from the registry each time)."""

    def __getitem__(self, name: str) -> str:
        if name not in TASK_KINDS:
            raise KeyError(name)
        return TASK_KINDS[name].system_prompt

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(TASK_KINDS))

    def __len__(self) -> int:
        return len(TASK_KINDS)

    def __repr__(self) -> str:
        return repr(dict(self))


#: The registered kinds' names, in registration order (a problem's ``kind``).
KINDS = Names(lambda: tuple(TASK_KINDS))
#: The dataset names the kinds provide, sorted (``dataset`` also takes a .jsonl path or a hub name owner/name).
DATASETS = Names(lambda: tuple(sorted(name for kind in TASK_KINDS.values() for name in kind.datasets)))
