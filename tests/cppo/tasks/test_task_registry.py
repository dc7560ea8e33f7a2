"""A problem kind is one registration (cppo.tasks.registry): a toy kind registered in one call loads from a .jsonl
file, builds its prompt and scores through the functions the trainer and the evaluation call; the built-in kinds
read rows, prompt and score as before, each asked through the registry."""

import json

import pytest

from cppo.config import DATASETS as CONFIG_DATASETS
from cppo.config import check_model_and_data
from cppo.step import tiny_tokenizer
from cppo.tasks import (
    DATASETS,
    GSM8K_SYSTEM_PROMPT,
    KINDS,
    MATH_SYSTEM_PROMPT,
    SYSTEM_PROMPTS,
    TASK_KINDS,
    Dataset,
    TaskKind,
    build_prompt,
    check_eval_limit,
    count_local_problems,
    eval_correct,
    get_rewards,
    load_problems,
    normalise_row,
    register_task_kind,
    score_all,
    system_prompt_for,
    task_kind,
    training_correct,
)

REVERSE_PROMPT = "Write the user's text backwards, and nothing else."
WORDS = ["abc", "hello", "cppo", "racecar", "level up"]


@pytest.fixture
def registry():
    """The registry as it was, restored after the test (the kinds it registered gone)."""
    saved = dict(TASK_KINDS)
    yield TASK_KINDS
    TASK_KINDS.clear()
    TASK_KINDS.update(saved)


def reversed_text(completion: str, answer: str) -> bool:
    return completion.strip() == answer


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows_of(problems: list[dict], group_size: int = 1) -> dict:
    """The columns the trainer hands the rewards (cppo/rollouts.py: answer, kind, solution, G times each)."""
    return {k: [p.get(k) for p in problems for _ in range(group_size)] for k in ("answer", "kind", "solution")}


def test_a_new_kind_is_one_registration(registry, tmp_path):
    register_task_kind("reverse", system_prompt=REVERSE_PROMPT, correct=reversed_text)  # the one call

    path = write_rows(
        tmp_path / "reverse.jsonl", [{"question": w, "answer": w[::-1], "kind": "reverse"} for w in WORDS]
    )
    problems = load_problems(path)
    assert [p["kind"] for p in problems] == ["reverse"] * len(WORDS)
    assert problems[0] == {"question": "abc", "answer": "cba", "kind": "reverse"}
    assert count_local_problems(path) == len(WORDS)

    tok = tiny_tokenizer(300)
    prompt = build_prompt(tok, problems[0])
    turns = f"system\n{REVERSE_PROMPT}", "user\nabc"
    assert prompt == "".join(f"<|im_start|>{t}<|im_end|>\n" for t in turns) + "<|im_start|>assistant\n"
    assert build_prompt(tok, problems[0], system_prompt="S.").startswith("<|im_start|>system\nS.<|im_end|>")

    # G = 2 completions per problem, the first right, the second wrong: scored as the trainer scores them
    completions = [c for p in problems for c in (p["answer"], p["question"] + "!")]
    rows = rows_of(problems, group_size=2)
    scores = score_all(
        get_rewards(["accuracy", "accuracy01", "format"]), [prompt] * len(completions), completions, **rows
    )
    assert scores["accuracy"] == scores["accuracy01"] == [1.0, 0.0] * len(WORDS)
    assert scores["format"] == [0.0] * len(completions)  # the official format reward, whatever the kind
    assert training_correct(completions, **rows) == [True, False] * len(WORDS)
    assert eval_correct(completions, **rows) == [True, False] * len(WORDS)

    assert "reverse" in KINDS and KINDS[-1] == "reverse" and SYSTEM_PROMPTS["reverse"] == REVERSE_PROMPT
    assert system_prompt_for("reverse") == REVERSE_PROMPT


def test_the_registry_is_restored_after_a_test():
    assert "reverse" not in KINDS and set(TASK_KINDS) == {"gsm8k", "math", "arith"}


def test_a_kind_mixed_with_the_built_in_ones_in_one_batch(registry):
    register_task_kind("reverse", system_prompt=REVERSE_PROMPT, correct=reversed_text)
    completions = ["<answer>42</answer>", "cba", "<answer>7</answer>", "abc"]
    rows = dict(answer=["42", "cba", "7", "cba"], kind=["gsm8k", "reverse", "arith", "reverse"])
    assert get_rewards(["accuracy"])["accuracy"]([""] * 4, completions, **rows) == [2.0, 1.0, 1.0, 0.0]
    assert training_correct(completions, **rows) == eval_correct(completions, **rows) == [True, True, True, False]


