"""Datasets, prompts and the seeded question sampler."""

import json

import pytest

from cppo.config import load_config
from cppo.step.models import tiny_tokenizer
from cppo.tasks import build_prompt
from cppo.tasks.data import (
    QuestionSampler,
    arithmetic_problems,
    count_local_problems,
    load_problems,
    normalise_row,
)
from cppo.tasks.prompts import GSM8K_SYSTEM_PROMPT, MATH_SYSTEM_PROMPT


def test_arithmetic_is_seeded_and_correct():
    a, b = arithmetic_problems(50, seed=3), arithmetic_problems(50, seed=3)
    assert a == b and a != arithmetic_problems(50, seed=4)
    for p in a:
        x, op, y = p["question"].removeprefix("What is ").removesuffix("?").split()
        assert str(eval(f"{x} {op} {y}")) == p["answer"]
    train, test = load_problems("arith", split="train"), load_problems("arith", split="test", max_questions=10)
    assert len(test) == 10 and train[:10] != test


def test_gsm8k_and_math_rows(tmp_path):
    assert normalise_row({"question": "q", "answer": "steps\n#### 1,234"}, source="x") == {
        "question": "q",
        "answer": "1234",
        "kind": "gsm8k",
    }
    row = normalise_row({"problem": "p", "solution": "so \\boxed{\\frac{1}{2}}"}, source="x")
    assert row["answer"] == "\\frac{1}{2}" and row["solution"] == "so \\boxed{\\frac{1}{2}}"  # math-verify's gold
    assert normalise_row({"problem": "p", "answer": "5"}, source="x") == {
        "question": "p",
        "answer": "5",
        "kind": "math",
        "solution": "$5$",
    }
    # the official gold: the text between the first and the second "####"
    assert normalise_row({"question": "q", "answer": "a #### 1 #### 2"}, source="x")["answer"] == "1"
    with pytest.raises(ValueError, match="rows need"):
        normalise_row({"text": "x"}, source="file.jsonl")
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(5)) + "\n")
    assert [p["answer"] for p in load_problems(str(path), max_questions=3)] == ["0", "1", "2"]
    with pytest.raises(ValueError, match="does not exist"):
        load_problems("gsm8k", dataset_path=str(tmp_path / "missing.jsonl"))


def test_shared_datasets(shared_dir):
    gsm = load_problems("gsm8k", split="test", dataset_path=str(shared_dir / "data" / "gsm8k"))
    assert len(gsm) == 1319 and all(p["kind"] == "gsm8k" for p in gsm)
    math = load_problems("math500", split="test", dataset_path=str(shared_dir / "data" / "math500"))
    assert len(math) == 500 and all(p["kind"] == "math" for p in math)
    via_math = load_problems("math", split="test", dataset_path=str(shared_dir / "data" / "math500"))
    assert via_math == math  # the test split of MATH is MATH-500


def test_math500_is_not_a_training_set(tmp_path):
    with pytest.raises(ValueError, match="math500.*evaluation set"):
        load_problems("math500", split="train", dataset_path=str(tmp_path))


def test_prompt_is_the_official_chat():
    tok = tiny_tokenizer(300)
    text = build_prompt(tok, {"question": "What is 1 + 2?", "answer": "3", "kind": "arith"})
    turns = f"system\n{GSM8K_SYSTEM_PROMPT}", "user\nWhat is 1 + 2?"
    assert text == "".join(f"<|im_start|>{t}<|im_end|>\n" for t in turns) + "<|im_start|>assistant\n"
    math = build_prompt(tok, {"question": "q", "answer": "1", "kind": "math"})
    assert MATH_SYSTEM_PROMPT in math and GSM8K_SYSTEM_PROMPT not in math
    own = build_prompt(tok, {"question": "q", "answer": "1", "kind": "math"}, system_prompt="S.")
    assert own.startswith("<|im_start|>system\nS.<|im_end|>")  # system_prompt replaces it whole
    assert tok.decode(tok(text)["input_ids"]) == text  # character-level round trip


