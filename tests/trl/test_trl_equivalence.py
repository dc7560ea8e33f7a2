"""At pruning_rate=0 CPPOTrainer trains exactly as stock trl.GRPOTrainer (compared against TRL itself, same seed,
completions of different lengths): the same logged loss and every other metric both log per step, the same final
weights within float tolerance, and not one random number more (the global RNG state after training is identical:
generation samples from it)."""

from __future__ import annotations

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl_tiny import digit_reward, fake_vllm, losses, make_config, save_tiny_moe, tiny_dataset, weights

import cppo.trl.loss as trl_loss
from cppo.trl import CPPOConfig, CPPOTrainer

CASES = {
    # the fused loss for every loss_type it expresses; beta > 0 and num_iterations=2 run both deferred passes
    "dapo": dict(loss_type="dapo", beta=0.04, num_iterations=2),
    "grpo": dict(loss_type="grpo", beta=0.04, num_iterations=2),
    "bnpo": dict(loss_type="bnpo", beta=0.04),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.04, num_iterations=2),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2, beta=0.04),
    # gradient accumulation over a generation split into two micro-batches
    "accumulation": dict(gradient_accumulation_steps=2, per_device_train_batch_size=4, beta=0.04, num_iterations=2),
    # the random metric draws from a generator of its own, never the global RNG
    "random-metric": dict(pruning_metric="random", selection_scope="global", beta=0.04),
    # the loss types beyond the PPO clip, TRL's default bias-corrected KL, and the per-token options
    "sapo": dict(loss_type="sapo", beta=0.04, num_iterations=2, use_bias_correction_kl=True),
    "cispo": dict(loss_type="cispo", epsilon_high=1.2, beta=0.04, num_iterations=2, use_bias_correction_kl=True),
    "vespo": dict(loss_type="vespo", beta=0.04, num_iterations=2, use_bias_correction_kl=True),
    "luspo": dict(
        loss_type="luspo",
        importance_sampling_level="sequence",
        beta=0.04,
        num_iterations=2,
        delta=1.5,
        use_bias_correction_kl=True,
    ),
    # clip ranges narrow enough that the second iteration clips some ratios: per sequence (TRL's clip ratios are
    # then fractions of the rows), and with a delta below 1 + epsilon_high (TRL's clip ratios read the capped ratio);
    # no bound at exactly 1, where an on-policy step's ratios sit (TRL's exactly, ours within fp32 rounding)
    "gspo-clipped": dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2, epsilon=0.005),
    "luspo-clipped": dict(
        loss_type="luspo", importance_sampling_level="sequence", num_iterations=2, epsilon=0.005, beta=0.04
    ),
    "cispo-sequence": dict(
        loss_type="cispo", importance_sampling_level="sequence", num_iterations=2, epsilon_high=1.002
    ),
    "delta-below-high-clip": dict(loss_type="dapo", num_iterations=2, epsilon=0.02, delta=1.01),
    "delta-below-high-clip-sequence": dict(
        loss_type="bnpo", importance_sampling_level="sequence", num_iterations=2, epsilon=0.005, delta=1.004
    ),
    "entropy-options": dict(
        loss_type="dapo",
        beta=0.04,
        num_iterations=2,
        use_bias_correction_kl=True,
        off_policy_mask_threshold=0.01,
        top_entropy_quantile=0.5,
        entropy_coef=0.01,
    ),
    # TRL's adaptive entropy controller: a target above the tiny model's entropy, so the bonus is applied from the
    # second step on and the coefficient moves every step; alone and with the entropy mask
    "adaptive-entropy": dict(
        loss_type="dapo",
        beta=0.04,
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_target=100.0,
        entropy_coef_delta=0.05,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
    ),  # fmt: skip
    "adaptive-entropy-quantile": dict(
        loss_type="grpo",
        beta=0.04,
        use_adaptive_entropy=True,
        entropy_target=100.0,
        entropy_coef_delta=0.05,
        top_entropy_quantile=0.5,
        num_iterations=2,
    ),  # fmt: skip
    # TRL's own loss on the kept rows, where the fused loss is refused (FSDP version 1, simulated)
    "fallback": dict(loss_type="dapo", beta=0.04),
}


