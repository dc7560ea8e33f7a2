"""The fused policy loss equals TRL's own ``_compute_loss`` on the same inputs, for every loss_type and importance
sampling level it expresses: loss, every parameter's gradient, and TRL's loss metrics."""

from __future__ import annotations

import pytest
import torch
from trl import GRPOTrainer
from trl_tiny import digit_reward, make_config, tiny_dataset

from cppo.trl import CPPOConfig, CPPOTrainer

CASES = [
    (loss_type, level, beta)
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo")
    for level in ("token", "sequence")
    for beta in (0.0, 0.04)
]
METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@pytest.fixture(scope="module")
def trainer(tiny_model, tmp_path_factory) -> CPPOTrainer:
    # temperature != 1 (TRL divides the logits by it), asymmetric clipping, two accumulation steps (the normalisers)
    args = make_config(
        CPPOConfig, tmp_path_factory.mktemp("loss"), temperature=0.7, epsilon=0.1, epsilon_high=0.15, beta=0.04,
        steps_per_generation=4, gradient_accumulation_steps=2,
    )  # fmt: skip
    trainer = CPPOTrainer(model=tiny_model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset())
    trainer.current_gradient_accumulation_steps = 2
    trainer.model.train()
    return trainer


@pytest.fixture(scope="module")
def inputs(trainer) -> dict:
    """A TRL batch of 6 rows: left-padded prompts, right-padded completions of 0 to 8 tokens, advantages of both
    signs, old and reference log-probs off the policy's by up to ~0.4 (so that some ratios are clipped)."""
    g = torch.Generator().manual_seed(0)
    prompt_lengths, completion_lengths = [3, 5, 2, 5, 4, 1], [8, 3, 0, 6, 1, 5]
    prompt_ids = torch.randint(4, 300, (6, 5), generator=g)
    prompt_mask = (torch.arange(5) >= 5 - torch.tensor(prompt_lengths)[:, None]).long()
    completion_ids = torch.randint(4, 300, (6, 8), generator=g)
    completion_mask = (torch.arange(8) < torch.tensor(completion_lengths)[:, None]).long()
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 8)[0]  # [6, 8]
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": torch.randn(6, generator=g),
        "old_per_token_logps": logps + 0.4 * torch.randn(6, 8, generator=g),
        "ref_per_token_logps": logps + 0.3 * torch.randn(6, 8, generator=g),
        "num_items_in_batch": torch.tensor(40),
    }  # fmt: skip


def loss_and_grads(trainer, compute, inputs) -> tuple[torch.Tensor, dict, dict]:
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = compute(trainer, trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type, level, beta", CASES)
def test_fused_loss_equals_trls(trainer, inputs, monkeypatch, loss_type, level, beta):
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "importance_sampling_level", level)
    monkeypatch.setattr(trainer, "beta", beta)
    want, want_grads, want_metrics = loss_and_grads(trainer, GRPOTrainer._compute_loss, inputs)
    got, got_grads, got_metrics = loss_and_grads(trainer, CPPOTrainer._compute_loss, inputs)
    assert want != 0.0
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    names = [m for m in METRICS if beta or m != "kl"]
    if level == "sequence":  # TRL's clip ratios are then per sequence; the fused kernel's per token
        names = [m for m in names if not m.startswith("clip_ratio")]
    torch.testing.assert_close([got_metrics[m] for m in names], [want_metrics[m] for m in names], atol=1e-5, rtol=1e-5)
    assert want_metrics["clip_ratio/region_mean"] > 0 or level == "sequence"
