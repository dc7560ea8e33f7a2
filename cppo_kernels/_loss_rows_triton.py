"""The row pass of the GEMM path (:mod:`cppo_kernels._loss_gemm`: gradient-in-forward around cuBLAS): one Triton
program per token reads its row of the fp32 head output ``y [C, V]`` (the logits GEMM's) exactly once and writes, in
place over the same row, the row's gradient factor in the dtype of the gradient GEMMs' operand (bf16 for bf16
models, else fp32).

Per row, over ``BLOCK_V`` tiles in a fixed order: the model's logit transform ``z = (y + b) * z_scale`` (with a cap
``tanh((y + b) * z_scale) * cap_out``, the temperature folded in: :class:`cppo_kernels._loss_inputs.LogitFactors`),
an online log-sum-exp (running max ``m``, ``s = sum exp(z - m)``), the target's logit and, with ``COMPUTE_ENTROPY``,
``u = sum exp(z - m) (z - m)`` (so ``entropy = log s - u / s``: no cancellation at large logits). With ``WANT_Q``
each tile is written back as ``q = exp(z - ref) * slope`` (``slope = 1 - (z / cap_out)^2`` with a cap, else 1)
against a per-row reference ``ref`` (the first tile's max): the true factor ``(softmax - onehot) * slope`` is
``q * exp(ref - lse)``, a per-row number (``fac``) that the caller folds into the gradient GEMMs' small ``[C, H]``
operands. When a later tile's max passes ``ref + margin`` (``exp`` would overflow the written values), the
already-written prefix of that row is rescaled in place to the new reference (a second read of the prefix, for
that row only, decided in the kernel: no host sync). After the row, the target's column is written once more as
``(exp(z_t - ref) - exp(lse - ref)) * slope_t`` (``softmax - 1`` at the target).

In place: a bf16 ``q`` of row r lies in the first half of the bytes of the fp32 row r, so tile k's store only
covers fp32 columns already loaded (``< (k + 1) * BLOCK_V / 2``); with fp32 ``q`` each column is overwritten by its own
value's factor. ``tl.debug_barrier`` orders the tile stores before the prefix's re-read and the target's store.

Per row it writes ``logp``, ``lse``, ``entropy`` (with ``COMPUTE_ENTROPY``) and ``fac = exp(ref - lse)``, all fp32.
A token's results depend on its own row alone (fixed tile order, no atomics): batch-invariant by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import interpreter_enabled
from ._loss_inputs import LogitFactors

__all__ = ["row_pass", "ROW_BLOCK_V", "RESCALE_MARGIN"]

#: Vocabulary tile of one row step on CUDA (fp32: 16 KB read per step) and under the interpreter (whose cost is
#: programs x steps; small enough that the tests' rows span several tiles).
ROW_BLOCK_V = {"cuda": 4096, "interpreter": 256}
#: Nats a row's max may rise above its reference before the written prefix is rescaled: ``exp(margin)`` stays far
#: from fp32's / bf16's overflow (e^88.7), and ``fac = exp(ref - lse) >= exp(-margin - log V)`` stays far from
#: their denormals once multiplied by a small upstream gradient.
RESCALE_MARGIN = 32.0


@triton.jit
def softcap_tanh(z):
    """``tanh(z)`` without overflow (triton.language has no tanh on every version): ``(1 - e) / (1 + e)`` with
    ``e = exp(-2 |z|)``, which cancels for small ``|z|``, where its Taylor series to z^9 holds instead (relative
    error < 6e-8 below 0.3): a cap far above the logits bends nothing. Shared with the two-pass kernels."""
    a = tl.abs(z)
    e = tl.exp(-2.0 * a)
    a2 = a * a
    series = a * (1.0 + a2 * (-0.333333333 + a2 * (0.133333333 + a2 * (-0.053968254 + a2 * 0.021869489))))
    th = tl.where(a < 0.3, series, (1.0 - e) / (1.0 + e))
    return tl.where(z < 0, -th, th)


@triton.jit(do_not_specialize=["V"])
def _row_pass_kernel(
    y_ptr,
    q_ptr,
    bias_ptr,
    targets_ptr,
    logp_ptr,
    lse_ptr,
    entropy_ptr,
    fac_ptr,
    V,
    stride_y,
    stride_q,
    z_scale,
    cap_out,
    margin,
    HAS_BIAS: tl.constexpr,
    HAS_CAP: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr,
    WANT_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * stride_y
    q_row = q_ptr + row * stride_q
    tgt = tl.load(targets_ptr + row).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)  # running max (a scalar)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)  # sum exp(z - m)
    u = s  # sum exp(z - m) (z - m)
    zt = s  # the target's logit
    ref = m  # the reference of the written factors
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + cols0
        mask = cols < V
        y = tl.load(y_row + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z = y * z_scale
        if HAS_CAP:
            z = softcap_tanh(z) * cap_out
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        seen = s > 0.0  # a tile before this one (else m is -inf: nothing to rescale)
        dm = tl.where(seen, m, m_new) - m_new  # <= 0; 0 on the first tile (no -inf arithmetic)
        alpha = tl.where(seen, tl.exp(dm), 0.0)
        zm = tl.where(mask, z, m_new) - m_new  # z - m_new, 0 past V
        e = tl.where(mask, tl.exp(zm), 0.0)
        if COMPUTE_ENTROPY:
            u = alpha * (u + dm * s) + tl.sum(e * zm, 0)
        s = s * alpha + tl.sum(e, 0)
        zt += tl.sum(tl.where(cols == tgt, z, 0.0), 0)
        m = m_new
        if WANT_Q:
            if v0 == 0:
                ref = m_new
            if m_new - ref > margin:  # the row's max moved too far: rescale the written prefix to the new reference
                tl.debug_barrier()
                shrink = tl.exp(ref - m_new)
                for p0 in range(0, v0, BLOCK_V):
                    old = tl.load(q_row + p0 + cols0).to(tl.float32)
                    tl.store(q_row + p0 + cols0, (old * shrink).to(q_ptr.dtype.element_ty))
                ref = m_new
            q = tl.where(mask, tl.exp(tl.where(mask, z, ref) - ref), 0.0)
            if HAS_CAP:
                t = tl.minimum(tl.maximum(z / cap_out, -1.0), 1.0)
                q = q * (1.0 - t * t)
            tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    lse = m + tl.log(s)
    tl.store(logp_ptr + row, zt - lse)
    tl.store(lse_ptr + row, lse)
    if COMPUTE_ENTROPY:
        tl.store(entropy_ptr + row, tl.log(s) - u / s)
    if WANT_Q:
        tl.debug_barrier()  # the target's tile store lands before its final value
        qt = tl.exp(zt - ref) - tl.exp(lse - ref)
        if HAS_CAP:
            t = tl.minimum(tl.maximum(zt / cap_out, -1.0), 1.0)
            qt = qt * (1.0 - t * t)
        tl.store(q_row + tgt, qt.to(q_ptr.dtype.element_ty))
        tl.store(fac_ptr + row, tl.exp(ref - lse))


def block_v(device: torch.device) -> int:
    """The row pass's vocabulary tile on ``device``: a constant per device kind (never derived from the call)."""
    return ROW_BLOCK_V["cuda" if device.type == "cuda" and not interpreter_enabled() else "interpreter"]


