"""The per-token policy math of the loss, shared by every loss path: ratio, clipping, dual clip, KL estimators,
aggregation and metrics, elementwise on the packed fp32 per-token log-probs (O(T), no vocabulary dimension)."""

from __future__ import annotations

import torch
from torch import Tensor

from .config import LossConfig

__all__ = ["policy_loss"]


def _kl(logp: Tensor, ref: Tensor, estimator: str) -> Tensor:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    d = ref - logp
    return torch.exp(d) - d - 1.0


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
    """The CPPO/GRPO policy loss from per-token log-probs in the packed layout (inputs already validated).

    ``logp [T]`` fp32 (differentiable), ``advantages [S]``, ``cu_seqlens [S+1]`` int64, ``old_logprobs`` /
    ``ref_logprobs`` / ``entropy [T]`` (``entropy`` given when ``config.compute_entropy``). Per token t of
    sequence s:

    - log-ratio ``d = logp - old`` (``old = logp.detach()`` when absent); with
      ``importance_sampling="sequence"`` every token of s uses the mean of d over s instead;
    - ``r = exp(d)``; ``pg = -min(r*A_s, clip(r, 1-eps_low, 1+eps_high)*A_s)``; with ``dual_clip=c``
      ``pg = min(pg, -c*A_s)`` where ``A_s < 0``;
    - plus ``beta * kl`` with kl the k1/k2/k3 estimator of logp against ``ref``;
    - aggregated ``token-mean`` (sum over all tokens / T), ``seq-mean-token-mean`` (mean over
      sequences of each sequence's token mean) or ``seq-mean-token-sum-norm`` (sum over all
      tokens / (S * max_completion_length)). Empty sequences and empty batches give 0, never NaN.

    Returns ``(loss, metrics)``: the fp32 scalar loss and the detached fp32 scalars of :func:`_metrics`.
    """
    cfg = config
    dtype = logp.dtype
    num_seqs = advantages.numel()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)  # [S]
    # output_size: no device sync to size the result (this runs on the training hot path).
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=logp.device), lengths, output_size=logp.numel())
    seq_len = lengths.clamp(min=1).to(dtype)  # [S]

    def seq_mean(x: Tensor) -> Tensor:  # [T] -> [S], 0 for an empty sequence
        return torch.zeros(num_seqs, dtype=dtype, device=logp.device).index_add(0, seq_of, x) / seq_len

    adv_t = advantages.to(dtype)[seq_of]  # [T]
    old = logp.detach() if old_logprobs is None else old_logprobs.to(dtype)
    log_ratio = logp - old  # [T]
    if cfg.importance_sampling == "sequence":
        log_ratio = seq_mean(log_ratio)[seq_of]
    ratio = torch.exp(log_ratio)  # [T]
    clipped = torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.eps_high)
    pg = -torch.minimum(ratio * adv_t, clipped * adv_t)  # [T]
    if cfg.dual_clip is not None:
        pg = torch.where(adv_t < 0, torch.minimum(pg, -cfg.dual_clip * adv_t), pg)
    per_token = pg
    kl = None
    if ref_logprobs is not None:
        kl = _kl(logp, ref_logprobs.to(dtype), cfg.kl_estimator)  # [T]
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * kl
    num_tokens = logp.numel()
    if cfg.loss_agg == "token-mean":
        loss = per_token.sum() / max(num_tokens, 1)
    elif cfg.loss_agg == "seq-mean-token-mean":
        loss = seq_mean(per_token).sum() / max(num_seqs, 1)
    else:
        loss = per_token.sum() / (max(num_seqs, 1) * cfg.max_completion_length)
    return loss, _metrics(logp, ratio, adv_t, kl, entropy, cfg)


@torch.no_grad()
def _metrics(
    logp: Tensor, ratio: Tensor, adv_t: Tensor, kl: Tensor | None, entropy: Tensor | None, cfg: LossConfig
) -> dict[str, Tensor]:
    """Detached fp32 scalars: the mean ``kl`` (0 without reference log-probs), the fractions of tokens whose ratio
    is clipped below (``A < 0``) and above (``A > 0``), ``ratio_mean/min/max`` (1 when there are no tokens),
    ``num_tokens``, and the mean ``entropy`` with ``compute_entropy``."""
    num_tokens = logp.numel()
    denom = max(num_tokens, 1)
    r = ratio.detach()  # [T]
    metrics = {
        "kl": (kl.detach().sum() / denom) if kl is not None else logp.new_zeros(()),
        "clip_fraction_low": ((r < 1.0 - cfg.epsilon_low) & (adv_t < 0)).sum() / denom,
        "clip_fraction_high": ((r > 1.0 + cfg.eps_high) & (adv_t > 0)).sum() / denom,
        "ratio_mean": r.sum() / denom if num_tokens else logp.new_ones(()),
        "ratio_min": r.min() if num_tokens else logp.new_ones(()),
        "ratio_max": r.max() if num_tokens else logp.new_ones(()),
        "num_tokens": logp.new_tensor(float(num_tokens)),
    }
    if cfg.compute_entropy:
        metrics["entropy"] = entropy.detach().sum() / denom
    return {k: v.to(torch.float32) for k, v in metrics.items()}
