"""vLLM's importance-sampling correction of TRL 1.16, computed on the kept completions.

TRL computes the ratio ``exp(old - sampling)`` between the trainer's old-policy log-probs and vLLM's sampling
log-probs inside its scoring, before the rewards; CPPO runs the old-policy pass after the pruning, so the ratio and
TRL's ``sampling/*`` metrics are computed here, on the kept rows, with TRL's formulas (``grpo_trainer.py`` lines
2659-2710 and 2860-2890 of the 1.16.0 wheel): token or sequence level, truncated or masked outside
``[clip_min, clip_max]``; tokens vLLM could not score (NaN) get a ratio of exactly 1 and are left out of the metrics.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["MODES", "importance_ratio", "sampling_stats"]

#: ``vllm_importance_sampling_mode`` values.
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_ratio(
    old: Tensor, sampling: Tensor, mask: Tensor, *, mode: str, clip_min: float | None, clip_max: float | None
) -> Tensor:
    """``[B, C]`` per token (``token_*``) or ``[B, 1]`` per sequence (``sequence_*``): ``exp(old - sampling)``
    over the tokens of ``mask``, clamped to ``[clip_min, clip_max]`` (``*_truncate``) or zeroed outside it
    (``*_mask``)."""
    if mode not in MODES:
        raise ValueError(f"vllm_importance_sampling_mode must be one of {MODES}, got {mode!r}")
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)  # [B, C]
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)  # [B, 1]
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampling_stats(
    old: Tensor, sampling: Tensor, mask: Tensor, ratio: Tensor, *, mode: str
) -> dict[str, tuple[Tensor, str]]:
    """This process's statistics behind TRL's ``sampling/*`` metrics of the ``ratio`` of ``mode``, each ``(value,
    how TRL reduces it over the processes: "mean" | "max" | "min")``."""
    mask = mask.bool()
    delta = torch.abs(old - sampling)
    delta = delta[mask & ~torch.isnan(delta)]
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[mask]

    def stat(x: Tensor, fn) -> Tensor:
        return fn(x) if x.numel() else torch.tensor(0.0, device=old.device)

    return {
        "sampling/sampling_logp_difference/mean": (stat(delta, torch.mean), "mean"),
        "sampling/sampling_logp_difference/max": (stat(delta, torch.max), "max"),
        "sampling/importance_sampling_ratio/min": (stat(flat, torch.min), "min"),
        "sampling/importance_sampling_ratio/mean": (stat(flat, torch.mean), "mean"),
        "sampling/importance_sampling_ratio/max": (stat(flat, torch.max), "max"),
    }
