"""The model's own logit transform in the fused ops (issue 26): ``logit_scale`` and the final tanh cap
``logit_softcap``, ``z = cap * tanh((h W^T + b) * scale / cap) / temperature``, against the float64 oracle on every
path (torch two-pass, torch gradient-in-forward, Triton two-pass under the interpreter), gradients through the cap
included, and the one-line errors of bad values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from loss_cases import DTYPES, TOL, assert_close, cu_seqlens, grads, hypothesis_settings, logit_error, problem

from cppo_kernels import (
    FusedCPPOLoss,
    LossConfig,
    _loss_torch,
    _loss_triton,
    fused_cppo_loss,
    fused_logprobs,
    reference,
)

pytestmark = pytest.mark.usefixtures("small_chunks")


def _head(dtype, *, seed: int, lengths: list[int], H: int, V: int, bias: bool, weight_scale: float = 3.0):
    hidden, weight, b, targets, adv, g = problem(seed, lengths, H, V, dtype, logit_scale=weight_scale, bias=bias)
    return hidden, weight, b, targets, adv, g


@hypothesis_settings(max_examples=25)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(0, 10), min_size=1, max_size=3).filter(lambda ls: sum(ls) <= 30),
    H=st.sampled_from([16, 37]),
    V=st.sampled_from([17, 150]),
    dtype=st.sampled_from(DTYPES),
    temperature=st.sampled_from([1.0, 0.7]),
    logit_scale=st.sampled_from([1.0, 0.25, 8.0]),
    logit_softcap=st.sampled_from([None, 30.0, 5.0, 0.5]),
    with_bias=st.booleans(),
    with_old=st.booleans(),
    beta=st.sampled_from([0.0, 0.04]),
    loss_agg=st.sampled_from(["token-mean", "seq-mean-token-mean"]),
)
def test_loss_with_logit_transform_matches_reference(
    loss_path, seed, lengths, H, V, dtype, temperature, logit_scale, logit_softcap, with_bias, with_old, beta, loss_agg
):
    """Loss, metrics and the gradients of hidden, weight and bias (through the scale and the cap) equal the float64
    oracle's, on each path; the cap at 0.5 saturates most logits (slopes near 0), at 30 it barely bends them."""
    hidden, weight, bias, targets, adv, g = _head(dtype, seed=seed, lengths=lengths, H=H, V=V, bias=with_bias)
    cu, T = cu_seqlens(lengths), hidden.shape[0]
    head = dict(logit_scale=logit_scale, logit_softcap=logit_softcap)
    options = dict(temperature=temperature, beta=beta, loss_agg=loss_agg, compute_entropy=True)
    params64 = [x.double().requires_grad_() for x in (hidden, weight) + ((bias,) if with_bias else ())]
    b64 = params64[2] if with_bias else None
    with torch.no_grad():
        logp64, _ = reference.token_logprobs(
            params64[0], params64[1], targets, bias=b64, temperature=temperature, **head
        )
    old = (logp64 + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)).float() if with_old else None
    ref = (logp64 + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)).float() if beta else None

    params = [x.clone().requires_grad_() for x in (hidden, weight) + ((bias,) if with_bias else ())]
    loss, metrics = fused_cppo_loss(
        params[0], params[1], targets, adv, cu_seqlens=cu, old_logprobs=old, ref_logprobs=ref,
        bias=params[2] if with_bias else None, **head, **options,
    )  # fmt: skip
    want, want_metrics = reference.fused_cppo_loss(
        params64[0], params64[1], targets, adv.double(), cu_seqlens=cu,
        old_logprobs=None if old is None else old.double(), ref_logprobs=None if ref is None else ref.double(),
        bias=b64, config=LossConfig(**options), **head,
    )  # fmt: skip
    loss_tol, grad_tol = TOL[dtype][0], TOL[dtype][1 if loss_path[0] == "torch" else 2]
    assert_close("loss", loss, want, loss_tol)
    for key in ("kl", "entropy", "ratio_mean", "clip_fraction_low", "clip_fraction_high"):
        atol = loss_tol * float(logp64.abs().max()) if key == "kl" and T else 1e-6
        assert_close(key, metrics[key], want_metrics[key], 1e-4, atol)
    upstream = float(torch.randn((), generator=g))
    names = ("dhidden", "dweight", "dbias")
    for name, got, exp in zip(names, grads(loss, params, upstream), grads(want, params64, upstream)):
        assert got.dtype == dtype, name
        assert_close(name, got, exp, grad_tol, TOL[dtype][3])


