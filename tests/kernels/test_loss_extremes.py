"""The fused loss at extreme but finite inputs (issue 40): logit scales of 1e10 and beyond, temperatures near
float32's range, caps of 1e30 and 1e-30, a large entropy bonus; on every CPU path (torch two-pass, torch
gradient-in-forward, Triton two-pass under the interpreter) the loss, its metrics and its gradients are finite and,
where float32 can hold them, the float64 oracle's; a logit factor beyond float32 is refused in one line."""

from __future__ import annotations

import pytest
import torch
from loss_cases import assert_close, cu_seqlens, problem

from cppo_kernels import (
    FusedCPPOLoss,
    LossConfig,
    _loss_torch,
    _loss_triton,
    cppo_loss_from_logits,
    fused_cppo_loss,
    fused_logprobs,
    reference,
)

pytestmark = pytest.mark.usefixtures("small_chunks")

LENGTHS = [5, 6]


def _problem(seed: int = 3):
    hidden, weight, _, targets, _, g = problem(seed, LENGTHS, 16, 40, torch.float32, logit_scale=3.0, bias=False)
    return hidden, weight, targets, torch.tensor([0.8, -1.3]), g


@pytest.mark.parametrize("head", [dict(logit_scale=1e10), dict(logit_scale=1e30), dict(temperature=1e-30),
                                  dict(logit_scale=1e10, logit_softcap=1e30)], ids=str)  # fmt: skip
@pytest.mark.parametrize("on_policy", [True, False])
def test_extreme_logit_scale_gives_the_oracles_finite_gradients(loss_path, head, on_policy):
    """Issue 40: ``logit_scale=1e10`` on the two-pass path gave the oracle's loss but NaN gradients: the backward
    rebuilt the log-sum-exp as ``picked - logp`` (two numbers of 1e10: ~1e3 nats of cancellation error) and
    ``exp(z - lse)`` overflowed. Now the forward keeps ``max + log sum exp(z - max)``, never below the largest
    logit, and the backward's probabilities are at most 1. Off-policy (old log-probs of -3) the clamped ratios give
    the oracle's zero gradient; on-policy, its gradient of about 1e10 (1e30) times the weights."""
    hidden, weight, targets, adv, _ = _problem()
    old = None if on_policy else torch.full((sum(LENGTHS),), -3.0)
    params = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    cfg = dict(temperature=head.get("temperature", 1.0))
    transform = {k: v for k, v in head.items() if k != "temperature"}
    loss, metrics = fused_cppo_loss(*params, targets, adv, cu_seqlens=cu_seqlens(LENGTHS), old_logprobs=old,
                                    **transform, **cfg)  # fmt: skip
    got = torch.autograd.grad(loss, params)
    params64 = [x.double().requires_grad_() for x in (hidden, weight)]
    want, want_metrics = reference.fused_cppo_loss(
        *params64, targets, adv.double(), cu_seqlens=cu_seqlens(LENGTHS), old_logprobs=None if old is None else
        old.double(), config=LossConfig(**cfg), **transform,
    )  # fmt: skip
    expected = torch.autograd.grad(want, params64)
    assert_close("loss", loss, want, 1e-5, 1e-6)
    assert all(torch.isfinite(v).all() for v in metrics.values()), metrics
    for name, a, b in zip(("dhidden", "dweight"), got, expected, strict=True):
        assert_close(name, a, b, 1e-5, 1e-6)  # relative to the largest gradient; 0 where the oracle's is 0
    if on_policy:
        assert float(expected[0].abs().max()) > 1e9  # not vacuous: the gradients are the scale's size


