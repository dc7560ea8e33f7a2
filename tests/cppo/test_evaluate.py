"""Evaluation: the problems decoded in batches of ``batch_size`` prompts, each graded by its kind, the accuracy over
every completion graded, the official format's rate, and the progress bar; one process evaluates a split alone.
(Grading against the official functions: test_evaluate_official.py.)"""

from cppo.distributed import DistInfo
from cppo.engines import Rollout
from cppo.evaluate import evaluate_model, evaluate_split
from cppo.step import tiny_tokenizer
from cppo.tasks import question_id

TAGGED = "<think>so</think>\n<answer>{}</answer>"


class EchoRollout:
    """Answers each prompt with the answer its question asks for in ``answers`` (the question text is in the prompt)."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers, self.calls = answers, []

    def generate(self, prompts, num_per_prompt, *, greedy=False):
        self.calls.append(len(prompts))
        texts = [next(a for q, a in self.answers.items() if q in p) for p in prompts for _ in range(num_per_prompt)]
        return Rollout([[1]] * len(texts), [[1]] * len(texts), texts)

    def __call__(self, prompts, num_per_prompt, *, greedy=False):
        """Evaluation calls the engine (RolloutEngine.__call__ checks the contract against a model's vocabulary;
        this stand-in has no model: the engine contract is tested in tests/cppo/engines/)."""
        return self.generate(prompts, num_per_prompt, greedy=greedy)


def problems(n: int) -> list[dict]:
    return [{"question": f"What is {i} + 0?", "answer": str(i), "kind": "arith"} for i in range(n)]


def test_accuracy_and_format_rate_over_batches():
    answers = {f"What is {i} + 0?": TAGGED.format(i) if i % 3 else str(i + 1) for i in range(7)}
    rollout = EchoRollout(answers)
    result = evaluate_model(rollout, tiny_tokenizer(300), problems(7), batch_size=3)
    assert rollout.calls == [3, 3, 1]
    # 0, 3 and 6 answer a wrong number without the tags; the others the right one, tagged
    per_problem = result.pop("per_problem")
    assert result == {"accuracy": 4 / 7, "correct": 4, "total": 7, "problems": 7, "format_rate": 4 / 7}
    # one record per problem, in order: its id, whether it was right and formatted, its completion's length
    assert [r["index"] for r in per_problem] == list(range(7)) and all(r["sample"] == 0 for r in per_problem)
    assert [r["correct"] for r in per_problem] == [i % 3 != 0 for i in range(7)]
    assert [r["format_ok"] for r in per_problem] == [i % 3 != 0 for i in range(7)]
    assert [r["id"] for r in per_problem] == [question_id(p) for p in problems(7)]
    assert all(r["completion_tokens"] == 1 for r in per_problem)  # the stand-in's completions are one token


def test_per_problem_records_with_several_samples_keep_problem_then_sample_order():
    class Alternating(EchoRollout):  # sample j of problem i: right when j is even, completion length j + 1
        def generate(self, prompts, num_per_prompt, *, greedy=False):
            base = super().generate(prompts, num_per_prompt, greedy=greedy)
            texts = [t if k % num_per_prompt % 2 == 0 else "wrong" for k, t in enumerate(base.texts)]
            lengths = [[1] * (k % num_per_prompt + 1) for k in range(len(texts))]
            return Rollout(base.prompt_ids, lengths, texts)

    rollout = Alternating({f"What is {i} + 0?": TAGGED.format(i) for i in range(3)})
    result = evaluate_model(rollout, tiny_tokenizer(300), problems(3), batch_size=2, num_samples=3)
    recs = result["per_problem"]
    assert [(r["index"], r["sample"]) for r in recs] == [(i, j) for i in range(3) for j in range(3)]
    assert [r["correct"] for r in recs] == [j % 2 == 0 for _ in range(3) for j in range(3)]
    assert [r["completion_tokens"] for r in recs] == [j + 1 for _ in range(3) for j in range(3)]
    assert result["correct"] == 6 and result["total"] == 9


def test_the_progress_bar_moves_per_batch(capsys):
    rollout = EchoRollout({f"What is {i} + 0?": str(i) for i in range(5)})
    evaluate_model(rollout, tiny_tokenizer(300), problems(5), batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert "eval" in err and "2/5" in err and "4/5" in err and "5/5" in err


def test_one_process_evaluates_the_whole_split():
    rollout = EchoRollout({f"What is {i} + 0?": str(i) for i in range(4)})
    result = evaluate_split(rollout, tiny_tokenizer(300), problems(4), info=DistInfo())
    assert (result["correct"], result["total"], result["accuracy"]) == (4, 4, 1.0) and rollout.calls == [4]
