"""The GEMM path (the Triton backend's gradient-in-forward, what CUDA runs under mode="auto"): the row pass under the
interpreter against a float64 oracle (every logit transform, fp32 and bf16 factors, rows of several tiles, targets in
every tile, the in-kernel rescale of a row whose max rises), the chunk rule, batch invariance, and the traffic ledger
checked against what actually runs (a TorchDispatchMode): three GEMMs per chunk, no other operation over a [C, V]
tensor, no [V, H] allocation per chunk.

Every loss type, option and aggregation runs on this path in the shared suites (``LOSS_PATHS`` /
``test_loss.PATHS``: ``triton-grad-in-forward``), against the same float64 oracles as the other paths.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cppo_kernels import _loss_gemm, _loss_rows_triton, fused_cppo_loss, use_backend
from cppo_kernels._ledger import recording
from cppo_kernels._loss_inputs import logit_factors

V, BLOCK = 200, 32  # rows of 7 tiles (the last one partial)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setitem(_loss_rows_triton.ROW_BLOCK_V, "interpreter", BLOCK)


def _oracle(y: torch.Tensor, bias, targets, f):
    """float64 ``(logp, lse, entropy, (softmax - onehot) * slope)`` of the head output ``y [n, V]``."""
    x = y.double() + (0.0 if bias is None else bias.double())
    z = x * f.z_scale if f.cap_out is None else torch.tanh(x * f.z_scale) * f.cap_out  # [n, V]
    logsm = torch.log_softmax(z, 1)
    p = logsm.exp()
    rows = torch.arange(len(targets))
    q = p.clone()
    q[rows, targets] -= 1.0
    if f.cap_out is not None:
        q *= 1.0 - (z / f.cap_out) ** 2
    return logsm[rows, targets], torch.logsumexp(z, 1), -(p * logsm).sum(1), q


def _run_rows(y, q_dtype, bias, targets, f, entropy=True):
    n = len(targets)
    buf = y.clone()
    q = buf if q_dtype == torch.float32 else buf.view(q_dtype)[:, : buf.shape[1]]
    out = tuple(torch.full((n,), float("nan")) for _ in range(4))
    _loss_rows_triton.row_pass(buf, q, bias, targets, f, compute_entropy=entropy, out=out)
    logp, lse, ent, fac = out
    return logp, lse, ent, q[:n].double() * fac.double()[:, None]


TRANSFORMS = {
    "plain": dict(temperature=1.0),
    "temperature-scale": dict(temperature=0.7, logit_scale=2.5),
    "softcap": dict(temperature=0.9, logit_scale=1.3, softcap=6.0),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_the_row_pass_matches_the_fp64_oracle(transform, q_dtype, with_bias):
    g = torch.Generator().manual_seed(1)
    n = 2 * math.ceil(V / BLOCK)
    y = torch.randn(n, V, generator=g) * 3.0  # [n, V]
    targets = torch.arange(n) * BLOCK // 2 % V  # two targets in every tile, the last (partial) one included
    assert set((targets // BLOCK).tolist()) == set(range(math.ceil(V / BLOCK)))
    bias = torch.randn(V, generator=g) if with_bias else None
    f = logit_factors(**TRANSFORMS[transform])
    logp, lse, ent, q = _run_rows(y, q_dtype, bias, targets, f)
    want = _oracle(y, bias, targets, f)
    for name, got, exp in zip(("logp", "lse", "entropy"), (logp, lse, ent), want):
        assert (got.double() - exp).abs().max() < 2e-5 * max(1.0, exp.abs().max()), name
    # the factors: fp32 within the rounding of exp's argument (a few ulp of the largest |z| and of lse: exp turns an
    # absolute error of the logit into a relative one); bf16 within 1 ulp more (the interpreter truncates its stores)
    fp32 = 4 * 2**-24 * (1.0 + want[1].abs().max().item() + (y.abs().max().item() + 3) * abs(TRANSFORMS[transform].get(
        "logit_scale", 1.0) / TRANSFORMS[transform]["temperature"]))  # fmt: skip
    tol = fp32 if q_dtype == torch.float32 else 2**-7 + fp32
    err = (q - want[3]).abs() / want[3].abs().clamp_min(1e-30)
    assert err.max() < tol, f"factor error {err.max():.3g}"


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_whose_max_rises_past_the_margin_is_rescaled(q_dtype, monkeypatch):
    """Tile k's logits lie near 40 k: the row's max passes the reference by more than RESCALE_MARGIN (32 nats) at
    every tile, so the kernel rescales the written prefix each time; the factors still match the oracle (an
    unrescaled prefix would be e^40 too large per tile). A control row with its max in the first tile is never
    rescaled, and a row with the rescale disabled (a huge margin) overflows, showing the branch ran."""
    tiles = math.ceil(V / BLOCK)
    rising = (torch.arange(V) // BLOCK).double() * 40.0 + torch.linspace(-1, 1, V).double()  # [V]
    first = -rising  # the max in the first tile
    y = torch.stack([rising, first]).float()  # [2, V]
    targets = torch.tensor([3, V - 2])
    f = logit_factors(1.0)
    logp, lse, _, q = _run_rows(y, q_dtype, None, targets, f)
    want = _oracle(y, None, targets, f)
    assert (lse.double() - want[1]).abs().max() < 1e-4 and (logp.double() - want[0]).abs().max() < 1e-4
    fp32 = 4 * 2**-24 * (1.0 + 2 * y.abs().max().item())  # exp of a logit near 280: its ulp, relative
    tol = fp32 if q_dtype == torch.float32 else 2**-6 + fp32  # a rescaled bf16 factor is rounded twice
    keep = want[3].abs() > 1e-30  # factors that underflow in fp32 are compared as zeros below
    assert ((q - want[3]).abs()[keep] / want[3].abs()[keep]).max() < tol
    assert (q[~keep].abs() < 1e-30).all()
    assert tiles * 40 > 2 * _loss_rows_triton.RESCALE_MARGIN
    monkeypatch.setattr(_loss_rows_triton, "RESCALE_MARGIN", 1e30)
    _, _, _, q_off = _run_rows(y, q_dtype, None, targets, f)
    assert not torch.isfinite(q_off[0]).all() or (q_off[0] - want[3][0]).abs().max() > 1.0


def test_the_chunk_height_depends_on_the_vocabulary_alone():
    """~1.25 GB of fp32 [C, V]: 2,048 tokens at Qwen2.5's V, 2,432 at Llama 3's; bounded for tiny heads."""
    assert _loss_gemm.chunk_tokens(151_936) == 2048 and _loss_gemm.chunk_tokens(128_256) == 2432
    assert (
        _loss_gemm.chunk_tokens(10) == _loss_gemm.CHUNK_MAX and _loss_gemm.chunk_tokens(10**8) == _loss_gemm.CHUNK_MIN
    )
    assert all(_loss_gemm.chunk_tokens(v) % _loss_gemm.CHUNK_ROUND == 0 for v in (1000, 49_152, 151_936, 256_000))


def _problem(T, H, dtype, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)  # [T, H]
    weight = (torch.randn(vocab, H, generator=g) / math.sqrt(H)).to(dtype)  # [V, H]
    targets = torch.randint(0, vocab, (T,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tokens_results_do_not_depend_on_the_batch(dtype, monkeypatch):
    """Fixed-height logits GEMMs (the last chunk zero-padded) and per-row passes: a sequence's log-prob, lse,
    entropy and dhidden are bit-identical alone or packed at any offset among other tokens, across chunks."""
    monkeypatch.setattr(_loss_gemm, "CHUNK_MAX", 16)
    hidden, weight, targets = _problem(53, 24, dtype)
    g = torch.randn(53, generator=torch.Generator().manual_seed(3))  # [T]

    def run(a, b):
        out = _loss_gemm.logprobs_fwd_grads(
            hidden[a:b], weight, targets[a:b], None, lambda s, e, lp: g[a + s : a + e], temperature=0.8,
            compute_entropy=True, needs_weight_grad=False,
        )  # fmt: skip
        return out[0], out[1], out[2], out[3]

    packed = run(0, 53)
    for a, b in ((5, 22), (30, 53), (16, 32)):  # across a chunk boundary, the padded tail, exactly one chunk
        for name, x, y in zip(("logp", "lse", "entropy", "dhidden"), packed, run(a, b)):
            assert torch.equal(x[a:b], y), (name, a, b)


class _AtenLog(TorchDispatchMode):
    """Every aten op outside the Triton launches (the interpreter copies its arguments), with its tensors' shapes."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(x, torch.Tensor)]
            self.ops.append((func.overloadpacket.__name__, [tuple(t.shape) for t in tensors]))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_ledger_matches_what_runs(dtype, monkeypatch):
    """Per chunk: three GEMMs (logits, dhidden, dweight), at most two passes over [C, V] (the logits GEMM's write,
    the row pass's read and in-place write), no [V, H] allocation: the ledger says so, and the aten ops that ran
    (outside the row pass's launch) agree: the only ops over a [C, V]-sized tensor are the three GEMMs, and the one
    allocation of [V, H] size is the weight gradient's accumulator, made once before the chunks."""
    monkeypatch.setattr(_loss_gemm, "CHUNK_MAX", 16)
    T, H, C = 40, 48, 16
    hidden, weight, targets = _problem(T, H, dtype, seed=5)
    g = torch.randn(T)
    log = _AtenLog()
    real_rows = _loss_gemm.row_pass

    def rows(*args, **kwargs):
        log.paused = True
        try:
            return real_rows(*args, **kwargs)
        finally:
            log.paused = False

    monkeypatch.setattr(_loss_gemm, "row_pass", rows)
    monkeypatch.setattr(_loss_gemm, "_native", lambda device: True)  # the cuBLAS calls, not their CPU stand-in
    monkeypatch.setattr(torch, "mm", _fake_out_dtype(torch.mm, log))
    monkeypatch.setattr(torch, "addmm", _fake_out_dtype(torch.addmm, log))
    with recording() as ledger, log:
        _loss_gemm.logprobs_fwd_grads(hidden, weight, targets, None, lambda s, e, lp: g[s:e], temperature=0.9)
    chunks = math.ceil(T / C)
    gemms = [op for op in ledger.ops if op.kind == "gemm"]
    assert [op.name for op in gemms] == ["logits", "dhidden", "dweight"] * chunks
    passes = [op for op in ledger.ops if op.kind == "pass" and op.read + op.written >= C * V * 2]
    assert [op.name for op in passes] == ["row pass"] * chunks  # the only non-GEMM pass over [C, V]
    assert all(op.read == n * V * 4 for op, n in zip(passes, (16, 16, 8)))
    es = 4 if dtype == torch.float32 else 2
    assert gemms[0].shape == (C, V, H) and gemms[0].written == C * V * 4 and gemms[0].read == (C * H + H * V) * es
    mm_ops = ("mm", "addmm", "addmm_")
    ran = [name for name, _ in log.ops if name in mm_ops]
    assert len(ran) == 3 * chunks, ran
    big = [(name, shapes) for name, shapes in log.ops if any(math.prod(s) >= C * V // 2 and len(s) == 2
                                                                 and V in s for s in shapes)]  # fmt: skip
    alloc_ops = ("empty", "zeros", "empty_like", "new_empty", "full", "zeros_like", "empty_strided")
    moves = [(name, shapes) for name, shapes in big if name not in (*mm_ops, *VIEWS, *alloc_ops)]
    assert moves == [], moves  # nothing but the GEMMs reads or writes [C, V] (views move no data)
    assert sum(1 for name, shapes in big if name in alloc_ops and shapes[-1] == (C, V)) == 1  # once for the call
    allocs = [shapes for name, shapes in log.ops if name in alloc_ops]
    assert sum(1 for shapes in allocs if math.prod(shapes[-1]) >= V * H) == 1, allocs  # dweight, once


