"""The kernels' properties on a CUDA device (marker ``cuda``); skipped without one (``benchmarks/gpu_check.py`` runs
them on a GPU with ``pytest -m cuda``).

On both backends and in fp32, bf16 and fp16: ``fused_cppo_loss`` (loss, metrics, gradients) and the advantages /
selection ops against the float64 oracles of :mod:`cppo_kernels.reference`; a token's results bit for bit the same
computed alone or packed among other tokens, at any offset; the same call twice gives the same bits; a new batch
shape or new loss settings compile no new Triton binary; at the GPU kit's loss shapes (V = 151,936),
``fused_logprobs`` and the loss of both library methods within the kernels' error bound of the float64 oracle.
Problems, helpers and tolerances are the CPU tests' (``test_loss``, ``test_advantages``, ``test_loss_triton``): on a
GPU the Triton dots run on tensor cores (bf16, fp16) or as 3xTF32 (fp32) and stores round to nearest instead of
truncating, which those tolerances already cover. Shapes keep H and V off multiples of 16 (masked tails; one Triton
binary per dtype and flag set). The loss is compared with the relative tolerance of the CPU tests plus what the
kernels' forward error bound on each log-prob (``test_loss_triton``) can do to it: a loss that cancels to near zero
is otherwise judged by its own size.
"""

from __future__ import annotations

import contextlib
import dataclasses

import advantage_cases as adv_tests
import loss_cases as loss_tests
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cppo_kernels import (
    LossConfig,
    _advantages_triton,
    _loss_gemm,
    _loss_torch,
    _loss_triton,
    cppo_select,
    fused_cppo_loss,
    fused_logprobs,
    group_advantages,
    reference,
    select_completions,
    use_backend,
)
from cppo_kernels._dispatch import backend_module

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("small_chunks"),
]

CUDA = torch.device("cuda")
BACKENDS = ["triton", "torch"]
DTYPES = pytest.mark.parametrize("dtype", loss_tests.DTYPES, ids=["fp32", "bf16", "fp16"])
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
H, V = 200, 3001  # neither a multiple of 16, nor of a tile
REWARD_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _cuda(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.to(CUDA)


@contextlib.contextmanager
def _dz_in_chunks(chunked: bool):
    """The default CUDA launch config, with the backward's dz scratch in chunks of one token tile when ``chunked``
    (so dweight accumulates across chunks, in fp32 for bf16/fp16)."""
    if not chunked:
        yield
        return
    default = _loss_triton.default_config
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_loss_triton, "default_config", lambda *a: dataclasses.replace(default(*a), dz_chunk_bytes=1))
        yield


def _loss_atol(logp64: torch.Tensor, h64, w64, b64, temperature: float, adv, cu, old, ref, config) -> float:
    """2 E sum_t |dloss/dlogp_t|: the loss error that log-prob errors within the kernels' forward bound E (on logits of
    size up to Z = max_tv (|h_t| . |w_v| + |b_v|) / temperature) can cause, to first order, with a factor 2."""
    if logp64.numel() == 0:
        return 0.0
    with torch.no_grad():
        z = (h64.abs() @ w64.abs().t() + (0.0 if b64 is None else b64.abs())) / temperature  # [T, V]
    logp = logp64.detach().clone().requires_grad_()
    loss, _ = reference.policy_loss(logp, adv, cu, old_logprobs=old, ref_logprobs=ref, config=config)
    (dlogp,) = torch.autograd.grad(loss, logp)  # [T]
    return 2 * loss_tests.logit_error(max(z.max().item(), 1.0), h64.shape[1]) * dlogp.abs().sum().item()


def _binaries(kernels) -> list[int]:
    """Binaries compiled so far for this device, per kernel (Triton's per-device cache)."""
    return [len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels]


