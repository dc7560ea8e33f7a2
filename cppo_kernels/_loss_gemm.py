"""Gradient-in-forward around cuBLAS: three GEMMs and one Triton row pass per chunk of tokens (the Triton backend's
``grad-in-forward`` mode, what ``mode="auto"`` runs on CUDA: :data:`cppo_kernels._loss_modes.MODE_RULES`).

Per chunk of :func:`chunk_tokens` tokens (a fixed height from a memory budget, never from T; the last chunk's
hidden states zero-padded to it, so a token's logits come from a GEMM of the same shape whatever its batch):

1. the logits GEMM ``y = h W^T`` in the input dtype with an fp32 output into a ``[C, V]`` buffer (written once);
2. the row pass (:func:`cppo_kernels._loss_rows_triton.row_pass`): each real row read once, the model's logit
   transform, log-sum-exp, the target's log-prob, the entropy where asked, and the row's gradient factor written in
   place (bf16 for bf16 models) with its per-row normaliser ``fac``;
3. the chunk's upstream gradients ``g = d loss / d logp`` from the loss (a callback, O(C)), folded with ``fac``,
   ``-logit_scale / temperature`` into one per-row scale ``r``;
4. ``dhidden = (Q @ W) * r`` (at the fixed height: the padded rows' factors are zeros, and a token's dhidden does not
   depend on its batch) and ``dweight (+)= Q^T @ (h * r)`` (the real rows: a sum over the batch) by cuBLAS, the weight
   gradient accumulated in place into one fp32 ``[V, H]`` buffer (``addmm(..., out_dtype=float32, out=acc)``: no
   ``[V, H]`` temporary); ``dbias (+)= Q^T r``.

So two passes over ``[C, V]`` per chunk (the GEMM's write, the row pass's read and in-place write), against five or
more separate torch kernels in :mod:`cppo_kernels._loss_torch`. The operations of every chunk are entered in the
traffic ledger (:mod:`cppo_kernels._ledger`) when one is recording: the GPU kit's roofline reads it.

On the CPU (the tests, under the Triton interpreter) the same code runs; torch has no CPU GEMM with bf16 operands
and an fp32 output, so there the bf16 GEMMs run as fp32 GEMMs of the upcast operands (exact: a bf16 value is an
fp32 value), outside the ledger, which records the cuBLAS call they stand for.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _loss_triton
from ._ledger import record
from ._loss_inputs import LogitFactors
from ._loss_rows_triton import row_pass
from ._loss_torch import entry_points, zeroed_unless

__all__ = ["logprobs_fwd", "logprobs_fwd_grads", "logprobs_bwd", "chunk_tokens", "CHUNK_BUDGET_BYTES"]

#: The fp32 ``[C, V]`` buffer's budget: C = the largest multiple of :data:`CHUNK_ROUND` rows within it (2,048 tokens
#: at V = 151,936: 1.24 GB; 2,432 at V = 128,256), between :data:`CHUNK_MIN` and :data:`CHUNK_MAX`.
CHUNK_BUDGET_BYTES = 1_250_000_000
CHUNK_ROUND, CHUNK_MIN, CHUNK_MAX = 128, 128, 4096


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk (the GEMMs' fixed height) for a head of ``vocab_size`` rows: depends on V alone."""
    rows = CHUNK_BUDGET_BYTES // (4 * max(vocab_size, 1)) // CHUNK_ROUND * CHUNK_ROUND
    return min(max(rows, CHUNK_MIN), CHUNK_MAX)


def _native(device: torch.device) -> bool:
    """Whether half-precision GEMMs with fp32 outputs run as such (cuBLAS) rather than emulated in fp32 (CPU)."""
    return device.type == "cuda"


def gemm(a: Tensor, b: Tensor, out: Tensor, *, accumulate: bool = False, name: str = "gemm") -> Tensor:
    """``out (+)= a @ b`` into fp32 ``out``, in place: one cuBLAS GEMM with fp32 accumulation and output for bf16
    operands on CUDA (``mm`` / ``addmm`` with ``out_dtype``), one fp32 ``mm`` / ``addmm_`` for fp32 operands, and on
    the CPU an fp32 GEMM of the upcast bf16 operands (the same numbers). Entered in the ledger as one GEMM."""
    m, k = a.shape
    n = b.shape[1]
    es = a.element_size()
    record(name, "gemm", flops=2 * m * n * k, read=(m * k + k * n) * es + (m * n * 4 if accumulate else 0),
           written=m * n * 4, shape=(m, n, k))  # fmt: skip
    if a.dtype == torch.float32:
        return out.addmm_(a, b, beta=1.0 if accumulate else 0.0)
    if not _native(a.device):  # CPU stand-in for the cuBLAS call (exact upcast)
        return out.addmm_(a.float(), b.float(), beta=1.0 if accumulate else 0.0)
    if accumulate:
        return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


def _compute_weight(weight: Tensor) -> Tensor:
    """The GEMMs' weight: itself for fp32 and bf16; an fp32 copy for fp16 (its range cannot hold the weight
    gradient's scaled operand ``h * r``)."""
    return weight if weight.dtype in (torch.float32, torch.bfloat16) else weight.float()