#: aten ops that make a view (no data moved).
VIEWS = ("t", "slice", "view", "select", "transpose", "as_strided", "expand", "unsqueeze", "alias", "detach",
         "_unsafe_view", "unbind", "squeeze", "permute")  # fmt: skip


def _fake_out_dtype(fn, log: _AtenLog):
    """torch.mm / torch.addmm that accept CUDA's ``out_dtype=torch.float32`` on the CPU: one fp32 GEMM of the upcast
    operands written into ``out``, logged as the one GEMM it stands for (its upcasts are this stand-in's, not the
    path's, and are not logged), so the test sees the CUDA branch's calls."""

    def call(*args, out_dtype=None, out=None, **kwargs):
        if out_dtype is None:
            return fn(*args, out=out, **kwargs) if out is not None else fn(*args, **kwargs)
        log.paused = True
        try:
            result = fn(*[a.float() if isinstance(a, torch.Tensor) else a for a in args], out=out, **kwargs)
        finally:
            log.paused = False
        log.ops.append((fn.__name__, [tuple(a.shape) for a in (*args, out) if isinstance(a, torch.Tensor)]))
        return result

    return call


def test_the_loss_on_this_path_matches_the_two_pass_kernels():
    """fused_cppo_loss with mode="grad-in-forward" on the Triton backend (this path) against mode="two-pass" (the
    Triton tile kernels) on the same inputs: loss and gradients within fp32 rounding."""
    hidden, weight, targets = _problem(30, 32, torch.float32, seed=9)
    adv = torch.tensor([0.5, -1.0, 2.0])
    cu = torch.tensor([0, 10, 18, 30])
    results = []
    for mode in ("grad-in-forward", "two-pass"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with use_backend("triton"):
            loss, _ = fused_cppo_loss(h, w, targets, adv, cu_seqlens=cu, mode=mode, logit_softcap=8.0, beta=0.0)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for name, x, y in zip(("loss", "dhidden", "dweight"), *results):
        assert torch.allclose(x, y, rtol=1e-4, atol=1e-6), name
