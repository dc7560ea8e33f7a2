"""Evaluation: the problems decoded in batches of ``batch_size`` prompts, each graded by its kind, the accuracy over
every completion graded, the official format's rate, and the progress bar; one process evaluates a split alone.
(Grading against the official functions: test_evaluate_official.py.)"""

from cppo.distributed import DistInfo
from cppo.engines import Rollout
from cppo.evaluate import evaluate_model, evaluate_split
from cppo.step import tiny_tokenizer

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
    assert result == {"accuracy": 4 / 7, "correct": 4, "total": 7, "problems": 7, "format_rate": 4 / 7}


def test_the_progress_bar_moves_per_batch(capsys):
    rollout = EchoRollout({f"What is {i} + 0?": str(i) for i in range(5)})
    evaluate_model(rollout, tiny_tokenizer(300), problems(5), batch_size=2, progress=True)
    err = capsys.readouterr().err
    assert "eval" in err and "2/5" in err and "4/5" in err and "5/5" in err


def test_one_process_evaluates_the_whole_split():
    rollout = EchoRollout({f"What is {i} + 0?": str(i) for i in range(4)})
    result = evaluate_split(rollout, tiny_tokenizer(300), problems(4), info=DistInfo())
    assert (result["correct"], result["total"], result["accuracy"]) == (4, 4, 1.0) and rollout.calls == [4]
