"""The fused log-prob Triton kernels (cppo_kernels._loss_triton) against the fp64 reference, under the interpreter."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_cases import logit_error

from cppo_kernels import _loss_triton as K
from cppo_kernels.reference import token_logprobs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: Forward (logp, lse, entropy): |err| <= E = FWD_ATOL * Z * max(1, sqrt(H) / 8), Z = max_t,v (|h_t| . |w_v| +
#: |b_v|) / temperature, the bound on the logits' size, sqrt(H) the growth of the fp32 accumulation error over
#: H. bf16/fp16 products are exact in fp32, so every dtype gets fp32's bound.
#: Gradients: |err| <= rtol * |ref| + (eps + E / 16) * M, with M the same contraction over absolute
#: values (e.g. |g| / temperature * (onehot + p) @ |W| for dhidden): the dot-product error bound. rtol covers the
#: rounding on store; eps the rounding of dz before the tensor-core dot (bf16/fp16) or the fp32 accumulation;
#: the Z term the fp32 error of the recomputed logits, which every probability inherits; a last term the
#: subnormal spacing (fp16: 6e-8) on the output and on each dz flushed before the dot. bf16 allows 1 ulp per
#: conversion because the interpreter truncates fp32 -> bf16 (a GPU rounds to nearest: half an ulp).
GRAD_TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2**-7, 2**-7), torch.float16: (2**-11, 2**-10)}

#: Small tiles: many vocab tiles, H chunks and matmul N tiles per launch (slow under the interpreter: small
#: shapes only).
SMALL = K.LossKernelConfig(block_t=16, block_v=32, block_h=32, num_warps=4, num_stages=1, block_h_out=32)
#: The backward at the interpreter's default tiles, its dz scratch in one chunk (the default's 512 MiB holds every
#: test shape) or in chunks of one token tile (64 tokens), so T = 70 spans two chunks and dweight accumulates.
DEFAULT = K.default_config(64, 256, torch.float32, "cpu")
CHUNKED = dataclasses.replace(DEFAULT, dz_chunk_bytes=1)
PATHS = {"one-chunk": DEFAULT, "chunked": CHUNKED}


@contextlib.contextmanager
def _launch_config(config: K.LossKernelConfig | None):
    """The launchers use ``config`` inside the block (they read ``default_config`` at each call); None: the default."""
    with pytest.MonkeyPatch.context() as mp:
        if config is not None:
            mp.setattr(K, "default_config", lambda *_: config)
        yield


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, allowed, what: str) -> None:
    assert actual.shape == expected.shape, what
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    diff = (actual.double() - expected).abs()
    allowed = torch.as_tensor(allowed, dtype=torch.float64).expand_as(diff)
    if diff.numel() == 0:
        return
    worst = (diff - allowed).argmax()
    assert (diff <= allowed).all(), (
        f"{what}: |diff| {diff.flatten()[worst]:.3g} > {allowed.flatten()[worst]:.3g} at flat index {int(worst)}"
    )


def _problem(T: int, H: int, V: int, dtype: torch.dtype, *, bias: bool, scale: float, seed: int):
    """hidden [T, H], weight [V, H], targets [T], bias [V] | None, with logits of std ~ ``scale``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)  # [T, H]
    weight = (torch.randn(V, H, generator=g) * (scale / math.sqrt(max(H, 1)))).to(dtype)  # [V, H]
    b = (torch.randn(V, generator=g) * scale).to(dtype) if bias else None  # [V]
    targets = torch.randint(0, V, (T,), generator=g)  # [T]
    return hidden, weight, targets, b


