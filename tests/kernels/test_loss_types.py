"""The loss types and per-token options of issue 26 (CISPO, SAPO, VESPO, LUSPO's aggregation, ``delta``, the
bias-corrected KL, importance weights, the off-policy and entropy masks, the entropy bonus) on every loss path
(torch two-pass, torch gradient-in-forward where the option allows it, Triton two-pass) and through
``cppo_loss_from_logits``, against the float64 oracle; and the finite loss for huge finite inputs (issue 27)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from loss_cases import TOL, assert_close, cu_seqlens, grads, hypothesis_settings, problem

from cppo_kernels import LossConfig, cppo_loss_from_logits, fused_cppo_loss, reference

pytestmark = pytest.mark.usefixtures("small_chunks")


#: The surrogate-specific options drawn with each surrogate (bounds included: tiny and large tau, k = 0, lambda = 0).
SURROGATE_CASES = st.sampled_from(
    [
        dict(surrogate="clip"),
        dict(surrogate="clip", delta=1.1),
        dict(surrogate="clip", delta=3.0, epsilon_high=0.28),
        dict(surrogate="cispo", epsilon_high=1.2),
        dict(surrogate="cispo", epsilon_high=5.0),
        dict(surrogate="sapo"),
        dict(surrogate="sapo", sapo_temperature_pos=1e-3, sapo_temperature_neg=50.0),
        dict(surrogate="vespo"),
        dict(surrogate="vespo", vespo_k_pos=0.0, vespo_lambda_pos=0.0, vespo_k_neg=5.0, vespo_lambda_neg=0.5),
    ]
)


def _old_logprobs(logp64: torch.Tensor, spread: float, g: torch.Generator) -> torch.Tensor:
    """Old log-probs around the current ones: ratios straddle the clip bounds; a spread of 30 gives extreme ratios
    (beyond the log-ratio clamp of 20)."""
    return (logp64 + spread * torch.randn(logp64.shape, generator=g, dtype=torch.float64)).float()


@hypothesis_settings(max_examples=25)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4).filter(lambda ls: sum(ls) <= 30),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    surrogate=SURROGATE_CASES,
    importance_sampling=st.sampled_from(["token", "sequence"]),
    loss_agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"]),
    beta=st.sampled_from([0.0, 0.04]),
    bias_corrected=st.booleans(),
    spread=st.sampled_from([None, 0.3, 30.0]),
    weights=st.sampled_from([None, "token", "sequence"]),
    off_policy=st.sampled_from([None, 0.0, 0.2]),
    with_sampling=st.booleans(),
    top_entropy_quantile=st.sampled_from([1.0, 0.5, 0.0]),
    entropy_coef=st.sampled_from([0.0, 0.05]),
    zero_advantages=st.booleans(),
)
def test_options_match_the_oracle(
    loss_path, seed, lengths, dtype, surrogate, importance_sampling, loss_agg, beta, bias_corrected, spread, weights,
    off_policy, with_sampling, top_entropy_quantile, entropy_coef, zero_advantages,
):  # fmt: skip
    hidden, weight, bias, targets, adv, g = problem(seed, lengths, 16, 40, dtype, logit_scale=3.0, bias=True)
    if zero_advantages:
        adv = torch.zeros_like(adv)
    cu = cu_seqlens(lengths)
    T, S = hidden.shape[0], len(lengths)
    options = dict(
        surrogate,
        importance_sampling=importance_sampling,
        loss_agg=loss_agg,
        max_completion_length=12 if loss_agg == "seq-mean-token-sum-norm" else None,
        beta=beta,
        use_bias_correction_kl=bias_corrected,
        off_policy_mask_threshold=off_policy,
        top_entropy_quantile=top_entropy_quantile,
        entropy_coef=entropy_coef,
    )
    params64 = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    with torch.no_grad():
        logp64, _ = reference.token_logprobs(*params64[:2], targets, bias=params64[2])
    old = None if spread is None else _old_logprobs(logp64, spread, g)
    ref = _old_logprobs(logp64, 0.3, g) if beta > 0 else None
    sampling = _old_logprobs(logp64, 0.5, g) if with_sampling else None
    iw = None
    if weights is not None:
        iw = torch.rand(T if weights == "token" else S, generator=g) * 2
    tensors = dict(cu_seqlens=cu, old_logprobs=old, ref_logprobs=ref, importance_weights=iw, sampling_logprobs=sampling)

    params = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    loss, metrics = fused_cppo_loss(params[0], params[1], targets, adv, bias=params[2], **tensors, **options)
    per_seq = weights == "sequence" and T != S  # packed with T == S: per token (the documented rule)
    double = {k: None if v is None or k == "cu_seqlens" else v.double() for k, v in tensors.items()}
    want, want_metrics = reference.fused_cppo_loss(
        *params64[:2], targets, adv.double(), bias=params64[2], config=LossConfig(**options), weights_per_seq=per_seq,
        **{**double, "cu_seqlens": cu},
    )  # fmt: skip
    backend, _ = loss_path
    loss_tol, grad_tol = TOL[dtype][0], TOL[dtype][1 if backend == "torch" else 2]
    scale = max(1.0, float(want_metrics["policy_loss"].abs()))
    assert_close("loss", loss, want, loss_tol * scale, 1e-6)
    assert set(metrics) <= set(want_metrics) and "policy_loss" in metrics
    for key in ("policy_loss", "num_tokens", "cispo_clip_fraction", "vespo_phi_mean"):
        if key in metrics:
            assert_close(key, metrics[key], want_metrics[key], 1e-4, 1e-6)
    upstream = float(torch.randn((), generator=g))
    for name, got, exp in zip(
        ("dhidden", "dweight", "dbias"), grads(loss, params, upstream), grads(want, params64, upstream)
    ):  # noqa: E501
        assert_close(name, got, exp, grad_tol, TOL[dtype][3])


@pytest.mark.parametrize("surrogate", ["clip", "cispo", "sapo", "vespo"])
def test_logits_path_matches_the_oracle(surrogate):
    """``cppo_loss_from_logits`` (the entropy differentiable there too) against the oracle, every option on."""
    hidden, weight, bias, targets, adv, g = problem(3, [5, 0, 7, 4], 16, 40, torch.float32, logit_scale=3.0, bias=False)
    cu = cu_seqlens([5, 0, 7, 4])
    logits64 = (hidden.double() @ weight.double().t()).requires_grad_()
    with torch.no_grad():
        logp64 = torch.log_softmax(logits64, -1).gather(-1, targets[:, None]).squeeze(-1)
    old, ref, sampling = (_old_logprobs(logp64, 0.3, g) for _ in range(3))
    iw = torch.rand(4, generator=g) * 2
    options = dict(
        surrogate=surrogate, beta=0.04, use_bias_correction_kl=True, off_policy_mask_threshold=0.05,
        top_entropy_quantile=0.6, entropy_coef=0.1, loss_agg="seq-mean-token-sum",
        **({"epsilon_high": 3.0} if surrogate == "cispo" else {"delta": 1.3} if surrogate == "clip" else {}),
    )  # fmt: skip
    tensors = dict(cu_seqlens=cu, old_logprobs=old, ref_logprobs=ref, sampling_logprobs=sampling, importance_weights=iw)
    logits = logits64.detach().float().requires_grad_()
    loss, _ = cppo_loss_from_logits(logits, targets, adv, **tensors, **options)
    logp, entropy = (
        torch.log_softmax(logits64, -1).gather(-1, targets[:, None]).squeeze(-1),
        -(torch.softmax(logits64, -1) * torch.log_softmax(logits64, -1)).sum(-1),
    )
    want, _ = reference.policy_loss(
        logp, adv.double(), cu, old_logprobs=old.double(), ref_logprobs=ref.double(), entropy=entropy,
        config=LossConfig(**options), importance_weights=iw.double(), weights_per_seq=True,
        sampling_logprobs=sampling.double(),
    )  # fmt: skip
    assert_close("loss", loss, want, 2e-5)
    (got,), (exp,) = torch.autograd.grad(loss, [logits]), torch.autograd.grad(want, [logits64])
    assert_close("dlogits", got, exp, 1e-4)


def test_entropy_bonus_gradient_flows_through_the_entropy(loss_path):
    """With every policy term masked off (A = 0) the loss is the entropy bonus alone, and its gradient is the
    entropy's: nonzero, and the oracle's."""
    hidden, weight, bias, targets, _, _ = problem(5, [6, 3], 16, 40, torch.float32, logit_scale=3.0, bias=True)
    adv = torch.zeros(2)
    params = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    params64 = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    loss, metrics = fused_cppo_loss(params[0], params[1], targets, adv, bias=params[2], cu_seqlens=cu_seqlens([6, 3]),
                                    entropy_coef=0.5)  # fmt: skip
    want, _ = reference.fused_cppo_loss(params64[0], params64[1], targets, adv.double(), bias=params64[2],
                                        cu_seqlens=cu_seqlens([6, 3]), config=LossConfig(entropy_coef=0.5))  # fmt: skip
    assert float(metrics["policy_loss"]) == 0.0
    assert_close("loss", loss, want, 2e-5)
    assert_close("loss", loss, -0.5 * metrics["entropy"], 2e-6)
    got, exp = grads(loss, params, 1.0), grads(want, params64, 1.0)
    assert float(got[0].abs().max()) > 1e-3
    for name, a, b in zip(("dhidden", "dweight", "dbias"), got, exp):
        assert_close(name, a, b, 1e-4)


def test_all_masked_rows_give_zero_not_nan(loss_path):
    """The off-policy mask drops every sequence (all A < 0, sampling far above the policy): the policy loss is 0
    with zero gradients; an all-empty batch is 0 with every option on."""
    hidden, weight, _, targets, _, _ = problem(9, [4, 5], 16, 40, torch.float32, logit_scale=3.0, bias=False)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    sampling = torch.zeros(9)  # log-prob 0 > the policy's: mean gap > threshold
    loss, metrics = fused_cppo_loss(h, w, targets, torch.tensor([-1.0, -0.5]), cu_seqlens=cu_seqlens([4, 5]),
                                    sampling_logprobs=sampling, off_policy_mask_threshold=0.1)  # fmt: skip
    assert float(loss.detach()) == 0.0 and float(metrics["policy_loss"]) == 0.0
    assert all(float(x.abs().max()) == 0.0 for x in torch.autograd.grad(loss, (h, w)))
    empty = torch.zeros(0, 16, requires_grad=True)
    loss, _ = fused_cppo_loss(empty, w, torch.zeros(0, dtype=torch.long), torch.tensor([1.0, -1.0]),
                              cu_seqlens=torch.zeros(3, dtype=torch.long), surrogate="vespo",
                              off_policy_mask_threshold=0.0, top_entropy_quantile=0.5, entropy_coef=0.1,
                              importance_weights=torch.ones(2))  # fmt: skip
    assert float(loss) == 0.0


@pytest.mark.parametrize("surrogate", ["clip", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize("magnitude", [1e38, 3.4e38])
def test_huge_finite_advantages_give_a_finite_loss(loss_path, surrogate, magnitude):
    """Issue 27: advantages of 1e38 and above (finite) gave an infinite or NaN loss; every term is now bounded: the
    loss and its gradients are finite, with KL, importance weights and the entropy bonus on too."""
    hidden, weight, _, targets, _, g = problem(2, [5, 6], 16, 40, torch.float32, logit_scale=3.0, bias=False)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    old = torch.full((11,), -8.0)  # ratios up to e^20 after the clamp
    ref = torch.full((11,), -3.0)
    adv = torch.tensor([magnitude, -magnitude])
    extra = {"epsilon_high": 1e30} if surrogate == "cispo" else {}
    for options in (dict(), dict(beta=1e30, use_bias_correction_kl=True, importance_weights=torch.full((11,), 1e30))):
        loss, metrics = fused_cppo_loss(h, w, targets, adv, cu_seqlens=cu_seqlens([5, 6]), old_logprobs=old,
                                        ref_logprobs=ref, surrogate=surrogate, **extra, **options)  # fmt: skip
        assert torch.isfinite(loss), (options, float(loss))
        assert torch.isfinite(metrics["policy_loss"])
        assert all(torch.isfinite(x).all() for x in torch.autograd.grad(loss, (h, w)))


def test_bad_new_inputs_raise_one_line():
    hidden, weight, _, targets, adv, _ = problem(1, [3, 2], 8, 20, torch.float32, logit_scale=1.0, bias=False)
    cu = cu_seqlens([3, 2])
    bad = {
        "importance_weights must have shape": dict(importance_weights=torch.ones(4)),
        "importance_weights must be finite and >= 0": dict(importance_weights=torch.tensor([1.0, -1.0])),
        "importance_weights must have a floating dtype": dict(importance_weights=torch.ones(5, dtype=torch.long)),
        "sampling_logprobs must not hold inf": dict(sampling_logprobs=torch.full((5,), float("-inf"))),
        "surrogate must be one of": dict(surrogate="ppo"),
        "delta caps the ratio of surrogate='clip'": dict(surrogate="sapo", delta=2.0),
        "dual_clip applies to surrogate='clip'": dict(surrogate="cispo", dual_clip=3.0),
        "sapo_temperature_neg must be > 0": dict(surrogate="sapo", sapo_temperature_neg=0.0),
        "vespo_lambda_pos must be >= 0": dict(surrogate="vespo", vespo_lambda_pos=-1.0),
        r"top_entropy_quantile must be in \[0, 1\]": dict(top_entropy_quantile=1.5),
        "entropy_coef must be finite": dict(entropy_coef=float("inf")),
        "use_bias_correction_kl must be a bool": dict(use_bias_correction_kl=1),
    }
    for message, options in bad.items():
        with pytest.raises(ValueError, match=message):
            fused_cppo_loss(hidden, weight, targets, adv, cu_seqlens=cu, **options)


def test_entropy_bonus_through_the_logit_transform(loss_path):
    """The entropy gradient chains through the model's logit scale and tanh cap (merged with i26-head's transform):
    loss and gradients of the oracle, every option that needs the entropy on."""
    hidden, weight, bias, targets, adv, g = problem(6, [5, 7], 16, 40, torch.float32, logit_scale=3.0, bias=True)
    cu = cu_seqlens([5, 7])
    head = dict(logit_scale=1.7, logit_softcap=4.0)
    options = dict(entropy_coef=0.3, top_entropy_quantile=0.5, beta=0.04, use_bias_correction_kl=True)
    params64 = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    with torch.no_grad():
        logp64, _ = reference.token_logprobs(*params64[:2], targets, bias=params64[2], **head)
    old, ref = (_old_logprobs(logp64, 0.3, g) for _ in range(2))
    params = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    loss, _ = fused_cppo_loss(params[0], params[1], targets, adv, bias=params[2], cu_seqlens=cu, old_logprobs=old,
                              ref_logprobs=ref, **head, **options)  # fmt: skip
    want, _ = reference.fused_cppo_loss(*params64[:2], targets, adv.double(), bias=params64[2], cu_seqlens=cu,
                                        old_logprobs=old.double(), ref_logprobs=ref.double(), **head,
                                        config=LossConfig(**options))  # fmt: skip
    assert_close("loss", loss, want, 2e-5)
    for name, a, b in zip(("dhidden", "dweight", "dbias"), grads(loss, params, 0.9), grads(want, params64, 0.9)):
        assert_close(name, a, b, 1e-4)


def test_vespo_weight_of_an_all_masked_row_is_its_own(loss_path):
    """Issue 40: VESPO's gamma weight of a row whose mask is all 0 (no tokens) with a per-sequence importance weight
    is ``phi(w)`` of that weight, as TRL's ``get_gamma_weights`` gives it (its ``(B, 1)`` ratio enters every row,
    masked or not); the float64 oracle weighed it as ``phi(1) = 1``. Production, the oracle and TRL's formula (from
    the installed trl) agree on ``vespo_phi_mean``, the mean over rows as TRL's ``vespo/phi_seq_mean``."""
    hidden, weight, _, targets, _, g = problem(4, [15], 16, 40, torch.float32, logit_scale=3.0, bias=False)
    B, L = 3, 5
    hidden, targets = hidden.reshape(B, L, 16), targets.reshape(B, L)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([0.7, -1.2, 0.4])
    seq_weights = torch.tensor([0.5, 2.5, 1.5])  # the all-masked row's: phi(2.5) != 1 for both (k, lambda) pairs
    with torch.no_grad():
        logp64, _ = reference.token_logprobs(hidden.double(), weight.double(), targets)  # [B, L]
    old = (logp64 + 0.2 * torch.randn(B, L, generator=g, dtype=torch.float64)).float()
    tensors = dict(mask=mask, old_logprobs=old, importance_weights=seq_weights)
    _, metrics = fused_cppo_loss(hidden, weight, targets, adv, surrogate="vespo", **tensors)
    _, want = reference.fused_cppo_loss(
        hidden.double(), weight.double(), targets, adv.double(), mask=mask, old_logprobs=old.double(),
        importance_weights=seq_weights.double(), weights_per_seq=True, config=LossConfig(surrogate="vespo"),
    )  # fmt: skip
    assert_close("vespo_phi_mean", metrics["vespo_phi_mean"], want["vespo_phi_mean"], 1e-5, 1e-7)
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    phi = trl_grpo.GRPOTrainer.get_gamma_weights(
        advantages=adv.double().unsqueeze(1),
        log_ratio_per_token=logp64 - old.double(),
        mask=mask.double(),
        importance_sampling_ratio=seq_weights.double().unsqueeze(1),
    )  # fmt: skip  (TRL's defaults: k_pos 2, lambda_pos 3, k_neg 3, lambda_neg 2, as LossConfig's)
    assert float(phi[1]) != pytest.approx(1.0, abs=1e-3)  # not vacuous: the masked row's weight is not phi(1)
    assert_close("vespo_phi_mean (TRL)", metrics["vespo_phi_mean"], phi.mean(), 1e-5, 1e-7)