def test_a_reward_of_its_own_and_an_evaluation_check_of_its_own(registry):
    register_task_kind(
        "reverse",
        system_prompt=REVERSE_PROMPT,
        reward=lambda c, a: 1.0 if c.strip() == a else 0.25 if sorted(c.strip()) == sorted(a) else 0.0,
        eval_correct=lambda c, a: c == a,  # the evaluation is strict about whitespace
    )
    completions, rows = ["cba", "bca", "xyz", " cba"], dict(answer=["cba"] * 4, kind=["reverse"] * 4)
    assert get_rewards(["accuracy"])["accuracy"]([""] * 4, completions, **rows) == [1.0, 0.25, 0.0, 1.0]
    assert training_correct(completions, **rows) == [True, True, False, True]  # correct: a positive reward
    assert eval_correct(completions, **rows) == [True, False, False, False]


def test_a_batched_kind_is_graded_once_per_call(registry):
    calls = []

    def grade(check, completions, problems):
        calls.append((check, len(completions), sorted(problems[0])))
        return (
            [float(c == p["answer"]) for c, p in zip(completions, problems)]
            if check == "reward"
            else [c == p["answer"] for c, p in zip(completions, problems)]
        )

    register_task_kind("reverse", system_prompt=REVERSE_PROMPT, grade=grade)
    completions = ["cba", "<answer>1</answer>", "abc", "cba"]
    rows = dict(answer=["cba", "1", "cba", "cba"], kind=["reverse", "arith", "reverse", "reverse"], solution=None)
    assert get_rewards(["accuracy"])["accuracy"]([""] * 4, completions, **rows) == [1.0, 1.0, 0.0, 1.0]
    assert eval_correct(completions, **rows) == [True, True, False, True]
    assert calls == [("reward", 3, ["answer", "solution"]), ("eval", 3, ["answer", "solution"])]


def test_a_kind_reads_rows_with_its_own_columns(registry, tmp_path):
    """A normaliser of its own: rows ``{"text": ...}`` of kind reverse become problems, the gold computed."""
    register_task_kind(
        "reverse",
        system_prompt=REVERSE_PROMPT,
        correct=reversed_text,
        normalise=lambda row, source: {"question": f"Reverse: {row['text']}", "answer": row["text"][::-1], "n": 1},
    )
    problems = load_problems(write_rows(tmp_path / "r.jsonl", [{"text": "abc", "kind": "reverse"}]))
    assert problems == [{"question": "Reverse: abc", "answer": "cba", "kind": "reverse", "n": 1}]
    with pytest.raises(ValueError, match=r"line 2: rows need 'question' and 'answer'"):  # no kind column: no kind
        load_problems(write_rows(tmp_path / "s.jsonl", [{"text": "abc", "kind": "reverse"}, {"text": "abc"}]))


def test_a_kind_may_provide_a_dataset_name(registry):
    """A generated dataset: ``dataset: reverse`` is then a name the config and the dry run accept."""

    def generate(split, max_questions, question_seed):
        words = WORDS if split == "test" else [w + str(i) for i in range(max_questions or 20) for w in WORDS[:1]]
        return [{"question": w, "answer": w[::-1], "kind": "reverse"} for w in words[: max_questions or None]]

    register_task_kind(
        "reverse",
        system_prompt=REVERSE_PROMPT,
        correct=reversed_text,
        datasets={"reverse": Dataset(generate=generate, count=lambda n: n or 20, test_size=len(WORDS))},
    )
    assert "reverse" in DATASETS and "reverse" in CONFIG_DATASETS and CONFIG_DATASETS == DATASETS
    check_model_and_data(model="tiny-qwen2", dataset="reverse")
    assert len(load_problems("reverse", max_questions=7)) == 7 and count_local_problems("reverse") == 20
    assert [p["question"] for p in load_problems("reverse", split="test")] == WORDS
    with pytest.raises(ValueError, match=r"eval_limit must be <= 5 for dataset reverse"):
        check_eval_limit("reverse", 6)
    with pytest.raises(ValueError, match="task kind 'other': task kind 'arith' provides dataset 'arith'"):
        register_task_kind(
            "other", system_prompt="", correct=reversed_text, datasets={"arith": Dataset(hub=("a", None))}
        )


def test_bad_registrations_and_unknown_kinds_are_one_line(registry):
    with pytest.raises(ValueError, match="needs correct, reward or grade"):
        register_task_kind("reverse", system_prompt=REVERSE_PROMPT)
    with pytest.raises(ValueError, match="correct must be callable"):
        register_task_kind("reverse", system_prompt=REVERSE_PROMPT, correct="yes")
    with pytest.raises(ValueError, match="either loaded from the hub"):
        Dataset()
    assert "reverse" not in KINDS
    with pytest.raises(ValueError, match=r"unknown problem kind 'reverse'; kinds: \['arith', 'gsm8k', 'math'\]"):
        training_correct(["x"], answer=["x"], kind=["reverse"])
    with pytest.raises(ValueError, match=r"'kind' must be one of \('gsm8k', 'math', 'arith'\), got 'reverse'"):
        normalise_row({"question": "abc", "answer": "cba", "kind": "reverse"}, source="x")


