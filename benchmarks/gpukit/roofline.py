"""The roofline of a fused-loss method: its traffic ledger at a shape (GEMMs with their flops, passes over memory with
the bytes they read and write) and the time the GPU's GEMM rate and memory bandwidth predict for it.

Where each ledger comes from (no GPU needed: every one is built on the ``meta`` device, so the kit's shapes cost
nothing):

- ``fused-grad-in-forward-gemm`` (what ``mode="auto"`` runs on CUDA): the path's own ledger
  (:mod:`cppo_kernels._ledger`), entered by ``cppo_kernels._loss_gemm`` as it runs;
- ``fused-grad-in-forward-cublas`` (the torch backend's gradient-in-forward on CUDA, the 2026-12-04 kit's fast
  path): the aten operations ``cppo_kernels._loss_torch`` issues in its CUDA configuration (bf16 GEMMs with fp32
  outputs, 1,024-token chunks), recorded by a ``TorchDispatchMode``, plus the backward's scale and cast;
- ``fused-two-pass-triton``, ``naive``, ``liger-triton``: counted from their code (below), as operations per call.

Prediction: a GEMM takes ``max(flops / rate, bytes / bandwidth)``; every other operation ``bytes / bandwidth``. A
row-wise softmax over rows longer than a block (608 KB at V = 151,936) reads its input three times (max, sum, write)
and a log-sum-exp twice: :data:`ROW_READS`. Launch overheads, wave quantisation and caches are not modelled: a
measurement far above its prediction names work the ledger does not show.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cppo_kernels._ledger import Ledger, Op, recording

#: Peak HBM bandwidth (bytes/s) by GPU, for a prediction without a measured one (the kit measures a copy).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}
#: Reads of its input by a row-wise reduction over rows longer than one block (CUDA's softmax kernels).
ROW_READS = {"log_softmax": 3, "_log_softmax": 3, "softmax": 3, "_softmax": 3, "logsumexp": 2}
#: aten ops that move no data.
NO_DATA = {"t", "slice", "view", "select", "transpose", "as_strided", "expand", "unsqueeze", "alias", "detach",
           "_unsafe_view", "unbind", "squeeze", "permute", "empty", "empty_like", "empty_strided", "new_empty",
           "zeros_like", "zero_", "lift_fresh"}  # fmt: skip
GEMMS = {"mm", "addmm", "addmm_", "addmv", "addmv_", "bmm"}


def predict_ms(ops: list[Op], *, gemm_flops_per_s: float, bandwidth: float) -> float:
    """The roofline time of ``ops`` in ms."""
    total = 0.0
    for op in ops:
        if op.kind == "gemm":
            total += max(op.flops / gemm_flops_per_s, op.bytes / bandwidth)
        else:
            total += op.bytes / bandwidth
    return total * 1e3


class _AtenLedger(TorchDispatchMode):
    """Every aten op as a ledger entry: GEMMs with their flops, the rest with the bytes of their tensor arguments
    (read) and results (written); views and allocations move nothing."""

    def __init__(self):
        super().__init__()
        self.ledger = Ledger()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name not in NO_DATA:
            ins = [t for t in tree_leaves((args, {k: v for k, v in kwargs.items() if k != "out"}))
                   if isinstance(t, torch.Tensor)]  # fmt: skip
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            read = sum(t.numel() * t.element_size() for t in ins) * ROW_READS.get(name, 1)
            written = sum(t.numel() * t.element_size() for t in outs)
            flops = 0
            if name in GEMMS:
                a, b = _gemm_operands(name, ins)
                flops = 2 * a.shape[0] * a.shape[1] * (b.shape[1] if b.dim() == 2 else 1)
            kind = "gemm" if name in GEMMS else "pass"
            self.ledger.ops.append(Op(name, kind, flops, read, written, tuple(outs[0].shape) if outs else ()))
        return out


def _gemm_operands(name: str, ins: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The two multiplied operands of a GEMM's inputs (``addmm`` / ``addmv``: after the added one)."""
    return (ins[0], ins[1]) if name in ("mm", "bmm") else (ins[1], ins[2])


