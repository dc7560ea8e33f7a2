"""The training/inference mismatch correction of TRL's GRPOTrainer (``vllm_importance_sampling_*``): an engine that
samples with other kernels than the training pass (vLLM) reports each sampled token's log-prob; the loss is weighed
by the ratio of the training policy's probability to the sampler's, truncated or masked."""

from __future__ import annotations

import math

import torch

from cppo_kernels.config import check_choice

__all__ = [
    "IS_MODES", "MISMATCH_METRICS", "bound_ratio", "check_mode", "correct_batches", "importance_weights",
    "mismatch_metrics", "mismatch_values",
]  # fmt: skip

#: ``vllm_importance_sampling_mode``: TRL's four corrections.
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def check_mode(mode: str) -> str:
    """``mode`` when it is one of :data:`IS_MODES`, else a one-line ``ValueError`` naming the setting."""
    return check_choice("vllm_importance_sampling_mode", mode, IS_MODES)


def bound_ratio(ratio: torch.Tensor, *, mode: str, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL's bound of an IS ratio: clamped to ``[clip_min, clip_max]`` (``*_truncate``; no bound where both are
    None) or set to 0 outside it (``*_mask``)."""
    if check_mode(mode).endswith("truncate"):
        if clip_min is None and clip_max is None:  # (torch.clamp refuses two None bounds)
            return ratio
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def importance_weights(
    old: torch.Tensor,
    sampling: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL's IS ratio of packed tokens. ``old [T]``: the training policy's log-probs of the sampled tokens before
    the update, ``sampling [T]``: the engine's; ``cu_seqlens [S+1]``. ``token_*`` modes: ``exp(old - sampling)`` per
    token ``[T]``; ``sequence_*``: ``exp`` of each sequence's summed difference ``[S]`` (the fused loss reads which
    from the shape). ``*_truncate`` clamps to ``[clip_min, clip_max]``; ``*_mask`` sets a ratio outside them to 0. A
    NaN sampling log-prob counts as no difference (ratio 1), as in TRL."""
    diff = torch.nan_to_num(old.float() - sampling.float(), nan=0.0)  # [T]
    if check_mode(mode).startswith("sequence"):
        seq = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=diff.device), cu_seqlens.diff().long())
        diff = torch.zeros(len(cu_seqlens) - 1, dtype=diff.dtype, device=diff.device).index_add_(0, seq, diff)  # [S]
    return bound_ratio(torch.exp(diff), mode=mode, clip_min=clip_min, clip_max=clip_max)


#: TRL's ``sampling/*`` metrics of the engine-policy mismatch, and how TRL reduces each over the processes.
MISMATCH_METRICS = {
    "sampling/sampling_logp_difference/mean": "mean", "sampling/sampling_logp_difference/max": "max",
    "sampling/importance_sampling_ratio/min": "min", "sampling/importance_sampling_ratio/mean": "mean",
    "sampling/importance_sampling_ratio/max": "max",
}  # fmt: skip


def mismatch_values(delta: torch.Tensor, ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """:data:`MISMATCH_METRICS` as 0-d tensors: the mean and max of ``delta`` (the counted tokens' |training -
    sampling log-prob|, NaN ones already left out) and the min, mean and max of ``ratio`` (flat); 0 when empty."""
    fns = {"mean": torch.mean, "max": torch.max, "min": torch.min}
    return {
        name: fns[name.rsplit("/", 1)[1]](x) if x.numel() else x.new_zeros(())
        for name in MISMATCH_METRICS
        for x in [delta if "logp_difference" in name else ratio]
    }


def mismatch_metrics(old: torch.Tensor, sampling: torch.Tensor, ratio: torch.Tensor) -> dict[str, float]:
    """TRL's names: the mean and max |training - sampling log-prob| over the tokens (NaN ones left out) and the IS
    ratio's min, mean and max (:func:`mismatch_values`)."""
    delta = (old.float() - sampling.float()).abs()
    values = mismatch_values(delta[~torch.isnan(delta)], ratio.flatten())
    return {name: float(v) for name, v in values.items()}


def correct_batches(
    old: list[torch.Tensor], batches: list, *, real: int, mode: str, clip_min: float | None, clip_max: float | None
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per packed micro-batch (``sampling_logprobs [T]``, ``cu_seqlens``; ``old``: the policy's log-probs before the
    update) its :func:`importance_weights`, and the step's :func:`mismatch_metrics` over the first ``real`` ones
    (those after repeat one to keep the ranks in step)."""
    weights = [
        importance_weights(o, b.sampling_logprobs, b.cu_seqlens, mode=mode, clip_min=clip_min, clip_max=clip_max)
        for o, b in zip(old, batches)
    ]
    metrics = mismatch_metrics(
        torch.cat(old[:real]), torch.cat([b.sampling_logprobs for b in batches[:real]]),
        torch.cat(weights[:real]),
    )  # fmt: skip
    return weights, metrics