# --------------------------------------------------------------------------------------------
# Which kind a row is: its kind column decides; a user's kind is never shadowed by a built-in one (issue 49)
# --------------------------------------------------------------------------------------------


def test_a_problem_row_of_a_registered_kind_is_that_kind(registry, tmp_path):
    """``{"problem", "answer", "kind": "reverse"}`` was MATH's: MATH's prompt and grader (its recogniser claimed every
    problem row and was asked before any registered kind)."""
    register_task_kind("reverse", system_prompt=REVERSE_PROMPT, correct=reversed_text)
    path = write_rows(tmp_path / "r.jsonl", [{"problem": w, "answer": w[::-1], "kind": "reverse"} for w in WORDS])
    problems = load_problems(path)
    assert problems[0] == {"question": "abc", "answer": "cba", "kind": "reverse"}
    assert [p["kind"] for p in problems] == ["reverse"] * len(WORDS)
    assert build_prompt(tiny_tokenizer(300), problems[0]).startswith(f"<|im_start|>system\n{REVERSE_PROMPT}<|im_end|>")
    completions = [p["answer"] for p in problems]  # right by the reverse kind, wrong by MATH's math-verify
    assert eval_correct(completions, **rows_of(problems)) == [True] * len(WORDS)


def test_a_kind_that_recognises_rows_is_asked_beside_the_built_in_ones(registry):
    """A row without a kind column: the one kind that reads it; several: an error naming them (never the first)."""
    register_task_kind(
        "reverse",
        system_prompt=REVERSE_PROMPT,
        correct=reversed_text,
        recognise=lambda row: "text" in row or "word" in row,
        normalise=lambda row, source: {"question": row.get("text") or row["word"], "answer": "x"},
    )
    ambiguous = r"each read this row; say which it is in a 'kind' column"
    assert normalise_row({"text": "abc"}, source="x") == {"question": "abc", "answer": "x", "kind": "reverse"}
    with pytest.raises(ValueError, match=r"^x: task kinds \['math', 'reverse'\] " + ambiguous):
        normalise_row({"problem": "p", "answer": "5", "word": "w"}, source="x")
    with pytest.raises(ValueError, match=r"^x: task kinds \['gsm8k', 'reverse'\] " + ambiguous):
        normalise_row({"question": "q", "answer": "#### 5", "word": "w"}, source="x")
    named = {"problem": "p", "answer": "5", "word": "w", "kind": "reverse"}
    assert normalise_row(named, source="x")["kind"] == "reverse"
    assert normalise_row({"problem": "p", "answer": "5"}, source="x")["kind"] == "math"  # math's alone, as before


def test_a_named_dataset_s_rows_are_its_kind_whatever_a_recogniser_says(registry, tmp_path):
    """``dataset: math`` (or ``gsm8k``) with ``dataset_path`` names the rows' kind: a user's recogniser that also
    reads ``problem`` rows makes them ambiguous only where nothing names the kind (a bare .jsonl path)."""
    register_task_kind(
        "reverse", system_prompt=REVERSE_PROMPT, correct=reversed_text, recognise=lambda row: "problem" in row
    )
    path = write_rows(tmp_path / "train.jsonl", [{"problem": "p", "answer": "5"}, {"problem": "q", "answer": "x^2"}])
    assert [p["kind"] for p in load_problems("math", dataset_path=path)] == ["math", "math"]
    assert [p["kind"] for p in load_problems("gsm8k", dataset_path=str(tmp_path))] == ["gsm8k", "gsm8k"]
    with pytest.raises(ValueError, match=r"line 1: task kinds \['math', 'reverse'\] each read this row"):
        load_problems(path)
    named = write_rows(tmp_path / "n.jsonl", [{"problem": "p", "answer": "5", "kind": "reverse"}])
    assert load_problems("math", dataset_path=named)[0]["kind"] == "reverse"  # a row's kind column decides


def test_a_recogniser_that_fails_is_one_line_naming_the_kind(registry):
    register_task_kind("reverse", system_prompt=REVERSE_PROMPT, correct=reversed_text, recognise=lambda r: r["text"])
    with pytest.raises(ValueError, match=r"^x: task kind 'reverse' could not read the row \(recognise: KeyError"):
        normalise_row({"question": "q", "answer": "5"}, source="x")


