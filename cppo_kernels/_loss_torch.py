"""Chunked PyTorch backend of the fused log-prob op: the CPU path, the fallback without Triton, and the
gradient-in-forward path of :func:`cppo_kernels.fused_cppo_loss` (CPU BLAS on the CPU, cuBLAS on CUDA).

Logits are the model's own: ``z = softcap * tanh((h W^T + b) * logit_scale / softcap) / temperature`` (Gemma's
final cap, Cohere's / Granite's scale; without a cap ``(h W^T + b) * logit_scale / temperature``): the scale rides
in the GEMM's ``alpha``, the cap is one in-place ``tanh`` of the block, and the gradients take the cap's slope
``1 - (z / cap_out)^2`` elementwise (one more block-sized buffer, only with a cap).

Same interface as ``_loss_triton`` (``logprobs_fwd`` / ``logprobs_bwd``) plus ``logprobs_fwd_grads``, over packed
rows already validated by :mod:`cppo_kernels.loss`; fp32 logits and accumulation (bf16/fp16 weights are upcast once
per call, except CUDA bf16 ones, which feed bf16 cuBLAS GEMMs with fp32 outputs); never a ``[T, V]``
allocation.

- Forward: a fixed chunk of :func:`chunk_tokens` tokens (192 on the CPU) at a time against the whole vocabulary:
  1 matmul into a ``[chunk, V]`` buffer and an in-place ``log_softmax`` (row-local, so about one pass over
  memory). Every logit matmul runs on a block of fixed height, zero-padded: BLAS may pick different kernels for
  different row counts, and fixed shapes are what make a token's log-prob independent of the tokens it is batched
  with, bit for bit. Full chunks are ``[chunk, H]``; a partial one is rounded up to a multiple of ``TAIL_TOKENS``
  rows on the CPU where a probe finds this BLAS giving a row the same bits at each such height (:func:`block_rows`),
  else padded to a full chunk.
- Gradient in the forward (``logprobs_fwd_grads``): the same forward, then, while the chunk's log-softmax is still
  in the buffer, the chunk's upstream gradients ``g`` (a callback: the loss knows them from each token alone),
  ``Q = softmax - onehot`` in place (one ``exp``), ``dhidden = (Q @ W) * (-g / temperature)`` and
  ``dweight += Q^T @ (h * -g / temperature)``: 3 matmuls in all, against 4 for the two passes; the two gradient
  matmuls on the chunk's real tokens only (not its zero-padded tail: one short row costs a fraction of a chunk).
- Backward (two-pass): ``[BWD_TOKENS, BWD_VOCAB]`` blocks, so all three matmuls are large: recompute the logits,
  ``Q = exp(min(z - lse, 0)) - onehot`` in place, ``dhidden += Q @ W_b`` and ``dweight_b += Q^T @ (-g * h)``.
  The forward's ``lse`` is ``max + log sum exp(z - max)``, never below the row's largest logit; the ``min`` keeps
  each recomputed probability at most 1 where this block's GEMM rounds a logit above the forward's (at a logit
  scale of 1e10 one ulp of a logit is 1e3 nats: ``exp`` would overflow and the gradients turn NaN).
  The upstream gradient ``g`` scales the small ``[tokens, H]`` operands, never the ``[tokens, V]`` block;
  ``dweight`` is read and written once per token block instead of once per small chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._loss_inputs import LogitFactors, logit_factors

__all__ = ["logprobs_fwd", "logprobs_fwd_grads", "logprobs_bwd", "chunk_tokens", "sequence_chunks", "entry_points"]

# Block sizes: constants (never derived from T), so results do not depend on batch composition.
#: Tokens per forward chunk on the CPU (workspace ``FWD_TOKENS x V`` fp32: 117 MB at V = 151,936, under a tenth
#: of the naive loss's [T, V] logits and log-softmax at T = 1,024: issue 39). 192 costs ~3.5% more CPU time than
#: 256 for fwd + bwd at T = 1,024, H = 896 (8.4 against 8.1 s, one thread, interleaved); 256 had measured as fast as
#: 512 and 128 at T = 2048 on 2 cores.
FWD_TOKENS = 192
#: GEMM height granularity of the forward's partial chunks on the CPU: a short call (one kept completion, ~40
#: tokens) pays a 64-row logits GEMM, not a 256-row one (0.05 s against 0.2 s at V = 49,152, H = 576). Only where
#: the BLAS gives each row the same bits at every multiple of it up to the chunk (probed once per weight shape,
#: dtype and thread count: :func:`block_rows`), so a token's log-prob still does not depend on its batch; else a
#: partial chunk is padded to the full chunk.
TAIL_TOKENS = 64
#: Tokens per forward chunk on CUDA (``[1024, V]`` fp32: 622 MB at V = 151,936): large enough for cuBLAS and few
#: launches; not yet timed on a GPU (the GPU kit may retune it).
CUDA_FWD_TOKENS = 1024
#: Rows per entropy block (a ``[rows, V]`` fp32 scratch).
ENTROPY_ROWS = 16
#: The backward block: ``BWD_TOKENS x BWD_VOCAB``.
BWD_TOKENS = 1024
BWD_VOCAB = 4096


def chunk_tokens(device: torch.device) -> int:
    """Tokens per forward chunk on ``device``: a constant per device type."""
    return CUDA_FWD_TOKENS if device.type == "cuda" else FWD_TOKENS


#: :func:`block_rows`'s probes: (weight shape, dtype, bias?, cap?, chunk, block, threads) -> rows invariant.
_BLOCK_PROBES: dict[tuple, bool] = {}
#: The head rows :func:`block_rows` probes: a GEMM's rows come out the same over the first 8,192 columns as over all
#: of them (measured on this machine's BLAS: 6 head shapes from 4,096 x 128 to 151,936 x 1,536, with and without
#: bias and cap, 1 and 2 threads), and the probe then holds ~8 MB where the whole head's [chunk, V] took 117-155 MB.
PROBE_VOCAB = 8192


def block_rows(w: Tensor, bias: Tensor | None, f: LogitFactors, C: int) -> int:
    """The height granularity of the forward's partial chunks: :data:`TAIL_TOKENS` on the CPU when the logits of
    random rows against ``w`` come out bit-identical from GEMMs of every multiple of ``TAIL_TOKENS`` rows below
    ``C`` and from a ``C``-row GEMM (probed once per weight shape, dtype, bias, cap and thread count), else ``C``."""
    if w.device.type != "cpu" or not 0 < TAIL_TOKENS < C:
        return C
    key = (tuple(w.shape), w.dtype, bias is None, f.cap_out is None, C, TAIL_TOKENS, torch.get_num_threads())
    if key not in _BLOCK_PROBES:  # on the first PROBE_VOCAB rows of the head: a few MB, not a [C, V] block
        h = torch.randn(C, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)  # [C, H]
        ws, bs = w[:PROBE_VOCAB], None if bias is None else bias[:PROBE_VOCAB]  # [V', H], [V']
        full = _logits_into(torch.empty(C, ws.shape[0]), h, ws, bs, f)  # [C, V']
        heights = range(TAIL_TOKENS, C, TAIL_TOKENS)
        parts = (_logits_into(torch.empty(m, ws.shape[0]), h[:m], ws, bs, f) for m in heights)
        _BLOCK_PROBES[key] = all(torch.equal(full[: part.shape[0]], part) for part in parts)
    return TAIL_TOKENS if _BLOCK_PROBES[key] else C


def _chunks(T: int, C: int, block: int, bounds: list[tuple[int, int]] | None) -> list[tuple[int, int, int]]:
    """``(start, stop, rows)`` of the forward's chunks (``bounds``: given chunks of at most ``C`` tokens; else full
    chunks of ``C`` tokens and the rest), each GEMM ``rows`` high: ``C``, or the rows rounded up to ``block``."""
    bounds = bounds if bounds is not None else [(s, min(s + C, T)) for s in range(0, T, C)]
    return [(a, b, min(C, -(-(b - a) // block) * block)) for a, b in bounds]


def sequence_chunks(lengths: Tensor, C: int) -> list[tuple[int, int, int, int]]:
    """``(start, stop, first sequence, end sequence)`` of chunks of whole sequences, each at most ``C`` tokens
    (every sequence fits one: :func:`cppo_kernels._loss_modes.call_mode`), filled greedily in order."""
    chunks, start, s0, size = [], 0, 0, 0
    for s, n in enumerate(lengths.tolist()):
        if size + n > C and size:
            chunks.append((start, start + size, s0, s))
            start, s0, size = start + size, s, 0
        size += n
    if size or not chunks:
        chunks.append((start, start + size, s0, len(lengths)))
    return chunks


def _fp32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.float()


def half_gemms(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the forward multiplies by the weight in its own dtype (tensor-core GEMMs, fp32 outputs): CUDA bf16
    only, on a torch with :data:`_MM_OUT_DTYPE`. fp16 goes through fp32: its range is too small for the weight
    gradient's scaled operand ``h * -g / temperature`` (a ratio up to e^20 overflows it, a tiny ``g`` underflows)."""
    return device.type == "cuda" and dtype == torch.bfloat16 and _MM_OUT_DTYPE