def run(cls, config_cls, model: str, out, vllm: bool = False, **options):
    trainer = cls(
        model=model, reward_funcs=digit_reward, args=make_config(config_cls, out, **options),
        train_dataset=tiny_dataset(),
    )  # fmt: skip
    if vllm:
        fake_vllm(trainer)
    trainer.train()
    return trainer, torch.get_rng_state()


#: Logged by TRL only: the per-sequence clip extremes, which the fused kernel does not compute.
NOT_LOGGED = {"clip_ratio/low_min", "clip_ratio/high_max"}
#: Wall-clock measurements, which differ between any two runs.
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def assert_same_metrics(cppo, stock) -> None:
    """Every step logs the same keys as stock TRL's but :data:`NOT_LOGGED` (plus CPPO's own ``cppo/*``), each the
    same value within the loss's tolerance: from the second step on the weights the fused loss trained are TRL's
    within fp32 rounding."""
    for step, (ours, theirs) in enumerate(zip(cppo.state.log_history, stock.state.log_history, strict=True)):
        keys = set(theirs) - TIMINGS - NOT_LOGGED
        extra = {k for k in ours if k.startswith("cppo/")} | NOT_LOGGED  # TRL's own loss (a fallback) logs those
        assert set(ours) - TIMINGS - keys <= extra, (step, set(ours) ^ keys)
        assert keys <= set(ours), (step, keys - set(ours))
        for key in sorted(keys):
            torch.testing.assert_close(ours[key], theirs[key], atol=1e-6, rtol=1e-5, msg=f"step {step}: {key}")


def assert_same_training(model, tmp_path, vllm: bool = False, **options) -> tuple[CPPOTrainer, GRPOTrainer]:
    trl_options = {k: v for k, v in options.items() if k not in ("pruning_metric", "selection_scope")}
    stock, stock_rng = run(GRPOTrainer, GRPOConfig, model, tmp_path / "stock", vllm, **trl_options)
    cppo, cppo_rng = run(CPPOTrainer, CPPOConfig, model, tmp_path / "cppo", vllm, pruning_rate=0.0, **options)
    assert len(losses(cppo)) == 3
    torch.testing.assert_close(losses(cppo), losses(stock), atol=1e-6, rtol=1e-5)
    for name, value in weights(stock).items():
        torch.testing.assert_close(weights(cppo)[name], value, atol=1e-4, rtol=1e-4, msg=name)
    assert torch.equal(cppo_rng, stock_rng), "CPPOTrainer drew random numbers stock TRL does not"
    assert_same_metrics(cppo, stock)
    return cppo, stock


def assert_ragged(trainer) -> None:
    """The completions of some generation had different lengths (what the metrics' units depend on)."""
    logs = [h for h in trainer.state.log_history if "completions/min_length" in h]  # the steps that generated
    spans = [(h["completions/min_length"], h["completions/max_length"]) for h in logs]
    assert any(low < high for low, high in spans), spans


@pytest.mark.parametrize("case", CASES)
def test_p0_trains_as_stock_trl(ragged_tiny_model, tmp_path, case, monkeypatch):
    if case == "fallback":
        monkeypatch.setattr(trl_loss, "_fsdp_version", lambda trainer: 1)
        with pytest.warns(UserWarning, match="FSDP version 1 .* is not expressed"):
            cppo, _ = assert_same_training(ragged_tiny_model, tmp_path, **CASES[case])
        assert cppo.fused_loss_refused.startswith("FSDP version 1")
        return
    cppo, stock = assert_same_training(ragged_tiny_model, tmp_path, **CASES[case])
    assert cppo.fused_loss_refused is None
    assert_ragged(stock)
    clip = "cispo_clip_ratio" if CASES[case].get("loss_type") == "cispo" else "clip_ratio/region_mean"
    if case.endswith(("clipped", "clip", "sequence")):  # the clip ratios compared above are not all 0
        assert any(h.get(clip, 0.0) > 0 for h in stock.state.log_history), case
    if case.startswith("adaptive"):  # the controller moved, as TRL's did, and its gate opened
        coefs = [h["entropy_coef"] for h in cppo.state.log_history if "entropy_coef" in h]
        assert coefs == [h["entropy_coef"] for h in stock.state.log_history if "entropy_coef" in h]
        assert len(coefs) == 3 and coefs[0] < coefs[1] < coefs[2], coefs
        assert cppo._last_world_entropy == pytest.approx(stock._last_world_entropy, rel=1e-5)


