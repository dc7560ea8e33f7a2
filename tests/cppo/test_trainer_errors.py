"""Issue 11, findings 3 (the trainer's part) and 4: a non-finite gradient is never applied, a run of them stops with
a clear error, and no setting lets inf or nan into a run."""

import dataclasses
import math
import typing

import pytest
import torch
from tiny_run import tiny_config, train_cli

from cppo import TrainConfig
from cppo.step.optim import NonFiniteUpdates
from cppo.trainer import Trainer


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")


def poison(monkeypatch, trainer, bad: set[int] | None = None) -> None:
    """Makes the loss NaN in the policy updates whose index (from 0, over the run) is in ``bad`` (None: all of
    them), as an overflowing log-ratio would: backward then puts NaN into every gradient. ``bad`` may change later."""
    real_loss, real_update, done = trainer._policy_loss, trainer._update, [0]

    def update(*args, **kwargs):
        real_update(*args, **kwargs)
        done[0] += 1

    def policy_loss(*args, **kwargs):
        loss, stats = real_loss(*args, **kwargs)
        return (loss * float("nan") if bad is None or done[0] in bad else loss), stats

    monkeypatch.setattr(trainer, "_policy_loss", policy_loss)
    monkeypatch.setattr(trainer, "_update", update)


def snapshot(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_non_finite_update_is_skipped_counted_and_the_next_one_applies(tmp_path, monkeypatch):
    trainer = Trainer(tiny_config(tmp_path, mu=2, num_steps=3))  # cosine from lr 1e-2, no warm-up
    before, lr_before = snapshot(trainer), trainer.scheduler.get_last_lr()
    bad = {0, 1}  # both updates of step 1
    poison(monkeypatch, trainer, bad)
    record = trainer.train_step()
    assert record["skipped_updates"] == 2 and math.isnan(record["grad_norm"])
    assert same(snapshot(trainer), before)  # nothing applied: not even weight decay or momentum
    assert not trainer.optimizer.state and trainer.scheduler.get_last_lr() == lr_before
    assert all(p.grad is None for p in trainer.model.parameters())

    bad.clear()
    bad.add(2)  # step 2: the first update poisoned, the second clean
    record = trainer.train_step()
    assert record["skipped_updates"] == 1 and math.isfinite(record["grad_norm"])
    after = snapshot(trainer)
    assert not same(after, before) and all(torch.isfinite(v).all() for v in after.values())
    assert trainer.skips.in_a_row == 0  # an applied update resets the count


def test_a_run_of_non_finite_updates_stops_with_a_clear_error(tmp_path, monkeypatch):
    trainer = Trainer(tiny_config(tmp_path, mu=2, num_steps=4, max_skipped_updates=3))
    before = snapshot(trainer)
    poison(monkeypatch, trainer)
    assert trainer.train_step()["skipped_updates"] == 2
    with pytest.raises(NonFiniteUpdates, match=r"step 2: 3 optimizer updates in a row .*max_skipped_updates=3"):
        trainer.train_step()
    assert same(snapshot(trainer), before)  # every parameter finite: those of the last finite update


def test_cppo_train_reports_a_diverged_run_in_one_line(tmp_path, monkeypatch, capsys):
    real = Trainer._policy_loss

    def nan_loss(self, *args, **kwargs):
        loss, stats = real(self, *args, **kwargs)
        return loss * float("inf") * 0.0, stats  # inf * 0 = nan

    monkeypatch.setattr(Trainer, "_policy_loss", nan_loss)
    assert train_cli(tmp_path / "run", settings=("num_steps=3", "max_skipped_updates=2")) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and err[0].startswith("cppo train: error: step 1: 2 optimizer updates in a row"), err
    assert not (tmp_path / "run" / "checkpoint-000001").exists()  # nothing non-finite was saved


def float_settings() -> list[str]:
    hints = {name: (hint, *typing.get_args(hint)) for name, hint in typing.get_type_hints(TrainConfig).items()}
    return [f.name for f in dataclasses.fields(TrainConfig) if float in hints[f.name]]


@pytest.mark.parametrize("name", float_settings())
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_every_float_setting_must_be_finite(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be finite"):
        TrainConfig(**{name: value})


def test_the_float_settings_are_the_ones_expected():
    """The parametrisation above really covers the issue's settings (and grows with new float settings)."""
    assert {"lr", "max_grad_norm", "weight_decay", "temperature", "beta", "top_p", "warmup_ratio"} <= set(
        float_settings()
    )


@pytest.mark.parametrize(
    "setting, match",
    [
        ("lr=.inf", "lr must be finite"),  # the issue's: the run exited 0 with every checkpointed tensor NaN
        ("max_grad_norm=nan", "max_grad_norm must be finite"),
        ("weight_decay=.inf", "weight_decay must be finite"),
        ("lr=-1e-3", "lr must be >= 0"),
        ("max_grad_norm=0", "max_grad_norm must be > 0"),
        ("weight_decay=-0.1", "weight_decay must be >= 0"),
        ("max_skipped_updates=0", "max_skipped_updates must be >= 1"),
        ("seed=-1", "seed must be >= 0"),
        (f"seed={2**70}", "seed must be <= 4294967295"),
    ],
)
def test_cppo_train_refuses_the_setting_before_the_model_loads(setting, match, tmp_path, monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the bad setting was found")

    monkeypatch.setattr("cppo.step.load_model_and_tokenizer", no_model)
    assert train_cli(tmp_path / "run", settings=(setting,)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"cppo train: error: --set {setting}: {match}"), line
    assert not (tmp_path / "run").exists()
