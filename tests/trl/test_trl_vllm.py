"""vLLM's importance-sampling correction under CPPOTrainer, without vLLM: a stand-in (``trl_tiny.fake_vllm``) feeds
sampling log-probs the way TRL's vLLM path returns them from generation. At P > 0 CPPO computes the ratio after
pruning, on the kept rows only: each kept row's ratio equals the one stock GRPOTrainer computes for that row of the
same generation, in all four ``vllm_importance_sampling_mode``s, and TRL's ``sampling/*`` metrics are those of the
kept rows. Then the fused loss takes it as ``importance_weights`` and trains."""

from __future__ import annotations

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl_tiny import digit_reward, fake_vllm, losses, make_config, tiny_dataset

import cppo.trl.loss as trl_loss
from cppo.trl import CPPOConfig, CPPOTrainer

#: (mode, clip_min, clip_max): bounds that cut some of the kept rows' ratios, not all (tokens: about 0.6 to 1.2 on
#: the tiny model and the stand-in; sequences: about 0.4 to 0.53)
MODES = [
    ("token_truncate", 0.8, 1.5),
    ("token_mask", 0.8, 1.5),
    ("sequence_truncate", 0.5, 3.0),
    ("sequence_mask", 0.5, 3.0),
]
SAMPLING = "sampling/importance_sampling_ratio/"


def trainers(tiny_model, tmp_path, **options) -> tuple[GRPOTrainer, CPPOTrainer]:
    build = dict(reward_funcs=digit_reward, train_dataset=tiny_dataset())
    stock = GRPOTrainer(model=tiny_model, args=make_config(GRPOConfig, tmp_path / "stock", **options), **build)
    cppo_args = make_config(CPPOConfig, tmp_path / "cppo", pruning_rate=0.5, **options)
    cppo = CPPOTrainer(model=tiny_model, args=cppo_args, **build)
    for trainer in (stock, cppo):
        fake_vllm(trainer)
        trainer.model.train()
    return stock, cppo


@pytest.mark.parametrize("mode, clip_min, clip_max", MODES)
def test_kept_rows_ratio_equals_stock_trl(tiny_model, tmp_path, mode, clip_min, clip_max):
    options = dict(beta=0.04, vllm_importance_sampling_mode=mode)
    options.update(vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max)
    stock, cppo = trainers(tiny_model, tmp_path, **options)
    inputs = [{"prompt": f"{i} + {i * 7} ="} for i in (3, 14) for _ in range(4)]  # 2 groups of 4 = one generation
    kept_rows = []
    kept_rows_of = cppo._kept_rows
    cppo._kept_rows = lambda adv: (lambda out: (kept_rows.append(out[0]), out)[1])(kept_rows_of(adv))

    torch.manual_seed(0)
    full = stock._generate_and_score_completions(inputs)
    torch.manual_seed(0)
    pruned = cppo._generate_and_score_completions(inputs)

    (kept,) = kept_rows
    assert 0 < kept.numel() < len(inputs)
    width = pruned["completion_ids"].size(1)
    assert torch.equal(pruned["completion_ids"], full["completion_ids"][kept, :width])  # the same generation
    mask = pruned["completion_mask"].bool()
    theirs = full["importance_sampling_ratio"][kept]  # [K, C] token modes, [K, 1] sequence modes
    ours = pruned["importance_sampling_ratio"]
    if mode.startswith("token"):
        assert ours.shape == (kept.numel(), width)
        theirs = theirs[:, :width]
        torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=1e-5)
        flat = theirs[mask]
    else:
        assert ours.shape == (kept.numel(), 1)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        flat = theirs.flatten()
    cut = flat == 0 if mode.endswith("mask") else (flat == clip_min) | (flat == clip_max)
    assert cut.any() and not cut.all(), f"the bounds cut none or all of {flat.tolist()}: choose others"
    logged, stock_logged = cppo._metrics["train"], stock._metrics["train"]
    expected = {"min": flat.min(), "mean": flat.mean(), "max": flat.max()}
    for name, value in expected.items():
        assert logged[SAMPLING + name][-1] == pytest.approx(value.item(), abs=1e-5), name
    all_rows = full["importance_sampling_ratio"]
    assert stock_logged[SAMPLING + "mean"][-1] != pytest.approx(logged[SAMPLING + "mean"][-1], abs=1e-7) or (
        all_rows.numel() == 0
    ), "stock's metric over every row equals the kept rows': the test shows nothing"


def test_pruned_run_with_the_correction_trains_through_the_fused_loss(tiny_model, tmp_path, monkeypatch):
    _, cppo = trainers(tiny_model, tmp_path, beta=0.04, vllm_importance_sampling_mode="token_mask", max_steps=2)
    assert cppo.fused_loss_refused is None
    calls = []
    fused = trl_loss.fused_cppo_loss

    def spy(*args, **kwargs):  # installed after the trainer decided its loss path
        calls.append(kwargs.get("importance_weights"))
        return fused(*args, **kwargs)

    monkeypatch.setattr(trl_loss, "fused_cppo_loss", spy)
    cppo.train()
    assert calls and all(w is not None and not w.requires_grad for w in calls)
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses(cppo)) and len(losses(cppo)) == 2


@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate"])
def test_the_kept_rows_ratio_is_what_the_fused_loss_gets_as_importance_weights(tiny_model, tmp_path, monkeypatch, mode):
    """The wiring: the micro-batch's
    ratio reaches ``fused_cppo_loss`` as ``importance_weights``, ``[B, C]`` per token or ``[B]`` per sequence, without
    gradient. The loss itself is the kernel's (its equality with TRL: the P = 0 tests above and in
    test_trl_equivalence.py)."""
    _, cppo = trainers(tiny_model, tmp_path, beta=0.04, vllm_importance_sampling_mode=mode)
    assert cppo.fused_loss_refused is None
    seen = []
    fused = trl_loss.fused_cppo_loss

    def spy(*args, importance_weights=None, **kwargs):
        seen.append(importance_weights)
        return fused(*args, **kwargs)  # the installed kernel, without the keyword it may lack

    monkeypatch.setattr(trl_loss, "fused_cppo_loss", spy)
    torch.manual_seed(0)
    batch = cppo._generate_and_score_completions([{"prompt": f"{i} + {i * 7} ="} for i in (3, 14) for _ in range(4)])
    cppo.current_gradient_accumulation_steps = 1
    cppo._compute_loss(cppo.model, batch)
    (weights,) = seen
    ratio = batch["importance_sampling_ratio"]
    expected = ratio if mode.startswith("token") else ratio.squeeze(1)
    assert weights is not None and weights.shape == expected.shape and not weights.requires_grad
    assert torch.equal(weights, expected) and weights.shape[0] == batch["completion_ids"].size(0) < 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_server_mode_without_cuda_is_one_line_before_anything_waits_for_a_server(tiny_model, tmp_path):
    """vllm_mode='server' sends weights over NCCL: on a CPU the trainer says so at once (TRL would wait for a server
    for server_timeout seconds, then fail on the weight transfer)."""
    args = make_config(CPPOConfig, tmp_path / "cppo", use_vllm=True, vllm_mode="server", vllm_server_timeout=1.0)
    with pytest.raises(ValueError, match="vllm_mode='server' sends the weights to the vLLM server over NCCL"):
        CPPOTrainer(model=tiny_model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset())
