"""CPPOTrainer's constructor (TRL's), its refusals (one line each), report_to (CPPO's metrics in TRL's metric dict
reach every logger: the log history, callbacks, TensorBoard) and the README's snippet."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl_tiny import digit_reward, make_config, tiny_dataset

from cppo.trl import CPPOConfig, CPPOTrainer

CPPO_METRICS = (
    "cppo/kept_fraction",
    "cppo/kept_completions",
    "cppo/completion_tokens_saved",
    "cppo/pass_tokens",
    "cppo/pass_tokens_saved",
)


def build(model, out, cls=CPPOTrainer, config_cls=CPPOConfig, train_dataset=None, **options):
    args = make_config(config_cls, out, **options)
    dataset = tiny_dataset() if train_dataset is None else train_dataset
    return cls(model=model, reward_funcs=digit_reward, args=args, train_dataset=dataset)


def test_the_constructor_is_grpotrainers():
    ours, theirs = inspect.signature(CPPOTrainer.__init__), inspect.signature(GRPOTrainer.__init__)
    assert list(ours.parameters) == list(theirs.parameters)
    assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()]


def test_args_must_be_a_cppo_config(tiny_model, tmp_path):
    with pytest.raises(TypeError, match="args must be a cppo.trl.CPPOConfig"):
        build(tiny_model, tmp_path, config_cls=GRPOConfig)


def test_tool_calling_is_refused(tiny_model, tmp_path):
    def add(a: int, b: int) -> int:
        """Adds.

        Args:
            a: a number.
            b: another.
        """
        return a + b

    args = make_config(CPPOConfig, tmp_path)
    with pytest.raises(ValueError, match=r"does not support tool calling \(tools= / environment_factory=\)"):
        CPPOTrainer(model=tiny_model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset(), tools=[add])


def test_multimodal_inputs_are_refused(tiny_model, tmp_path):
    trainer = build(tiny_model, tmp_path)
    trainer.model.train()
    with pytest.raises(ValueError, match="does not support multimodal inputs"):
        trainer._generate_and_score_completions([{"prompt": "1 + 1 =", "image": None}] * 4)


def test_an_uneven_split_of_the_kept_is_refused(tiny_model, tmp_path):
    # 8 completions per generation in 2 micro-batches; P = 0.875 keeps 1
    with pytest.raises(ValueError, match=r"keeps 1 of each process's 8 completions, not divisible into steps_per"):
        build(tiny_model, tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, pruning_rate=0.875)


def test_a_loss_the_fused_kernel_cannot_express_warns_once_naming_it(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr("cppo.trl.loss._fsdp_version", lambda trainer: 1)  # FSDP version 1, simulated
    with pytest.warns(UserWarning, match=r"CPPOTrainer: FSDP version 1 \(its LM head is a flat-parameter shard "
                      r"outside the forward: use FSDP2\) is not expressed by cppo_kernels"):  # fmt: skip
        trainer = build(tiny_model, tmp_path)
    assert trainer.fused_loss_refused.startswith("FSDP version 1")


def test_the_entropy_settings_run_fused(tiny_model, tmp_path):
    """TRL's adaptive entropy controller and the entropy mask (on one process here; two: tests/support/trl_worker.py)
    are expressed by the fused loss: nothing of TRL's entropy settings falls back."""
    for options in (dict(use_adaptive_entropy=True), dict(use_adaptive_entropy=True, top_entropy_quantile=0.2)):
        assert build(tiny_model, tmp_path, **options).fused_loss_refused is None, options


def test_trls_defaults_and_every_loss_type_run_fused(tiny_model, tmp_path):
    """TRL's default use_bias_correction_kl=True with beta > 0, delta and each of TRL's eight loss types: no
    fallback (issue 26: 5 of 14 configurations ran fused, none with TRL's default)."""
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"):
        trainer = build(tiny_model, tmp_path, beta=0.04, use_bias_correction_kl=True, loss_type=loss_type)
        assert trainer.fused_loss_refused is None, loss_type
    assert build(tiny_model, tmp_path, delta=2.0, top_entropy_quantile=0.5).fused_loss_refused is None