def _reference(hidden, weight, targets, bias, temperature, grad_logp):
    """fp64 reference: dict of logp, lse, entropy, grads (autograd of grad_logp . logp), their magnitudes, Z."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    b = bias.double().requires_grad_() if bias is not None else None
    logp, entropy = token_logprobs(h, w, targets, bias=b, temperature=temperature)
    logits = (h @ w.t() + (b if b is not None else 0.0)) / temperature  # [T, V]
    grads = torch.autograd.grad(logp, [h, w] + ([b] if b is not None else []), grad_logp.double())
    with torch.no_grad():
        ha, wa = h.abs(), w.abs()
        z_abs = (ha @ wa.t() + (b.abs() if b is not None else 0.0)) / temperature  # [T, V]
        onehot = torch.nn.functional.one_hot(targets, weight.shape[0]).double()  # [T, V]
        dz_abs = (grad_logp.double().abs() / temperature)[:, None] * (onehot + logits.softmax(-1))  # [T, V]
        return dict(
            logp=logp.detach(),
            lse=logits.logsumexp(-1).detach(),
            entropy=entropy.detach(),
            Z=max(z_abs.max().item(), 1.0) if z_abs.numel() else 1.0,
            # (value, magnitude bound, bound on what flushing dz to subnormals/zero can lose, per unit spacing)
            # flushing dz = g q / temperature before the dot
            dhidden=(grads[0], dz_abs @ wa, (1 + grad_logp.double().abs() / temperature)[:, None] * wa.sum(0)),
            dweight=(grads[1], dz_abs.t() @ ha, ha.sum(0).expand_as(w)),
            dbias=(grads[2], dz_abs.sum(0), torch.full_like(b, len(targets))) if b is not None else None,
        )


def _check_fwd(hidden, weight, targets, bias, temperature, config=None) -> None:
    with _launch_config(config):
        logp, lse, entropy = K.logprobs_fwd(
            hidden, weight, targets, bias, temperature=temperature, compute_entropy=True
        )
    ref = _reference(hidden, weight, targets, bias, temperature, torch.zeros(len(targets), device=hidden.device))
    assert logp.dtype == lse.dtype == entropy.dtype == torch.float32
    for name, got in (("logp", logp), ("lse", lse), ("entropy", entropy)):
        _assert_close(got, ref[name], logit_error(ref["Z"], hidden.shape[1]), name)


def _check_bwd(hidden, weight, targets, bias, temperature, grad_logp, *, needs=(True, True, True), config=None):
    needs = (needs[0], needs[1], needs[2] and bias is not None)
    with _launch_config(config):
        _, lse, _ = K.logprobs_fwd(hidden, weight, targets, bias, temperature=temperature)
        got = K.logprobs_bwd(
            hidden, weight, targets, bias, lse, grad_logp, temperature=temperature,
            needs_hidden_grad=needs[0], needs_weight_grad=needs[1], needs_bias_grad=needs[2],
        )  # fmt: skip
    ref = _reference(hidden, weight, targets, bias, temperature, grad_logp)
    rtol, eps = GRAD_TOL[hidden.dtype]
    for name, grad, needed in zip(("dhidden", "dweight", "dbias"), got, needs):
        if not needed:
            assert grad is None, f"{name} was not asked for"
            continue
        assert grad.dtype == hidden.dtype, name
        value, magnitude, flush = ref[name]
        spacing = torch.finfo(hidden.dtype).tiny * torch.finfo(hidden.dtype).eps  # of subnormals
        logit_slack = logit_error(ref["Z"], hidden.shape[1]) / 16
        allowed = rtol * value.abs() + (eps + logit_slack) * magnitude + spacing * (1 + flush)
        _assert_close(grad, value, allowed, name)


shapes = st.tuples(
    st.sampled_from([1, 2, 7, 33, 64, 70]),  # T: 1, odd, a few tens, a tile, over a tile
    st.integers(1, 160).filter(lambda h: h % 16 != 0),  # H: not a multiple of 16
    st.integers(2, 260),  # V: mostly not a multiple of the tile
)
scales = st.sampled_from([1e-3, 1.0, 20.0, 1e3])  # logit std: tiny to huge


@settings(max_examples=30)
@given(
    shape=shapes,
    dtype=st.sampled_from(list(DTYPES.values())),
    bias=st.booleans(),
    temperature=st.floats(0.3, 2.0),
    scale=scales,
    seed=st.integers(0, 2**16),
)
def test_forward_matches_reference(shape, dtype, bias, temperature, scale, seed):
    T, H, V = shape
    hidden, weight, targets, b = _problem(T, H, V, dtype, bias=bias, scale=scale, seed=seed)
    _check_fwd(hidden, weight, targets, b, temperature)


@settings(max_examples=20)  # ~1-3 s each under the interpreter
@given(
    shape=shapes,
    dtype=st.sampled_from(list(DTYPES.values())),
    bias=st.booleans(),
    temperature=st.floats(0.3, 2.0),
    scale=scales,
    needs=st.sampled_from([(True, True, True), (True, False, False), (False, True, False), (False, False, True)]),
    path=st.sampled_from(list(PATHS)),
    seed=st.integers(0, 2**16),
)
def test_backward_matches_reference(shape, dtype, bias, temperature, scale, needs, path, seed):
    T, H, V = shape
    hidden, weight, targets, b = _problem(T, H, V, dtype, bias=bias, scale=scale, seed=seed)
    grad_logp = torch.randn(T, generator=torch.Generator().manual_seed(seed + 1))  # [T]
    _check_bwd(hidden, weight, targets, b, temperature, grad_logp, needs=needs, config=PATHS[path])


@pytest.mark.parametrize("chunk", [SMALL.dz_chunk_bytes, 1], ids=["one-chunk", "chunked"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("T,H,V", [(1, 50, 97), (19, 70, 130)])
def test_small_tiles(T, H, V, dtype, chunk):
    """Many vocab tiles, H chunks and matmul N tiles (and dz chunks of 16 tokens) per launch."""
    config = dataclasses.replace(SMALL, dz_chunk_bytes=chunk)
    hidden, weight, targets, b = _problem(T, H, V, dtype, bias=True, scale=5.0, seed=T + H + V)
    _check_fwd(hidden, weight, targets, b, 0.7, config=config)
    grad_logp = torch.randn(T, generator=torch.Generator().manual_seed(3))  # [T]
    _check_bwd(hidden, weight, targets, b, 0.7, grad_logp, config=config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [1e4, 1e-6])
def test_extreme_logits(dtype, scale):
    """Logits of std 1e4 (exp would overflow without the running max) or 1e-6 (uniform softmax)."""
    hidden, weight, targets, b = _problem(21, 45, 150, dtype, bias=True, scale=scale, seed=11)
    _check_fwd(hidden, weight, targets, b, 1.3)
    _check_bwd(hidden, weight, targets, b, 1.3, torch.randn(21, generator=torch.Generator().manual_seed(5)))


def test_target_equals_argmax_and_last_column():
    """Targets at the last vocab column (in the partial tile) and at the argmax give the reference logp."""
    hidden, weight, _, b = _problem(9, 33, 130, torch.float32, bias=True, scale=30.0, seed=2)
    logits = hidden.double() @ weight.double().t() + b.double()  # [T, V]
    targets = logits.argmax(-1)  # [T]
    targets[::2] = 129
    _check_fwd(hidden, weight, targets, b, 1.0)


def _alone_and_packed(dtype: torch.dtype, seq: slice, config=None, device: str = "cpu"):
    """(fwd outputs + dhidden) of a 17-token sequence computed alone and packed among 73 other tokens."""
    hidden, weight, targets, b = (
        x.to(device) for x in _problem(90, 40, 200, dtype, bias=True, scale=3.0, seed=4)
    )  # fmt: skip
    grad_logp = torch.randn(90, generator=torch.Generator().manual_seed(6)).to(device)  # [T]
    rows = torch.arange(seq.start, seq.stop, device=device)
    alone = (hidden[rows], targets[rows], grad_logp[rows])
    out = []
    for h, t, g in ((hidden, targets, grad_logp), alone):
        with _launch_config(config):
            logp, lse, ent = K.logprobs_fwd(h, weight, t, b, temperature=0.9, compute_entropy=True)
            dh, _, _ = K.logprobs_bwd(h, weight, t, b, lse, g, temperature=0.9, needs_weight_grad=False)
        out.append((logp, lse, ent, dh))
    return [x[seq] for x in out[0]], out[1]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_token_results_do_not_depend_on_the_batch(dtype, path):
    """A sequence's logp/lse/entropy/dhidden are bit-identical alone (T=17) or packed among other tokens (T=90).

    Packed at the same offset modulo block_t (64): the interpreter's numpy matmul rounds a row differently
    depending on its position in the tile, which MMA on a GPU does not (see the CUDA test below).
    """
    assert K.default_config(40, 200, dtype, torch.device("cpu")).block_t == 64
    packed, alone = _alone_and_packed(dtype, slice(64, 81), PATHS[path])
    for name, x, y in zip(("logp", "lse", "entropy", "dhidden"), packed, alone):
        assert torch.equal(x, y), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="bit-exactness at any offset needs GPU MMA")
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_token_results_do_not_depend_on_the_offset_cuda(dtype):
    packed, alone = _alone_and_packed(dtype, slice(55, 72), device="cuda")  # straddles a token-tile boundary
    for name, x, y in zip(("logp", "lse", "entropy", "dhidden"), packed, alone):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("path", list(PATHS))
def test_strided_inputs(path):
    """Rows of hidden with a row stride != H, a transposed (column-major) weight and a strided bias."""
    hidden, weight, targets, b = _problem(12, 37, 90, torch.float32, bias=True, scale=4.0, seed=8)
    wide = torch.zeros(12, 50)
    wide[:, 5:42] = hidden
    weight_t = weight.t().contiguous().t()  # [V, H] with stride (1, V)
    bias_s = torch.stack([b, b], dim=1)[:, 0]  # [V] with stride 2
    grad_logp = torch.randn(12)  # [T]
    with _launch_config(PATHS[path]):
        logp, lse, _ = K.logprobs_fwd(wide[:, 5:42], weight_t, targets, bias_s, temperature=1.5)
        ref_logp, ref_lse, _ = K.logprobs_fwd(hidden, weight, targets, b, temperature=1.5)
        got = K.logprobs_bwd(
            wide[:, 5:42], weight_t, targets, bias_s, lse, grad_logp, temperature=1.5, needs_bias_grad=True
        )
        want = K.logprobs_bwd(hidden, weight, targets, b, lse, grad_logp, temperature=1.5, needs_bias_grad=True)
    assert torch.equal(logp, ref_logp) and torch.equal(lse, ref_lse)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    "field,value", [("block_t", 8), ("block_v", 48), ("block_h_out", 0), ("num_warps", 3), ("dz_chunk_bytes", 0)]
)
def test_bad_config_raises(field, value):
    fields = dict(block_t=16, block_v=32, block_h=32, num_warps=4, num_stages=1, block_h_out=32)
    with pytest.raises(ValueError, match=field):
        K.LossKernelConfig(**{**fields, field: value})


@pytest.mark.parametrize("path", list(PATHS))
def test_zero_hidden_size(path):
    """H = 0: the logits are the bias alone; dbias is still a real gradient."""
    hidden, weight, targets, b = _problem(70, 0, 40, torch.float32, bias=True, scale=2.0, seed=3)
    grad_logp = torch.randn(70, generator=torch.Generator().manual_seed(2))  # [T]
    _check_bwd(hidden, weight, targets, b, 0.8, grad_logp, config=PATHS[path])


def test_zero_tokens():
    weight = torch.randn(20, 8)
    bias = torch.randn(20)
    hidden = torch.empty(0, 8)
    targets = torch.empty(0, dtype=torch.long)
    logp, lse, ent = K.logprobs_fwd(hidden, weight, targets, bias, compute_entropy=True)
    assert logp.shape == lse.shape == ent.shape == (0,)
    dh, dw, db = K.logprobs_bwd(hidden, weight, targets, bias, lse, logp, needs_bias_grad=True)
    assert dh.shape == (0, 8)
    assert torch.equal(dw, torch.zeros_like(weight)) and torch.equal(db, torch.zeros_like(bias))


def test_entropy_is_optional_and_unneeded_grads_are_none():
    hidden, weight, targets, _ = _problem(5, 20, 40, torch.float32, bias=False, scale=1.0, seed=1)
    logp, lse, ent = K.logprobs_fwd(hidden, weight, targets)
    assert ent is None
    assert K.logprobs_bwd(
        hidden, weight, targets, None, lse, logp, needs_hidden_grad=False, needs_weight_grad=False
    ) == (
        None,
        None,
        None,
    )


KERNELS = [K._logprobs_fwd_kernel, K._logprobs_bwd_dz_kernel]
COMPILE_TIME = {"HAS_BIAS", "HAS_SOFTCAP", "COMPUTE_ENTROPY", "DOT_PRECISION", "UPCAST_DOT"}


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.fn.__name__ if hasattr(k, "fn") else k.__name__)
def test_only_tiles_flags_and_dtypes_are_constexpr(kernel):
    """T, V, H, strides, the temperature and the model's logit scale and cap (folded into z_scale and cap_out) are
    runtime args: a new batch shape, temperature, scale or cap value never recompiles."""
    import inspect

    fn = kernel.fn
    params = inspect.signature(fn).parameters
    constexpr = {name for name, p in params.items() if "constexpr" in str(p.annotation)}
    assert constexpr == {n for n in constexpr if n.startswith("BLOCK_") or n in COMPILE_TIME}
    for runtime in ("T", "V", "H", "z_scale", "cap_out"):
        assert runtime in params and runtime not in constexpr
    # T is not specialised on (== 1, divisibility by 16) either
    dns = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize", ())
    assert "T" in dns


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(
    "T,H,V,dtype",
    [(300, 896, 5000, torch.bfloat16), (257, 1536, 3001, torch.bfloat16), (130, 896, 2000, torch.float16),
     (200, 896, 3000, torch.float32)],
)  # fmt: skip
def test_cuda_default_config_matches_reference(T, H, V, dtype):
    """The real GPU path (tensor-core dots, 3xTF32 for fp32, pipelined loads) at the default CUDA config."""
    hidden, weight, targets, b = (x.cuda() for x in _problem(T, H, V, dtype, bias=True, scale=8.0, seed=T))
    _check_fwd(hidden, weight, targets, b, 0.7)
    _check_bwd(hidden, weight, targets, b, 0.7, torch.randn(T, generator=torch.Generator().manual_seed(1)).cuda())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compile cache is only observable on CUDA")
def test_new_token_count_or_temperature_does_not_recompile():
    hidden, weight, targets, b = _problem(64, 128, 1000, torch.bfloat16, bias=False, scale=1.0, seed=0)
    hidden, weight, targets = hidden.cuda(), weight.cuda(), targets.cuda()
    kernels = (K._logprobs_fwd_kernel, K._logprobs_bwd_dz_kernel, K._matmul_dhidden_kernel, K._matmul_dweight_kernel)

    def run(T, temperature):
        _, lse, _ = K.logprobs_fwd(hidden[:T], weight, targets[:T], temperature=temperature)
        grad = torch.randn(T, device="cuda")
        K.logprobs_bwd(hidden[:T], weight, targets[:T], None, lse, grad, temperature=temperature)

    def compiled():
        return [len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels]

    run(64, 1.0)
    n = compiled()
    for T, temperature in ((37, 0.6), (1, 1.7), (48, 1.0)):
        run(T, temperature)
    assert compiled() == n