# --------------------------------------------------------------------------------------------
# The loss against the float64 oracle
# --------------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("backend", BACKENDS)
@loss_tests.hypothesis_settings(max_examples=15)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(0, 90), min_size=1, max_size=5),
    temperature=st.sampled_from([1.0, 0.7]),
    epsilon_high=st.sampled_from([None, 0.28]),
    dual_clip=st.sampled_from([None, 3.0]),
    kl=st.sampled_from([None, "k1", "k3"]),
    importance_sampling=st.sampled_from(["token", "sequence"]),
    loss_agg=st.sampled_from(AGGS),
    with_old=st.booleans(),
    with_bias=st.booleans(),
    compute_entropy=st.booleans(),
    logit_scale=st.sampled_from([1.0, 20.0]),
    chunked=st.booleans(),
)
def test_loss_matches_reference(
    backend, dtype, seed, lengths, temperature, epsilon_high, dual_clip, kl, importance_sampling, loss_agg, with_old,
    with_bias, compute_entropy, logit_scale, chunked,
):  # fmt: skip
    hidden, weight, bias, targets, adv, g = loss_tests.problem(
        seed, lengths, H, V, dtype, logit_scale=logit_scale, bias=with_bias
    )
    cu = loss_tests.cu_seqlens(lengths)
    options = dict(
        temperature=temperature, epsilon_high=epsilon_high, dual_clip=dual_clip, beta=0.0 if kl is None else 0.04,
        kl_estimator=kl or "k3", importance_sampling=importance_sampling, loss_agg=loss_agg,
        max_completion_length=90 if loss_agg == "seq-mean-token-sum-norm" else None, compute_entropy=compute_entropy,
    )  # fmt: skip
    params64 = [x.double().requires_grad_() for x in (hidden, weight) + ((bias,) if with_bias else ())]
    b64 = params64[2] if with_bias else None
    with torch.no_grad():  # old / reference log-probs near the current ones: ratios straddle both clip bounds
        logp64, _ = reference.token_logprobs(params64[0], params64[1], targets, bias=b64, temperature=temperature)
    old = (logp64 + 0.3 * torch.randn(len(targets), generator=g, dtype=torch.float64)).float() if with_old else None
    ref = (logp64 + 0.3 * torch.randn(len(targets), generator=g, dtype=torch.float64)).float() if kl else None
    upstream = float(torch.randn((), generator=g))

    params = [x.to(CUDA).requires_grad_() for x in (hidden, weight) + ((bias,) if with_bias else ())]
    with use_backend(backend), _dz_in_chunks(chunked):
        loss, metrics = fused_cppo_loss(
            params[0], params[1], targets.to(CUDA), adv.to(CUDA), cu_seqlens=cu.to(CUDA), old_logprobs=_cuda(old),
            ref_logprobs=_cuda(ref), bias=params[2] if with_bias else None, **options,
        )  # fmt: skip
        grads = loss_tests.grads(loss, params, upstream)
    old64, ref64 = (None if x is None else x.double() for x in (old, ref))
    want, want_metrics = reference.fused_cppo_loss(
        params64[0], params64[1], targets, adv.double(), cu_seqlens=cu, bias=b64, config=LossConfig(**options),
        old_logprobs=old64, ref_logprobs=ref64,
    )  # fmt: skip
    atol = _loss_atol(logp64, params64[0], params64[1], b64, temperature, adv.double(), cu, old64, ref64,
                      LossConfig(**options))  # fmt: skip

    loss_tol, grad_tol = loss_tests.TOL[dtype][0], _grad_tol(backend, dtype)
    assert loss.device.type == "cuda" and loss.dtype == torch.float32
    loss_tests.assert_close("loss", loss, want, loss_tol, 1e-7 + atol)
    for key, value in metrics.items():
        atol = loss_tol * float(logp64.abs().max()) if key == "kl" and len(targets) else 1e-7
        loss_tests.assert_close(key, value, want_metrics[key], 1e-4, atol)
    for name, got, exp in zip(("dhidden", "dweight", "dbias"), grads, loss_tests.grads(want, params64, upstream)):
        assert got.dtype == dtype and got.device.type == "cuda", name
        loss_tests.assert_close(name, got, exp, grad_tol, loss_tests.TOL[dtype][3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
@loss_tests.hypothesis_settings(max_examples=8)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(0, 90), min_size=1, max_size=5),
    surrogate=st.sampled_from(
        [
            dict(surrogate="clip", delta=1.2),
            dict(surrogate="cispo", epsilon_high=1.2),
            dict(surrogate="sapo"),
            dict(surrogate="vespo"),
        ]
    ),  # fmt: skip
    loss_agg=st.sampled_from([*AGGS[:2], "seq-mean-token-sum"]),
    per_token_weights=st.booleans(),
    masks=st.booleans(),
    entropy_coef=st.sampled_from([0.0, 0.05]),
)
def test_loss_types_match_reference(
    backend, dtype, seed, lengths, surrogate, loss_agg, per_token_weights, masks, entropy_coef
):  # fmt: skip
    """Issue 26's loss types and options on CUDA, both backends, against the float64 oracle: the bias-corrected KL,
    importance weights, the off-policy mask (and the entropy mask in fp32) and the entropy bonus."""
    hidden, weight, _, targets, adv, g = loss_tests.problem(seed, lengths, H, V, dtype, logit_scale=1.0, bias=False)
    cu, T, S = loss_tests.cu_seqlens(lengths), len(targets), len(lengths)
    options = dict(
        surrogate, loss_agg=loss_agg, beta=0.04, use_bias_correction_kl=True, entropy_coef=entropy_coef,
        off_policy_mask_threshold=0.05 if masks else None,
        top_entropy_quantile=0.5 if masks and dtype == torch.float32 else 1.0,
    )  # fmt: skip
    params64 = [x.double().requires_grad_() for x in (hidden, weight)]
    with torch.no_grad():
        logp64, _ = reference.token_logprobs(params64[0], params64[1], targets)
    old, ref = ((logp64 + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)).float() for _ in range(2))
    weights = torch.rand(T if per_token_weights else S, generator=g) * 2
    per_seq = not per_token_weights and T != S
    params = [x.to(CUDA).requires_grad_() for x in (hidden, weight)]
    with use_backend(backend):
        loss, _ = fused_cppo_loss(
            params[0], params[1], targets.to(CUDA), adv.to(CUDA), cu_seqlens=cu.to(CUDA), old_logprobs=_cuda(old),
            ref_logprobs=_cuda(ref), importance_weights=_cuda(weights), **options,
        )  # fmt: skip
        grads = loss_tests.grads(loss, params, 0.7)
    want, _ = reference.fused_cppo_loss(
        params64[0], params64[1], targets, adv.double(), cu_seqlens=cu, config=LossConfig(**options),
        old_logprobs=old.double(), ref_logprobs=ref.double(), importance_weights=weights.double(),
        weights_per_seq=per_seq,
    )  # fmt: skip
    plain = {"entropy_coef": 0.0, "top_entropy_quantile": 1.0, "off_policy_mask_threshold": None}
    plain = LossConfig(**{**options, **plain})  # the policy terms' sensitivity to log-prob errors
    atol = _loss_atol(logp64, params64[0], params64[1], None, 1.0, adv.double(), cu, old.double(), ref.double(), plain)
    loss_tol, grad_tol = loss_tests.TOL[dtype][0], _grad_tol(backend, dtype)
    loss_tests.assert_close("loss", loss, want, loss_tol, 1e-6 + atol)
    for name, got, exp in zip(("dhidden", "dweight"), grads, loss_tests.grads(want, params64, 0.7)):
        assert got.dtype == dtype and got.device.type == "cuda", name
        loss_tests.assert_close(name, got, exp, grad_tol, loss_tests.TOL[dtype][3])


