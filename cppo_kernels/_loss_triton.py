"""Triton backend of the fused token log-prob op: kernels and launchers. Logits
``z = softcap * tanh((hidden @ weight^T + bias) * logit_scale / softcap) / temperature`` (the model's own scale and
final cap; ``(hidden @ weight^T + bias) * logit_scale / temperature`` without a cap, the ``HAS_SOFTCAP`` flag) are
computed tile by tile and never materialised as ``[T, V]``; the scale and the cap are runtime values.
The launchers take input already validated by :mod:`cppo_kernels.loss` and do not check it again.

Forward: a program per ``block_t`` tokens walks the vocabulary in ``block_v`` tiles (each tile reduced over H
in ``block_h`` chunks with ``tl.dot``) and keeps an online logsumexp, the target logit and, optionally, the
entropy (as a running sum of p * (z - max), so large logits do not cancel). Only lse/logp/entropy are stored.

Backward (logit tiles recomputed from the saved LSE): for chunks of tokens (length fixed by V and the dtype,
never by T), one kernel writes ``dz = grad * (onehot - softmax) / temperature`` into a ``[chunk, V]`` scratch,
then two fixed-tile matmuls give ``dhidden = dz @ W`` and ``dweight += dz^T @ X`` (fp32 across chunks). About 3
forward-equivalents of FLOPs; scratch <= ``dz_chunk_bytes`` (512 MiB) plus an fp32 ``[V, H]`` accumulator when
bf16/fp16 T spans several chunks.

Decision (issue 9): the no-scratch "slab" backward that used to sit beside it (a program per H slab recomputing
every logit tile: ``2 * (ceil(H / block_h_out) + 1)`` forward-equivalents, 14 at H=1536) is gone. No public path
could pick it, it was 4-5x the FLOPs of the chunked one, and the chunked scratch is bounded; it lives in the git
history (before issue 9) should a no-scratch backward ever be needed.

No atomics anywhere; every reduction has a fixed order, so results are deterministic and a token's logp, lse,
entropy and dhidden do not depend on the other tokens of the launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._dispatch import interpreter_enabled
from ._loss_inputs import LogitFactors, logit_factors
from ._loss_rows_triton import softcap_tanh

__all__ = ["LossKernelConfig", "default_config", "logprobs_fwd", "logprobs_bwd"]


@dataclass(frozen=True)
class LossKernelConfig:
    """Launch configuration: tile sizes, warps and pipeline stages (compile-time constants), and the dz scratch budget.

    ``block_h`` is the reduction chunk of the logit tiles; ``block_h_out`` the N tile (a slab of H) of the two
    gradient matmuls. Tiles are powers of two >= 16 (``tl.dot``). ``dz_chunk_bytes`` bounds the backward's dz
    scratch (dtype of the inputs); the chunk length depends on V and the dtype only, never on T.
    """

    block_t: int
    block_v: int
    block_h: int
    num_warps: int
    num_stages: int
    block_h_out: int = 128
    dz_chunk_bytes: int = 512 * 2**20

    def __post_init__(self) -> None:
        for name in ("block_t", "block_v", "block_h", "block_h_out"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
        if self.num_warps not in (1, 2, 4, 8, 16) or not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"num_warps must be a power of two <= 16 and num_stages >= 1, got {self}")
        if not isinstance(self.dz_chunk_bytes, int) or self.dz_chunk_bytes < 1:
            raise ValueError(f"dz_chunk_bytes must be an int >= 1, got {self.dz_chunk_bytes!r}")

    def dz_chunk_tokens(self, vocab_size: int, dtype: torch.dtype) -> int:
        """Tokens per dz chunk: a multiple of block_t within dz_chunk_bytes (at least one token tile)."""
        per_tile = self.block_t * vocab_size * torch.empty(0, dtype=dtype).element_size()
        return self.block_t * max(1, self.dz_chunk_bytes // per_tile)


def default_config(
    hidden_size: int, vocab_size: int, dtype: torch.dtype, device: torch.device | str
) -> LossKernelConfig:
    """Heuristic launch config; depends on (H, V, dtype, device) only, never on the token count."""
    device = torch.device(device)
    if device.type != "cuda" or interpreter_enabled():
        # Interpreter: cost is programs x loop iterations, so large tiles and few of them.
        return LossKernelConfig(block_t=64, block_v=128, block_h=128, num_warps=4, num_stages=1, block_h_out=256)
    # CUDA: chosen with the sm_80/sm_90 compile checks (tests/test_compile_loss.py): no spills, 1 CTA of 8 warps
    # per SM; block_h_out is the N tile of the gradient matmuls.
    if dtype == torch.float32:  # 3xTF32 dots need about twice the registers of bf16 ones
        return LossKernelConfig(block_t=32, block_v=64, block_h=32, num_warps=8, num_stages=2, block_h_out=64)
    return LossKernelConfig(block_t=64, block_v=64, block_h=64, num_warps=8, num_stages=2, block_h_out=256)


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``acc + a @ b`` in fp32. ``UPCAST_DOT`` (interpreter + bf16 only): the interpreter multiplies the raw
    bits of bf16 operands, so they go in as fp32 (bf16 x bf16 products are exact in fp32 either way)."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _logit_tile(
    x_ptr,
    w_ptr,
    b_ptr,
    n_t,
    n_v,
    H,
    stride_ht,
    stride_wv,
    z_scale,
    cap_out,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """fp32 ``[BLOCK_T, BLOCK_V]`` tile of z (``y * z_scale``, or ``tanh(y * z_scale) * cap_out`` with
    ``HAS_SOFTCAP``, for the head output ``y``) for the ``n_t`` tokens at ``x_ptr`` and ``n_v`` vocab rows at ``w_ptr``.

    Pointers are already offset to the tile (int64 math done once per tile), so in-tile offsets stay int32.
    Columns past ``n_v`` are -inf; rows past ``n_t`` are finite (zero hidden state).
    """
    rt = tl.arange(0, BLOCK_T)
    rv = tl.arange(0, BLOCK_V)
    rh = tl.arange(0, BLOCK_H)
    mask_t = rt < n_t
    mask_v = rv < n_v
    x_ptrs = x_ptr + rt[:, None] * stride_ht + rh[None, :]  # [BT, BH]
    w_ptrs = w_ptr + rv[:, None] * stride_wv + rh[None, :]  # [BV, BH]
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        mask_h = rh < H - h0
        x = tl.load(x_ptrs, mask=mask_t[:, None] & mask_h[None, :], other=0.0)  # [BT, BH]
        w = tl.load(w_ptrs, mask=mask_v[:, None] & mask_h[None, :], other=0.0)  # [BV, BH]
        acc = _dot(x, tl.trans(w), acc, DOT_PRECISION, UPCAST_DOT)
        x_ptrs += BLOCK_H
        w_ptrs += BLOCK_H
    if HAS_BIAS:
        b = tl.load(b_ptr + rv, mask=mask_v, other=0.0).to(tl.float32)  # [BV]
        acc += b[None, :]
    z = acc * z_scale
    if HAS_SOFTCAP:
        z = softcap_tanh(z) * cap_out
    return tl.where(mask_v[None, :], z, float("-inf"))


@triton.jit
def _dlogit_tile(
    x_ptr,
    w_ptr,
    b_ptr,
    n_t,
    n_v,
    tgt,
    lse,
    H,
    stride_ht,
    stride_wv,
    z_scale,
    cap_out,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """fp32 tile of ``d logp / dz = onehot(target) - softmax(z)`` (``tgt`` relative to the tile), times the cap's
    slope ``1 - (z / cap_out)^2`` with ``HAS_SOFTCAP``; 0 outside the tile. The forward's ``lse = m + log(s)``
    (``s >= 1``) is never below a row's largest logit, and ``softmax = exp(min(z - lse, 0))``: a recomputed logit
    that rounds above the forward's (one ulp is 1e3 nats at a logit scale of 1e10) cannot overflow ``exp``."""
    z = _logit_tile(
        x_ptr, w_ptr, b_ptr, n_t, n_v, H, stride_ht, stride_wv, z_scale, cap_out,
        HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, UPCAST_DOT, BLOCK_T, BLOCK_V, BLOCK_H,
    )  # fmt: skip
    p = tl.exp(tl.minimum(z - lse[:, None], 0.0))  # [BT, BV] at most 1, even where z rounds above the forward's
    q = tl.where(tl.arange(0, BLOCK_V)[None, :] == tgt[:, None], 1.0 - p, -p)
    if HAS_SOFTCAP:
        t = tl.minimum(tl.maximum(z / cap_out, -1.0), 1.0)  # |t| <= 1; masked columns (-inf) get slope 0
        q = q * (1.0 - t * t)
    keep = (tl.arange(0, BLOCK_T) < n_t)[:, None] & (tl.arange(0, BLOCK_V) < n_v)[None, :]
    return tl.where(keep, q, 0.0)