@hypothesis_settings(max_examples=15)
@given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(1,), (23,), (3, 7)]),
    dtype=st.sampled_from(DTYPES),
    temperature=st.sampled_from([1.0, 0.7]),
    logit_scale=st.sampled_from([1.0, 0.125, 5.0]),
    logit_softcap=st.sampled_from([None, 30.0, 2.0]),
    with_bias=st.booleans(),
)
def test_fused_logprobs_with_logit_transform_matches_reference(
    backend, seed, shape, dtype, temperature, logit_scale, logit_softcap, with_bias
):
    n = 1
    for d in shape:
        n *= d
    hidden, weight, bias, targets, _, _ = _head(dtype, seed=seed, lengths=[n], H=40, V=130, bias=with_bias)
    hidden, targets = hidden.reshape(*shape, 40), targets.reshape(shape)
    head = dict(logit_scale=logit_scale, logit_softcap=logit_softcap)
    logp, ent = fused_logprobs(
        hidden, weight, targets, bias=bias, temperature=temperature, compute_entropy=True, **head
    )
    want, want_ent = reference.token_logprobs(
        hidden.double().reshape(-1, 40), weight.double(), targets.reshape(-1),
        bias=None if bias is None else bias.double(), temperature=temperature, **head,
    )  # fmt: skip
    assert logp.shape == ent.shape == shape
    assert_close("logp", logp.reshape(-1), want, 2e-6, 2e-6)
    assert_close("entropy", ent.reshape(-1), want_ent, 2e-5, 2e-6)


@pytest.mark.parametrize("module", [_loss_torch, _loss_triton], ids=["torch", "triton"])
@pytest.mark.parametrize("softcap", [None, 3.0, 0.3])
def test_backward_through_the_cap_matches_the_oracle(module, softcap):
    """Each backend's ``logprobs_bwd`` (and the torch ``logprobs_fwd_grads``) against float64 autograd through
    ``cap * tanh(y * scale / cap) / temperature``: the gradient of ``sum_t g_t logp_t`` w.r.t. hidden, weight, bias.
    fp32 inputs; the cap at 0.3 saturates nearly every logit."""
    hidden, weight, bias, targets, _, g = _head(torch.float32, seed=3, lengths=[29], H=24, V=90, bias=True)
    grad_logp = torch.randn(29, generator=g)
    head = dict(temperature=0.8, logit_scale=2.5, softcap=softcap)
    logp, lse, _ = module.logprobs_fwd(hidden, weight, targets, bias, **head)
    got = module.logprobs_bwd(hidden, weight, targets, bias, lse, grad_logp, needs_bias_grad=True, **head)
    params64 = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    want_logp, _ = reference.token_logprobs(
        *params64[:2], targets, bias=params64[2], temperature=0.8, logit_scale=2.5, logit_softcap=softcap
    )
    want = torch.autograd.grad((want_logp * grad_logp.double()).sum(), params64)
    assert_close("logp", logp, want_logp, 1e-5, 1e-5)
    for name, a, b in zip(("dhidden", "dweight", "dbias"), got, want, strict=True):
        assert_close(name, a, b, 1e-4, 1e-6)
    if module is _loss_torch:
        upstream = lambda start, stop, lp: grad_logp[start:stop]  # noqa: E731
        fused = module.logprobs_fwd_grads(hidden, weight, targets, bias, upstream, needs_bias_grad=True, **head)
        assert torch.equal(fused[0], logp)
        for name, a, b in zip(("dhidden", "dweight", "dbias"), fused[3:], want, strict=True):
            assert_close(name, a, b, 1e-4, 1e-6)


def test_identity_transform_is_the_plain_head(loss_path):
    """``logit_scale=1`` without a cap is exactly the head without a transform (the same bits), and a scale folds
    into the temperature: scale 2 at temperature 1 is temperature 0.5 (within rounding)."""
    hidden, weight, bias, targets, adv, _ = _head(torch.float32, seed=5, lengths=[6, 3], H=16, V=40, bias=True)
    args = (hidden, weight, targets, adv)
    plain, _ = fused_cppo_loss(*args, cu_seqlens=cu_seqlens([6, 3]), bias=bias, temperature=0.9)
    same, _ = fused_cppo_loss(*args, cu_seqlens=cu_seqlens([6, 3]), bias=bias, temperature=0.9, logit_scale=1.0)
    assert torch.equal(plain, same)
    a = fused_logprobs(hidden, weight, targets, bias=bias, logit_scale=2.0)
    b = fused_logprobs(hidden, weight, targets, bias=bias, temperature=0.5)
    assert_close("logp", a, b, 1e-6, 1e-6)