def _grad_tol(backend: str, dtype: torch.dtype) -> float:
    """The gradients' tolerance on CUDA (tests/support/loss_cases.py ``TOL``): the Triton backend's, and the torch
    backend's own only outside bf16, where on CUDA it too feeds bf16 gradient operands to its GEMMs
    (``_loss_torch.half_gemms``: the tolerance of the CPU's torch bf16 path assumes fp32 GEMMs, and the kit's first
    run failed this test on it)."""
    torch_own = backend == "torch" and not _loss_torch.half_gemms(CUDA, dtype)
    return loss_tests.TOL[dtype][1 if torch_own else 2]


#: The GPU kit's loss shapes (benchmarks/gpukit/plan.py: a Qwen2-1.5B-sized head, Liger-Kernel's published shape,
#: the CPU benchmark's) and bench_loss's options (the CPPO recipe): its loss part records the errors, this test judges
#: them.
KIT_SHAPES = [(16_384, 1536, 151_936, torch.bfloat16), (8192, 4096, 128_256, torch.bfloat16),
              (2048, 896, 151_936, torch.float32)]  # fmt: skip
KIT_OPTIONS = dict(epsilon_low=0.2, beta=0.04, kl_estimator="k3", loss_agg="token-mean")


def _fp64_logprobs(hidden, weight, targets, *, chunk: int = 1024) -> tuple[torch.Tensor, float]:
    """The float64 log-probs ``[T]`` of ``targets`` on CUDA, ``chunk`` tokens at a time, and Z = max(1, max_tv
    |h_t| . |w_v|), the logit scale of the kernels' forward error bound."""
    w64 = weight.double()  # [V, H]
    w_abs = w64.abs()  # [V, H]
    logp64 = torch.empty(len(targets), dtype=torch.float64, device=hidden.device)  # [T]
    z_max = 1.0
    with torch.no_grad():
        for a in range(0, len(targets), chunk):
            h64 = hidden[a : a + chunk].double()  # [C, H]
            logp64[a : a + chunk] = reference.token_logprobs(h64, w64, targets[a : a + chunk])[0]
            z_max = max(z_max, (h64.abs() @ w_abs.t()).max().item())
    return logp64, z_max


