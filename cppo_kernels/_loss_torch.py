"""Chunked PyTorch backend of the fused log-prob op: the CPU path and the fallback without Triton.

Same interface as ``_loss_triton``: ``logprobs_fwd`` / ``logprobs_bwd`` over packed rows already validated by
:mod:`cppo_kernels.loss`, all arithmetic in fp32 (bf16/fp16 inputs are upcast), never a ``[T, V]`` allocation.

- Forward: a fixed chunk of ``FWD_TOKENS`` tokens at a time against the whole vocabulary: 1 matmul into a ``[chunk, V]``
  buffer and an in-place ``log_softmax`` (row-local, so about one pass over memory). Every logit matmul
  runs on a full ``[chunk, H]`` block (the tail is zero-padded): BLAS picks different kernels for
  different row counts, and a fixed shape is what makes a token's log-prob independent of the tokens
  it is batched with, bit for bit.
- Backward: ``[BWD_TOKENS, BWD_VOCAB]`` blocks, so all three matmuls are large: recompute the logits,
  ``Q = exp(z - lse) - onehot`` in place, ``dhidden += Q @ W_b`` and ``dweight_b += Q^T @ (-g * h)``.
  The upstream gradient ``g`` scales the small ``[tokens, H]`` operands, never the ``[tokens, V]`` block;
  ``dweight`` is read and written once per token block instead of once per small chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["logprobs_fwd", "logprobs_bwd"]

# Block sizes: constants (never derived from T), so results do not depend on batch composition.
#: Tokens per forward chunk (workspace ``FWD_TOKENS x V`` fp32).
FWD_TOKENS = 256
#: The backward block: ``BWD_TOKENS x BWD_VOCAB``.
BWD_TOKENS = 1024
BWD_VOCAB = 4096


def _fp32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _logits_into(z: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None, inv_t: float) -> Tensor:
    """``z = (h @ weight^T + bias) / temperature`` in place, one GEMM. ``z [n, V]``, ``h [n, H]`` fp32."""
    if bias is None:
        return z.addmm_(h, weight.t(), beta=0.0, alpha=inv_t)
    z.copy_((bias * inv_t).unsqueeze(0).expand_as(z))
    return z.addmm_(h, weight.t(), alpha=inv_t)


def logprobs_fwd(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Log-prob of each target under softmax((h W^T + b) / temperature), chunked over tokens.

    ``hidden [T, H]``, ``weight [V, H]``, ``targets [T]`` int, ``bias [V]``. Returns
    ``(logp [T], lse [T], entropy [T] or None)``, all fp32; lse is the logsumexp of the tempered logits.
    """
    num_tokens, dim = hidden.shape
    vocab = weight.shape[0]
    chunk = FWD_TOKENS
    device = hidden.device
    inv_t = 1.0 / temperature
    w = _fp32(weight)  # [V, H]
    b = None if bias is None else _fp32(bias)  # [V]
    logp = torch.empty(num_tokens, dtype=torch.float32, device=device)  # [T]
    lse = torch.empty(num_tokens, dtype=torch.float32, device=device)  # [T]
    entropy = torch.empty(num_tokens, dtype=torch.float32, device=device) if compute_entropy else None  # [T]
    if num_tokens == 0:
        return logp, lse, entropy
    hbuf = torch.zeros(chunk, dim, dtype=torch.float32, device=device)  # [C, H]
    z = torch.empty(chunk, vocab, dtype=torch.float32, device=device)  # [C, V]
    rows = min(chunk, num_tokens)
    ebuf = torch.empty(rows, vocab, dtype=torch.float32, device=device) if compute_entropy else None  # [C, V]
    for start in range(0, num_tokens, chunk):
        stop = min(start + chunk, num_tokens)
        n = stop - start
        hbuf[:n].copy_(hidden[start:stop])
        if n < chunk:
            hbuf[n:].zero_()
        _logits_into(z, hbuf, w, b, inv_t)
        zc = z[:n]  # [n, V]
        tgt = targets[start:stop].long().unsqueeze(1)  # [n, 1]
        picked = zc.gather(1, tgt).squeeze(1)  # [n]
        torch.log_softmax(zc, 1, out=zc)  # in place, row-local max / sum-exp / write
        logp_c = zc.gather(1, tgt).squeeze(1)  # [n]
        logp[start:stop] = logp_c
        lse[start:stop] = picked - logp_c
        if ebuf is not None:
            e = torch.exp(zc, out=ebuf[:n])  # [n, V] softmax
            entropy[start:stop] = e.mul_(zc).sum(dim=1).neg_()
    return logp, lse, entropy