class _Chunked:
    """The per-call buffers and accumulators: the ``[C, H]`` padded hidden states, the ``[C, V]`` fp32 head output
    (and its in-place gradient-factor view), and with gradients the fp32 ``dhidden [T, H]``, ``dweight [V, H]``,
    ``dbias [V]``."""

    def __init__(self, hidden: Tensor, w: Tensor, bias: Tensor | None, needs: tuple[bool, bool, bool] | None):
        (T, H), V, device = hidden.shape, w.shape[0], hidden.device
        self.C = chunk_tokens(V)
        f32 = dict(dtype=torch.float32, device=device)
        self.h = torch.zeros(self.C, H, dtype=w.dtype, device=device)  # [C, H]
        self.y = torch.empty(self.C, V, **f32)  # [C, V] the head output, then the gradient factors in place
        self.q = None
        if needs is not None:  # the factors in the GEMMs' dtype over the same bytes: fp32 itself, bf16 its front half
            self.q = self.y if w.dtype == torch.float32 else self.y.view(w.dtype)[:, :V]  # [C, V] row stride 2V
        needs = needs or (False, False, False)
        self.dhidden = torch.empty(T, H, **f32) if needs[0] else None  # [T, H]
        self.dweight = torch.empty(V, H, **f32) if needs[1] else None  # [V, H], written by the first chunk
        self.dbias = torch.empty(V, 1, **f32) if needs[2] and bias is not None else None  # [V, 1]
        self.dh = torch.empty(self.C, H, **f32) if needs[0] else None  # [C, H]
        self.hs = torch.empty(self.C, H, dtype=w.dtype, device=device) if needs[1] else None  # [C, H] h * r
        self.written = False

    def grads(self, n: int, start: int, w: Tensor, r: Tensor) -> None:
        """The gradient GEMMs of the chunk's ``n`` real rows (``r [n]``: their per-row scale)."""
        q = self.q[:n]  # [n, V]
        if self.dh is not None:  # at the fixed height too (the padded rows' factors are zeros): a token's dhidden
            gemm(self.q, w, self.dh, name="dhidden")  # [C, H] does not depend on its batch either
            torch.mul(self.dh[:n], r[:, None], out=self.dhidden[start : start + n])
            record("dhidden scale", "pass", read=n * w.shape[1] * 4, written=n * w.shape[1] * 4)
        if self.dweight is not None:
            hs = torch.mul(self.h[:n], r[:, None], out=self.hs[:n])  # [n, H] one rounding to the GEMM's dtype
            record("h * r", "pass", read=n * w.shape[1] * w.element_size(), written=n * w.shape[1] * w.element_size())
            gemm(q.t(), hs, self.dweight, accumulate=self.written, name="dweight")
        if self.dbias is not None:
            gemm(q.t(), r[:, None].to(q.dtype), self.dbias, accumulate=self.written, name="dbias")
        self.written = True

    def result(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(dhidden, dweight, dbias)`` in fp32, zeros where no chunk wrote (an empty call)."""
        dweight, dbias = zeroed_unless(self.written, self.dweight, self.dbias)
        return self.dhidden, dweight, None if dbias is None else dbias.view(-1)


def _forward(hidden, weight, targets, bias, f: LogitFactors, compute_entropy: bool, upstream, needs, bounds=None):
    """``(logp, lse, entropy, chunked)``: the chunked GEMM + row pass (module docstring), with the gradients when
    ``upstream`` is given; ``bounds``: the chunks' ``(start, stop)``, each at most :func:`chunk_tokens` (default:
    fixed chunks)."""
    (T, H), V, device = hidden.shape, weight.shape[0], hidden.device
    w = _compute_weight(weight)  # [V, H]
    b = None if bias is None else bias.float()  # [V]
    f32 = dict(dtype=torch.float32, device=device)
    logp, lse = torch.empty(T, **f32), torch.empty(T, **f32)  # [T]
    entropy = torch.empty(T, **f32) if compute_entropy else None  # [T]
    work = _Chunked(hidden, w, bias, None if upstream is None else needs)
    fac = torch.empty(work.C, **f32) if upstream is not None else None  # [C]
    bounds = bounds if bounds is not None else [(s, min(s + work.C, T)) for s in range(0, T, work.C)]
    if any(b - a > work.C for a, b in bounds):
        raise ValueError(f"a chunk of the GEMM path holds at most {work.C} tokens at V = {V}, got {bounds}")
    for start, stop in bounds:
        n = stop - start
        work.h[:n].copy_(hidden[start:stop])
        if n < work.C:
            work.h[n:].zero_()
        record("h copy", "pass", read=n * H * hidden.element_size(), written=work.C * H * w.element_size())
        gemm(work.h, w.t(), work.y, name="logits")  # [C, V] fp32, the fixed height
        out = (logp[start:stop], lse[start:stop], None if entropy is None else entropy[start:stop], fac)
        row_pass(work.y, work.q, b, targets[start:stop], f, compute_entropy=compute_entropy, out=out)
        qs = 4 if work.q is None else work.q.element_size()
        record("row pass", "pass", read=n * V * 4, written=n * V * qs if work.q is not None else 0)
        if upstream is not None and n:
            r = upstream(start, stop, logp[start:stop]) * (-f.grad_scale) * fac[:n]  # [n]
            record("policy terms", "small", read=n * 4 * 8, written=n * 4 * 4)
            work.grads(n, start, w, r)
    return logp, lse, entropy, work


#: The chunked backends' interface (:func:`cppo_kernels._loss_torch.entry_points`) over this path's forward: the
#: log-probs alone (no factors written; bit-identical to those of the gradient pass) and with the fp32 gradients.
logprobs_fwd, logprobs_fwd_grads = entry_points(_forward)


#: A second backward through a retained graph recomputes the gradients with the Triton two-pass backward.
logprobs_bwd = _loss_triton.logprobs_bwd