#: (mode, clip_min, clip_max): each of TRL's four modes with bounds that cut some rows or tokens, and bounds that cut
#: nothing. Plain SGD: Adam turns the fp32 rounding of a near-zero gradient element into a step of up to the
#: learning rate (with these completions of different lengths one weight differed by 3e-3 after three Adam steps,
#: where SGD's weights agree within 1.2e-7), so the weights compare at the harness's tolerance only where the update
#: is proportional to the gradient; the learning rate moves the weights by about 2e-2, as Adam's steps do elsewhere.
VLLM_IS_CASES = [
    ("token_truncate", 0.5, 3.0),
    ("token_mask", 0.7, 1.1),
    ("sequence_truncate", 0.45, 0.7),
    ("sequence_mask", 0.45, 3.0),
    ("sequence_mask", None, 1e6),
]


@pytest.mark.parametrize("mode, clip_min, clip_max", VLLM_IS_CASES)
def test_p0_with_vllm_importance_sampling_trains_as_stock_trl(ragged_tiny_model, tmp_path, mode, clip_min, clip_max):
    """vLLM's importance-sampling correction (sampling log-probs from a stand-in): TRL computes the ratio from the
    old-policy pass inside its scoring; CPPO recomputes it after its deferred old pass and gives it to the fused loss
    as ``importance_weights``: same loss, weights and metrics, ``sampling/*`` included."""
    options = dict(beta=0.04, vllm_importance_sampling_mode=mode, optim="sgd", learning_rate=0.5)
    options.update(vllm_importance_sampling_clip_min=clip_min, vllm_importance_sampling_clip_max=clip_max)
    cppo, stock = assert_same_training(ragged_tiny_model, tmp_path, vllm=True, **options)
    assert cppo.fused_loss_refused is None  # the fused path ran, the ratio as its importance weights
    assert_ragged(stock)
    logged = cppo.state.log_history[0]
    assert len([k for k in logged if k.startswith("sampling/")]) == 5
    assert logged["loss"] != 0.0 and logged["sampling/importance_sampling_ratio/mean"] > 0, logged


def test_p0_mixture_of_experts_aux_loss_trains_as_stock_trl(tmp_path, monkeypatch):
    """A mixture-of-experts policy with ``router_aux_loss_coef``: the fused loss plus the model's own load-balancing
    loss of the padded rows (prefix sharing is off for it, one warning), as TRL adds it."""
    calls = []
    fused = trl_loss.fused_cppo_loss
    monkeypatch.setattr(trl_loss, "fused_cppo_loss", lambda *a, **k: (calls.append(1), fused(*a, **k))[1])
    model = save_tiny_moe(tmp_path / "moe")
    with pytest.warns(UserWarning, match="prefix_sharing=True is not used with router_aux_loss_coef"):
        cppo, stock = assert_same_training(model, tmp_path, beta=0.04, num_iterations=2)
    assert cppo.aux_loss_enabled and cppo.fused_loss_refused is None and len(calls) == 3
    aux = [h["aux_loss"] for h in cppo.state.log_history if "aux_loss" in h]
    assert len(aux) == 3 and aux[0] > 0
    torch.testing.assert_close(aux, [h["aux_loss"] for h in stock.state.log_history if "aux_loss" in h])