@triton.jit(do_not_specialize=["T"])  # token counts change every step: one binary for all
def _logprobs_fwd_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    targets_ptr,
    logp_ptr,
    lse_ptr,
    entropy_ptr,
    T,
    V,
    H,
    stride_ht,
    stride_wv,
    z_scale,
    cap_out,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Per token: lse = logsumexp(z), logp = z[target] - lse, entropy = lse - E_softmax[z]."""
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    rt = tl.arange(0, BLOCK_T)
    mask_t = rt < T - t0
    x_ptr = hidden_ptr + t0 * stride_ht
    tgt = tl.load(targets_ptr + t0 + rt, mask=mask_t, other=0)  # [BT]
    rv = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)  # running max
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)  # sum exp(z - m)
    sd = tl.zeros((BLOCK_T,), dtype=tl.float32)  # sum exp(z - m) * (z - m)
    z_tgt = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        w_ptr = weight_ptr + tl.cast(v0, tl.int64) * stride_wv  # V * H passes 2^31 for large models
        z = _logit_tile(
            x_ptr, w_ptr, bias_ptr + v0, T - t0, V - v0, H, stride_ht, stride_wv,
            z_scale, cap_out, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, UPCAST_DOT, BLOCK_T, BLOCK_V, BLOCK_H,
        )  # fmt: skip
        # Every vocab tile holds a valid column, so m_new is finite (for finite inputs).
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new[:, None])  # [BT, BV]; 0 on masked columns
        if COMPUTE_ENTROPY:
            d = tl.where(rv[None, :] < V - v0, z - m_new[:, None], 0.0)
            shift = tl.where(s > 0, m - m_new, 0.0) * s  # re-centre the old sum on m_new
            sd = alpha * (sd + shift) + tl.sum(p * d, axis=1)
        s = s * alpha + tl.sum(p, axis=1)
        m = m_new
        z_tgt += tl.sum(tl.where(rv[None, :] == (tgt - v0)[:, None], z, 0.0), axis=1)
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(lse_ptr + t0 + rt, lse, mask=mask_t)
    tl.store(logp_ptr + t0 + rt, z_tgt - lse, mask=mask_t)
    if COMPUTE_ENTROPY:
        tl.store(entropy_ptr + t0 + rt, log_s - sd / s, mask=mask_t)


@triton.jit(do_not_specialize=["T"])  # token counts change every step: one binary for all
def _logprobs_bwd_dz_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    targets_ptr,
    lse_ptr,
    grad_ptr,
    dz_ptr,
    T,
    V,
    H,
    stride_ht,
    stride_wv,
    stride_dzt,
    z_scale,
    cap_out,
    grad_scale,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """``dy[t, v] = grad[t] * grad_scale * (onehot - softmax)[t, v]`` (times the cap's slope with ``HAS_SOFTCAP``)
    for one (token tile, vocab tile), ``grad_scale = logit_scale / temperature``."""
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    v0 = tl.program_id(1).to(tl.int64) * BLOCK_V
    rt = tl.arange(0, BLOCK_T)
    rv = tl.arange(0, BLOCK_V)
    mask_t = rt < T - t0
    tgt = tl.load(targets_ptr + t0 + rt, mask=mask_t, other=0)  # [BT]
    lse = tl.load(lse_ptr + t0 + rt, mask=mask_t, other=float("inf"))  # [BT]; p = 0 past T
    g = tl.load(grad_ptr + t0 + rt, mask=mask_t, other=0.0)  # [BT]
    q = _dlogit_tile(
        hidden_ptr + t0 * stride_ht, weight_ptr + v0 * stride_wv, bias_ptr + v0, T - t0, V - v0, tgt - v0, lse,
        H, stride_ht, stride_wv, z_scale, cap_out, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, UPCAST_DOT,
        BLOCK_T, BLOCK_V, BLOCK_H,
    )  # fmt: skip
    dz = q * (g * grad_scale)[:, None]  # [BT, BV]
    out = dz_ptr + t0 * stride_dzt + v0 + rt[:, None] * stride_dzt + rv[None, :]
    tl.store(out, dz.to(dz_ptr.dtype.element_ty), mask=mask_t[:, None] & (rv < V - v0)[None, :])


def _matmul(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[M, N] (+)= a[M, K] @ b[K, N] with fp32 accumulation; one program per output tile, K in a fixed order
    (no split-K), so an output row depends on its own row of ``a`` only."""
    m0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M - m0
    mask_n = rn < N - n0
    a_ptrs = a_ptr + m0 * stride_am + rm[:, None] * stride_am + rk[None, :] * stride_ak  # [BM, BK]
    b_ptrs = b_ptr + n0 * stride_bn + rk[:, None] * stride_bk + rn[None, :] * stride_bn  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = rk < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = _dot(a, b, acc, DOT_PRECISION, UPCAST_DOT)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + m0 * stride_cm + n0 + rm[:, None] * stride_cm + rn[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# The token dimension of a chunk (M of dz @ W, K of dz^T @ X) changes every step: not specialised, so a new token
# count never compiles a new binary. The other dimensions (V, H) keep their divisibility for vectorised loads.
_matmul_dhidden_kernel = triton.jit(do_not_specialize=["M"])(_matmul)
_matmul_dweight_kernel = triton.jit(do_not_specialize=["K"])(_matmul)


# ------------------------------------------------------------------------------------------------
# Host launchers
# ------------------------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: 3xTF32 (near-fp32 accuracy on tensor cores); bf16/fp16: native tensor-core dot."""
    return "tf32x3" if dtype == torch.float32 else "ieee"


def _upcast_dot(hidden: torch.Tensor) -> bool:
    return hidden.dtype == torch.bfloat16 and not hidden.is_cuda and interpreter_enabled()


def _constexprs(hidden: torch.Tensor, bias: torch.Tensor | None, cfg: LossKernelConfig, softcap) -> dict:
    """Compile-time arguments shared by every kernel launch (flags, dtype-derived choices, tiles, warps)."""
    return dict(
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        DOT_PRECISION=_dot_precision(hidden.dtype),
        UPCAST_DOT=_upcast_dot(hidden),
        BLOCK_T=cfg.block_t,
        BLOCK_V=cfg.block_v,
        BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit stride along its last dim (the kernels take row strides only)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def logprobs_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-token ``(logp, lse, entropy)`` in fp32 ``[T]`` of
    ``z = softcap * tanh((hidden @ weight^T + bias) * logit_scale / softcap) / temperature`` (no tanh without a cap).

    ``hidden [T, H]``, ``weight [V, H]`` (hidden's dtype), ``targets [T]`` int in ``[0, V)``, ``bias [V]``.
    ``logp[t] = z[t, targets[t]] - lse[t]``; ``entropy`` is None unless ``compute_entropy``.
    """
    T, H = hidden.shape
    V = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    logp = torch.empty(T, **f32)  # [T]
    lse = torch.empty(T, **f32)  # [T]
    entropy = torch.empty(T, **f32) if compute_entropy else None  # [T]
    if T == 0:
        return logp, lse, entropy
    cfg = default_config(H, V, hidden.dtype, hidden.device)
    f = logit_factors(temperature, logit_scale, softcap)
    hidden, weight, targets = _rows(hidden), _rows(weight), targets.contiguous()
    bias = bias.contiguous() if bias is not None else None
    _logprobs_fwd_kernel[(triton.cdiv(T, cfg.block_t),)](
        hidden,
        weight,
        bias if bias is not None else weight,
        targets,
        logp,
        lse,
        entropy if entropy is not None else logp,
        T,
        V,
        H,
        hidden.stride(0),
        weight.stride(0),
        f.z_scale,
        1.0 if f.cap_out is None else f.cap_out,
        COMPUTE_ENTROPY=compute_entropy,
        **_constexprs(hidden, bias, cfg, softcap),
    )
    return logp, lse, entropy


def logprobs_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    needs_hidden_grad: bool = True,
    needs_weight_grad: bool = True,
    needs_bias_grad: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``sum_t grad_logp[t] * logp[t]`` w.r.t. hidden, weight and bias (None where not needed).

    ``lse`` is the forward's fp32 ``[T]`` LSE; ``grad_logp`` fp32 ``[T]``. With
    ``dz[t, v] = grad_logp[t] * (onehot(targets[t])_v - softmax(z[t])_v) * logit_scale / temperature`` (times the
    cap's slope ``1 - tanh^2`` with a ``softcap``):
    ``dhidden = dz @ weight`` ``[T, H]``, ``dweight = dz^T @ hidden`` ``[V, H]``, ``dbias = dz.sum(0)`` ``[V]``,
    each in its input's dtype. ``needs_bias_grad`` only with a bias.
    """
    T, H = hidden.shape
    V = weight.shape[0]
    dhidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if needs_hidden_grad else None  # [T, H]
    dweight = torch.empty_like(weight, memory_format=torch.contiguous_format) if needs_weight_grad else None  # [V, H]
    dbias = torch.empty_like(bias) if needs_bias_grad else None  # [V]
    if T == 0:
        for grad in (dweight, dbias):
            if grad is not None:
                grad.zero_()
        return dhidden, dweight, dbias
    cfg = default_config(H, V, hidden.dtype, hidden.device)
    hidden, weight, targets = _rows(hidden), _rows(weight), targets.contiguous()
    bias = bias.contiguous() if bias is not None else None
    lse = lse.to(torch.float32).contiguous()  # [T]
    grad_logp = grad_logp.to(torch.float32).contiguous()  # [T]
    f = logit_factors(temperature, logit_scale, softcap)
    _bwd_chunked(hidden, weight, targets, bias, lse, grad_logp, f, cfg, dhidden, dweight, dbias)
    return dhidden, dweight, dbias


def _bwd_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    f: LogitFactors,
    cfg: LossKernelConfig,
    dhidden: torch.Tensor | None,
    dweight: torch.Tensor | None,
    dbias: torch.Tensor | None,
) -> None:
    """Backward through a dz scratch: per chunk of tokens, dz (recomputed logits), then dhidden = dz @ W and
    dweight += dz^T @ X with fixed-tile matmuls; dweight accumulates in fp32 across chunks."""
    T, H = hidden.shape
    V = weight.shape[0]
    chunk = cfg.dz_chunk_tokens(V, hidden.dtype)
    dz = torch.empty(min(chunk, T), V, dtype=hidden.dtype, device=hidden.device)  # [Tc, V]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    single = T <= chunk or dweight is None or dweight.dtype == torch.float32
    dw_acc = dweight if single else torch.empty(V, H, **f32)  # [V, H]
    db_acc = torch.zeros(V, **f32) if dbias is not None else None  # [V]
    flags = _constexprs(hidden, bias, cfg, f.cap_out)
    mm = dict(
        DOT_PRECISION=flags["DOT_PRECISION"], UPCAST_DOT=flags["UPCAST_DOT"],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    bt, bv, bo = cfg.block_t, cfg.block_v, cfg.block_h_out
    for c0 in range(0, T, chunk):
        n = min(chunk, T - c0)
        x = hidden[c0 : c0 + n]  # [n, H]
        d = dz[:n]  # [n, V]
        _logprobs_bwd_dz_kernel[(triton.cdiv(n, bt), triton.cdiv(V, bv))](
            x, weight, bias if bias is not None else weight, targets[c0:], lse[c0:], grad_logp[c0:], d,
            n, V, H, x.stride(0), weight.stride(0), d.stride(0), f.z_scale, 1.0 if f.cap_out is None else f.cap_out,
            f.grad_scale, **flags,
        )  # fmt: skip
        if dhidden is not None and H > 0:
            out = dhidden[c0 : c0 + n]  # [n, H]
            _matmul_dhidden_kernel[(triton.cdiv(n, bt), triton.cdiv(H, bo))](
                d, weight, out, n, H, V, d.stride(0), 1, weight.stride(0), 1, out.stride(0),
                ACCUMULATE=False, BLOCK_M=bt, BLOCK_N=bo, BLOCK_K=bv, **mm,
            )  # fmt: skip
        if dw_acc is not None and H > 0:  # dz^T: [V, n] with strides (1, d.stride(0))
            _matmul_dweight_kernel[(triton.cdiv(V, bv), triton.cdiv(H, bo))](
                d, x, dw_acc, V, H, n, 1, d.stride(0), x.stride(0), 1, dw_acc.stride(0),
                ACCUMULATE=c0 > 0, BLOCK_M=bv, BLOCK_N=bo, BLOCK_K=bt, **mm,
            )  # fmt: skip
        if db_acc is not None:
            db_acc += d.float().sum(0)
    if dweight is not None and dw_acc is not dweight:
        dweight.copy_(dw_acc)
    if dbias is not None:
        dbias.copy_(db_acc)