@pytest.mark.parametrize("T,H,V,dtype", KIT_SHAPES, ids=[f"T{t}-H{h}-V{v}-{str(d)[6:]}" for t, h, v, d in KIT_SHAPES])
def test_the_loss_at_the_kits_shapes_matches_the_fp64_oracle(T, H, V, dtype):
    """At the kit's shapes: ``fused_logprobs`` (the default backend, Triton) within the kernels' forward bound E
    of the float64 log-probs, and the loss of both library methods (gradient-in-forward on cuBLAS, the Triton
    two-pass kernels) within what errors E can do to it, ``2 E sum_t |dloss/dlogp_t|`` (the gradient from
    autograd), plus 1e-5 of the loss's scale for the fp32 arithmetic of the policy terms and their sum."""
    lengths = [512] * (T // 512)
    hidden, weight, _, targets, adv, g = loss_tests.problem(0, lengths, H, V, dtype, logit_scale=2.0, bias=False)
    hidden, weight, targets = hidden.to(CUDA), weight.to(CUDA), targets.to(CUDA)
    logp64, z_max = _fp64_logprobs(hidden, weight, targets)
    # old / reference log-probs near the current ones (fp32, as the trainer passes them): ratios straddle the clip
    old, ref = ((logp64.cpu() + 0.1 * torch.randn(T, generator=g, dtype=torch.float64)).float() for _ in range(2))
    cu = loss_tests.cu_seqlens(lengths)
    logp = logp64.cpu().requires_grad_()
    loss64, _ = reference.policy_loss(logp, adv.double(), cu, old_logprobs=old.double(), ref_logprobs=ref.double(),
                                      config=LossConfig(**KIT_OPTIONS))  # fmt: skip
    (dlogp,) = torch.autograd.grad(loss64, logp)  # [T]
    bound, sensitivity = loss_tests.logit_error(z_max, H), dlogp.abs().sum().item()
    with use_backend("auto"):
        error = (fused_logprobs(hidden, weight, targets).double() - logp64).abs().max().item()
    assert error <= bound, f"fused_logprobs: max abs error {error:.3g} > bound {bound:.3g}"
    loss_bound = 2 * bound * sensitivity + 1e-5 * (abs(loss64.item()) + sensitivity) + 1e-7
    for backend, mode in (("torch", "grad-in-forward"), ("triton", "two-pass")):
        params = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
        with use_backend(backend):
            loss, _ = fused_cppo_loss(params[0], params[1], targets, adv.to(CUDA), cu_seqlens=cu.to(CUDA),
                                      old_logprobs=old.to(CUDA), ref_logprobs=ref.to(CUDA), mode=mode,
                                      **KIT_OPTIONS)  # fmt: skip
        error = abs(loss.item() - loss64.item())
        assert error <= loss_bound, f"{backend} {mode}: loss error {error:.3g} > bound {loss_bound:.3g}"


# --------------------------------------------------------------------------------------------
# Batch invariance and determinism, bit for bit
# --------------------------------------------------------------------------------------------


def _token_results(module, hidden, weight, bias, targets, grad_logp, temperature):
    """(logp, lse, entropy, dhidden) of the backend ``module`` for these tokens."""
    logp, lse, entropy = module.logprobs_fwd(
        hidden, weight, targets, bias, temperature=temperature, compute_entropy=True
    )
    dhidden, _, _ = module.logprobs_bwd(
        hidden, weight, targets, bias, lse, grad_logp, temperature=temperature, needs_weight_grad=False
    )
    return logp, lse, entropy, dhidden


@DTYPES
@pytest.mark.parametrize("backend", BACKENDS)
@loss_tests.hypothesis_settings(max_examples=10)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(1, 150), min_size=2, max_size=5),
    temperature=st.sampled_from([1.0, 0.6]),
)
def test_a_tokens_results_do_not_depend_on_the_batch(backend, dtype, seed, lengths, temperature):
    """Every sequence's log-probs, LSE and entropies (both backends) and its dhidden (Triton: fixed tiles, no
    split-K) are bit-identical computed alone or packed after the others, at whatever offset in the tiles."""
    hidden, weight, bias, targets, _, g = loss_tests.problem(seed, lengths, H, V, dtype, logit_scale=4.0, bias=True)
    grad_logp = torch.randn(len(targets), generator=g)  # [T]
    hidden, weight, bias, targets, grad_logp = (x.to(CUDA) for x in (hidden, weight, bias, targets, grad_logp))
    cu = loss_tests.cu_seqlens(lengths).tolist()
    names = ("logp", "lse", "entropy", "dhidden") if backend == "triton" else ("logp", "lse", "entropy")
    with use_backend(backend):
        module = backend_module("loss", hidden)
        packed = _token_results(module, hidden, weight, bias, targets, grad_logp, temperature)
        for s, (a, b) in enumerate(zip(cu, cu[1:])):
            alone = _token_results(module, hidden[a:b], weight, bias, targets[a:b], grad_logp[a:b], temperature)
            for name, x, y in zip(names, packed, alone):
                assert torch.equal(x[a:b], y), f"sequence {s} ({a}:{b}): {name}"


