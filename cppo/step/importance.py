"""The training/inference mismatch correction of TRL's GRPOTrainer (``vllm_importance_sampling_*``): an engine that
samples with other kernels than the training pass (vLLM) reports each sampled token's log-prob; the loss is weighed
by the ratio of the training policy's probability to the sampler's, truncated or masked."""

from __future__ import annotations

import math

import torch

__all__ = ["importance_weights", "mismatch_metrics"]


def importance_weights(
    old: torch.Tensor,
    sampling: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, bool]:
    """``(weights, per_sequence)``: TRL's IS ratio of packed tokens. ``old [T]``: the training policy's log-probs of
    the sampled tokens before the update, ``sampling [T]``: the engine's; ``cu_seqlens [S+1]``. ``token_*`` modes:
    ``exp(old - sampling)`` per token ``[T]``; ``sequence_*``: ``exp`` of each sequence's summed difference ``[S]``
    (``per_sequence`` True). ``*_truncate`` clamps to ``[clip_min, clip_max]``; ``*_mask`` sets a ratio outside them to
    0. A NaN sampling log-prob counts as no difference (ratio 1), as in TRL."""
    diff = torch.nan_to_num(old.float() - sampling.float(), nan=0.0)  # [T]
    per_sequence = mode.startswith("sequence")
    if per_sequence:
        seq = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=diff.device), cu_seqlens.diff().long())
        diff = torch.zeros(len(cu_seqlens) - 1, dtype=diff.dtype, device=diff.device).index_add_(0, seq, diff)  # [S]
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        if clip_min is not None or clip_max is not None:  # (torch.clamp refuses two None bounds)
            ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    elif mode.endswith("mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    else:
        raise ValueError(f"vllm_importance_sampling_mode must be one of token_truncate, token_mask, sequence_truncate, "
                         f"sequence_mask, got {mode!r}")  # fmt: skip
    return ratio, per_sequence


def mismatch_metrics(old: torch.Tensor, sampling: torch.Tensor, ratio: torch.Tensor) -> dict[str, float]:
    """TRL's names: the mean and max |training - sampling log-prob| over the tokens (NaN ones left out) and the IS
    ratio's min, mean and max."""
    delta = (old.float() - sampling.float()).abs()
    delta = delta[~torch.isnan(delta)]
    out = {
        "sampling/sampling_logp_difference/mean": float(delta.mean()) if delta.numel() else 0.0,
        "sampling/sampling_logp_difference/max": float(delta.max()) if delta.numel() else 0.0,
    }
    flat = ratio.flatten()
    for name, fn in (("min", torch.min), ("mean", torch.mean), ("max", torch.max)):
        out[f"sampling/importance_sampling_ratio/{name}"] = float(fn(flat)) if flat.numel() else 0.0
    return out