def aten_ledger(fn: Callable[[], object]) -> Ledger:
    """The aten operations ``fn`` runs (on meta tensors), as a ledger."""
    mode = _AtenLedger()
    with mode:
        fn()
    return mode.ledger


def _meta_inputs(T: int, H: int, V: int, dtype: torch.dtype):
    meta = torch.device("meta")
    return (torch.empty(T, H, dtype=dtype, device=meta), torch.empty(V, H, dtype=dtype, device=meta),
            torch.empty(T, dtype=torch.int64, device=meta))  # fmt: skip


def gemm_path(T: int, H: int, V: int, dtype: torch.dtype) -> Ledger:
    """``cppo_kernels._loss_gemm``'s own ledger for a forward + backward at ``[T, H] x [V, H]``, as it runs on CUDA
    (its GEMMs are the cuBLAS ones whatever the device: the CPU stand-in is not entered), plus the backward's scale
    and cast of the two gradients."""
    from cppo_kernels import _loss_gemm

    h, w, t = _meta_inputs(T, H, V, dtype)
    with recording() as ledger:
        _, _, _, dh, dw, _ = _loss_gemm.logprobs_fwd_grads(h, w, t, None, lambda a, b, lp: torch.ones_like(lp))
    ledger.ops += _scale_and_cast(dh, dw, dtype)
    return ledger


def _scale_and_cast(dh: torch.Tensor, dw: torch.Tensor, dtype: torch.dtype) -> list[Op]:
    """GradInForward's backward: the fp32 gradients times the incoming gradient, cast to the inputs' dtype in one
    pass each."""
    es = torch.empty(0, dtype=dtype).element_size()
    return [Op("scale and cast", "pass", 0, g.numel() * 4, g.numel() * es) for g in (dh, dw)]


def old_cublas_path(T: int, H: int, V: int, dtype: torch.dtype) -> Ledger:
    """The torch backend's gradient-in-forward in its CUDA configuration (``cppo_kernels._loss_torch``: bf16 GEMMs
    with fp32 outputs, ``CUDA_FWD_TOKENS`` chunks), its aten ops recorded on meta tensors; then the backward's
    scale (in place, fp32) and cast, as ``GradInForward.backward`` ran them on 2026-12-04 (two passes)."""
    from unittest import mock

    from cppo_kernels import _loss_torch

    h, w, t = _meta_inputs(T, H, V, dtype)
    with (
        mock.patch.object(_loss_torch, "half_gemms", lambda device, d: d == torch.bfloat16),
        mock.patch.object(_loss_torch, "chunk_tokens", lambda device: _loss_torch.CUDA_FWD_TOKENS),
    ):
        out = {}

        def run():
            out["grads"] = _loss_torch.logprobs_fwd_grads(h, w, t, None, lambda a, b, lp: torch.ones_like(lp))

        ledger = aten_ledger(run)
    es = torch.empty(0, dtype=dtype).element_size()
    for g in out["grads"][3:5]:
        ledger.ops += [Op("scale (mul_)", "pass", 0, g.numel() * 4 * 2, g.numel() * 4),
                       Op("cast (.to)", "pass", 0, g.numel() * 4, g.numel() * es)]  # fmt: skip
    return ledger


