"""The per-token policy math of the loss, shared by every loss path: ratio, clipping, dual clip, KL estimators,
aggregation and metrics, elementwise on the packed fp32 per-token log-probs (O(T), no vocabulary dimension), and
the analytic per-token gradient that lets the gradient-in-forward path of :func:`cppo_kernels.fused_cppo_loss`
compute ``d loss / d logp_t`` before the loss exists.

Two exponentials are clamped, as verl does (``core_algos.compute_policy_loss`` and its ``low_var_kl``): the
log-ratio ``logp - old`` (the sequence's mean for GSPO) before ``exp`` and the k3 exponent ``ref - logp``, both to
``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND] = [-20, 20]``. In-range values are bit-identical to the unclamped formulas
(TRL clamps nothing); beyond, ``exp`` would reach fp32's overflow at 88.7 and ``0 * inf`` would turn a clipped
token's zero gradient, or the whole loss of an ``A = 0`` group, into NaN. A clamped token has the loss of the bound
and a zero gradient through the clamped term (the gradient of ``torch.clamp``); ``e^20 = 4.9e8`` keeps
``ratio * A`` finite for any ``|A| < 7e29``. verl also clamps the k3 value itself to ``[-10, 10]``; we do not: with
its exponent bounded k3 stays below ``e^20`` and in-range values stay exact.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .config import LossConfig

__all__ = [
    "LOG_RATIO_BOUND",
    "Batch",
    "batch_constants",
    "token_terms",
    "token_grad",
    "token_weights",
    "aggregate",
    "policy_loss",
    "metrics",
]

#: Bound of the clamped log-ratio and of the k3 exponent (verl's; see the module docstring).
LOG_RATIO_BOUND = 20.0


class Batch(NamedTuple):
    """The per-token constants of a packed batch, detached: the policy loss treats them as data, never as
    something to differentiate (``advantages``, ``old_logprobs`` and ``ref_logprobs`` get no gradient)."""

    adv: Tensor  # [T] the advantage of each token's sequence
    old: Tensor | None  # [T]
    ref: Tensor | None  # [T]
    seq_of: Tensor  # [T] int64 sequence index of each token
    lengths: Tensor  # [S] int64 tokens per sequence
    num_seqs: int


def batch_constants(
    advantages: Tensor, cu_seqlens: Tensor, old_logprobs: Tensor | None, ref_logprobs: Tensor | None, num_tokens: int
) -> Batch:
    """The :class:`Batch` of packed per-sequence ``advantages [S]`` / ``cu_seqlens [S+1]`` and per-token
    ``old_logprobs`` / ``ref_logprobs [T]``, in fp32."""
    num_seqs = advantages.numel()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)  # [S]
    # output_size: no device sync to size the result (this runs on the training hot path).
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=lengths.device), lengths, output_size=num_tokens)

    def fp32(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.detach().to(torch.float32)

    return Batch(fp32(advantages)[seq_of], fp32(old_logprobs), fp32(ref_logprobs), seq_of, lengths, num_seqs)


def _seq_mean(x: Tensor, batch: Batch) -> Tensor:
    """``[T] -> [S]``: each sequence's mean of ``x`` (0 for an empty sequence)."""
    sums = torch.zeros(batch.num_seqs, dtype=x.dtype, device=x.device).index_add(0, batch.seq_of, x)  # [S]
    return sums / batch.lengths.clamp(min=1).to(x.dtype)


def _clamp(x: Tensor) -> Tensor:
    return x.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _inside(x: Tensor) -> Tensor:
    """Where the gradient passes :func:`_clamp` (``torch.clamp`` passes it at the bounds themselves)."""
    return (x >= -LOG_RATIO_BOUND) & (x <= LOG_RATIO_BOUND)


def _kl(logp: Tensor, ref: Tensor, estimator: str) -> Tensor:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    d = _clamp(ref - logp)
    return torch.exp(d) - d - 1.0


