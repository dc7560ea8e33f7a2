"""A step's loss and gradients do not depend on how the step is cut into micro-batches (issue 49, defect 2): every
``loss.loss_type`` (TRL's names), every flat ``loss_agg`` and the loss options that aggregate over the whole call
(the entropy bonus) give, within fp32 rounding, the same loss and gradients with one micro-batch as with several.

One trainer serves every case: its step generates once (a fixed rollout whose completions have different lengths, so
that a micro-batch's share of the tokens differs from its share of the sequences), the optimizer step records the
gradients and applies nothing, and the question sampler is rewound. Two processes: tests/e2e/test_loss_cut_ranks.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_run import tiny_config

from cppo.engines import Rollout
from cppo.trainer import Trainer
from cppo_kernels.config import LOSS_AGGS, LOSS_TYPES

#: Micro-batch budgets: every question's completions in one micro-batch, or one question a micro-batch at most.
WHOLE, CUT = 1024, 56


class FrozenStep:
    """``trainer`` with a step that always trains the same rollout and rewards and records its gradients."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.base = trainer, trainer.config
        problems, prompts, rollout = trainer._generate()
        # completion i keeps 1 + (5 i mod 8) tokens: the questions' token counts differ, their sequence counts do not
        ids = [c[: 1 + (5 * i) % len(c)] for i, c in enumerate(rollout.completion_ids)]
        texts = trainer.tokenizer.batch_decode(ids)
        self.generated = problems, prompts, Rollout(rollout.prompt_ids, ids, texts)
        rewards = torch.tensor([float(len(c) % 3) for c in ids])  # [Q * G], varied within every group
        self.rewarded = rewards, {"length": rewards.tolist()}, [False] * len(ids)
        self.sampler = trainer.sampler.state_dict()
        trainer._generate = lambda *a: self.generated
        trainer._reward = lambda *a: self.rewarded
        trainer._optimizer_step = self._record
        self.grads: dict[str, torch.Tensor] = {}

    def _record(self) -> tuple[float, bool]:
        self.grads = {n: p.grad.clone() for n, p in self.trainer.model.named_parameters() if p.grad is not None}
        norm = torch.cat([g.reshape(-1) for g in self.grads.values()]).norm()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        return float(norm), True

    def run(self, micro_batch_tokens: int, **settings) -> tuple[dict, dict[str, torch.Tensor]]:
        """The step's metrics and gradients under ``settings`` with the micro-batch budget ``micro_batch_tokens``."""
        t = self.trainer
        t.config = dataclasses.replace(self.base, micro_batch_tokens=micro_batch_tokens, **settings)
        t.loss_config = t.config.loss_config  # as the trainer takes it when built
        t.sampler.load_state_dict(self.sampler)
        t.step = 0
        metrics = t.train_step()
        return metrics, self.grads


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    trainer = Trainer(tiny_config(tmp_path_factory.mktemp("cut"), mu=1, questions_per_step=3, micro_batch_tokens=WHOLE))
    return FrozenStep(trainer)


def assert_same_step(frozen: FrozenStep, **settings) -> None:
    whole, whole_grads = frozen.run(WHOLE, **settings)
    cut, cut_grads = frozen.run(CUT, **settings)
    assert whole["micro_batches"] == 1 and cut["micro_batches"] >= 3, (whole["micro_batches"], cut["micro_batches"])
    assert max(float(g.abs().max()) for g in whole_grads.values()) > 1e-4  # the step moves the policy
    for key in ("loss", "kl", "entropy", "clip_fraction", "grad_norm"):
        assert cut[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), (key, cut[key], whole[key])
    assert whole_grads.keys() == cut_grads.keys()
    for name, want in whole_grads.items():
        torch.testing.assert_close(cut_grads[name], want, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_every_loss_type_gives_the_same_step_however_it_is_cut(frozen, loss_type):
    assert_same_step(frozen, loss={"loss_type": loss_type})


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_every_aggregation_gives_the_same_step_however_it_is_cut(frozen, loss_agg):
    assert_same_step(frozen, loss_agg=loss_agg)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_entropy_bonus_is_the_step_mean_however_it_is_cut(frozen, loss_type):
    """The bonus is ``entropy_coef`` times the mean entropy of the step's tokens, whatever the policy term's
    aggregation: not a micro-batch's mean weighted by its share of the sequences."""
    assert_same_step(frozen, loss={"loss_type": loss_type, "entropy_coef": 0.5})


@pytest.mark.parametrize("loss", [{"top_entropy_quantile": 0.5}, {"top_entropy_quantile": 0.5, "entropy_coef": 0.5}])
def test_the_entropy_mask_cuts_at_the_step_quantile_however_it_is_cut(frozen, loss):
    """``top_entropy_quantile``: the cut is the quantile of the step's tokens, not of each micro-batch's."""
    assert_same_step(frozen, loss={"loss_type": "grpo", **loss})
