"""CPPOTrainer's LM head under DeepSpeed ZeRO-3, with a stand-in: DeepSpeed does not run here, so the head's weight is
partitioned by hand the way ZeRO-3 leaves it outside its module's forward (an empty tensor with a ``ds_id``), a
``deepspeed`` module whose ``zero.GatheredParameters`` restores and re-partitions it, and forward hooks that gather it
for its modules' own forwards (the head in TRL's generation, the embedding it is tied to) as ZeRO-3's hooks do. Not a
real ZeRO-3 job: the fused passes gather the head once per step (:class:`cppo.trl.sharding.ZeroHead`), the loss sees
the whole weight, its gradient is whole when the gathered context closes (where ZeRO-3 reduces it), equal to an
unpartitioned run's, and the weight is partitioned again after the step."""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from trl_tiny import digit_reward, make_config, tiny_dataset

import cppo.trl.loss as trl_loss
import cppo.trl.sharding as sharding
from cppo.trl import CPPOConfig, CPPOTrainer


class FakeZero3:
    """One parameter partitioned as ZeRO-3 leaves it (``data`` empty between uses); ``events`` records the gathers and
    the gradient present each time the parameter is partitioned again."""

    def __init__(self, model: torch.nn.Module, param: torch.nn.Parameter):
        self.param, self.full, self.gathered_by = param, param.data, None
        self.events: list[str] = []
        self.grads: list[torch.Tensor] = []
        param.ds_id, param.ds_status, param.data = 0, SimpleNamespace(name="NOT_AVAILABLE"), torch.empty(0)
        for module in model.modules():  # its modules (the head, and the embedding it is tied to) gather it
            if any(p is param for p in module.parameters(recurse=False)):
                module.register_forward_pre_hook(lambda *_: self._gather("hook"))
                module.register_forward_hook(lambda *_: self._release("hook"))

    def _gather(self, by: str) -> None:
        if self.gathered_by is None:
            self.param.data, self.gathered_by = self.full, by
            self.param.ds_status = SimpleNamespace(name="AVAILABLE")
            self.events.append(f"gather:{by}")

    def _release(self, by: str) -> None:
        if self.gathered_by != by:
            return
        if self.param.grad is not None:  # ZeRO-3 reduces the whole gradient into its partitions here
            self.grads.append(self.param.grad.clone())
            self.param.grad = None
        self.full, self.param.data, self.gathered_by = self.param.data, torch.empty(0), None
        self.param.ds_status = SimpleNamespace(name="NOT_AVAILABLE")
        self.events.append(f"release:{by}")

    def module(self) -> types.ModuleType:
        fake = types.ModuleType("deepspeed")
        fake.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)  # no distribution: libraries see none

        @contextlib.contextmanager
        def gathered_parameters(params, modifier_rank=None):
            assert [p is self.param for p in params] == [True] and modifier_rank is None
            self._gather("context")
            try:
                yield
            finally:
                self._release("context")

        fake.zero = SimpleNamespace(GatheredParameters=gathered_parameters)
        return fake


def build(tiny_model, tmp_path, name: str) -> CPPOTrainer:
    args = make_config(CPPOConfig, tmp_path / name, pruning_rate=0.5, beta=0.04, num_iterations=2)
    trainer = CPPOTrainer(model=tiny_model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what train() sets
    return trainer


def step(trainer: CPPOTrainer):
    """One training step on a fixed generation batch (two groups of 4), seeded: the same completions every time."""
    inputs = [{"prompt": f"{i} + {i * 7} ="} for i in (3, 14) for _ in range(4)]
    torch.manual_seed(0)
    return trainer.training_step(trainer.model, inputs, None)


def test_zero3_head_gathered_for_the_step_and_its_gradient_whole(tiny_model, tmp_path, monkeypatch):
    plain = build(tiny_model, tmp_path, "plain")
    loss = step(plain)
    expected = plain.model.lm_head.weight.grad.clone()
    assert expected.abs().sum() > 0

    trainer = build(tiny_model, tmp_path, "zero3")
    fake = FakeZero3(trainer.model, trainer.model.lm_head.weight)  # tied to the embedding: both modules gather it
    monkeypatch.setitem(sys.modules, "deepspeed", fake.module())
    monkeypatch.setattr(sharding, "zero3_enabled", lambda t: t is trainer)
    seen = []
    fused = trl_loss.fused_cppo_loss
    spy = lambda *a, **k: (seen.append(tuple(a[1].shape)), fused(*a, **k))[1]  # noqa: E731
    monkeypatch.setattr(trl_loss, "fused_cppo_loss", spy)

    torch.testing.assert_close(step(trainer), loss, atol=1e-6, rtol=1e-5)
    assert trainer.fused_loss_refused is None and seen == [(300, 32)], seen  # the fused loss read the whole head
    assert fake.events.count("gather:context") == 1 and fake.events[-1] == "release:context", fake.events
    assert "gather:hook" in fake.events  # generation ran the head module through ZeRO-3's hooks
    (grad,) = fake.grads  # whole when the step's context closed: after the backward
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5)
    assert trainer.model.lm_head.weight.numel() == 0  # partitioned again after the step

    with pytest.raises(RuntimeError, match="outside a training or prediction step"):
        sharding.gathered_head(trainer, trainer.model)


def test_zero3_detection():
    def trainer(enabled: bool, stage: int | None):
        plugin = None if stage is None else SimpleNamespace(zero_stage=stage)
        return SimpleNamespace(is_deepspeed_enabled=enabled, accelerator=SimpleNamespace(state=SimpleNamespace(
            deepspeed_plugin=plugin)))  # fmt: skip

    assert sharding.zero3_enabled(trainer(True, 3))
    assert not sharding.zero3_enabled(trainer(True, 2))
    assert not sharding.zero3_enabled(trainer(False, None))