def logprobs_bwd(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    grad_logp: Tensor,
    *,
    temperature: float = 1.0,
    needs_hidden_grad: bool = True,
    needs_weight_grad: bool = True,
    needs_bias_grad: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of ``sum_t grad_logp[t] * logp[t]`` w.r.t. hidden, weight and bias.

    ``dz[t, j] = grad_logp[t] * (onehot(target_t)_j - softmax(z_t)_j) / temperature``; the softmax is
    recomputed from the saved ``lse [T]``. Returns ``(dhidden, dweight, dbias)`` in the dtypes of
    hidden / weight / bias (accumulated in fp32, cast once), None where not needed.
    """
    num_tokens, dim = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    inv_t = 1.0 / temperature
    needs_bias_grad = needs_bias_grad and bias is not None
    w = _fp32(weight)  # [V, H]
    b = None if bias is None else _fp32(bias)  # [V]
    dhidden = torch.empty_like(hidden) if needs_hidden_grad else None  # [T, H]
    dweight = torch.zeros(vocab, dim, dtype=torch.float32, device=device) if needs_weight_grad else None  # [V, H]
    dbias = torch.zeros(vocab, dtype=torch.float32, device=device) if needs_bias_grad else None  # [V]
    if num_tokens > 0 and (needs_hidden_grad or needs_weight_grad or needs_bias_grad):
        rows = min(BWD_TOKENS, num_tokens)
        zbuf = torch.empty(rows * min(BWD_VOCAB, vocab), dtype=torch.float32, device=device)  # [Tb * Vb]
        dh = torch.empty(rows, dim, dtype=torch.float32, device=device) if needs_hidden_grad else None  # [Tb, H]
        for start in range(0, num_tokens, BWD_TOKENS):
            stop = min(start + BWD_TOKENS, num_tokens)
            n = stop - start
            h = _fp32(hidden[start:stop])  # [n, H]
            tgt = targets[start:stop].long()  # [n]
            neg_g = grad_logp[start:stop].float() * -inv_t  # [n]
            hs = h * neg_g.unsqueeze(1)  # [n, H]
            lse_c = lse[start:stop].unsqueeze(1)  # [n, 1]
            if dh is not None:
                dh[:n].zero_()
            for v0 in range(0, vocab, BWD_VOCAB):
                v1 = min(v0 + BWD_VOCAB, vocab)
                w_b = w[v0:v1]  # [Vb, H]
                q = _logits_into(zbuf[: n * (v1 - v0)].view(n, v1 - v0), h, w_b, None if b is None else b[v0:v1], inv_t)
                q.sub_(lse_c).exp_()  # [n, Vb] softmax
                # q = softmax - onehot, so dz = -g q / temperature; scatter, not nonzero(): no device sync
                col = (tgt - v0).clamp_(0, v1 - v0 - 1).unsqueeze(1)  # [n, 1]
                at = q.gather(1, col)  # [n, 1]
                hit = ((tgt >= v0) & (tgt < v1)).unsqueeze(1)  # [n, 1] rows whose target is in this block
                q.scatter_(1, col, torch.where(hit, at - 1.0, at))
                if dh is not None:
                    dh[:n].addmm_(q, w_b)
                if dweight is not None:
                    dweight[v0:v1].addmm_(q.t(), hs)
                if dbias is not None:
                    dbias[v0:v1].addmv_(q.t(), neg_g)
            if dh is not None:
                dhidden[start:stop].copy_(dh[:n].mul_(neg_g.unsqueeze(1)))
    if dweight is not None and dweight.dtype != weight.dtype:
        dweight = dweight.to(weight.dtype)
    if dbias is not None and dbias.dtype != bias.dtype:
        dbias = dbias.to(bias.dtype)
    return dhidden, dweight, dbias