@DTYPES
@loss_tests.hypothesis_settings(max_examples=10)
@given(seed=st.integers(0, 2**16), lengths=st.lists(st.integers(1, 150), min_size=2, max_size=5))
def test_the_gemm_paths_results_do_not_depend_on_the_batch(dtype, seed, lengths):
    """The GEMM path (gradient-in-forward of the Triton backend, mode="auto" on CUDA): fixed-height GEMMs and per-row
    passes, so a sequence's log-prob, lse, entropy and dhidden are bit-identical alone or packed."""
    hidden, weight, bias, targets, _, g = loss_tests.problem(seed, lengths, H, V, dtype, logit_scale=4.0, bias=True)
    up = torch.randn(len(targets), generator=g)  # [T]
    hidden, weight, bias, targets, up = (x.to(CUDA) for x in (hidden, weight, bias, targets, up))
    cu = loss_tests.cu_seqlens(lengths).tolist()

    def run(a, b):
        out = _loss_gemm.logprobs_fwd_grads(hidden[a:b], weight, targets[a:b], bias, lambda s, e, lp: up[a + s : a + e],
                                            temperature=0.9, compute_entropy=True, needs_weight_grad=False)  # fmt: skip
        return out[:4]

    packed = run(0, cu[-1])
    for s, (a, b) in enumerate(zip(cu, cu[1:])):
        for name, x, y in zip(("logp", "lse", "entropy", "dhidden"), packed, run(a, b)):
            assert torch.equal(x[a:b], y), f"sequence {s} ({a}:{b}): {name}"