@pytest.mark.parametrize("module", [_loss_torch, _loss_triton], ids=["torch", "triton"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_backward_probabilities_stay_at_most_one(module, softcap):
    """The backward recomputes the logits; where its GEMM rounds a logit above the forward's (one ulp is 1e3 nats
    at a logit scale of 1e10), ``exp(z - lse)`` would overflow to inf and the gradients turn NaN. Each backend's
    ``logprobs_bwd`` keeps every probability at most 1: given a log-sum-exp 200 nats below the true one, its
    gradients stay finite."""
    hidden, weight, targets, _, g = _problem(seed=5)
    head = dict(temperature=0.7, logit_scale=2.0, softcap=softcap)
    _, lse, _ = module.logprobs_fwd(hidden, weight, targets, None, **head)
    grad_logp = torch.randn(hidden.shape[0], generator=g)
    grads = module.logprobs_bwd(hidden, weight, targets, None, lse - 200.0, grad_logp, **head)
    assert all(torch.isfinite(x).all() for x in grads if x is not None)
    if module is _loss_torch:  # the entropy path's backward too
        grads = module.logprobs_bwd(
            hidden,
            weight,
            targets,
            None,
            lse - 200.0,
            grad_logp,
            **head,
            grad_entropy=torch.ones_like(grad_logp),
            entropy=torch.ones_like(grad_logp),
        )
        assert all(torch.isfinite(x).all() for x in grads if x is not None)


def test_large_entropy_bonus_at_extreme_logit_scale_has_finite_gradients(loss_path):
    """The entropy bonus's backward formed ``(log p + H) * g_ent`` before its product with ``p``: at a logit scale
    of 1e10 ``log p`` is -1e10 where ``p`` underflows to 0, and times a large ``g_ent`` (entropy_coef 1e30) it was
    inf, then ``inf * 0 = NaN``. Now ``p (log p + H)`` comes first."""
    hidden, weight, targets, adv, _ = _problem()
    params = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss, _ = fused_cppo_loss(*params, targets, adv, cu_seqlens=cu_seqlens(LENGTHS), logit_scale=1e10,
                              entropy_coef=1e30)  # fmt: skip
    assert torch.isfinite(loss)
    assert all(torch.isfinite(x).all() for x in torch.autograd.grad(loss, params))


OPTIONS = {
    "clip": dict(),
    "dual-clip-delta": dict(dual_clip=3.0, delta=2.0),
    "cispo": dict(surrogate="cispo"),
    "sapo": dict(surrogate="sapo"),
    "vespo": dict(surrogate="vespo"),
    "gspo": dict(importance_sampling="sequence"),
    "k3-bias-corrected": dict(beta=0.04, use_bias_correction_kl=True),
    "entropy": dict(entropy_coef=0.01, top_entropy_quantile=0.5),
    "off-policy-mask": dict(off_policy_mask_threshold=0.1),
}
HEADS = {
    "scale-1e10": dict(logit_scale=1e10),
    "temperature-1e-30": dict(temperature=1e-30),
    "cap-1e30": dict(logit_scale=1e10, logit_softcap=1e30),
    "cap-1e-30": dict(logit_softcap=1e-30),
    "temperature-1e30": dict(temperature=1e30),
}


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("option", OPTIONS)
def test_every_option_at_extreme_heads_is_finite(loss_path, option, head):
    """The neighbours of issue 40's logit scale: each loss option at each extreme head, with old and reference
    log-probs and importance weights: a finite loss, finite metrics and finite gradients on every path."""
    hidden, weight, targets, adv, g = _problem(seed=7)
    T = sum(LENGTHS)
    old, ref = -3.0 + torch.randn(T, generator=g), -3.0 + torch.randn(T, generator=g)
    params = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss, metrics = fused_cppo_loss(*params, targets, adv, cu_seqlens=cu_seqlens(LENGTHS), old_logprobs=old,
                                    ref_logprobs=ref, importance_weights=torch.rand(T, generator=g) * 2,
                                    **OPTIONS[option], **HEADS[head])  # fmt: skip
    assert torch.isfinite(loss)
    assert all(torch.isfinite(v).all() for v in metrics.values()), metrics
    assert all(torch.isfinite(x).all() for x in torch.autograd.grad(loss, params))


BEYOND_FP32 = {
    "temperature-1e-39": (dict(temperature=1e-39), "logit_scale / temperature"),
    "scale-over-temperature": (dict(logit_scale=1e20, temperature=1e-20), "logit_scale / temperature"),
    "cap-1e-39": (dict(logit_softcap=1e-39), "logit_scale / logit_softcap"),
    "cap-over-temperature": (dict(logit_softcap=1e30, temperature=1e-10), "logit_softcap / temperature"),
}


@pytest.mark.parametrize("case", BEYOND_FP32)
@pytest.mark.parametrize("fn", ["fused_cppo_loss", "fused_logprobs", "FusedCPPOLoss"])
def test_a_logit_factor_beyond_float32_is_one_line_error(case, fn):
    """``temperature=1e-39`` passed validation and then failed with a raw ``RuntimeError`` (its ``1 / temperature``
    cannot be a float32); every factor the backends apply is checked first, in one line naming the arguments."""
    hidden, weight, targets, adv, _ = _problem()
    options, factor = BEYOND_FP32[case]
    with pytest.raises(ValueError, match=rf"^{factor} must be at most float32's 3.403e\+38, got ") as err:
        if fn == "fused_cppo_loss":
            fused_cppo_loss(hidden, weight, targets, adv, cu_seqlens=cu_seqlens(LENGTHS), **options)
        elif fn == "fused_logprobs":
            fused_logprobs(hidden, weight, targets, **options)
        else:
            FusedCPPOLoss(**options)
    assert "\n" not in str(err.value) and "temperature=" in str(err.value)


def test_logits_over_a_tiny_temperature_name_the_temperature():
    """``cppo_loss_from_logits`` with ``temperature=1e-39``: its finite logits overflow once divided, which the
    error now says (it said the logits were not finite)."""
    logits = torch.randn(11, 40)
    adv = torch.tensor([0.8, -1.3])
    targets = torch.randint(0, 40, (11,))
    with pytest.raises(ValueError, match=r"^logits / temperature overflows float32 \(temperature=1e-39\)"):
        cppo_loss_from_logits(logits, targets, adv, cu_seqlens=cu_seqlens(LENGTHS), temperature=1e-39)
    logits[0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"^logits must be finite"):
        cppo_loss_from_logits(logits, targets, adv, cu_seqlens=cu_seqlens(LENGTHS), temperature=1e-39)