def test_a_built_in_kind_is_not_replaced_a_user_s_kind_is(registry):
    for name in ("gsm8k", "math", "arith"):
        with pytest.raises(ValueError, match=rf"^task kind {name!r} is built in: register yours under another name"):
            register_task_kind(name, system_prompt=REVERSE_PROMPT, correct=reversed_text)
    assert task_kind("math").system_prompt == MATH_SYSTEM_PROMPT
    register_task_kind("reverse", system_prompt="first", correct=reversed_text)
    register_task_kind("reverse", system_prompt=REVERSE_PROMPT, correct=reversed_text)  # yours: replaced
    assert task_kind("reverse").system_prompt == REVERSE_PROMPT and KINDS.count("reverse") == 1


# --------------------------------------------------------------------------------------------
# The built-in kinds, through the registry, as before
# --------------------------------------------------------------------------------------------


def test_the_built_in_kinds_are_registered():
    assert KINDS == ("gsm8k", "math", "arith") and DATASETS == ("arith", "gsm8k", "math", "math500")
    assert CONFIG_DATASETS == ("arith", "gsm8k", "math", "math500")
    assert repr(DATASETS) == "('arith', 'gsm8k', 'math', 'math500')"  # the config's messages print the tuple
    assert [task_kind(k).system_prompt for k in KINDS] == [GSM8K_SYSTEM_PROMPT, MATH_SYSTEM_PROMPT, GSM8K_SYSTEM_PROMPT]
    assert isinstance(task_kind("math"), TaskKind) and task_kind("math").grade is not None


@pytest.mark.parametrize(
    ("row", "want"),
    [
        ({"question": "q", "answer": "steps #### 1,234"}, {"question": "q", "answer": "1234", "kind": "gsm8k"}),
        ({"question": "q", "answer": 5}, {"question": "q", "answer": "5", "kind": "gsm8k"}),
        ({"question": "q", "answer": "x^2"}, {"question": "q", "answer": "x^2", "kind": "math", "solution": "$x^2$"}),
        ({"question": "q", "answer": "7", "kind": "arith"}, {"question": "q", "answer": "7", "kind": "arith"}),
        ({"question": "q", "answer": "x #### 2", "kind": "gsm8k"}, {"question": "q", "answer": "2", "kind": "gsm8k"}),
        (
            {"question": "q", "answer": "#### 7", "kind": "math"},
            {"question": "q", "answer": "#### 7", "kind": "math", "solution": "$#### 7$"},
        ),
        ({"problem": "p", "answer": "5"}, {"question": "p", "answer": "5", "kind": "math", "solution": "$5$"}),
        (  # a row's kind column decides, a problem row too (issue 49: it was MATH's whatever its kind said)
            {"problem": "p", "answer": "5", "kind": "gsm8k"},
            {"question": "p", "answer": "5", "kind": "gsm8k"},
        ),
        ({"problem": "p", "answer": "5", "kind": "arith"}, {"question": "p", "answer": "5", "kind": "arith"}),
        (
            {"problem": "p", "solution": "so \\boxed{\\frac{1}{2}}"},
            {"question": "p", "answer": "\\frac{1}{2}", "kind": "math", "solution": "so \\boxed{\\frac{1}{2}}"},
        ),
    ],
)
def test_built_in_rows_read_as_before(row, want):
    assert normalise_row(row, source="x") == want


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"text": "x"}, "rows need 'question' and 'answer'"),
        ({"text": "x", "kind": "arith"}, "rows need 'question' and 'answer'"),
        ({"answer": "1", "kind": "math"}, "rows need 'question' and 'answer'"),
        ({"problem": "p", "solution": "none"}, "a MATH row needs an 'answer' or a 'solution'"),
        ({"question": "q", "answer": "1", "kind": "chess"}, "'kind' must be one of"),
    ],
)
def test_built_in_bad_rows_fail_as_before(row, message):
    with pytest.raises(ValueError, match=message):
        normalise_row(row, source="x")


def test_built_in_scores_as_before():
    completions = ["<answer>1,234</answer>", "<answer> 1234.0 </answer>", "x 1234", "<answer>41</answer>"]
    gsm8k = dict(answer=["1234"] * 4, kind=["gsm8k"] * 4)
    assert get_rewards(["accuracy"])["accuracy"]([""] * 4, completions, **gsm8k) == [2.0, 1.5, 0.0, 0.0]
    assert training_correct(completions, **gsm8k) == [True, True, False, False]
    assert eval_correct(completions, **gsm8k) == [True, True, True, False]  # the whole text's last number
    arith = dict(answer=["1234"] * 4, kind=["arith"] * 4)
    assert get_rewards(["accuracy"])["accuracy"]([""] * 4, completions, **arith) == [1.0, 1.0, 1.0, 0.0]