def test_sampler_epochs_resume_and_ranks():
    s = QuestionSampler(10, seed=1)
    first = s.draw(4) + s.draw(4)
    crossing = s.draw(4)  # 2 from epoch 0, 2 from epoch 1
    assert sorted(first + crossing[:2]) == list(range(10))
    state = s.state_dict()
    ahead = [s.draw(3) for _ in range(3)]
    t = QuestionSampler(10, seed=1)
    t.load_state_dict(state)
    assert [t.draw(3) for _ in range(3)] == ahead
    ranks = [QuestionSampler(10, seed=1, rank=r, world_size=2).draw(4) for r in range(2)]
    assert ranks[0] + ranks[1] == QuestionSampler(10, seed=1).draw(4)
    with pytest.raises(ValueError, match="world_size"):
        QuestionSampler(10, world_size=2).draw(3)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"question": "\\ud800 what?", "answer": "1"}\n', r"line 2: 'question' holds a lone surrogate \(U\+D800"),
        (b'{"question": "ok \xff\xfe", "answer": "1"}\n', r"line 2: not valid UTF-8 \(byte 0xff at column 18\)"),
        (b"[" * 200_000 + b"]" * 200_000 + b"\n", r"line 2: JSON nested deeper than 64 levels"),
        (b'{"question": "q", "answer": "1", "x": ' + b"[" * 100 + b"]" * 100 + b"}\n", "nested deeper"),
    ],
)
def test_bad_rows_name_file_and_line_at_load_time(tmp_path, raw, message):
    """A lone surrogate (valid JSON that every tokenizer refuses mid-run), invalid UTF-8 and absurd nesting are found
    when the file is read (so --dry-run finds them too), naming the file and the line."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"question": "What is 1 + 1?", "answer": "2"}\n' + raw)
    with pytest.raises(ValueError, match=message) as e:
        load_problems(str(path))
    assert str(path) in str(e.value)


def test_bad_rows_fail_the_dry_run_count_too(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"question": "\\udfff", "answer": "1"}\n')
    with pytest.raises(ValueError, match="line 1: 'question' holds a lone surrogate"):
        count_local_problems(str(path))


def test_arith_is_counted_without_building_and_bounded():
    assert count_local_problems("arith", max_questions=1_000_000) == 1_000_000  # instant: nothing generated
    with pytest.raises(ValueError, match=r"max_questions must be <= 1,000,000 for dataset arith"):
        count_local_problems("arith", max_questions=100_000_000)
    with pytest.raises(ValueError, match="max_questions must be <= 1,000,000"):
        load_problems("arith", max_questions=100_000_000)


def test_the_question_seed_draws_the_training_questions(tmp_path):
    """Runs of other seeds train other questions (arith generates them from the seed; a file is sampled), and every
    run evaluates on the same test problems."""
    a = load_problems("arith", split="train", max_questions=64, question_seed=42)
    b = load_problems("arith", split="train", max_questions=64, question_seed=43)
    assert a != b and a == load_problems("arith", split="train", max_questions=64, question_seed=42)
    assert load_problems("arith", split="train", max_questions=64) == load_problems(
        "arith", split="train", max_questions=64, question_seed=0
    )  # no question_seed is seed 0
    test = load_problems("arith", split="test", max_questions=20, question_seed=42)
    assert test == load_problems("arith", split="test", max_questions=20, question_seed=43)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}?", "answer": str(i)}) + "\n" for i in range(50)))
    first = load_problems(str(path), max_questions=5)
    assert [p["answer"] for p in first] == ["0", "1", "2", "3", "4"]
    sampled = [load_problems(str(path), max_questions=5, question_seed=s) for s in (1, 2)]
    assert sampled[0] != sampled[1] and all(len(s) == 5 for s in sampled)
    assert [p["answer"] for p in sampled[0]] == sorted((p["answer"] for p in sampled[0]), key=int)  # file order


def test_trainer_takes_question_seed_else_seed():
    from cppo import TrainConfig

    base = dict(max_prompt_length=8, max_completion_length=8)
    assert TrainConfig(seed=7, **base).training_question_seed == 7
    assert TrainConfig(seed=7, question_seed=3, **base).training_question_seed == 3
    with pytest.raises(ValueError, match="question_seed must be >= 0"):
        TrainConfig(question_seed=-1, **base)


def test_the_arith_test_split_is_distinct_and_held_out_of_training():
    """500 distinct test problems; no training split of any seed generates one of them; asking for more is an error
    naming eval_limit, from the config too."""
    test = load_problems("arith", split="test")
    questions = {p["question"] for p in test}
    assert len(test) == len(questions) == 500
    for seed in (0, 42, 43):
        train = load_problems("arith", split="train", max_questions=2000, question_seed=seed)
        assert not questions & {p["question"] for p in train}
    with pytest.raises(ValueError, match="eval_limit must be <= 500"):
        load_problems("arith", split="test", max_questions=501)
    with pytest.raises(ValueError, match="eval_limit must be <= 500"):
        load_config("tiny-cpu", ["eval_limit=501"])
    assert len(load_problems("arith", split="test", max_questions=300)) == 300
