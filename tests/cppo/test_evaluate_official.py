"""Evaluation under the official protocol: GSM8K's tagged-else-last-number check on tagged, untagged and mixed
outputs (against the official loop, tests/official_cppo.py), MATH through math-verify with the gold first, samples
averaged, and ``cppo eval``'s protocol defaults."""

import itertools

import official_cppo as off
import pytest
import torch

from cppo.cli import _parser, main
from cppo.engines import EngineSettings, Rollout, RolloutEngine
from cppo.evaluate import evaluate_model
from cppo.step.models import tiny_tokenizer

GSM8K_OUTPUTS = [
    "<think>16 - 3 - 4 = 9, 9 * 2 = 18</think>\n<answer>18</answer>",  # tagged, right
    "<think>...</think>\n<answer>$18.00</answer>",  # tagged, a single number
    "She makes 9 * 2 = $18 every day.",  # untagged: the last number
    "Janet sells 9 eggs for $2 each, 18 dollars, so 20.",  # untagged, wrong last number
    "<think>so 18</think>\n<answer>20</answer>",  # mixed: the tag decides, wrong
    "<think>so 20</think>\n<answer>18</answer> and 20",  # mixed: the tag decides, right
    "<think>x</think>\n<answer>18",  # unclosed tag: the whole text
    "<answer>18 or 20</answer>",  # tagged, two numbers, last one wrong
]


class CannedRollout(RolloutEngine):
    """Returns the next canned texts instead of decoding (the evaluation only reads ``texts``; the token ids are a
    placeholder within the contract the evaluation checks)."""

    def __init__(self, texts):
        settings = EngineSettings(model_name="canned", max_prompt_length=1, max_completion_length=1)
        super().__init__(torch.nn.Module(), tiny_tokenizer(300), settings)
        self.model.get_input_embeddings = lambda: torch.nn.Embedding(300, 1)
        self.texts, self.calls = itertools.cycle(texts), []

    def generate(self, prompts, num_per_prompt, *, greedy=False):
        self.calls.append((len(prompts), num_per_prompt, greedy))
        texts = [next(self.texts) for _ in range(len(prompts) * num_per_prompt)]
        return Rollout([[1]] * len(texts), [[1]] * len(texts), texts)

    def sync_weights(self) -> None:
        """Nothing to take."""


def test_gsm8k_tagged_untagged_and_mixed_outputs_score_as_the_official_loop():
    problems = [{"question": f"q{i}", "answer": "18", "kind": "gsm8k"} for i in range(len(GSM8K_OUTPUTS))]
    rollout = CannedRollout(GSM8K_OUTPUTS)
    result = evaluate_model(rollout, tiny_tokenizer(300), problems, batch_size=3)
    want = [off.gsm8k_eval_is_correct(t, "18") for t in GSM8K_OUTPUTS]
    assert want == [True, True, True, False, False, True, True, False]
    assert (result["correct"], result["total"], result["problems"]) == (sum(want), 8, 8)
    assert result["format_rate"] == sum(bool(off.format_reward(t)) for t in GSM8K_OUTPUTS) / 8
    assert rollout.calls == [(3, 1, True), (3, 1, True), (2, 1, True)]  # greedy, one completion each


def test_math_samples_are_averaged():
    problems = [{"question": "q", "answer": "2", "kind": "math", "solution": "so $\\boxed{2}$"}] * 2
    outputs = ["\\boxed{2}", "\\boxed{3}", "\\boxed{2}", "$2$"]
    rollout = CannedRollout(outputs)
    result = evaluate_model(rollout, tiny_tokenizer(300), problems, num_samples=2, greedy=False)
    want = sum(off.math_eval_is_correct(t, "so $\\boxed{2}$") for t in outputs)
    assert (result["correct"], result["total"], result["accuracy"]) == (want, 4, want / 4)
    assert rollout.calls == [(2, 2, False)]


def test_cppo_eval_defaults_are_the_protocol():
    args = _parser().parse_args(["eval", "--model", "m"])
    assert (args.max_completion_length, args.temperature, args.num_samples, args.top_p) == (1024, 0.0, 1, 1.0)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--num-samples", "4"], "--temperature > 0"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--num-samples", "0"], "--num-samples"),
        (["--reward-timeout", "0"], "reward_timeout"),
    ],
)
def test_cppo_eval_refuses_bad_sampling_options(argv, match, capsys):
    assert main(["eval", "--model", "tiny-qwen2", *argv]) == 2
    assert match in capsys.readouterr().err