def row_pass(
    y: torch.Tensor,
    q: torch.Tensor | None,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    f: LogitFactors,
    *,
    compute_entropy: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """The row pass over the ``n = len(targets)`` rows of the fp32 head output ``y [>= n, V]`` (row stride
    ``y.stride(0)``, unit column stride): writes ``out = (logp [n], lse [n], entropy [n] or None, fac [n] or None)``
    and, with ``q`` (a view of ``y``'s memory, fp32 or bf16, ``[>= n, V]``), the rows' gradient factors (module
    docstring). ``bias [V]`` or None, ``targets [n]`` int64. On ``meta`` tensors nothing runs."""
    n, V = targets.shape[0], y.shape[1]
    if n == 0 or y.device.type == "meta":  # meta: a traffic ledger's plan (the GPU kit's roofline), no data
        return
    logp, lse, entropy, fac = out
    want_q = q is not None
    _row_pass_kernel[(n,)](
        y, q if want_q else y, bias if bias is not None else y, targets, logp, lse,
        entropy if entropy is not None else lse, fac if fac is not None else lse,
        V, y.stride(0), q.stride(0) if want_q else y.stride(0),
        f.z_scale, f.cap_out if f.cap_out is not None else 1.0, RESCALE_MARGIN,
        HAS_BIAS=bias is not None, HAS_CAP=f.cap_out is not None, COMPUTE_ENTROPY=compute_entropy,
        WANT_Q=want_q, BLOCK_V=block_v(y.device), num_warps=8 if y.device.type == "cuda" else 1,
    )  # fmt: skip
