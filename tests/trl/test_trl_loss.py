"""The fused policy loss equals TRL's own ``_compute_loss`` on the same inputs (completions of 0 to 8 tokens), for
each of TRL's eight loss types, both importance sampling levels, ``delta``, the bias-corrected KL (TRL's default),
the off-policy mask, the high-entropy token mask and the entropy bonus: loss, every parameter's gradient, and every
loss metric both log (TRL's clip ratios per token, or per sequence with sequence-level ratios, and with ``delta``
of the capped ratio); each on the fused path (``fused_cppo_loss`` called, no fallback)."""

from __future__ import annotations

import pytest
import torch
from trl import GRPOTrainer
from trl_tiny import digit_reward, make_config, tiny_dataset

import cppo.trl.loss as trl_loss
from cppo.trl import CPPOConfig, CPPOTrainer

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CASES = [
    (loss_type, level, beta) for loss_type in LOSS_TYPES for level in ("token", "sequence") for beta in (0.0, 0.04)
]
#: TRL's per-sequence clip extremes, which the fused kernel does not compute.
NOT_LOGGED = {"clip_ratio/low_min", "clip_ratio/high_max"}
#: The options beyond the loss type, each on with TRL's default bias-corrected KL (beta = 0.04). The fixture's
#: clip range is [0.9, 1.15]: TRL's clip ratios read the ratio capped at ``delta``, so a ``delta`` below 1.15 clips
#: nothing above, and one below 0.9 counts every ``A < 0`` token (or sequence) as clipped below.
OPTION_CASES = {
    "delta": dict(args=dict(delta=1.2)),
    "delta-below-high-clip": dict(args=dict(delta=1.1)),
    "delta-below-low-clip": dict(args=dict(delta=0.85)),
    "bias-corrected-kl": dict(args=dict(use_bias_correction_kl=True)),
    "off-policy-mask": dict(trainer=dict(off_policy_mask_threshold=0.05), sampling=True),
    "off-policy-mask-old": dict(trainer=dict(off_policy_mask_threshold=0.0)),
    "entropy-mask": dict(trainer=dict(top_entropy_quantile=0.3)),
    "entropy-bonus": dict(trainer=dict(entropy_coef=0.05, _entropy_bonus_enabled=True)),
    "all": dict(
        args=dict(use_bias_correction_kl=True, delta=1.3),
        trainer=dict(
            off_policy_mask_threshold=0.05, top_entropy_quantile=0.5, entropy_coef=0.05, _entropy_bonus_enabled=True
        ),
        sampling=True,
    ),
}


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
        "sampling_per_token_logps": logps + 0.3 * torch.randn(6, 8, generator=g),
    }  # fmt: skip


def loss_and_grads(trainer, compute, inputs) -> tuple[torch.Tensor, dict, dict]:
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = compute(trainer, trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def assert_equal_to_trl(trainer, inputs, monkeypatch) -> dict:
    """TRL's ``_compute_loss`` and CPPOTrainer's (which must run the fused loss) give the same loss, gradients and
    metrics; returns TRL's metrics."""
    assert trl_loss.unsupported_setting(trainer) is None and trainer.fused_loss_refused is None
    want, want_grads, want_metrics = loss_and_grads(trainer, GRPOTrainer._compute_loss, inputs)
    calls = []
    fused = trl_loss.fused_cppo_loss
    monkeypatch.setattr(trl_loss, "fused_cppo_loss", lambda *a, **k: calls.append(k) or fused(*a, **k))
    got, got_grads, got_metrics = loss_and_grads(trainer, CPPOTrainer._compute_loss, inputs)
    assert len(calls) == 1, "the fused loss did not run"
    assert want != 0.0
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    names = sorted(set(want_metrics) - NOT_LOGGED)
    assert set(names) == set(got_metrics), set(names) ^ set(got_metrics)
    for name in names:
        torch.testing.assert_close(got_metrics[name], want_metrics[name], atol=1e-6, rtol=1e-5, msg=name)
    return want_metrics


@pytest.mark.parametrize("loss_type, level, beta", CASES)
def test_fused_loss_equals_trls(trainer, inputs, monkeypatch, loss_type, level, beta):
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "importance_sampling_level", level)
    monkeypatch.setattr(trainer, "beta", beta)
    if loss_type == "cispo":  # TRL's cap of the ratio itself (ScaleRL's 5.0 never bites); sequence ratios are nearer 1
        monkeypatch.setattr(trainer, "epsilon_high", 1.2 if level == "token" else 1.05)
    want_metrics = assert_equal_to_trl(trainer, inputs, monkeypatch)
    if loss_type not in ("cispo", "sapo", "vespo"):  # some ratios (tokens or sequences) are clipped, not all
        assert 0 < want_metrics["clip_ratio/region_mean"] < 1
    if loss_type == "cispo":
        assert 0 < want_metrics["cispo_clip_ratio"] < 1


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("case", OPTION_CASES)
def test_fused_options_equal_trls(trainer, inputs, monkeypatch, loss_type, case, level):
    """Each option beyond the loss type, through every loss type and both importance sampling levels, with the
    bias-corrected KL (TRL's default) on."""
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "importance_sampling_level", level)
    monkeypatch.setattr(trainer.args, "use_bias_correction_kl", True)
    option = OPTION_CASES[case]
    for name, value in option.get("args", {}).items():
        monkeypatch.setattr(trainer.args, name, value)
    for name, value in option.get("trainer", {}).items():
        monkeypatch.setattr(trainer, name, value)
    if not option.get("sampling"):
        inputs = {k: v for k, v in inputs.items() if k != "sampling_per_token_logps"}
    assert_equal_to_trl(trainer, inputs, monkeypatch)


def test_an_empty_completion_is_a_row_of_ratio_one(trainer, inputs, monkeypatch):
    """With sequence-level ratios TRL's clip ratios are fractions of the rows, an empty completion's included (its
    ratio is exp(0) = 1): a CISPO cap below 1 clips it when its advantage is positive, and not once it is negative."""
    monkeypatch.setattr(trainer, "loss_type", "cispo")
    monkeypatch.setattr(trainer, "importance_sampling_level", "sequence")
    monkeypatch.setattr(trainer, "epsilon_high", 0.9)
    empty = int((inputs["completion_mask"].sum(1) == 0).nonzero())
    assert inputs["advantages"][empty] > 0
    positive = assert_equal_to_trl(trainer, inputs, monkeypatch)["cispo_clip_ratio"]
    flipped = {**inputs, "advantages": inputs["advantages"].clone()}
    flipped["advantages"][empty] *= -1
    negative = assert_equal_to_trl(trainer, flipped, monkeypatch)["cispo_clip_ratio"]
    assert positive - negative == pytest.approx(1 / len(inputs["advantages"]))