@pytest.mark.parametrize(
    "prompts, options, message",
    [  # train() used to return after 0 steps, train_loss 0, no message
        (5, dict(pruning_rate=0.75, allocation=True), r"holds 5 prompts, fewer than one generation draws \(allocation="
         r"True draws ceil\(2 / \(1 - pruning_rate=0.75\)\) = 8; lower pruning_rate or set allocation=False\)"),
        (64, dict(pruning_rate=0.999, allocation=True), r"holds 64 prompts, .* = 2000; lower pruning_rate"),
        (1, {}, r"holds 1 prompts, fewer than one generation draws \(generation_batch_size=8 / num_generations=4 = "
         r"2; lower per_device_train_batch_size or steps_per_generation\), so train\(\) would run no step"),
    ],
)  # fmt: skip
def test_a_dataset_smaller_than_a_generation_is_refused(tiny_model, tmp_path, prompts, options, message):
    args = make_config(CPPOConfig, tmp_path, **options)
    trainer = CPPOTrainer(model=tiny_model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset(prompts))
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert trainer.state.global_step == 0


def test_an_empty_prompt_is_refused_naming_its_row(tiny_model, tmp_path):
    """A map-style dataset: the row, before any step (alone in a generation it was an IndexError in generate; with
    other prompts it trained on a completion of no context). A stream: the prompt, when its generation comes."""
    dataset = Dataset.from_dict({"prompt": ["1 + 1 =", "2 + 2 =", "", "3 + 3 ="]})
    trainer = build(tiny_model, tmp_path, train_dataset=dataset)
    with pytest.raises(ValueError, match=r"^train_dataset row 2: 'prompt' is empty \(no token to generate from\)$"):
        trainer.train()
    stream = dataset.select([0, 2]).to_iterable_dataset()
    trainer = build(tiny_model, tmp_path, train_dataset=stream, per_device_train_batch_size=4, max_steps=2)
    with pytest.raises(ValueError, match=r"^prompt 0 of this batch \(''\) has no token to generate from: give every"):
        trainer.train()
    assert trainer.state.global_step == 1  # the first prompt trained


def test_an_infinite_reward_is_refused_naming_its_function_and_completion(tiny_model, tmp_path):
    """scale_rewards='none' turned the group's advantages, then the weights, into NaN (stock TRL too)."""

    def unbounded(completions, **kwargs) -> list[float]:
        return [math.inf if i == 5 else 0.1 * i for i in range(len(completions))]

    args = make_config(CPPOConfig, tmp_path, scale_rewards="none", shuffle_dataset=False)
    rewards = [digit_reward, unbounded]
    trainer = CPPOTrainer(model=tiny_model, reward_funcs=rewards, args=args, train_dataset=tiny_dataset())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    message = r"^reward function 'unbounded' returned inf for completion 5 of this generation \(prompt '1 \+ 7 ='\): "
    message += r"rewards must be finite \(None marks a completion it cannot score\)$"
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())  # nothing trained on it


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_cppo_metrics_reach_every_logger(tiny_model, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    recorder = Recorder()
    args = make_config(CPPOConfig, tmp_path / "out", pruning_rate=0.5, report_to=["tensorboard"], max_steps=2)
    trainer = CPPOTrainer(
        model=tiny_model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset(), callbacks=[recorder]
    )
    trainer.train()
    steps = [logs for logs in recorder.logs if "loss" in logs]
    assert len(steps) == 2 and all(logs["cppo/kept_fraction"] == 0.5 for logs in steps)
    assert all(name in steps[0] for name in CPPO_METRICS) and steps[0]["cppo/completion_tokens_saved"] > 0
    assert all(name in trainer.state.log_history[0] for name in CPPO_METRICS)
    (events,) = (tmp_path / "tb").rglob("events.out.tfevents.*")
    tags = EventAccumulator(str(events.parent)).Reload().Tags()["scalars"]
    assert {f"train/{name}" for name in CPPO_METRICS} <= set(tags), tags
    assert torch.isfinite(torch.tensor([logs["loss"] for logs in steps])).all()
