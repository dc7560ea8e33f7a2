"""examples/trl_cppo.py: the paper's settings, the official rewards on TRL's conversational completions, and a
smoke run with --tiny."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "trl_cppo.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("trl_cppo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rewards_are_the_official_ones_on_trl_completions(example):
    good = [{"role": "assistant", "content": "<think>48 + 24</think>\n<answer>72</answer>"}]
    near = [{"role": "assistant", "content": "<answer>72.0</answer>"}]
    assert example.gsm8k_format(None, [good, near]) == [1.0, 0.0]
    assert example.gsm8k_accuracy(None, [good, near], answer=["72", "72"], kind=["gsm8k", "gsm8k"]) == [2.0, 1.5]


def test_the_default_settings_are_the_papers(example, tmp_path, monkeypatch):
    parsed = example.parse_args(["--output-dir", str(tmp_path)])
    assert example.PAPER["bf16"] and example.PAPER["gradient_checkpointing"]  # as the paper; this CPU has no bf16
    monkeypatch.setitem(example.PAPER, "bf16", False)
    monkeypatch.setitem(example.PAPER, "use_cpu", True)
    args = example.config(parsed)
    assert (parsed.model, args.lr_scheduler_type, args.warmup_steps) == ("Qwen/Qwen2.5-1.5B-Instruct", "cosine", 0.1)
    assert (args.pruning_rate, args.allocation, args.selection_scope) == (0.875, True, "batch")
    assert (args.num_generations, args.per_device_train_batch_size, args.num_iterations) == (16, 16, 2)
    assert (args.beta, args.epsilon, args.loss_type, args.use_bias_correction_kl) == (0.04, 0.2, "dapo", False)
    assert (args.learning_rate, args.max_completion_length, args.seed) == (1e-6, 1024, 42)
    assert args.pruning.questions_drawn == 8  # one question per step in GRPO; 1 / (1 - 0.875) with allocation


def test_a_tiny_run(example, tmp_path, capsys):
    trainer = example.main(["--tiny", "--max-steps", "2", "--output-dir", str(tmp_path), "--limit", "16"])
    logged = trainer.state.log_history[0]
    # 8 questions x 4 completions drawn (allocation), 32 - int(32 * 0.875) = 4 kept: as many as GRPO trains
    assert logged["cppo/kept_completions"] == 4 and logged["cppo/kept_fraction"] == 0.125
    assert "rewards/gsm8k_format/mean" in logged and "rewards/gsm8k_accuracy/mean" in logged
    # its zeros are explained, not left to look like a bug
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert said.startswith("trl_cppo --tiny: 2 optimizer steps ran, the last generation keeping 4 completions")
    assert "rewards [0.0]" in said and "every advantage and the loss are 0" in said