@DTYPES
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_call_gives_the_same_bits(backend, dtype):
    hidden, weight, bias, targets, adv, _ = loss_tests.problem(
        3, [300, 17, 700], H, V, dtype, logit_scale=4.0, bias=True
    )
    cu = loss_tests.cu_seqlens([300, 17, 700]).to(CUDA)
    runs = []
    for _ in range(2):
        params = [x.to(CUDA).requires_grad_() for x in (hidden, weight, bias)]
        with use_backend(backend):
            loss, metrics = fused_cppo_loss(params[0], params[1], targets.to(CUDA), adv.to(CUDA), cu_seqlens=cu,
                                            bias=params[2], compute_entropy=True)  # fmt: skip
            loss.backward()
        runs.append([loss, *metrics.values(), *(p.grad for p in params)])
    for i, (x, y) in enumerate(zip(*runs)):
        assert torch.equal(x, y), f"output {i} differs between two identical calls"


# --------------------------------------------------------------------------------------------
# Advantages and selection against the float64 oracle
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", REWARD_DTYPES, ids=["fp32", "bf16", "fp16", "fp64"])
@pytest.mark.parametrize("backend", BACKENDS)
@loss_tests.hypothesis_settings(max_examples=10)
@given(
    data=adv_tests.grouped_rewards(),
    scale=st.sampled_from(["group", "batch", "none"]),
    unbiased=st.booleans(),
    keep_frac=st.floats(0, 1),
    scope=st.sampled_from(["group", "batch"]),
    metric=st.sampled_from(["smallest", "largest"]),
)
def test_advantages_and_selection_match_reference(backend, dtype, data, scale, unbiased, keep_frac, scope, metric):
    rewards, g = data
    rewards = rewards.to(dtype)  # the oracle sees the same (rounded) rewards
    keep = round(keep_frac * g)
    with use_backend(backend):
        adv = group_advantages(rewards.to(CUDA), g, scale=scale, unbiased=unbiased)  # [N]
        idx = select_completions(adv, g, keep, scope=scope, metric=metric)
        fused = cppo_select(rewards.to(CUDA), g, keep, scale=scale, unbiased=unbiased, scope=scope, metric=metric)
    adv_tests.assert_adv_close(adv.cpu(), adv_tests.ref_adv(rewards, g, scale=scale, unbiased=unbiased), rewards, scale)
    assert torch.equal(idx.cpu(), reference.select_completions(adv.cpu(), g, keep, scope=scope, metric=metric))
    assert torch.equal(fused[0], adv) and torch.equal(fused[1], idx)  # cppo_select is the composition


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scope", ["group", "batch"])
@pytest.mark.parametrize("scale", ["group", "batch"])
@pytest.mark.parametrize("questions", [64, 4096])
def test_cppo_select_at_training_sizes(backend, scope, scale, questions):
    """CPPO's reward values (exact dyadic, many exact ties), G = 16, keep 4: advantages and the same indices."""
    gen = torch.Generator().manual_seed(questions)
    values = torch.tensor(adv_tests.DYADIC)
    rewards = values[torch.randint(0, len(values), (questions * 16,), generator=gen)]  # [N]
    with use_backend(backend):
        adv, idx = cppo_select(rewards.to(CUDA), 16, 4, scale=scale, scope=scope)
    want_adv, want_idx = reference.cppo_select(rewards.double(), 16, 4, scale=scale, scope=scope)
    adv_tests.assert_adv_close(adv.cpu(), want_adv, rewards, scale)
    assert torch.equal(idx.cpu(), want_idx)