def token_terms(
    logp: Tensor, adv: Tensor, old: Tensor | None, ref: Tensor | None, cfg: LossConfig, log_ratio: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(per-token loss, ratio, kl or None)`` of the tokens ``logp [n]`` (differentiable or not) with advantages
    ``adv [n]`` and ``old`` / ``ref [n]`` (``old = logp.detach()`` when None; ``kl`` needs ``ref``).

    ``log_ratio``: the tokens' log-ratios when not ``logp - old`` (GSPO: the sequence's mean). Per token:
    ``r = exp(clamp(log_ratio))``, ``pg = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, at most ``-c A`` where
    ``A < 0`` with ``dual_clip=c``, plus ``beta * kl`` (k3 with its exponent clamped).
    """
    if log_ratio is None:
        log_ratio = logp - (logp.detach() if old is None else old)  # [n]
    ratio = torch.exp(_clamp(log_ratio))  # [n]
    clipped = torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.eps_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)  # [n]
    if cfg.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -cfg.dual_clip * adv), pg)
    kl = None if ref is None else _kl(logp, ref, cfg.kl_estimator)  # [n]
    per_token = pg + cfg.beta * kl if kl is not None and cfg.beta > 0 else pg
    return per_token, ratio, kl


def _min_share(x: Tensor, y: Tensor) -> Tensor:
    """The share of ``torch.minimum(x, y)``'s gradient that goes to ``x``: 1, 0, or 1/2 on a tie (torch's rule)."""
    return torch.where(x < y, 1.0, torch.where(x == y, 0.5, 0.0))


def token_grad(logp: Tensor, adv: Tensor, old: Tensor | None, ref: Tensor | None, cfg: LossConfig) -> Tensor:
    """``d per-token loss / d logp`` of :func:`token_terms` with token-level importance sampling, analytically and
    elementwise: what autograd gives through :func:`token_terms`, torch's subgradient conventions included (a
    clamp passes the gradient at its bounds, ``minimum`` splits it on ties)."""
    log_ratio = torch.zeros_like(logp) if old is None else logp - old  # [n]
    ratio = torch.exp(_clamp(log_ratio))  # [n]
    lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.eps_high
    a, b = ratio * adv, torch.clamp(ratio, lo, hi) * adv  # the two surrogates
    passes = ((ratio >= lo) & (ratio <= hi)).to(ratio.dtype)  # the clip's own gradient
    d_min = adv * (_min_share(a, b) + _min_share(b, a) * passes)  # d min(a, b) / d ratio
    grad = -d_min * torch.where(_inside(log_ratio), ratio, 0.0)  # [n] d pg / d logp
    if cfg.dual_clip is not None:
        pg, cap = -torch.minimum(a, b), -cfg.dual_clip * adv
        grad = torch.where(adv < 0, grad * _min_share(pg, cap), grad)
    if ref is not None and cfg.beta > 0:
        if cfg.kl_estimator == "k1":
            d_kl = torch.ones_like(logp)
        elif cfg.kl_estimator == "k2":
            d_kl = logp - ref
        else:
            d = ref - logp
            d_kl = torch.where(_inside(d), 1.0 - torch.exp(_clamp(d)), 0.0)
        grad = grad + cfg.beta * d_kl
    return grad


def token_weights(batch: Batch, cfg: LossConfig) -> Tensor:
    """``[T]``: ``d loss / d per-token loss`` of :func:`aggregate` (counts known before any log-prob)."""
    num_tokens, num_seqs = batch.seq_of.numel(), max(batch.num_seqs, 1)
    if cfg.loss_agg == "token-mean":
        return torch.full((num_tokens,), 1.0 / max(num_tokens, 1), device=batch.seq_of.device)
    if cfg.loss_agg == "seq-mean-token-mean":
        return (1.0 / num_seqs) / batch.lengths.clamp(min=1).to(torch.float32)[batch.seq_of]
    return torch.full((num_tokens,), 1.0 / (num_seqs * cfg.max_completion_length), device=batch.seq_of.device)


def aggregate(per_token: Tensor, batch: Batch, cfg: LossConfig) -> Tensor:
    """The scalar loss of ``per_token [T]``: ``token-mean`` (sum / T), ``seq-mean-token-mean`` (mean over sequences
    of each sequence's token mean) or ``seq-mean-token-sum-norm`` (sum / (S * max_completion_length)); 0 for
    empty sequences and batches, never NaN."""
    num_tokens = per_token.numel()
    if cfg.loss_agg == "token-mean":
        return per_token.sum() / max(num_tokens, 1)
    if cfg.loss_agg == "seq-mean-token-mean":
        return _seq_mean(per_token, batch).sum() / max(batch.num_seqs, 1)
    return per_token.sum() / (max(batch.num_seqs, 1) * cfg.max_completion_length)


def policy_loss(
    logp: Tensor,
    advantages: Tensor,
    cu_seqlens: Tensor,
    *,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    entropy: Tensor | None,
    config: LossConfig,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The CPPO/GRPO policy loss from per-token log-probs in the packed layout (inputs already validated), with
    gradients by autograd to ``logp`` only.

    ``logp [T]`` fp32 (differentiable), ``advantages [S]``, ``cu_seqlens [S+1]`` int64, ``old_logprobs`` /
    ``ref_logprobs`` / ``entropy [T]`` (``entropy`` given when ``config.compute_entropy``): the per-token terms of
    :func:`token_terms` (with ``importance_sampling="sequence"`` every token of s uses the mean log-ratio of s),
    aggregated by :func:`aggregate`.

    Returns ``(loss, metrics)``: the fp32 scalar loss and the detached fp32 scalars of :func:`metrics`.
    """
    batch = batch_constants(advantages, cu_seqlens, old_logprobs, ref_logprobs, logp.numel())
    log_ratio = None
    if config.importance_sampling == "sequence":
        log_ratio = _seq_mean(logp - (logp.detach() if batch.old is None else batch.old), batch)[batch.seq_of]
    per_token, ratio, kl = token_terms(logp, batch.adv, batch.old, batch.ref, config, log_ratio)
    return aggregate(per_token, batch, config), metrics(logp, ratio, batch.adv, kl, entropy, config)


@torch.no_grad()
def metrics(
    logp: Tensor, ratio: Tensor, adv: Tensor, kl: Tensor | None, entropy: Tensor | None, cfg: LossConfig
) -> dict[str, Tensor]:
    """Detached fp32 scalars: the mean ``kl`` (0 without reference log-probs), the fractions of tokens whose ratio
    is clipped below (``A < 0``) and above (``A > 0``), ``ratio_mean/min/max`` (1 when there are no tokens),
    ``num_tokens``, and the mean ``entropy`` with ``compute_entropy``."""
    num_tokens = logp.numel()
    denom = max(num_tokens, 1)
    r = ratio.detach()  # [T]
    out = {
        "kl": (kl.detach().sum() / denom) if kl is not None else logp.new_zeros(()),
        "clip_fraction_low": ((r < 1.0 - cfg.epsilon_low) & (adv < 0)).sum() / denom,
        "clip_fraction_high": ((r > 1.0 + cfg.eps_high) & (adv > 0)).sum() / denom,
        "ratio_mean": r.sum() / denom if num_tokens else logp.new_ones(()),
        "ratio_min": r.min() if num_tokens else logp.new_ones(()),
        "ratio_max": r.max() if num_tokens else logp.new_ones(()),
        "num_tokens": logp.new_tensor(float(num_tokens)),
    }
    if cfg.compute_entropy:
        out["entropy"] = entropy.detach().sum() / denom
    return {k: v.to(torch.float32) for k, v in out.items()}
