"""Peer check: fused_cppo_loss against Liger-Kernel's chunked LigerFusedLinearGRPOLoss on CPU.

Every configuration both implement: TRL loss types grpo / dapo / dr_grpo (our ``loss_agg``
seq-mean-token-mean / token-mean / seq-mean-token-sum-norm), token and sequence importance sampling,
beta with the k3 estimator against given reference log-probs, asymmetric epsilons, temperature, bias,
with and without old log-probs. Liger's metrics are ``[kl (only when beta != 0), clip_ratio]``; its
clip_ratio is our ``clip_fraction_low + clip_fraction_high`` (the two events are disjoint).

Intentional differences (not exercised): Liger's dapo divides by ``num_items_in_batch`` / the token count
all-reduced over processes when given / distributed; we divide by this call's token count. We add dual clip
and the k1/k2 estimators, which Liger lacks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cppo_kernels import fused_cppo_loss

liger_grpo = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")

LOSS_AGG = {"grpo": "seq-mean-token-mean", "dapo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
MAX_LEN = 12


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, name
    assert torch.isfinite(got).all(), f"{name}: non-finite"
    err = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-6)
    assert err <= tol * scale + 1e-7, f"{name}: max error {err:.3g} > {tol} x {scale:.3g}"


@settings(suppress_health_check=[*settings().suppress_health_check, HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(0, MAX_LEN), min_size=1, max_size=4),
    loss_type=st.sampled_from(list(LOSS_AGG)),
    importance_sampling=st.sampled_from(["token", "sequence"]),
    beta=st.sampled_from([0.0, 0.04]),
    epsilons=st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)]),
    temperature=st.sampled_from([1.0, 0.7]),
    with_bias=st.booleans(),
    with_old=st.booleans(),
)
def test_matches_liger(
    backend, seed, lengths, loss_type, importance_sampling, beta, epsilons, temperature, with_bias, with_old
):
    g = torch.Generator().manual_seed(seed)
    B, L, H, V = len(lengths), MAX_LEN, 32, 120
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True  # right padding, as TRL's completion mask
    hidden = torch.randn(B, L, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 3 / H**0.5
    bias = torch.randn(V, generator=g) * 0.5 if with_bias else None
    targets = torch.randint(0, V, (B, L), generator=g)
    advantages = torch.randn(B, generator=g)
    with torch.no_grad():
        logp = torch.log_softmax(((hidden @ weight.t()) + (0 if bias is None else bias)) / temperature, -1)
        logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, L]
    old = logp + 0.3 * torch.randn(B, L, generator=g) if with_old else None
    ref = logp + 0.3 * torch.randn(B, L, generator=g) if beta > 0 else None
    eps_low, eps_high = epsilons

    ours = [x.clone().requires_grad_() for x in (hidden, weight) + ((bias,) if with_bias else ())]
    loss, metrics = fused_cppo_loss(
        ours[0],
        ours[1],
        targets,
        advantages,
        mask=mask,
        bias=ours[2] if with_bias else None,
        old_logprobs=old,
        ref_logprobs=ref,
        temperature=temperature,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        beta=beta,
        kl_estimator="k3",
        importance_sampling=importance_sampling,
        loss_agg=LOSS_AGG[loss_type],
        max_completion_length=MAX_LEN,
    )

    theirs = [x.clone().requires_grad_() for x in (hidden, weight) + ((bias,) if with_bias else ())]
    peer = liger_grpo.LigerFusedLinearGRPOLoss(
        beta=beta,
        compiled=False,
        use_ref_model=beta > 0,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        loss_type=loss_type,
        max_completion_length=MAX_LEN,
        importance_sampling_level=importance_sampling,
        temperature=temperature,
    )
    want, want_metrics = peer(
        theirs[0],
        theirs[1],
        targets,
        mask.to(torch.int64),
        advantages,
        bias=theirs[2] if with_bias else None,
        ref_per_token_logps=ref,
        old_per_token_logps=old,
    )

    _close("loss", loss, want)
    if beta > 0:
        kl, clip_ratio = want_metrics
        _close("kl", metrics["kl"], kl, 1e-4)
    else:
        (clip_ratio,) = want_metrics
    _close("clip_ratio", metrics["clip_fraction_low"] + metrics["clip_fraction_high"], clip_ratio, 1e-6)

    upstream = float(torch.randn((), generator=g))
    got = torch.autograd.grad(loss * upstream, ours)
    exp = torch.autograd.grad(want * upstream, theirs)
    for name, a, b in zip(("dhidden", "dweight", "dbias"), got, exp):
        _close(name, a, b, 1e-4)


#: Issue 26's loss types as both implement them: (Liger's loss_type, our options, importance sampling levels Liger
#: accepts). Liger refuses sequence-level ratios for cispo / sapo / vespo; its luspo multiplies the unmasked
#: per-token loss by each row's length (TRL's older formula), equal to TRL 1.16's only with one value per sequence:
#: sequence-level ratios and no KL.
NEW_TYPES = {
    "cispo": (dict(surrogate="cispo", loss_agg="token-mean"), ("token",)),
    "sapo": (dict(surrogate="sapo", loss_agg="seq-mean-token-mean"), ("token",)),
    "vespo": (dict(surrogate="vespo", loss_agg="token-mean"), ("token",)),
    "luspo": (dict(loss_agg="seq-mean-token-sum"), ("sequence",)),
    "grpo": (dict(loss_agg="seq-mean-token-mean"), ("token", "sequence")),
    "dapo": (dict(loss_agg="token-mean"), ("token", "sequence")),
}


@settings(suppress_health_check=[*settings().suppress_health_check, HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(0, MAX_LEN), min_size=1, max_size=4),
    loss_type=st.sampled_from(list(NEW_TYPES)),
    beta=st.sampled_from([0.0, 0.04]),
    bias_corrected=st.booleans(),
    delta=st.sampled_from([None, 1.1]),
    weights=st.sampled_from([None, "token", "sequence"]),
    epsilon_high=st.sampled_from([0.28, 1.3]),
    sapo_temperatures=st.sampled_from([(1.0, 1.05), (0.5, 3.0)]),
    vespo=st.sampled_from([(2.0, 3.0, 3.0, 2.0), (0.0, 0.0, 5.0, 0.5)]),
)
def test_new_loss_types_match_liger(
    backend, seed, lengths, loss_type, beta, bias_corrected, delta, weights, epsilon_high, sapo_temperatures, vespo
):
    """cispo, sapo, vespo, luspo, ``delta``, the bias-corrected KL and importance weights (Liger's ``vllm_is_ratio``,
    per token or per sequence) against Liger-Kernel 0.8.5: loss, cispo's clip fraction, gradients."""
    options, levels = NEW_TYPES[loss_type]
    level = levels[seed % len(levels)]
    if loss_type == "luspo":
        beta, weights = 0.0, None if weights == "token" else weights  # one value per sequence (see NEW_TYPES)
    clip_family = "surrogate" not in options
    g = torch.Generator().manual_seed(seed)
    B, L, H, V = len(lengths), MAX_LEN, 32, 120
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    hidden = torch.randn(B, L, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 3 / H**0.5
    targets = torch.randint(0, V, (B, L), generator=g)
    advantages = torch.randn(B, generator=g)
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, L]
    old = logp + 0.3 * torch.randn(B, L, generator=g)
    ref = logp + 0.3 * torch.randn(B, L, generator=g) if beta > 0 else None
    ratio = None  # Liger's vllm_is_ratio: [B, L] (1 at the padding, as TRL's) or [B, 1]
    if weights == "token":
        ratio = torch.where(mask, torch.rand(B, L, generator=g) * 2, torch.ones(()))
    elif weights == "sequence":
        ratio = torch.rand(B, 1, generator=g) * 2
    kw = dict(
        options, importance_sampling=level, beta=beta, use_bias_correction_kl=bias_corrected, epsilon_high=epsilon_high,
        delta=delta if clip_family else None, sapo_temperature_pos=sapo_temperatures[0],
        sapo_temperature_neg=sapo_temperatures[1], vespo_k_pos=vespo[0], vespo_lambda_pos=vespo[1],
        vespo_k_neg=vespo[2], vespo_lambda_neg=vespo[3],
    )  # fmt: skip
    ours = [x.clone().requires_grad_() for x in (hidden, weight)]
    loss, metrics = fused_cppo_loss(
        ours[0], ours[1], targets, advantages, mask=mask, old_logprobs=old, ref_logprobs=ref,
        importance_weights=None if ratio is None else ratio.squeeze(1) if weights == "sequence" else ratio, **kw,
    )  # fmt: skip
    theirs = [x.clone().requires_grad_() for x in (hidden, weight)]
    peer = liger_grpo.LigerFusedLinearGRPOLoss(
        beta=beta, compiled=False, use_ref_model=beta > 0, epsilon_low=0.2, epsilon_high=epsilon_high,
        loss_type=loss_type, importance_sampling_level=level, delta=kw["delta"],
        use_bias_correction_kl=bias_corrected, sapo_temperature_pos=sapo_temperatures[0],
        sapo_temperature_neg=sapo_temperatures[1], vespo_k_pos=vespo[0], vespo_lambda_pos=vespo[1],
        vespo_k_neg=vespo[2], vespo_lambda_neg=vespo[3],
    )  # fmt: skip
    want, want_metrics = peer(
        theirs[0], theirs[1], targets, mask.to(torch.int64), advantages, ref_per_token_logps=ref,
        old_per_token_logps=old, vllm_is_ratio=ratio,
    )  # fmt: skip
    _close("loss", loss, want)
    clip_ratio = want_metrics[-1]
    if loss_type == "cispo":
        _close("cispo clip fraction", metrics["cispo_clip_fraction"], clip_ratio, 1e-6)
    elif clip_family and level == "token":
        _close("clip_ratio", metrics["clip_fraction_low"] + metrics["clip_fraction_high"], clip_ratio, 1e-6)
    upstream = float(torch.randn((), generator=g))
    for name, a, b in zip(("dhidden", "dweight"), torch.autograd.grad(loss * upstream, ours),
                          torch.autograd.grad(want * upstream, theirs)):  # fmt: skip
        _close(name, a, b, 1e-4)