# --------------------------------------------------------------------------------------------
# No recompilation for a new batch
# --------------------------------------------------------------------------------------------


def test_new_batch_shapes_and_loss_settings_compile_nothing():
    """Through the public loss: new token and sequence counts, temperature, clipping, KL and aggregation settings
    reuse the binaries of the first call (T is never specialised; the rest is not a kernel argument or a runtime
    one)."""
    kernels = [_loss_triton._logprobs_fwd_kernel, _loss_triton._logprobs_bwd_dz_kernel]
    kernels += [_loss_triton._matmul_dhidden_kernel, _loss_triton._matmul_dweight_kernel]

    def step(lengths: list[int], **options) -> None:
        hidden, weight, _, targets, adv, g = loss_tests.problem(
            len(lengths), lengths, H, V, torch.bfloat16, logit_scale=4.0, bias=False
        )
        hidden, weight, targets = hidden.to(CUDA).requires_grad_(), weight.to(CUDA).requires_grad_(), targets.to(CUDA)
        old = fused_logprobs(hidden, weight, targets) + 0.1 * torch.randn(len(targets), generator=g).to(CUDA)  # [T]
        cu = loss_tests.cu_seqlens(lengths).to(CUDA)
        loss, _ = fused_cppo_loss(hidden, weight, targets, adv.to(CUDA), cu_seqlens=cu,
                                  old_logprobs=old, ref_logprobs=old, **options)  # fmt: skip
        loss.backward()

    with use_backend("triton"):
        step([300, 17], temperature=1.0, beta=0.04)
        first = _binaries(kernels)
        step([5, 1, 64], temperature=0.6, epsilon_low=0.1, epsilon_high=0.28, beta=0.0)
        step([1], temperature=1.7, dual_clip=3.0, beta=0.04, kl_estimator="k1")
        step([1000, 999], loss_agg="seq-mean-token-mean", importance_sampling="sequence")
        assert _binaries(kernels) == first


def test_a_new_number_of_questions_compiles_nothing():
    """Tile shapes depend on the group size only. Triton specialises integer arguments equal to 1 or divisible by
    16, so after one call per class of (number of groups, groups x keep), any other number of groups reuses them."""
    kernels = [_advantages_triton._group_kernel, _advantages_triton._batch_kernel, _advantages_triton._batch_std_kernel]

    def calls(questions: int) -> None:
        rewards = torch.randint(0, 4, (questions * 16,), device=CUDA).float() / 2  # [N]
        for scope in ("group", "batch"):
            for scale in ("group", "batch"):
                adv, _ = cppo_select(rewards, 16, 4, scope=scope, scale=scale)
            select_completions(adv, 16, 4, scope=scope)
        group_advantages(rewards, 16)

    with use_backend("triton"):
        for questions in (1, 2, 4, 16):  # classes (1, other), (other, other), (other, 16k), (16k, 16k)
            calls(questions)
        first = _binaries(kernels)
        for questions in (3, 5, 8, 12, 17, 48, 1000, 4096):
            calls(questions)
        assert _binaries(kernels) == first
