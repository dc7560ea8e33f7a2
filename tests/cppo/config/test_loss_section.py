"""The ``loss`` section of the trainer's config (issue 39): every option of ``cppo_kernels.LossConfig`` reaches
``cppo train`` (``--set loss.NAME=VALUE``, or a YAML mapping), TRL's ``loss_type`` names too, each refused in one
line naming it; and every loss type CPPOTrainer supports trains through it, the trainer's loss equal to the kernel
called directly with the same ``LossConfig``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_run import tiny_config

import cppo.trainer
from cppo.config import load_config
from cppo.trainer import Trainer
from cppo_kernels import LossConfig, fused_cppo_loss
from cppo_kernels.config import LOSS_TYPES


def test_set_loss_name_value_reaches_the_loss_config():
    cfg = load_config("tiny-cpu", ["loss.top_entropy_quantile=0.8", "loss.importance_sampling=sequence",
                                   "loss.dual_clip=3", "loss.entropy_coef=0.01", "epsilon_high=0.28"])  # fmt: skip
    lc = cfg.loss_config
    assert (lc.top_entropy_quantile, lc.importance_sampling, lc.dual_clip, lc.entropy_coef, lc.epsilon_high) == (
        0.8,
        "sequence",
        3,
        0.01,
        0.28,
    )
    assert cfg.loss == {"top_entropy_quantile": 0.8, "importance_sampling": "sequence", "dual_clip": 3,
                        "entropy_coef": 0.01}  # fmt: skip


def test_a_yaml_loss_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny-qwen2\nloss:\n  loss_type: vespo\n  vespo_k_pos: 1.5\n")
    lc = load_config(str(path)).loss_config
    assert (lc.surrogate, lc.loss_agg, lc.vespo_k_pos) == ("vespo", "token-mean", 1.5)


@pytest.mark.parametrize(
    ("item", "match"),
    [
        (
            "loss.surrogat=cispo",
            r"--set loss.surrogat=cispo: loss.surrogat: not an option of the loss \(did you mean "
            r"'surrogate'\?\)",
        ),
        ("loss.beta=0.1", "loss.beta: beta is a setting of its own; set beta=0.1"),
        ("loss.loss_type=ppo", r"loss.loss_type must be one of \['bnpo', 'cispo'"),
        ("loss.surrogate=nope", r"--set loss.surrogate=nope: loss.surrogate must be one of"),
        ("loss.delta=-1", r"--set loss.delta=-1: loss.delta"),
    ],
)
def test_a_bad_loss_option_is_one_line_naming_it(item, match):
    with pytest.raises(ValueError, match=match):
        load_config("tiny-cpu", [item])


@pytest.mark.parametrize(
    ("item", "name", "value"),
    [
        ("loss.entropy_coef=1e-3", "entropy_coef", 1e-3),  # YAML 1.1 reads 1e-3 as text, as for lr=1e-3
        ("loss.top_entropy_quantile=5E-1", "top_entropy_quantile", 0.5),
        ("loss.delta=2", "delta", 2.0),
        ("loss.off_policy_mask_threshold=1e-2", "off_policy_mask_threshold", 0.01),
    ],
)
def test_loss_section_values_parse_as_the_flat_settings_do(item, name, value, tmp_path):
    """``--set loss.entropy_coef=1e-3`` is the number, as the flat ``--set lr=1e-3`` is (issue 49); a YAML file's
    ``loss:`` mapping too."""
    assert load_config("tiny-cpu", ["lr=1e-3"]).lr == 1e-3
    assert getattr(load_config("tiny-cpu", [item]).loss_config, name) == value
    path = tmp_path / "run.yaml"
    path.write_text(f"model: tiny-qwen2\nloss:\n  {item.split('.', 1)[1].replace('=', ': ')}\n")
    assert getattr(load_config(str(path)).loss_config, name) == value


@pytest.mark.parametrize(
    ("item", "match"),
    [
        (
            "loss.entropy_coef=abc",
            r"^--set loss.entropy_coef=abc: loss.entropy_coef must be a number, got abc \(text\)$",
        ),
        ("loss.compute_entropy=true", r"loss.compute_entropy: cppo train always computes the entropy"),
        ("entropy_coef=0.01", r"unknown setting 'entropy_coef' \(an option of the loss: --set loss.entropy_coef="),
        ("delta=2", r"unknown setting 'delta' \(an option of the loss: --set loss.delta=2, or delta under loss: in a"),
        ("loss_type=grpo", r"unknown setting 'loss_type' \(that is TRL's name: here use loss.loss_type="),
    ],
)
def test_loss_advice_names_settings_that_exist(item, match):
    """The advice of a refused loss option names what to set: never a setting that does not exist (issue 49:
    ``loss.compute_entropy`` said ``set compute_entropy=True``)."""
    with pytest.raises(ValueError, match=match) as e:
        load_config("tiny-cpu", [item])
    assert "set compute_entropy" not in str(e.value)


def test_loss_type_and_another_flat_aggregation_are_refused():
    """``loss.loss_type`` sets the aggregation: a flat ``loss_agg`` set to another one is refused (one of the two
    would be dropped silently); the flat default, and a preset's explicit token-mean, give way."""
    with pytest.raises(ValueError, match=r"loss.loss_type=dapo aggregates by token-mean, but loss_agg=seq-mean"):
        load_config("tiny-cpu", ["loss.loss_type=dapo", "loss_agg=seq-mean-token-mean"])
    assert load_config("tiny-cpu", ["loss.loss_type=grpo"]).loss_config.loss_agg == "seq-mean-token-mean"
    assert load_config("tiny-cpu", ["loss.loss_type=grpo", "loss_agg=seq-mean-token-mean"]).loss_agg == (
        "seq-mean-token-mean"
    )
    assert load_config("gsm8k-qwen2.5-1.5b", ["loss.loss_type=grpo"]).loss_config.loss_agg == "seq-mean-token-mean"


def test_loss_type_and_surrogate_together_are_refused():
    with pytest.raises(ValueError, match="loss.loss_type=sapo sets the surrogate"):
        load_config("tiny-cpu", ["loss.loss_type=sapo", "loss.surrogate=clip"])


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_every_loss_type_trains_through_cppo_train_as_the_kernel_computes_it(tmp_path, loss_type, monkeypatch):
    """One step of ``--set loss.loss_type=T``: the trainer's fused_cppo_loss calls carry the LossConfig built
    independently from TRL's table (surrogate, aggregation), and each returns what the kernel returns when called
    directly on the same inputs with that LossConfig."""
    surrogate, agg = LOSS_TYPES[loss_type]
    want = LossConfig(temperature=1.0, epsilon_low=0.2, beta=0.04, loss_agg=agg, surrogate=surrogate,
                      max_completion_length=8, compute_entropy=True)  # fmt: skip
    calls = []

    def spy(*args, **kwargs):
        loss, metrics = fused_cppo_loss(*args, **kwargs)
        frozen = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]  # before the update
        calls.append((frozen, {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
                      loss.detach()))  # fmt: skip
        return loss, metrics

    monkeypatch.setattr(cppo.trainer, "fused_cppo_loss", spy)
    trainer = Trainer(tiny_config(tmp_path, loss={"loss_type": loss_type}, pruning_rate=0.5, num_steps=1))
    record = trainer.train_step()
    assert calls and torch.isfinite(torch.tensor(record["loss"]))
    for args, kwargs, loss in calls:
        assert kwargs["config"] == want
        again, _ = fused_cppo_loss(*args, **{**kwargs, "config": dataclasses.replace(want)})
        assert torch.equal(again, loss)