def counted_paths(T: int, H: int, V: int, dtype: torch.dtype) -> dict[str, Ledger]:
    """The ledgers counted from the methods' code, per call (bytes of bf16 ``[T, V]`` logits: ``2 T V``)."""
    es = torch.empty(0, dtype=dtype).element_size()
    gemm = 2 * T * H * V
    tv, vh, th = T * V, V * H, T * H

    def g(name, read, written, flops=gemm):
        return Op(name, "gemm", flops, read, written)

    def p(name, read, written):
        return Op(name, "pass", 0, read, written)

    operands = (th + vh) * es
    naive = [  # (h @ w.t()).float(), cppo_loss_from_logits: logsumexp + gather; backward: softmax, cast, 2 GEMMs
        g("logits", operands, tv * es), p(".float()", tv * es, tv * 4), p("logsumexp", tv * 4 * 2, T * 4),
        p("softmax backward", tv * 4 * 2, tv * 4), p("cast to bf16", tv * 4, tv * es),
        g("dhidden", tv * es + vh * es, th * es), g("dweight", tv * es + th * es, vh * es),
    ]  # fmt: skip
    liger = [  # logits (bf16) + triton_grpo_loss: its forward reads them, its backward reads them and writes dlogits
        g("logits", operands, tv * es), p("grpo loss forward", tv * es, T * 4),
        p("grpo loss backward", tv * es, tv * es), g("dhidden", tv * es + vh * es, th * es),
        g("dweight", tv * es + th * es, vh * es),
    ]  # fmt: skip
    two_pass = [  # four GEMM-sized products inside Triton kernels (forward; backward recomputes the logits)
        g("forward logits (tiles)", operands, T * 8), g("backward logits (tiles)", operands, tv * es),
        p("dz scratch", 0, 0), g("dhidden", tv * es + vh * es, th * 4), g("dweight", tv * es + th * es, vh * 4),
        p("cast", (th + vh) * 4, (th + vh) * es),
    ]  # fmt: skip
    return {name: Ledger(ops) for name, ops in
            (("naive", naive), ("liger-triton", liger), ("fused-two-pass-triton", two_pass))}  # fmt: skip


def ledgers(T: int, H: int, V: int, dtype: torch.dtype) -> dict[str, Ledger]:
    """Every method's ledger the kit can predict, by its ``bench_loss`` name (loss-type variants share theirs)."""
    return {
        "fused-grad-in-forward-gemm": gemm_path(T, H, V, dtype),
        "fused-grad-in-forward-cublas": old_cublas_path(T, H, V, dtype),
        **counted_paths(T, H, V, dtype),
    }


def method_ledger(name: str, table: dict[str, Ledger]) -> Ledger | None:
    """``name``'s ledger: its own, or its loss type's base method's (``...-sapo``)."""
    if name in table:
        return table[name]
    base = name.rsplit("-", 1)[0]
    return table.get(base) if name.startswith("fused") else None


def roofline(names, T: int, H: int, V: int, dtype: torch.dtype, *, gemm_ms: float, bandwidth: float) -> dict:
    """Per method of ``names``: ``predicted_ms`` (None without a ledger), the ledger's totals; ``gemm_ms``: one
    ``[T, H] x [H, V]`` GEMM as measured, which sets the rate."""
    table = ledgers(T, H, V, dtype)
    rate = 2 * T * H * V / (gemm_ms / 1e3)
    out = {}
    for name in names:
        ledger = method_ledger(name, table)
        out[name] = (
            {"predicted_ms": None}
            if ledger is None
            else {"predicted_ms": predict_ms(ledger.ops, gemm_flops_per_s=rate, bandwidth=bandwidth), **ledger.totals()}
        )
    return out


def floor_ratio(predicted_ms: float, gemm_ms: float) -> float:
    """A prediction over the 3-GEMM floor."""
    return predicted_ms / (3 * gemm_ms) if gemm_ms > 0 else math.nan


def prediction_file(T: int, H: int, V: int, dtype: torch.dtype, *, gemm_ms: float, bandwidth: float) -> dict:
    """The predictions the docs quote for a shape (``benchmarks/results/gpu/roofline-*.json``): every method's
    roofline ms and its ratio to the 3-GEMM floor, and the GEMM path's working buffers (the fp32 ``[C, V]`` block,
    the fp32 weight gradient and the fp32 hidden gradient) in GB."""
    from cppo_kernels import _loss_gemm

    names = list(ledgers(T, H, V, dtype))
    rows = roofline(names, T, H, V, dtype, gemm_ms=gemm_ms, bandwidth=bandwidth)
    buffers = 4 * (_loss_gemm.chunk_tokens(V) * V + V * H + T * H)
    return {
        "shape": {"T": T, "H": H, "V": V, "dtype": str(dtype).removeprefix("torch.")},
        "gemm_ms": gemm_ms, "bandwidth_tbs": bandwidth / 1e12,
        "methods": {n: {"predicted_ms": round(r["predicted_ms"], 2),
                        "x_floor": round(floor_ratio(r["predicted_ms"], gemm_ms), 3)} for n, r in rows.items()},
        "gemm_path_buffers_gb": round(buffers / 1e9, 2),
    }  # fmt: skip