def test_the_module_holds_the_transform(loss_path):
    hidden, weight, bias, targets, adv, _ = _head(torch.float32, seed=6, lengths=[5, 4], H=16, V=40, bias=False)
    cu = cu_seqlens([5, 4])
    old = torch.zeros(9) - 3.0  # a ratio that depends on the log-probs
    module = FusedCPPOLoss(compute_entropy=True, logit_scale=0.5, logit_softcap=4.0)
    assert "logit_softcap=4.0" in repr(module)
    got = module(hidden, weight, targets, adv, cu_seqlens=cu, old_logprobs=old)
    want = fused_cppo_loss(
        hidden, weight, targets, adv, cu_seqlens=cu, old_logprobs=old, compute_entropy=True, logit_scale=0.5,
        logit_softcap=4.0,
    )  # fmt: skip
    assert torch.equal(got[0], want[0]) and torch.equal(got[1]["entropy"], want[1]["entropy"])
    uncapped = fused_cppo_loss(
        hidden, weight, targets, adv, cu_seqlens=cu, old_logprobs=old, compute_entropy=True, logit_scale=0.5
    )
    assert not torch.equal(got[1]["entropy"], uncapped[1]["entropy"])


BAD = {
    "scale-zero": (dict(logit_scale=0.0), "logit_scale must be > 0.0, got 0.0"),
    "scale-negative": (dict(logit_scale=-2.0), "logit_scale must be > 0.0, got -2.0"),
    "scale-nan": (dict(logit_scale=float("nan")), "logit_scale must be finite, got nan"),
    "scale-inf": (dict(logit_scale=float("inf")), "logit_scale must be finite, got inf"),
    "scale-str": (dict(logit_scale="2"), "logit_scale must be a float, got str"),
    "scale-bool": (dict(logit_scale=True), "logit_scale must be a float, got bool"),
    "cap-zero": (dict(logit_softcap=0.0), "logit_softcap must be > 0.0, got 0.0"),
    "cap-negative": (dict(logit_softcap=-30.0), "logit_softcap must be > 0.0, got -30.0"),
    "cap-inf": (dict(logit_softcap=float("inf")), "logit_softcap must be finite, got inf"),
    "cap-tensor": (dict(logit_softcap=torch.tensor(3.0)), "logit_softcap must be a float, got Tensor"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("fn", ["fused_cppo_loss", "fused_logprobs", "FusedCPPOLoss"])
def test_bad_transform_is_one_line_error(case, fn):
    hidden, weight, _, targets, adv, _ = _head(torch.float32, seed=1, lengths=[3], H=16, V=20, bias=False)
    kwargs, message = BAD[case]
    with pytest.raises(ValueError) as err:
        if fn == "fused_cppo_loss":
            fused_cppo_loss(hidden, weight, targets, adv, cu_seqlens=cu_seqlens([3]), **kwargs)
        elif fn == "fused_logprobs":
            fused_logprobs(hidden, weight, targets, **kwargs)
        else:
            FusedCPPOLoss(**kwargs)
    assert str(err.value) == message


# --------------------------------------------------------------------------------------------
# On a GPU (marker cuda: benchmarks/gpu_check.py runs them with pytest -m cuda)
# --------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("logit_softcap", [None, 30.0, 2.0])
def test_cuda_loss_with_logit_transform_matches_reference(backend, dtype, logit_softcap):
    """The real GPU kernels (tensor-core dots, the tanh of the cap on the device) against the float64 oracle, loss
    and gradients, H and V off multiples of 16."""
    from cppo_kernels import use_backend

    lengths = [70, 0, 33]
    hidden, weight, bias, targets, adv, g = _head(dtype, seed=11, lengths=lengths, H=200, V=3001, bias=True)
    head = dict(logit_scale=0.5, logit_softcap=logit_softcap)
    cu = cu_seqlens(lengths)
    params64 = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    with torch.no_grad():
        logp64, _ = reference.token_logprobs(*params64[:2], targets, bias=params64[2], temperature=0.7, **head)
    old = (logp64 + 0.3 * torch.randn(len(targets), generator=g, dtype=torch.float64)).float()
    params = [x.cuda().requires_grad_() for x in (hidden, weight, bias)]
    with use_backend(backend):
        loss, _ = fused_cppo_loss(
            params[0], params[1], targets.cuda(), adv.cuda(), cu_seqlens=cu.cuda(), old_logprobs=old.cuda(),
            bias=params[2], temperature=0.7, **head,
        )  # fmt: skip
        got = grads(loss, params, 0.9)
    want, _ = reference.fused_cppo_loss(
        *params64[:2], targets, adv.double(), cu_seqlens=cu, old_logprobs=old.double(), bias=params64[2],
        config=LossConfig(temperature=0.7), **head,
    )  # fmt: skip
    with torch.no_grad():  # a log-prob errs by at most twice the logit bound; the loss by that times ratio |A|
        z = (params64[0] @ params64[1].t() + params64[2]) * 0.5
        z = z if logit_softcap is None else torch.tanh(z / logit_softcap) * logit_softcap
    atol = 6 * logit_error(float(z.abs().max()) / 0.7, 200) * float(adv.abs().max()) + 1e-7  # ratios up to ~3
    loss_tol, grad_tol = TOL[dtype][0], TOL[dtype][1 if backend == "torch" else 2]
    assert_close("loss", loss, want, loss_tol, atol)
    for name, a, b in zip(("dhidden", "dweight", "dbias"), got, grads(want, params64, 0.9), strict=True):
        assert a.device.type == "cuda" and a.dtype == dtype, name
        assert_close(name, a, b, grad_tol, TOL[dtype][3])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_new_scale_or_cap_value_compiles_nothing():
    """The scale and the cap are runtime values: after one capped and one uncapped call, new values compile no new
    Triton binary (whether there is a cap at all is the one compile-time flag)."""
    from cppo_kernels import use_backend

    kernels = [_loss_triton._logprobs_fwd_kernel, _loss_triton._logprobs_bwd_dz_kernel]

    def binaries() -> list[int]:
        return [len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels]

    hidden, weight, _, targets, adv, _ = _head(torch.bfloat16, seed=2, lengths=[40, 9], H=128, V=1000, bias=False)
    cu = cu_seqlens([40, 9]).cuda()

    def step(**head) -> None:
        params = [hidden.cuda().requires_grad_(), weight.cuda().requires_grad_()]
        loss, _ = fused_cppo_loss(*params, targets.cuda(), adv.cuda(), cu_seqlens=cu, mode="two-pass", **head)
        loss.backward()

    with use_backend("triton"):
        step(logit_scale=1.0)
        step(logit_scale=2.0, logit_softcap=30.0)
        first = binaries()
        step(logit_scale=0.25, logit_softcap=5.0)
        step(logit_scale=3.0)
        assert binaries() == first


def test_the_transform_travels_through_the_custom_ops():
    """Under ``torch.compile(fullgraph=True)`` the loss and the log-probs are single custom-op nodes
    (:mod:`cppo_kernels._ops`) carrying the scale and the cap: the eager results and gradients; ``opcheck`` passes
    for the loss op with a capped head."""
    from cppo_kernels._ops import _metric_key, encode

    hidden, weight, bias, targets, adv, _ = _head(torch.float32, seed=4, lengths=[5, 4], H=16, V=40, bias=True)
    cu, old = cu_seqlens([5, 4]), torch.full((9,), -3.0)
    options = dict(cu_seqlens=cu, old_logprobs=old, bias=bias, logit_scale=0.5, logit_softcap=3.0, beta=0.0)

    def loss_fn(h, w):
        return fused_cppo_loss(h, w, targets, adv, **options)[0]

    def logprobs_fn(h, w):
        return fused_logprobs(h, w, targets, bias=bias, logit_scale=0.5, logit_softcap=3.0, temperature=0.8)

    compiled_loss = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    compiled_logprobs = torch.compile(logprobs_fn, backend="aot_eager", fullgraph=True)
    params = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    got = compiled_loss(*params)
    got_grads = torch.autograd.grad(got, params)
    want = loss_fn(*(x.detach().requires_grad_() for x in params))
    assert_close("loss", got, want, 1e-6)
    eager_params = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    want_grads = torch.autograd.grad(loss_fn(*eager_params), eager_params)
    for name, a, b in zip(("dhidden", "dweight"), got_grads, want_grads, strict=True):
        assert_close(name, a, b, 1e-6)
    assert_close("logp", compiled_logprobs(hidden, weight), logprobs_fn(hidden, weight), 1e-6)
    uncapped = fused_logprobs(hidden, weight, targets, bias=bias, temperature=0.8)
    assert not torch.allclose(uncapped, logprobs_fn(hidden, weight))

    cfg = LossConfig()
    op_options = encode(**vars(cfg), mode="two-pass", needs="110", metrics=_metric_key(cfg),
                        **{"head.logit_scale": 0.5, "head.logit_softcap": 3.0})  # fmt: skip
    args = (
        params[0].detach().requires_grad_(),
        params[1].detach().requires_grad_(),
        bias,
        targets,
        adv,
        cu,
        None,
        old,
        None,
        None,
        None,
        *op_options,
    )  # fmt: skip (no importance weights, no sampling log-probs)
    torch.library.opcheck(torch.ops.cppo_kernels.fused_cppo_loss.default, args)
