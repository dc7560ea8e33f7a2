"""fused_cppo_loss / fused_logprobs / cppo_loss_from_logits against the float64 reference, on both backends and, for
the loss, in both modes of the torch backend (two-pass and gradient-in-forward)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from loss_cases import DTYPES, METRIC_KEYS, TOL, assert_close, cu_seqlens, grads, hypothesis_settings, problem

from cppo_kernels import (
    FusedCPPOLoss,
    LossConfig,
    _loss_torch,
    _policy,
    cppo_loss_from_logits,
    fused_cppo_loss,
    fused_logprobs,
    reference,
)
from cppo_kernels import loss as loss_module
from cppo_kernels.config import LOSS_OPTIONS

pytestmark = pytest.mark.usefixtures("small_chunks")


class LossPath(NamedTuple):
    backend: str
    mode: str


#: Every path of fused_cppo_loss on the CPU: the torch backend in both modes, the Triton kernels (two-pass) and the
#: GEMM path (Triton gradient-in-forward: GEMMs around the Triton row pass, under the interpreter).
PATHS = {
    "torch-two-pass": LossPath("torch", "two-pass"),
    "torch-grad-in-forward": LossPath("torch", "grad-in-forward"),
    "triton-two-pass": LossPath("triton", "two-pass"),
    "triton-grad-in-forward": LossPath("triton", "grad-in-forward"),
}


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch) -> LossPath:
    """Runs a test once per loss path: the backend by CPPO_KERNELS_BACKEND, the mode as the CPU rule of that backend
    (so ``mode="auto"`` calls take it, and GSPO still takes the two-pass path)."""
    chosen = PATHS[request.param]
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", chosen.backend)
    monkeypatch.setitem(loss_module.MODE_RULES, ("cpu", chosen.backend, None), chosen.mode)
    return chosen


@hypothesis_settings()
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4).filter(lambda ls: sum(ls) <= 40),
    H=st.sampled_from([16, 24, 37, 64]),
    V=st.sampled_from([17, 100, 150, 200]),
    dtype=st.sampled_from(DTYPES),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
    epsilon_low=st.sampled_from([0.2, 0.1]),
    epsilon_high=st.sampled_from([None, 0.28]),
    dual_clip=st.sampled_from([None, 3.0]),
    kl=st.sampled_from([None, "k1", "k2", "k3"]),
    importance_sampling=st.sampled_from(["token", "sequence"]),
    loss_agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
    with_old=st.booleans(),
    with_bias=st.booleans(),
    compute_entropy=st.booleans(),
    logit_scale=st.sampled_from([1.0, 4.0, 20.0]),
)
def test_loss_matches_reference(
    path,
    seed,
    lengths,
    H,
    V,
    dtype,
    temperature,
    epsilon_low,
    epsilon_high,
    dual_clip,
    kl,
    importance_sampling,
    loss_agg,
    with_old,
    with_bias,
    compute_entropy,
    logit_scale,
):
    hidden, weight, bias, targets, adv, g = problem(seed, lengths, H, V, dtype, logit_scale=logit_scale, bias=with_bias)
    cu = cu_seqlens(lengths)
    T = hidden.shape[0]
    options = dict(
        temperature=temperature,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        dual_clip=dual_clip,
        beta=0.0 if kl is None else 0.04,
        kl_estimator=kl or "k3",
        importance_sampling=importance_sampling,
        loss_agg=loss_agg,
        max_completion_length=16 if loss_agg == "seq-mean-token-sum-norm" else None,
        compute_entropy=compute_entropy,
    )
    # Old / reference log-probs near the current ones, so ratios straddle both clip bounds.
    params64 = [x.double().requires_grad_() for x in (hidden, weight) + ((bias,) if with_bias else ())]
    with torch.no_grad():
        logp64, _ = reference.token_logprobs(
            params64[0], params64[1], targets, bias=params64[2] if with_bias else None, temperature=temperature
        )
    old = (logp64 + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)).float() if with_old else None
    ref = (logp64 + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)).float() if kl else None

    params = [x.clone().requires_grad_() for x in (hidden, weight) + ((bias,) if with_bias else ())]
    loss, metrics = fused_cppo_loss(
        params[0],
        params[1],
        targets,
        adv,
        cu_seqlens=cu,
        old_logprobs=old,
        ref_logprobs=ref,
        bias=params[2] if with_bias else None,
        **options,
    )
    want, want_metrics = reference.fused_cppo_loss(
        params64[0],
        params64[1],
        targets,
        adv.double(),
        cu_seqlens=cu,
        old_logprobs=None if old is None else old.double(),
        ref_logprobs=None if ref is None else ref.double(),
        bias=params64[2] if with_bias else None,
        config=LossConfig(**options),
    )
    loss_tol, grad_tol = TOL[dtype][0], TOL[dtype][1 if path.backend == "torch" else 2]
    assert loss.dtype == torch.float32 and loss.dim() == 0
    # the loss holds beta * kl, whose fp32 error scales with |logp| (see the kl metric below), not with the loss
    kl_atol = loss_tol * 0.04 * float(logp64.abs().max()) if kl and T else 0.0
    assert_close("loss", loss, want, loss_tol, max(1e-7, kl_atol))
    sequence_keys = {"seq_clip_fraction_low", "seq_clip_fraction_high"} if importance_sampling == "sequence" else set()
    assert set(metrics) == set(METRIC_KEYS) | ({"entropy"} if compute_entropy else set()) | sequence_keys
    for key, value in metrics.items():
        assert value.dtype == torch.float32 and value.dim() == 0 and not value.requires_grad, key
        # kl = f(logp - ref) cancels: its fp32 error scales with |logp|, not with kl itself.
        atol = loss_tol * float(logp64.abs().max()) if key == "kl" and T else 1e-7
        assert_close(key, value, want_metrics[key], 1e-4, atol)

    upstream = float(torch.randn((), generator=g))
    for name, got, exp in zip(
        ("dhidden", "dweight", "dbias"), grads(loss, params, upstream), grads(want, params64, upstream)
    ):
        assert got.dtype == dtype, name
        assert_close(name, got, exp, grad_tol, TOL[dtype][3])


def _padded(hidden: torch.Tensor, targets: torch.Tensor, lengths: list[int], L: int, g: torch.Generator):
    """Scatters packed rows into [B, L, ...] with NaN hidden states and -100 targets at the padding."""
    B, H = len(lengths), hidden.shape[1]
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i, n in enumerate(lengths):
        start = int(torch.randint(0, L - n + 1, (), generator=g))  # left or right padding
        mask[i, start : start + n] = True
    hp = torch.full((B, L, H), float("nan"), dtype=hidden.dtype)
    tp = torch.full((B, L), -100, dtype=torch.int64)
    hp[mask], tp[mask] = hidden, targets
    return hp, tp, mask


@hypothesis_settings(max_examples=10)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES),
    loss_agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
    importance_sampling=st.sampled_from(["token", "sequence"]),
)
def test_packed_and_padded_agree(path, seed, lengths, dtype, loss_agg, importance_sampling):
    H, V, L = 24, 100, 10
    hidden, weight, bias, targets, adv, g = problem(seed, lengths, H, V, dtype, logit_scale=4.0, bias=True)
    T = hidden.shape[0]
    with torch.no_grad():  # old / ref near the current log-probs: ratios stay in range (fp16 dweight finite)
        logp, _ = reference.token_logprobs(hidden.double(), weight.double(), targets, bias=bias.double())
    old = (logp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)).float()
    ref = (logp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)).float()
    options = dict(
        beta=0.04, loss_agg=loss_agg, max_completion_length=12, importance_sampling=importance_sampling,
        compute_entropy=True,
    )  # fmt: skip
    hp, tp, mask = _padded(hidden, targets, lengths, L, g)
    oldp = torch.zeros(mask.shape).masked_scatter(mask, old)
    refp = torch.zeros(mask.shape).masked_scatter(mask, ref)
    w1, b1, h1 = weight.clone().requires_grad_(), bias.clone().requires_grad_(), hidden.clone().requires_grad_()
    w2, b2, h2 = weight.clone().requires_grad_(), bias.clone().requires_grad_(), hp.clone().requires_grad_()
    loss1, m1 = fused_cppo_loss(
        h1, w1, targets, adv, cu_seqlens=cu_seqlens(lengths), bias=b1, old_logprobs=old, ref_logprobs=ref, **options
    )
    loss2, m2 = fused_cppo_loss(
        h2, w2, tp, adv, mask=mask.to(torch.int32), bias=b2, old_logprobs=oldp, ref_logprobs=refp, **options
    )
    assert torch.equal(loss1, loss2)
    for key in m1:
        assert torch.equal(m1[key], m2[key]), key
    upstream = float(torch.randn((), generator=g))
    g1 = grads(loss1, [h1, w1, b1], upstream)
    g2 = grads(loss2, [h2, w2, b2], upstream)
    assert torch.equal(g2[0][mask], g1[0])
    assert torch.equal(g2[0][~mask], torch.zeros_like(g2[0][~mask]))
    for got, want in zip(g2[1:], g1[1:]):
        assert_close("param grad", got, want, 1e-6)


@hypothesis_settings(max_examples=10)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(1, 15), min_size=2, max_size=4),
    dtype=st.sampled_from(DTYPES),
    temperature=st.sampled_from([1.0, 0.6]),
)
def test_logprobs_do_not_depend_on_packing(backend, seed, lengths, dtype, temperature):
    """Each sequence's log-probs and entropies are bit-identical computed alone or packed with others.

    Under the Triton interpreter ``tl.dot`` is numpy's matmul, whose fp32 result for a row depends on the
    row's position in the tile (a BLAS micro-kernel artefact, not the kernel's), so there only the first
    sequence (same rows of the same tiles either way) must be identical. The others get logits that differ
    by about an ulp of the token's largest logit, an absolute error on logp and entropy of up to about
    2 * eps_fp32 * max_v |z_tv| (measured up to 5.7e-6 at these logit scales); the test allows twice that,
    per token. Bit-exactness at any offset is checked on GPU in test_loss_triton.py.
    """
    hidden, weight, bias, targets, _, _ = problem(seed, lengths, 37, 150, dtype, logit_scale=4.0, bias=True)
    cu = cu_seqlens(lengths)
    logp, ent = fused_logprobs(hidden, weight, targets, bias=bias, temperature=temperature, compute_entropy=True)
    z_max = ((hidden.double() @ weight.double().t() + bias.double()) / temperature).abs().amax(-1)  # [T]
    bound = 4 * torch.finfo(torch.float32).eps * z_max  # [T]
    for s in range(len(lengths)):
        a, b = int(cu[s]), int(cu[s + 1])
        alone, alone_ent = fused_logprobs(
            hidden[a:b], weight, targets[a:b], bias=bias, temperature=temperature, compute_entropy=True
        )
        if backend == "torch" or s == 0:
            assert torch.equal(alone, logp[a:b]), f"sequence {s}"
            assert torch.equal(alone_ent, ent[a:b]), f"sequence {s} entropy"
        else:
            assert ((alone - logp[a:b]).abs() <= bound[a:b]).all(), f"sequence {s}"
            assert ((alone_ent - ent[a:b]).abs() <= bound[a:b]).all(), f"sequence {s} entropy"


@hypothesis_settings(max_examples=10)
@given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(1,), (23,), (3, 7), (2, 1)]),
    dtype=st.sampled_from(DTYPES),
    temperature=st.sampled_from([1.0, 0.7]),
    with_bias=st.booleans(),
    logit_scale=st.sampled_from([1.0, 30.0]),
)
def test_fused_logprobs_matches_reference(backend, seed, shape, dtype, temperature, with_bias, logit_scale):
    n = 1
    for d in shape:
        n *= d
    hidden, weight, bias, targets, _, _ = problem(seed, [n], 40, 130, dtype, logit_scale=logit_scale, bias=with_bias)
    hidden, targets = hidden.reshape(*shape, 40), targets.reshape(shape)
    logp, ent = fused_logprobs(hidden, weight, targets, bias=bias, temperature=temperature, compute_entropy=True)
    want, want_ent = reference.token_logprobs(
        hidden.double().reshape(-1, 40),
        weight.double(),
        targets.reshape(-1),
        bias=None if bias is None else bias.double(),
        temperature=temperature,
    )
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == shape
    assert not logp.requires_grad
    assert_close("logp", logp.reshape(-1), want, 2e-6)
    assert_close("entropy", ent.reshape(-1), want_ent, 2e-5)
    only = fused_logprobs(hidden, weight, targets, bias=bias, temperature=temperature)
    assert torch.equal(only, logp)


@hypothesis_settings(max_examples=10)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    padded=st.booleans(),
    temperature=st.sampled_from([1.0, 0.8]),
    loss_agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
    importance_sampling=st.sampled_from(["token", "sequence"]),
)
def test_loss_from_logits_matches_reference(seed, lengths, dtype, padded, temperature, loss_agg, importance_sampling):
    V = 60
    logits, _, _, targets, adv, g = problem(seed, lengths, V, V, dtype, logit_scale=1.0, bias=False)
    logits = (logits.float() * 3).to(dtype)
    T = logits.shape[0]
    old = -torch.rand(T, generator=g) * 4
    ref = -torch.rand(T, generator=g) * 4
    options = dict(
        temperature=temperature, beta=0.1, kl_estimator="k2", loss_agg=loss_agg, max_completion_length=9,
        importance_sampling=importance_sampling, compute_entropy=True,
    )  # fmt: skip
    # The oracle: logits = hidden @ I.
    x64 = logits.double().requires_grad_()
    want, want_m = reference.fused_cppo_loss(
        x64,
        torch.eye(V, dtype=torch.float64),
        targets,
        adv.double(),
        cu_seqlens=cu_seqlens(lengths),
        old_logprobs=old.double(),
        ref_logprobs=ref.double(),
        config=LossConfig(**options),
    )
    if padded:
        lp, tp, mask = _padded(logits, targets, lengths, 10, g)
        lp = lp.nan_to_num(0.0).requires_grad_()
        oldp = torch.zeros(mask.shape).masked_scatter(mask, old)
        refp = torch.zeros(mask.shape).masked_scatter(mask, ref)
        loss, m = cppo_loss_from_logits(lp, tp, adv, mask=mask, old_logprobs=oldp, ref_logprobs=refp, **options)
        x = lp
    else:
        x = logits.clone().requires_grad_()
        loss, m = cppo_loss_from_logits(
            x, targets, adv, cu_seqlens=cu_seqlens(lengths), old_logprobs=old, ref_logprobs=ref, **options
        )
    assert_close("loss", loss, want, 2e-5)
    for key in want_m:
        assert_close(key, m[key], want_m[key], 1e-4)
    upstream = float(torch.randn((), generator=g))
    (got,) = grads(loss, [x], upstream)
    (exp,) = grads(want, [x64], upstream)
    if padded:
        assert torch.equal(got[~mask], torch.zeros_like(got[~mask]))
        got = got[mask]
    assert_close("dlogits", got, exp, TOL[dtype][1])


def test_empty_batch(path):
    """No tokens at all (and empty sequences): loss 0, zero gradients, no NaN."""
    weight = torch.randn(50, 16, requires_grad=True)
    for cu in (torch.tensor([0]), torch.tensor([0, 0, 0])):
        hidden = torch.randn(0, 16, requires_grad=True)
        adv = torch.randn(cu.numel() - 1)
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            loss, metrics = fused_cppo_loss(
                hidden, weight, torch.zeros(0, dtype=torch.long), adv, cu_seqlens=cu, loss_agg=agg,
                max_completion_length=4, compute_entropy=True,
            )  # fmt: skip
            assert loss.item() == 0.0 and metrics["num_tokens"].item() == 0.0
            dh, dw = torch.autograd.grad(loss * 2.0, [hidden, weight])
            assert dh.shape == (0, 16) and torch.equal(dw, torch.zeros_like(dw))


def test_frozen_weight_and_entropy_only(path):
    """Gradients flow to whichever inputs require them (frozen LM head); the entropy metric is detached."""
    hidden, weight, bias, targets, adv, _ = problem(3, [5, 4], 16, 40, torch.float32, logit_scale=2.0, bias=True)
    h = hidden.clone().requires_grad_()
    loss, _ = fused_cppo_loss(h, weight, targets, adv, cu_seqlens=cu_seqlens([5, 4]), bias=bias, beta=0.0)
    (dh,) = torch.autograd.grad(loss * 0.5, [h])
    h64 = hidden.double().requires_grad_()
    want, _ = reference.fused_cppo_loss(h64, weight.double(), targets, adv.double(), cu_seqlens=cu_seqlens([5, 4]),
                                        bias=bias.double())  # fmt: skip
    (exp,) = torch.autograd.grad(want * 0.5, [h64])
    assert_close("dhidden", dh, exp, TOL[torch.float32][1 if path.backend == "torch" else 2])

    w = weight.clone().requires_grad_()
    _, metrics = fused_cppo_loss(hidden, w, targets, adv, cu_seqlens=cu_seqlens([5, 4]), compute_entropy=True)
    assert not metrics["entropy"].requires_grad


def test_default_chunk_is_fixed(monkeypatch):
    """The torch backend's chunk is a constant: results for 300 tokens equal those of each token's own chunk."""
    monkeypatch.undo()
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")
    hidden, weight, _, targets, _, _ = problem(5, [300], 32, 64, torch.float32, logit_scale=3.0, bias=False)
    logp = fused_logprobs(hidden, weight, targets)
    chunk = _loss_torch.FWD_TOKENS
    assert chunk < 300
    tail = fused_logprobs(hidden[chunk:], weight, targets[chunk:])
    assert torch.equal(tail, logp[chunk:])
    one = fused_logprobs(hidden[-1:], weight, targets[-1:])
    assert torch.equal(one, logp[-1:])


# --------------------------------------------------------------------------------------------
# Options as a LossConfig: config= and FusedCPPOLoss
# --------------------------------------------------------------------------------------------

#: Every option away from its default.
OPTIONS = dict(
    temperature=0.8, epsilon_low=0.1, epsilon_high=0.28, dual_clip=3.0, beta=0.04, kl_estimator="k2",
    importance_sampling="sequence", loss_agg="seq-mean-token-sum-norm", max_completion_length=9, compute_entropy=True,
    surrogate="clip", delta=2.5, sapo_temperature_pos=0.9, sapo_temperature_neg=1.2, vespo_k_pos=1.5,
    vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5, use_bias_correction_kl=True,
    off_policy_mask_threshold=0.3, top_entropy_quantile=0.8, entropy_coef=0.01,
)  # fmt: skip
#: The same with a surrogate other than the clip (which takes no dual_clip or delta): with OPTIONS, every field set
#: away from its default.
SURROGATE_OPTIONS = {**OPTIONS, "surrogate": "vespo", "dual_clip": None, "delta": None}


def test_options_cover_every_field():
    """OPTIONS and SURROGATE_OPTIONS set every LossConfig field away from its default, so the config tests below
    pass every option through every public function (a keyword not forwarded into the LossConfig fails them)."""
    assert list(OPTIONS) == list(SURROGATE_OPTIONS) == list(LOSS_OPTIONS)
    defaults = LossConfig()
    assert all(
        OPTIONS[name] != getattr(defaults, name) or SURROGATE_OPTIONS[name] != getattr(defaults, name)
        for name in LOSS_OPTIONS
    )


def _run(loss_fn, inputs: list[torch.Tensor], *args, **kwargs):
    """(loss, metrics, gradients w.r.t. ``inputs`` of 0.7 * loss) of ``loss_fn(*args, **kwargs)``."""
    loss, metrics = loss_fn(*args, **kwargs)
    return loss, metrics, grads(loss, inputs, 0.7)


def _assert_same(got, want) -> None:
    """Bit-identical losses, metrics and gradients."""
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and all(torch.equal(got[1][k], want[1][k]) for k in got[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2], strict=True))


def _loss_inputs(seed: int = 7):
    """Packed inputs of fused_cppo_loss with old and reference log-probs near the current ones."""
    hidden, weight, bias, targets, adv, g = problem(seed, [5, 0, 4], 16, 40, torch.float32, logit_scale=3.0, bias=True)
    with torch.no_grad():
        logp, _ = reference.token_logprobs(hidden.double(), weight.double(), targets, bias=bias.double())
    old, ref = ((logp + 0.3 * torch.randn(9, generator=g, dtype=torch.float64)).float() for _ in range(2))
    params = [hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()]
    tensors = dict(cu_seqlens=cu_seqlens([5, 0, 4]), old_logprobs=old, ref_logprobs=ref, bias=bias)
    return params, (hidden, weight, targets, adv), tensors


@pytest.mark.parametrize("options", [OPTIONS, SURROGATE_OPTIONS], ids=["clip", "vespo"])
def test_config_equals_keywords(path, options):
    OPTIONS = options  # noqa: N806  (the module's name, shadowed: the body reads the same for both sets)
    params, args, tensors = _loss_inputs()
    want = _run(fused_cppo_loss, params, *args, **tensors, **OPTIONS)
    _assert_same(_run(fused_cppo_loss, params, *args, **tensors, config=LossConfig(**OPTIONS)), want)
    # a keyword repeating the config's value is allowed (another value is a ValueError: the next test)
    config = LossConfig(**OPTIONS)
    _assert_same(_run(fused_cppo_loss, params, *args, **tensors, config=config, beta=config.beta), want)

    logits = (args[0].detach() @ args[1].detach().t()).requires_grad_()  # [T, V]
    packed = dict(
        cu_seqlens=tensors["cu_seqlens"], old_logprobs=tensors["old_logprobs"], ref_logprobs=tensors["ref_logprobs"]
    )
    want = _run(cppo_loss_from_logits, [logits], logits, args[2], args[3], **packed, **OPTIONS)
    got = _run(cppo_loss_from_logits, [logits], logits, args[2], args[3], **packed, config=LossConfig(**OPTIONS))
    _assert_same(got, want)


@pytest.mark.parametrize("fn", [fused_cppo_loss, cppo_loss_from_logits])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_config_with_a_conflicting_keyword_raises(fn, option):
    params, (hidden, weight, targets, adv), tensors = _loss_inputs()
    x = (hidden, weight) if fn is fused_cppo_loss else (hidden.detach() @ weight.detach().t(),)
    if fn is cppo_loss_from_logits:
        del tensors["bias"]
    options = OPTIONS if OPTIONS[option] != getattr(LossConfig(), option) else SURROGATE_OPTIONS
    config = LossConfig(**options)
    with pytest.raises(ValueError, match=f"{option}=.*conflicts with config="):  # its default: not config's value
        fn(*x, targets, adv, **tensors, config=config, **{option: getattr(LossConfig(), option)})
    with pytest.raises(ValueError, match="config must be a LossConfig"):
        fn(*x, targets, adv, **tensors, config=dict(OPTIONS))


def test_module_matches_the_function(path):
    params, args, tensors = _loss_inputs()
    want = _run(fused_cppo_loss, params, *args, **tensors, **OPTIONS)
    for module in (FusedCPPOLoss(**OPTIONS), FusedCPPOLoss(LossConfig(**OPTIONS))):
        assert module.config == LossConfig(**OPTIONS) and not list(module.parameters())
        _assert_same(_run(module, params, *args, **tensors), want)
    padded = FusedCPPOLoss(beta=0.0)
    h, w, t, adv = args
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    hp = torch.zeros(3, 5, 16).masked_scatter(mask[..., None].expand(3, 5, 16), h.detach()).requires_grad_()
    tp = torch.zeros(3, 5, dtype=torch.long).masked_scatter(mask, t)
    got = _run(padded, [hp], hp, w, tp, adv, mask=mask, bias=tensors["bias"])
    _assert_same(got, _run(fused_cppo_loss, [hp], hp, w, tp, adv, mask=mask, bias=tensors["bias"]))
    for mode in ("two-pass", "grad-in-forward"):
        module = FusedCPPOLoss(beta=0.0, mode=mode)
        assert module.mode == mode and f"mode='{mode}'" in repr(module)
        got = _run(module, [hp], hp, w, tp, adv, mask=mask, bias=tensors["bias"])
        _assert_same(got, _run(fused_cppo_loss, [hp], hp, w, tp, adv, mask=mask, bias=tensors["bias"], mode=mode))


def test_module_bad_options():
    with pytest.raises(TypeError, match="unexpected keyword argument 'betta'"):
        FusedCPPOLoss(betta=0.1)
    with pytest.raises(ValueError, match="beta=0.1 conflicts with config="):
        FusedCPPOLoss(LossConfig(beta=0.04), beta=0.1)
    with pytest.raises(ValueError, match="kl_estimator"):
        FusedCPPOLoss(kl_estimator="k4")
    with pytest.raises(ValueError, match="mode must be one of"):
        FusedCPPOLoss(mode="fast")


# --------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the argument
# --------------------------------------------------------------------------------------------


def _good():
    g = torch.Generator().manual_seed(0)
    return dict(
        hidden=torch.randn(7, 16, generator=g),
        weight=torch.randn(30, 16, generator=g),
        targets=torch.randint(0, 30, (7,), generator=g),
        advantages=torch.randn(2, generator=g),
        cu_seqlens=torch.tensor([0, 3, 7]),
        old_logprobs=-torch.rand(7, generator=g),
        ref_logprobs=-torch.rand(7, generator=g),
        bias=torch.randn(30, generator=g),
    )


def _nan_at(x: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[1] = value
    return x


BAD = {
    "hidden 1-D": (dict(hidden=torch.randn(7)), "hidden"),
    "hidden int": (dict(hidden=torch.ones(7, 16, dtype=torch.long)), "hidden"),
    "hidden float64": (dict(hidden=torch.randn(7, 16, dtype=torch.float64)), "hidden"),
    "hidden nan": (dict(hidden=_nan_at(torch.randn(7, 16))), "hidden"),
    "hidden inf": (dict(hidden=_nan_at(torch.randn(7, 16), float("inf"))), "hidden"),
    "hidden 3-D with cu_seqlens": (dict(hidden=torch.randn(1, 7, 16)), "hidden"),
    "weight dtype": (dict(weight=torch.randn(30, 16, dtype=torch.bfloat16)), "weight"),
    "weight H": (dict(weight=torch.randn(30, 15)), "weight"),
    "weight 1-D": (dict(weight=torch.randn(30)), "weight"),
    "weight not tensor": (dict(weight=[[1.0]]), "weight"),
    "weight empty vocabulary": (dict(weight=torch.randn(0, 16), bias=torch.randn(0)), "weight"),
    "bias shape": (dict(bias=torch.randn(29)), "bias"),
    "bias dtype": (dict(bias=torch.randn(30, dtype=torch.float16)), "bias"),
    "targets float": (dict(targets=torch.zeros(7)), "targets"),
    "targets shape": (dict(targets=torch.zeros(6, dtype=torch.long)), "targets"),
    "targets too large": (dict(targets=torch.full((7,), 30)), "targets"),
    "targets negative": (dict(targets=torch.full((7,), -1)), "targets"),
    "both layouts": (dict(mask=torch.ones(2, 7, dtype=torch.bool)), "cu_seqlens"),
    "no layout": (dict(cu_seqlens=None), "cu_seqlens"),
    "cu_seqlens 2-D": (dict(cu_seqlens=torch.tensor([[0, 3, 7]])), "cu_seqlens"),
    "cu_seqlens float": (dict(cu_seqlens=torch.tensor([0.0, 3.0, 7.0])), "cu_seqlens"),
    "cu_seqlens start": (dict(cu_seqlens=torch.tensor([1, 3, 7])), "cu_seqlens"),
    "cu_seqlens decreasing": (dict(cu_seqlens=torch.tensor([0, 5, 3, 7]), advantages=torch.randn(3)), "cu_seqlens"),
    "cu_seqlens end": (dict(cu_seqlens=torch.tensor([0, 3, 6])), "cu_seqlens"),
    "advantages length": (dict(advantages=torch.randn(3)), "advantages"),
    "advantages 2-D": (dict(advantages=torch.randn(2, 1)), "advantages"),
    "advantages int": (dict(advantages=torch.ones(2, dtype=torch.long)), "advantages"),
    "advantages nan": (dict(advantages=torch.tensor([0.0, float("nan")])), "advantages"),
    "old_logprobs shape": (dict(old_logprobs=torch.zeros(6)), "old_logprobs"),
    "old_logprobs inf": (dict(old_logprobs=_nan_at(torch.zeros(7), float("-inf"))), "old_logprobs"),
    "ref_logprobs nan": (dict(ref_logprobs=_nan_at(torch.zeros(7))), "ref_logprobs"),
    "ref_logprobs int": (dict(ref_logprobs=torch.zeros(7, dtype=torch.long)), "ref_logprobs"),
    "beta without ref": (dict(ref_logprobs=None, beta=0.1), "ref_logprobs"),
    "kl_estimator": (dict(kl_estimator="k4"), "kl_estimator"),
    "importance_sampling": (dict(importance_sampling="seq"), "importance_sampling"),
    "loss_agg": (dict(loss_agg="mean"), "loss_agg"),
    "dr grpo without length": (dict(loss_agg="seq-mean-token-sum-norm"), "max_completion_length"),
    "max_completion_length": (dict(max_completion_length=0), "max_completion_length"),
    "temperature": (dict(temperature=0.0), "temperature"),
    "temperature nan": (dict(temperature=float("nan")), "temperature"),
    "epsilon_low": (dict(epsilon_low=-0.1), "epsilon_low"),
    "epsilon_low 1": (dict(epsilon_low=1.0), "epsilon_low must be < 1.*1 - epsilon_low must stay > 0"),
    "epsilon_low 3": (dict(epsilon_low=3.0), "epsilon_low must be < 1"),
    "epsilon_high": (dict(epsilon_high=float("nan")), "epsilon_high"),
    "dual_clip": (dict(dual_clip=1.0), "dual_clip"),
    "beta": (dict(beta=-1.0), "beta"),
    "compute_entropy": (dict(compute_entropy="yes"), "compute_entropy"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_packed(case):
    change, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        fused_cppo_loss(**{**_good(), **change})


def _good_padded():
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    return dict(
        hidden=torch.randn(2, 4, 16, generator=g),
        weight=torch.randn(30, 16, generator=g),
        targets=torch.randint(0, 30, (2, 4), generator=g),
        advantages=torch.randn(2, generator=g),
        mask=mask,
        old_logprobs=-torch.rand(2, 4, generator=g),
    )


BAD_PADDED = {
    "hidden 2-D with mask": (dict(hidden=torch.randn(8, 16)), "hidden"),
    "mask shape": (dict(mask=torch.ones(2, 5, dtype=torch.bool)), "mask"),
    "mask float not 0/1": (dict(mask=torch.full((2, 4), 0.5)), r"mask \(torch.float32\) must hold only 0 and 1"),
    "mask float nan": (dict(mask=torch.full((2, 4), float("nan"))), r"mask \(torch.float32\) must hold only 0 and 1"),
    "mask complex": (dict(mask=torch.ones(2, 4, dtype=torch.complex64)), "mask must be bool, integer or floating"),
    "mask values": (dict(mask=torch.full((2, 4), 2)), "mask"),
    "targets shape": (dict(targets=torch.zeros(2, 3, dtype=torch.long)), "targets"),
    "targets out of range where valid": (dict(targets=torch.full((2, 4), 30)), "targets"),
    "advantages length": (dict(advantages=torch.randn(3)), "advantages"),
    "old_logprobs shape": (dict(old_logprobs=torch.zeros(8)), "old_logprobs"),
    "old_logprobs nan where valid": (dict(old_logprobs=_nan_at(torch.zeros(2, 4))), "old_logprobs"),
    "hidden nan where valid": (dict(hidden=_nan_at(torch.randn(2, 4, 16))), "hidden"),
}


@pytest.mark.parametrize("case", list(BAD_PADDED))
def test_bad_input_padded(case):
    change, match = BAD_PADDED[case]
    with pytest.raises(ValueError, match=match):
        fused_cppo_loss(**{**_good_padded(), **change})


def test_padding_content_is_ignored():
    """Garbage (NaN hidden, -100 targets, NaN log-probs) at padded positions is not an error."""
    kwargs = _good_padded()
    pad = ~kwargs["mask"]
    kwargs["hidden"][pad] = float("nan")
    kwargs["targets"][pad] = -100
    kwargs["old_logprobs"][pad] = float("nan")
    loss, _ = fused_cppo_loss(**kwargs)
    assert torch.isfinite(loss)


def test_bad_input_other_functions():
    kw = _good()
    with pytest.raises(ValueError, match="targets"):
        fused_logprobs(kw["hidden"], kw["weight"], kw["targets"] + 30)
    with pytest.raises(ValueError, match="hidden"):
        fused_logprobs(kw["hidden"][0], kw["weight"], kw["targets"][0])
    with pytest.raises(ValueError, match="weight"):
        fused_logprobs(kw["hidden"], kw["weight"][:, :8], kw["targets"])
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs(kw["hidden"], kw["weight"], kw["targets"], temperature=-1.0)
    logits = torch.randn(7, 30)
    with pytest.raises(ValueError, match="logits"):
        cppo_loss_from_logits(_nan_at(logits), kw["targets"], kw["advantages"], cu_seqlens=kw["cu_seqlens"])
    with pytest.raises(ValueError, match="targets"):
        cppo_loss_from_logits(logits, kw["targets"] - 1 - kw["targets"], kw["advantages"], cu_seqlens=kw["cu_seqlens"])
    with pytest.raises(ValueError, match="cu_seqlens"):
        cppo_loss_from_logits(logits, kw["targets"], kw["advantages"])
    with pytest.raises(ValueError, match="ref_logprobs"):
        cppo_loss_from_logits(logits, kw["targets"], kw["advantages"], cu_seqlens=kw["cu_seqlens"], beta=0.1)


# --------------------------------------------------------------------------------------------
# Robustness (issue 11): finite for every finite input, constants get no gradient, non-finite logits named
# --------------------------------------------------------------------------------------------


def _offset_inputs(offsets: list[float], adv: list[float], *, seed: int = 0):
    """Packed problem, one sequence per advantage (``len(offsets)`` tokens each), with
    ``logp - old_logprobs = offsets`` per token (up to fp32 rounding of ``old``)."""
    n, S = len(offsets), len(adv)
    hidden, weight, bias, targets, _, _ = problem(seed, [n] * S, 16, 40, torch.float32, logit_scale=3.0, bias=True)
    with torch.no_grad():
        logp, _ = reference.token_logprobs(hidden.double(), weight.double(), targets, bias=bias.double())
    old = (logp - torch.tensor(offsets, dtype=torch.float64).repeat(S)).float()  # [T]
    return hidden, weight, bias, targets, torch.tensor(adv), cu_seqlens([n] * S), old, logp


def _loss_and_grads(hidden, weight, bias, targets, adv, cu, **kwargs):
    params = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    loss, metrics = fused_cppo_loss(params[0], params[1], targets, adv, cu_seqlens=cu, bias=params[2], **kwargs)
    return loss, metrics, torch.autograd.grad(loss * 0.5, params)


def _want(hidden, weight, bias, targets, adv, cu, config: LossConfig, old=None, ref=None):
    params = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    want, _ = reference.fused_cppo_loss(
        params[0], params[1], targets, adv.double(), cu_seqlens=cu, bias=params[2], config=config,
        old_logprobs=None if old is None else old.double(), ref_logprobs=None if ref is None else ref.double(),
    )  # fmt: skip
    return want, torch.autograd.grad(want * 0.5, params)


#: Log-ratios from far below to far above the clamp (not at +-20 itself, where the fp32 rounding of ``old`` decides
#: on which side of the clamp's gradient a token falls; the analytic-gradient tests cover the bounds).
OFFSETS = [-1000.0, -100.0, -88.8, -20.5, -19.5, -0.3, 0.0, 0.05, 19.5, 20.5, 88.8, 100.0, 1000.0]


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_huge_log_ratios_give_finite_loss_and_gradients(path, dual_clip):
    """Regression: exp(logp - old) overflowed past a log-ratio of 88.7, so the loss or the gradient went NaN (a
    clipped token's 0 * inf; every token of an A = 0 group). The log-ratio is clamped to [-20, 20] as verl does."""
    hidden, weight, bias, targets, adv, cu, old, _ = _offset_inputs(OFFSETS, [1.5, -2.0, 0.0, 1e6])
    config = LossConfig(dual_clip=dual_clip, epsilon_high=0.28)
    loss, metrics, grads = _loss_and_grads(hidden, weight, bias, targets, adv, cu, old_logprobs=old, config=config)
    want, want_grads = _want(hidden, weight, bias, targets, adv, cu, config, old=old)
    assert torch.isfinite(loss) and all(torch.isfinite(m) for m in metrics.values())
    assert_close("loss", loss, want, 1e-5)
    for name, got, exp in zip(("dhidden", "dweight", "dbias"), grads, want_grads):
        assert_close(name, got, exp, 1e-4)
    assert metrics["ratio_max"] == torch.exp(torch.tensor(20.0)) and metrics["ratio_min"] == torch.exp(
        torch.tensor(-20.0)
    )


@pytest.mark.parametrize("offset", [1.0, 25.0, 100.0, 1000.0])
def test_clipped_tokens_give_exactly_zero_gradient(path, offset):
    """Every token clipped (A > 0 with a ratio above 1 + eps, A < 0 below 1 - eps): the gradient is exactly 0."""
    for sign in (1.0, -1.0):
        hidden, weight, bias, targets, adv, cu, old, _ = _offset_inputs([sign * offset] * 5, [sign * 2.0, sign * 0.5])
        loss, _, grads = _loss_and_grads(hidden, weight, bias, targets, adv, cu, old_logprobs=old)
        assert torch.isfinite(loss)
        for g in grads:
            assert torch.equal(g, torch.zeros_like(g)), (sign, offset)


def test_zero_advantage_group_is_not_nan(path):
    """A = 0 (a constant-reward group): loss 0 and zero gradients, whatever the log-ratio (used to be 0 * inf)."""
    hidden, weight, bias, targets, adv, cu, old, _ = _offset_inputs(OFFSETS, [0.0, 0.0])
    loss, metrics, grads = _loss_and_grads(hidden, weight, bias, targets, adv, cu, old_logprobs=old)
    assert loss.item() == 0.0 and all(torch.isfinite(m) for m in metrics.values())
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_far_from_the_reference_is_finite(path, estimator):
    """Regression: k3 with ref - logp = 100 was exp(100) = inf. Its exponent is clamped to [-20, 20] (verl): the
    penalty is e^20 - 21 there and its gradient 0; k1 and k2 need no clamp."""
    gaps = [-100.0, -30.0, -20.5, -5.0, 0.0, 5.0, 19.5, 30.0, 100.0]
    hidden, weight, bias, targets, adv, cu, _, logp = _offset_inputs(gaps, [1.0, -1.0])
    ref = (logp + torch.tensor(gaps, dtype=torch.float64).repeat(2)).float()  # ref - logp = gaps
    config = LossConfig(beta=0.04, kl_estimator=estimator)
    loss, metrics, grads = _loss_and_grads(hidden, weight, bias, targets, adv, cu, ref_logprobs=ref, config=config)
    want, want_grads = _want(hidden, weight, bias, targets, adv, cu, config, ref=ref)
    assert torch.isfinite(loss) and torch.isfinite(metrics["kl"])
    assert_close("loss", loss, want, 1e-5)
    for name, got, exp in zip(("dhidden", "dweight", "dbias"), grads, want_grads):
        assert_close(name, got, exp, 1e-4)
    if estimator == "k3":
        worst = torch.exp(torch.tensor(20.0)) - 21  # the clamped exponent's penalty
        assert metrics["kl"] <= worst


def test_in_range_log_ratios_are_bit_identical_to_the_unclamped_formula():
    """The clamps change nothing within [-20, 20]: ratio and k3 equal the plain formulas bit for bit."""
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(1000, generator=g) * 10  # [T]
    old, ref = logp + (torch.rand(2, 1000, generator=g) - 0.5) * 39.9  # |d| < 20
    adv = torch.randn(1000, generator=g)
    per_token, ratio, kl = _policy.token_terms(logp, adv, old, ref, LossConfig(beta=0.04))
    plain_ratio = torch.exp(logp - old)
    plain_kl = torch.exp(ref - logp) - (ref - logp) - 1.0
    plain = -torch.minimum(plain_ratio * adv, plain_ratio.clamp(0.8, 1.2) * adv) + 0.04 * plain_kl
    assert torch.equal(ratio, plain_ratio) and torch.equal(kl, plain_kl) and torch.equal(per_token, plain)


@pytest.mark.parametrize("padded", [False, True])
def test_advantages_old_and_ref_get_no_gradient(path, padded):
    """They are constants of the loss (detached): no gradient flows into them even when they require one."""
    params, (hidden, weight, targets, adv), tensors = _loss_inputs()
    adv = adv.clone().requires_grad_()
    old, ref = (tensors.pop(k).clone().requires_grad_() for k in ("old_logprobs", "ref_logprobs"))
    kwargs = dict(old_logprobs=old, ref_logprobs=ref, beta=0.04)
    if padded:  # one sequence per row, the same tokens
        mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
        pad = (
            lambda x: torch.zeros(mask.shape + x.shape[1:]).masked_scatter(  # noqa: E731
                mask.reshape(mask.shape + (1,) * (x.dim() - 1)).expand(mask.shape + x.shape[1:]), x
            )
        )
        old_p, ref_p = pad(old), pad(ref)
        kwargs.update(old_logprobs=old_p, ref_logprobs=ref_p, mask=mask)
        hidden, targets, old, ref = pad(hidden), pad(targets.float()).long(), old_p, ref_p
    else:
        kwargs["cu_seqlens"] = tensors["cu_seqlens"]
    h = hidden.detach().requires_grad_()
    loss, _ = fused_cppo_loss(h, weight, targets, adv, bias=tensors["bias"], **kwargs)
    grads = torch.autograd.grad(loss, [h, adv, old, ref], allow_unused=True)
    assert grads[0] is not None and all(g is None for g in grads[1:])
    logits = (hidden.detach() @ weight.detach().t()).requires_grad_()
    loss, _ = cppo_loss_from_logits(logits, targets, adv, **kwargs)
    grads = torch.autograd.grad(loss, [logits, adv, old, ref], allow_unused=True)
    assert grads[0] is not None and all(g is None for g in grads[1:])


NON_FINITE_HEAD = {
    "weight nan": (lambda h, w, b: (h, _nan_at(w), b), "weight must be finite"),
    "weight inf": (lambda h, w, b: (h, _nan_at(w, float("-inf")), b), "weight must be finite"),
    "bias inf": (lambda h, w, b: (h, w, _nan_at(b, float("inf"))), "bias must be finite"),
    "bias -inf at every target": (lambda h, w, b: (h, w, torch.full_like(b, float("-inf"))), "bias must be finite"),
    "hidden inf": (lambda h, w, b: (_nan_at(h, float("inf")), w, b), "hidden must be finite"),
    "logits overflow": (lambda h, w, b: (h * 1e20, w * 1e20, b), "overflows float32"),
}


@pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("case", list(NON_FINITE_HEAD))
def test_non_finite_logits_raise_naming_the_input(path, case):
    """Regression: NaN/inf in weight or bias went unchecked. The per-token log-sum-exp is checked (no [V, H] scan);
    the message names hidden, weight or bias, or says their logits overflow."""
    change, match = NON_FINITE_HEAD[case]
    kw = _good()
    hidden, weight, bias = change(kw["hidden"], kw["weight"], kw["bias"])
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with pytest.raises(ValueError, match=match):
        fused_cppo_loss(**{**kw, "hidden": h, "weight": w, "bias": bias})
    with pytest.raises(ValueError, match=match):
        fused_logprobs(hidden, weight, kw["targets"], bias=bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_float_mask_of_zeros_and_ones_is_accepted(path, dtype):
    """TRL passes a 0/1 float completion mask: the same results as the bool mask."""
    kw = _good_padded()
    kw["hidden"].requires_grad_()
    bool_mask = kw.pop("mask")
    want = _run(fused_cppo_loss, [kw["hidden"]], **kw, mask=bool_mask)
    _assert_same(_run(fused_cppo_loss, [kw["hidden"]], **kw, mask=bool_mask.to(dtype)), want)


# --------------------------------------------------------------------------------------------
# Issue 21, finding 13: finite or a clear error
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_target_at_a_minus_inf_logit_is_a_clear_error_not_nan(layout):
    """A target whose logit is -inf has probability 0: its log-prob is -inf, and the loss was NaN."""
    logits = torch.zeros(4, 5)
    logits[1, 2] = float("-inf")
    targets = torch.tensor([0, 2, 1, 1])
    if layout == "packed":
        call = dict(cu_seqlens=torch.tensor([0, 4]))
        args = (logits, targets, torch.tensor([1.0]))
    else:
        call = dict(mask=torch.ones(2, 2))
        args = (logits.reshape(2, 2, 5), targets.reshape(2, 2), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match=r"logits: the target token of counted position 1 has logit -inf"):
        cppo_loss_from_logits(*args, **call)
    logits[1, 2], logits[1, 3] = 0.0, float("-inf")  # a -inf logit elsewhere is fine: the target is possible
    loss, metrics = cppo_loss_from_logits(logits, targets, torch.tensor([1.0]), cu_seqlens=torch.tensor([0, 4]))
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_fp16_hidden_at_its_range_gives_fp32_finite_metrics(backend_name, monkeypatch):
    """fp16 hidden states near fp16's maximum (6e4) with a large head: logits far past fp16's range. The loss and
    every metric come back fp32 and finite."""
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", backend_name)
    g = torch.Generator().manual_seed(0)
    hidden = torch.full((6, 16), 6e4).half().requires_grad_()
    weight = (torch.randn(50, 16, generator=g) * 0.5).half()
    targets = torch.randint(0, 50, (6,), generator=g)
    old = torch.zeros(6, dtype=torch.float16)
    loss, metrics = fused_cppo_loss(
        hidden, weight, targets, torch.tensor([1.0, -1.0]), cu_seqlens=torch.tensor([0, 3, 6]),
        old_logprobs=old, ref_logprobs=old, beta=0.04, compute_entropy=True,
    )  # fmt: skip
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    for name, value in metrics.items():
        assert value.dtype == torch.float32 and torch.isfinite(value), (name, value)