#: ``torch.mm(a, b, out_dtype=torch.float32)`` for half-precision operands: torch >= 2.8 (older: fp32 GEMMs).
_MM_OUT_DTYPE = torch.torch_version.TorchVersion(torch.__version__) >= (2, 8)


def _compute_weight(weight: Tensor) -> Tensor:
    """The weight the forward multiplies by: itself in fp32 or for :func:`half_gemms`, else an fp32 copy (one per
    call)."""
    return weight if weight.dtype == torch.float32 or half_gemms(weight.device, weight.dtype) else weight.float()


def _half_gemm(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """fp32 ``a @ b`` of CUDA bf16 operands: one cuBLAS tensor-core GEMM with fp32 accumulation and output."""
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


def _matmul(a: Tensor, b: Tensor, out: Tensor, *, accumulate: bool = False, alpha: float = 1.0) -> Tensor:
    """``out (+)= alpha * a @ b`` into fp32 ``out``: in place for fp32 operands; for CUDA bf16 operands
    :func:`_half_gemm` (into ``out``, or into an fp32 temporary the size of ``out`` that is then added)."""
    if a.dtype == torch.float32:
        return out.addmm_(a, b, beta=1.0 if accumulate else 0.0, alpha=alpha)
    if accumulate:
        return out.add_(_half_gemm(a, b), alpha=alpha)
    _half_gemm(a, b, out=out)
    return out if alpha == 1.0 else out.mul_(alpha)


def _logits_into(z: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None, f: LogitFactors) -> Tensor:
    """``z = softcap * tanh((h @ weight^T + bias) * logit_scale / softcap) / temperature`` (without a cap
    ``(h @ weight^T + bias) * logit_scale / temperature``) in place, one GEMM. ``z [n, V]`` fp32, ``h [n, H]``
    weight's dtype, ``bias`` fp32."""
    alpha = f.z_scale
    if bias is None:
        _matmul(h, weight.t(), z, alpha=alpha)
    else:
        z.copy_((bias * alpha).unsqueeze(0).expand_as(z))
        _matmul(h, weight.t(), z, accumulate=True, alpha=alpha)
    return z if f.cap_out is None else z.tanh_().mul_(f.cap_out)


def _cap_slope(z: Tensor, f: LogitFactors, out: Tensor) -> Tensor:
    """``out = 1 - (z / cap_out)^2``: the cap's ``d tanh`` at the capped logits ``z`` (the same shape)."""
    return torch.div(z, f.cap_out, out=out).square_().neg_().add_(1.0)


def _entropy(z: Tensor, n: int, scratch: Tensor) -> Tensor:
    """``[n]``: ``-sum_v p log p`` of the first ``n`` rows of ``z [m, V]`` (they hold the log-softmax), block by
    block in ``scratch [k, V]``, every block exactly ``k`` rows high (the last one runs into ``z``'s padding rows,
    whose results are dropped): a reduction's order may depend on how many rows it reduces at once (CUDA's sum
    does), and a token's entropy must not depend on the tokens batched with it."""
    k = scratch.shape[0]
    out = torch.empty(-(-n // k) * k, dtype=torch.float32, device=z.device)  # [n rounded up to k]
    for r in range(0, n, k):
        rows = z[r : r + k]  # [k, V]
        p = torch.exp(rows, out=scratch)  # [k, V]
        out[r : r + k] = p.mul_(rows).sum(dim=1).neg_()
    return out[:n]


class _Grads:
    """The gradient-in-forward accumulators, fp32: ``dhidden [T, H]``, ``dweight [V, H]`` and ``dbias [V]``, fed one
    chunk at a time by :meth:`add`."""

    def __init__(self, hidden: Tensor, w: Tensor, bias, upstream, f: LogitFactors, needs: tuple[bool, bool, bool]):
        H, V, C = hidden.shape[1], w.shape[0], chunk_tokens(hidden.device)
        f32 = dict(dtype=torch.float32, device=hidden.device)
        self.w, self.upstream, self.f = w, upstream, f
        self.dhidden = torch.empty(hidden.shape, **f32) if needs[0] else None  # [T, H]
        # written by the first chunk, accumulated by the others (no [V, H] memset: 45 ms at V = 49,152, H = 576)
        self.dweight = torch.empty(V, H, **f32) if needs[1] else None  # [V, H]
        self.dbias = torch.empty(V, **f32) if needs[2] and bias is not None else None  # [V]
        self.written = False  # whether a chunk has written dweight / dbias yet
        self.scale = torch.zeros(C, **f32)  # [C] -g / temperature of the chunk's tokens
        self.hs = torch.empty(C, H, dtype=w.dtype, device=hidden.device)  # [C, H] h * scale
        self.dh = torch.empty(C, H, **f32) if needs[0] else None  # [C, H] Q @ W
        self.minus_one = torch.full((C, 1), -1.0, **f32)  # [C, 1]
        self.slope = None if f.cap_out is None else torch.empty(C, V, **f32)  # [C, V] the cap's d tanh

    def keep_slope(self, z: Tensor) -> None:
        """Before the log-softmax overwrites the chunk's capped logits ``z [C, V]``: the cap's slope at them."""
        if self.slope is not None:
            _cap_slope(z, self.f, self.slope[: z.shape[0]])

    def add(self, start: int, stop: int, z: Tensor, h: Tensor, tgt: Tensor, logp: Tensor) -> None:
        """The chunk's tokens ``start:stop``: ``z [C, V]`` holds their log-softmax (rows past ``n = stop - start``:
        padding), ``h [C, H]`` their hidden states (zero past n), ``tgt [n, 1]``, ``logp [n]``. Consumes ``z``. The
        gradient GEMMs take the ``n`` real rows only: the fixed chunk keeps the log-probs batch-invariant, and a short
        batch (one kept completion: 40 tokens of a 192-token chunk) would otherwise pay two full-chunk GEMMs."""
        n = stop - start
        scale = self.scale[:n]  # [n]
        scale.copy_(self.upstream(start, stop, logp) * -self.f.grad_scale)
        zn = z[:n]  # [n, V] the chunk's real tokens: the padded tail is never read (the forward padded the logits)
        zn.exp_()  # softmax
        zn.scatter_add_(1, tgt, self.minus_one[:n])  # softmax - onehot
        if self.slope is not None:
            zn.mul_(self.slope[:n])  # through the cap
        q = zn if self.w.dtype == torch.float32 else zn.to(self.w.dtype)  # [n, V] the GEMM operand
        if self.dh is not None:
            torch.mul(_matmul(q, self.w, self.dh[:n]), scale[:, None], out=self.dhidden[start:stop])
        if self.dweight is not None:
            hs = torch.mul(h[:n], scale[:, None], out=self.hs[:n])  # [n, H]
            _matmul(q.t(), hs, self.dweight, accumulate=self.written)
        if self.dbias is not None:
            self.dbias.addmv_(zn.t(), scale, beta=1.0 if self.written else 0.0)
        self.written = True

    def result(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(dhidden, dweight, dbias)``, zeros where no chunk wrote (an empty call)."""
        return self.dhidden, *zeroed_unless(self.written, self.dweight, self.dbias)


def zeroed_unless(written: bool, *accumulators: Tensor | None) -> tuple[Tensor | None, ...]:
    """The accumulators a first chunk writes (no memset), zeroed when no chunk wrote them (an empty call)."""
    if not written:
        for g in accumulators:
            if g is not None:
                g.zero_()
    return accumulators


def _cast_grads(dweight: Tensor | None, dbias: Tensor | None, weight: Tensor, bias: Tensor | None):
    """``(dweight, dbias)`` accumulated in fp32, in the dtypes of weight and bias."""
    return (
        None if dweight is None else dweight.to(weight.dtype),
        None if dbias is None else dbias.to(bias.dtype),
    )


def _forward(hidden, weight, targets, bias, f: LogitFactors, compute_entropy: bool, upstream, needs, bounds=None):
    """``(logp, lse, entropy, grads)``: the chunked forward (see the module docstring), with the gradients of
    :class:`_Grads` when ``upstream`` is given (else ``grads`` is None); ``bounds``: the chunks' ``(start, stop)``
    (default: fixed chunks)."""
    (T, H), V, device = hidden.shape, weight.shape[0], hidden.device
    C = chunk_tokens(device)
    w = _compute_weight(weight)  # [V, H]
    b = None if bias is None else _fp32(bias)  # [V]
    f32 = dict(dtype=torch.float32, device=device)
    logp, lse = torch.empty(T, **f32), torch.empty(T, **f32)  # [T]
    entropy = torch.empty(T, **f32) if compute_entropy else None  # [T]
    grads = None if upstream is None else _Grads(hidden, w, bias, upstream, f, needs)
    if T == 0:
        return logp, lse, entropy, grads
    partial = T % C if bounds is None else any(b - a < C for a, b in bounds)
    chunks = _chunks(T, C, block_rows(w, b, f, C) if partial else C, bounds)  # (start, stop, GEMM rows)
    M = max(m for _, _, m in chunks)  # the tallest GEMM
    hbuf = torch.zeros(M, H, dtype=w.dtype, device=device)  # [M, H]
    rows = -(-M // ENTROPY_ROWS) * ENTROPY_ROWS if compute_entropy else M  # whole entropy blocks (_entropy)
    zbuf = torch.empty(rows, V, **f32)  # [M (rounded up), V]
    scratch = torch.empty(ENTROPY_ROWS, V, **f32) if compute_entropy else None  # [rows, V]
    for start, stop, m in chunks:
        n = stop - start
        h, z = hbuf[:m], zbuf[:m]  # [m, H], [m, V]
        h[:n].copy_(hidden[start:stop])
        if n < m:
            h[n:].zero_()
        _logits_into(z, h, w, b, f)
        if grads is not None:
            grads.keep_slope(z)
        zc = z[:n]  # [n, V]
        tgt = targets[start:stop].long().unsqueeze(1)  # [n, 1]
        top, at = zc.max(1, keepdim=True)  # [n, 1] each row's largest logit and its column
        torch.log_softmax(zc, 1, out=zc)  # in place, row-local max / sum-exp / write
        logp_c = zc.gather(1, tgt).squeeze(1)  # [n]
        logp[start:stop] = logp_c
        # lse = max + log sum exp(z - max), from the log-softmax at the max (-log sum <= 0): never below the
        # largest logit, so the backward's exp(z - lse) cannot overflow; picked - logp would cancel at large logits
        lse[start:stop] = (top - zc.gather(1, at)).squeeze(1)
        if entropy is not None:
            entropy[start:stop] = _entropy(zbuf, n, scratch)
        if grads is not None:
            grads.add(start, stop, z, h, tgt, logp_c)
    return logp, lse, entropy, grads


def entry_points(forward: Callable) -> tuple[Callable, Callable]:
    """``(logprobs_fwd, logprobs_fwd_grads)`` of a chunked backend over its ``forward(hidden, weight, targets, bias,
    factors, compute_entropy, upstream, needs, bounds) -> (logp, lse, entropy, grads)`` (``grads.result()``: the
    fp32 gradients): the one interface this module and :mod:`cppo_kernels._loss_gemm` implement."""

    def logprobs_fwd(
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        bias: Tensor | None = None,
        *,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        logit_scale: float = 1.0,
        softcap: float | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Log-prob of each target under ``softmax(z)``, ``z = softcap * tanh((h W^T + b) * logit_scale / softcap) /
        temperature`` (``(h W^T + b) * logit_scale / temperature`` without a cap), chunked over tokens.

        ``hidden [T, H]``, ``weight [V, H]``, ``targets [T]`` int, ``bias [V]``. Returns
        ``(logp [T], lse [T], entropy [T] or None)``, all fp32; lse is the logsumexp of ``z``.
        """
        f = logit_factors(temperature, logit_scale, softcap)
        logp, lse, entropy, _ = forward(hidden, weight, targets, bias, f, compute_entropy, None, None)
        return logp, lse, entropy

    def logprobs_fwd_grads(
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        bias: Tensor | None,
        upstream: Callable[[int, int, Tensor], Tensor],
        *,
        temperature: float = 1.0,
        compute_entropy: bool = False,
        logit_scale: float = 1.0,
        softcap: float | None = None,
        needs_hidden_grad: bool = True,
        needs_weight_grad: bool = True,
        needs_bias_grad: bool = False,
        chunks: list[tuple[int, int]] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        """:func:`logprobs_fwd` and, in the same pass, the gradients of ``sum_t g_t * logp_t`` w.r.t. hidden, weight and
        bias, where ``g = upstream(start, stop, logp[start:stop])`` (fp32 ``[stop - start]``) is asked for each chunk of
        tokens once its log-probs are known.

        Returns ``(logp, lse, entropy, dhidden, dweight, dbias)``: fp32 ``[T]`` (entropy None unless
        ``compute_entropy``), then the gradients in fp32 (the caller scales them, then rounds them to the inputs'
        dtypes once: an fp16 gradient could overflow before its scaling), None where not needed (``needs_bias_grad``
        only with a bias). The log-probs are bit-identical to :func:`logprobs_fwd`'s. ``chunks``: the chunks'
        ``(start, stop)``, each at most the backend's chunk (:func:`sequence_chunks`: whole sequences), else fixed.
        """
        needs = (needs_hidden_grad, needs_weight_grad, needs_bias_grad and bias is not None)
        f = logit_factors(temperature, logit_scale, softcap)
        logp, lse, entropy, grads = forward(hidden, weight, targets, bias, f, compute_entropy, upstream, needs, chunks)
        return logp, lse, entropy, *grads.result()

    return logprobs_fwd, logprobs_fwd_grads


logprobs_fwd, logprobs_fwd_grads = entry_points(_forward)


def _softmax_minus_onehot(q: Tensor, lse: Tensor, targets: Tensor, v0: int) -> None:
    """In place: the logits block ``q [n, Vb]`` (vocab columns ``v0 ...``) becomes ``softmax - onehot(target)``, so
    that ``dz = -g q / temperature``; a scatter, not ``nonzero()``: no device sync."""
    q.sub_(lse).clamp_max_(0.0).exp_()  # [n, Vb] softmax (lse: [n, 1]), at most 1 (module docstring: Backward)
    width = q.shape[1]
    col = (targets - v0).clamp_(0, width - 1).unsqueeze(1)  # [n, 1]
    at = q.gather(1, col)  # [n, 1]
    hit = ((targets >= v0) & (targets < v0 + width)).unsqueeze(1)  # [n, 1] rows whose target is in this block
    q.scatter_(1, col, torch.where(hit, at - 1.0, at))


def _entropy_block(
    q: Tensor, p: Tensor, lse: Tensor, targets: Tensor, v0: int, g: Tensor, g_ent: Tensor, ent: Tensor
) -> None:
    """In place: the logits block ``q [n, Vb]`` becomes ``g (p - onehot) + g_ent p (log p + H)`` (``-dz``), with
    ``p`` the softmax (in the scratch ``p``), ``g [n]`` / ``g_ent [n, 1]`` the upstream gradients of the log-prob
    and of the entropy ``ent [n, 1]``."""
    q.sub_(lse).clamp_max_(0.0)  # [n, Vb] log p, at most 0 (module docstring: Backward)
    torch.exp(q, out=p)
    # p (log p + H) first: at most 1 + H, and 0 where p underflows (log p of -1e10 at a logit scale of 1e10, times
    # a large g_ent, would overflow before its product with p = 0: inf * 0 = NaN)
    q.add_(ent).mul_(p).mul_(g_ent).addcmul_(p, g.unsqueeze(1))
    width = q.shape[1]
    col = (targets - v0).clamp(0, width - 1).unsqueeze(1)  # [n, 1]
    at = q.gather(1, col)  # [n, 1]
    hit = ((targets >= v0) & (targets < v0 + width)).unsqueeze(1)  # [n, 1]
    q.scatter_(1, col, torch.where(hit, at - g.unsqueeze(1), at))


class _Backward:
    """The blocks of :func:`logprobs_bwd`: the fp32 head, the scratch blocks it reuses for every ``[n, Vb]`` block
    (logits, the entropy path's softmax, the cap's slope, the block's dhidden) and the gradients it adds into."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias, f: LogitFactors, grads: tuple, *, entropy: bool):
        num_tokens, dim = hidden.shape
        self.hidden, self.f = hidden, f
        self.w = _fp32(weight)  # [V, H]
        self.b = None if bias is None else _fp32(bias)  # [V]
        self.dhidden, self.dweight, self.dbias = grads  # [T, H] in hidden's dtype, fp32 [V, H], fp32 [V] (or None)
        rows, device = min(BWD_TOKENS, num_tokens), hidden.device
        self.zbuf = torch.empty(rows * min(BWD_VOCAB, weight.shape[0]), dtype=torch.float32, device=device)  # [Tb*Vb]
        self.pbuf = torch.empty_like(self.zbuf) if entropy else None  # [Tb * Vb] the entropy path's softmax
        self.sbuf = None if f.cap_out is None else torch.empty_like(self.zbuf)  # [Tb * Vb] the cap's slope
        self.dh = None if self.dhidden is None else torch.empty(rows, dim, dtype=torch.float32, device=device)

    def rows(self, start: int, stop: int, tgt: Tensor, lse: Tensor, g: Tensor, ent: tuple | None = None) -> None:
        """Adds the gradients of the tokens ``start:stop`` (targets ``tgt [n]``, log-sum-exps ``lse [n, 1]``,
        upstream ``g [n]``; with the entropy's gradient, ``ent``: its upstream and the entropies, ``[n, 1]`` each)."""
        n, f, w, b, dh = stop - start, self.f, self.w, self.b, self.dh
        h = _fp32(self.hidden[start:stop])  # [n, H]
        # with the entropy the block holds the whole -dz: scale by -logit_scale / temperature only
        neg_g = g * -f.grad_scale if ent is None else torch.full_like(g, -f.grad_scale)  # [n]
        hs = h * neg_g.unsqueeze(1)  # [n, H]
        if dh is not None:
            dh[:n].zero_()
        for v0 in range(0, w.shape[0], BWD_VOCAB):
            v1 = min(v0 + BWD_VOCAB, w.shape[0])
            w_b = w[v0:v1]  # [Vb, H]
            q = _logits_into(self.zbuf[: n * (v1 - v0)].view(n, v1 - v0), h, w_b, None if b is None else b[v0:v1], f)
            slope = None if self.sbuf is None else _cap_slope(q, f, self.sbuf[: q.numel()].view_as(q))  # [n, Vb]
            if ent is None:
                _softmax_minus_onehot(q, lse, tgt, v0)  # [n, Vb]
            else:
                _entropy_block(q, self.pbuf[: q.numel()].view_as(q), lse, tgt, v0, g, *ent)
            if slope is not None:
                q.mul_(slope)
            if dh is not None:
                dh[:n].addmm_(q, w_b)
            if self.dweight is not None:
                self.dweight[v0:v1].addmm_(q.t(), hs)
            if self.dbias is not None:
                self.dbias[v0:v1].addmv_(q.t(), neg_g)
        if dh is not None:
            self.dhidden[start:stop].copy_(dh[:n].mul_(neg_g.unsqueeze(1)))


def logprobs_bwd(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    grad_logp: Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    needs_hidden_grad: bool = True,
    needs_weight_grad: bool = True,
    needs_bias_grad: bool = False,
    grad_entropy: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of ``sum_t grad_logp[t] * logp[t]`` (plus ``grad_entropy[t] * entropy[t]`` when given, with the
    forward's ``entropy [T]``) w.r.t. hidden, weight and bias.

    ``dy[t, j] = grad_logp[t] * (onehot(target_t)_j - softmax(z_t)_j) * logit_scale / temperature`` (times the
    cap's slope ``1 - tanh^2`` with a ``softcap``) for the head output ``y = h W^T + b``; the softmax is
    recomputed from the saved ``lse [T]``. The entropy ``H = -sum_j p_j log p_j`` adds
    ``-grad_entropy[t] * p_j (log p_j + H)`` to the bracket. Returns ``(dhidden, dweight, dbias)`` in the dtypes of
    hidden / weight / bias (accumulated in fp32, cast once), None where not needed.
    """
    num_tokens, dim = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    f = logit_factors(temperature, logit_scale, softcap)
    needs_bias_grad = needs_bias_grad and bias is not None
    dhidden = torch.empty_like(hidden) if needs_hidden_grad else None  # [T, H]
    dweight = torch.zeros(vocab, dim, dtype=torch.float32, device=device) if needs_weight_grad else None  # [V, H]
    dbias = torch.zeros(vocab, dtype=torch.float32, device=device) if needs_bias_grad else None  # [V]
    if num_tokens > 0 and (needs_hidden_grad or needs_weight_grad or needs_bias_grad):
        blocks = _Backward(hidden, weight, bias, f, (dhidden, dweight, dbias), entropy=grad_entropy is not None)
        for start in range(0, num_tokens, BWD_TOKENS):
            stop = min(start + BWD_TOKENS, num_tokens)
            g = grad_logp[start:stop].float()  # [n]
            if grad_entropy is not None:
                ent = (grad_entropy[start:stop].unsqueeze(1), entropy[start:stop].unsqueeze(1))  # [n, 1] each
                blocks.rows(start, stop, targets[start:stop].long(), lse[start:stop].unsqueeze(1), g, ent)
            else:
                blocks.rows(start, stop, targets[start:stop].long(), lse[start:stop].unsqueeze(1), g)
    return dhidden, *_cast_grads(dweight, dbias, weight, bias)
