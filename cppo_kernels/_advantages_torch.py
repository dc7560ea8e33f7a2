"""PyTorch backend of the advantages and the completion selection: the CPU path and the fallback without Triton.

Same interface as ``_advantages_triton``; the inputs are already validated by :mod:`cppo_kernels.advantages`.
Statistics in float64 on rewards scaled by a power of two, advantages returned fp32; selection by a stable sort of
the fp32 scores; ``metric="max-variance"`` by one stable sort per group and fp64 prefix sums (:func:`max_variance`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._carriers import SelectOptions
from .config import MAX_VARIANCE_RTOL

__all__ = ["group_advantages", "select_completions", "cppo_select"]

FP32_MAX = torch.finfo(torch.float32).max
MIN_NORMAL = torch.finfo(torch.float64).tiny


def group_advantages(rewards: Tensor, group_size: int, options: SelectOptions) -> Tensor:
    """fp32 ``[N]`` advantages of ``rewards [N]`` (see :func:`cppo_kernels.group_advantages`; of ``options``, its
    ``scale``, ``unbiased`` and ``eps``).

    Each group (the whole batch for ``scale="batch"``) is divided by the power of two :func:`pow2_scale` of its
    largest |reward| first (exact, and no square or sum can overflow whatever the finite input), then shifted by
    its first reward (exact differences for clustered rewards), as the Triton kernels do.
    """
    scale, unbiased, eps = options.scale, options.unbiased, options.eps
    r = rewards.detach().to(torch.float64).reshape(-1, group_size)  # [Q, G]
    if r.numel() == 0:
        return torch.empty(0, dtype=torch.float32, device=r.device)
    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)  # [Q, 1]
    mag = r.abs()  # [Q, G]
    s = pow2_scale(mag.amax() if scale == "batch" else mag.amax(dim=1, keepdim=True))  # [Q, 1] or []
    rs = r / s  # [Q, G], |rs| < 2
    d = rs - rs[:, :1]  # [Q, G] shifted by the first reward: exact differences for clustered rewards
    centered = d - d.mean(dim=1, keepdim=True)  # [Q, G]
    if scale == "group":
        adv = centered / (_std(d, unbiased=unbiased) + eps / s)  # std [Q, 1]
    elif scale == "batch":
        flat = rs.reshape(1, -1)  # [1, N]
        adv = centered / (_std(flat - flat[:, :1], unbiased=unbiased) + eps / s)  # std [1, 1]
    else:
        adv = (centered * s).clamp(-FP32_MAX, FP32_MAX)  # rounded to fp32 below, saturating instead of inf
    adv = torch.where(constant, torch.zeros_like(adv), adv)  # exact 0, also when eps=0 makes it 0/0
    return adv.reshape(-1).to(torch.float32)


def pow2_scale(m: Tensor) -> Tensor:
    """``2^floor(log2 m)`` of fp64 ``m >= 0`` (at least 2^-1022, the smallest normal): dividing by it is exact."""
    exponent = m.view(torch.int64) & 0x7FF0000000000000  # the exponent bits alone: a power of two (or 0)
    return exponent.view(torch.float64).clamp_min(MIN_NORMAL)


def _std(x: Tensor, *, unbiased: bool) -> Tensor:
    """Std of each row of ``x [R, n]`` as ``[R, 1]``; 0 over fewer than two values (one with ``unbiased=False``)."""
    n = x.shape[1]
    denom = n - 1 if unbiased else n
    if denom <= 0:
        return x.new_zeros(x.shape[0], 1)
    ss = ((x - x.mean(dim=1, keepdim=True)) ** 2).sum(dim=1, keepdim=True)  # [R, 1]
    return (ss / denom).sqrt()


def select_completions(
    advantages: Tensor, group_size: int, count: int, options: SelectOptions, draws: Tensor | None
) -> Tensor:
    """Ascending int64 indices of the kept completions (see :func:`cppo_kernels.select_completions`): ``count`` per
    group (``options.scope="group"``) or over the whole batch (``"batch"``), by ``options.metric``.

    ``draws``: fp32 ``[N]`` uniform scores for ``metric="random"`` (drawn by the public layer), else None.
    """
    device, scope, metric = advantages.device, options.scope, options.metric
    num_groups = advantages.numel() // group_size
    if count == 0 or num_groups == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    if metric == "max-variance":
        return max_variance(advantages, group_size, count)
    if metric == "random":
        score = draws  # [N]
    else:
        mag = advantages.detach().abs().to(torch.float32)  # [N]
        score = mag if metric == "smallest" else -mag
    if scope == "group":
        order = torch.sort(-score.reshape(num_groups, group_size), dim=1, stable=True).indices  # [Q, G]
        offsets = torch.arange(num_groups, device=device).unsqueeze(1) * group_size  # [Q, 1]
        kept = (order[:, :count] + offsets).reshape(-1)  # [Q * count]
    else:
        kept = torch.sort(-score, stable=True).indices[:count]  # [count]
    return torch.sort(kept).values.to(torch.long)


def max_variance(advantages: Tensor, group_size: int, keep: int) -> Tensor:
    """Ascending int64 indices of the ``keep`` completions of each group whose advantages have the largest variance
    (PODS; see :func:`cppo_kernels.select_completions`), ``keep >= 1``.

    The advantages are rounded to fp32 (saturating; -0.0 read as 0.0) and each group sorted once, highest first,
    equal values by index (stable sort). Candidate ``i`` takes the ``i`` highest and ``keep - i`` lowest; its sum of
    squared deviations comes from fp64 prefix sums of the values centred on the group's mid-range (rounding well
    below :data:`MAX_VARIANCE_RTOL` of the largest for groups up to 4,096, the worst-case bound being ~9 G^2 2^-53).
    The smallest ``i`` within the tolerance of the largest wins; of equal values the lowest indices are kept.
    """
    top = torch.finfo(torch.float32).max
    x = advantages.detach().to(torch.float64).clamp(-top, top).to(torch.float32).reshape(-1, group_size)  # [Q, G]
    x = torch.where(x == 0, torch.zeros_like(x), x)  # -0.0 as 0.0: one value, as in the Triton kernel's keys
    values, order = torch.sort(x, dim=1, descending=True, stable=True)  # [Q, G]: equal values by index
    first = _best_candidate(values.to(torch.float64), keep)  # [Q, 1]
    pos = torch.arange(group_size, device=x.device).expand_as(order)  # [Q, G] sorted positions
    new = torch.ones_like(order, dtype=torch.bool)
    new[:, 1:] = values[:, 1:] != values[:, :-1]  # [Q, G] the first position of each run of equal values
    start = torch.cummax(torch.where(new, pos, 0), dim=1).values  # [Q, G] its run's first position
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    end = torch.where(last, pos + 1, group_size).flip(1).cummin(dim=1).values.flip(1)  # [Q, G] its run's end
    # how many of each run the candidate takes (the part above `first`, the part from the bottom), lowest indices
    bottom = group_size - keep + first  # [Q, 1]
    taken = (torch.minimum(end, first) - start).clamp_min(0) + (end - torch.maximum(start, bottom)).clamp_min(0)
    kept = pos - start < taken  # [Q, G], exactly `keep` per group
    offsets = torch.arange(x.shape[0], device=x.device).unsqueeze(1) * group_size  # [Q, 1]
    return torch.sort((order + offsets)[kept]).values.to(torch.long)


def _best_candidate(values: Tensor, keep: int) -> Tensor:
    """``[Q, 1]``: per row of fp64 ``values [Q, G]`` (sorted, highest first) the smallest ``i`` whose candidate (the
    ``i`` first and ``keep - i`` last) has a sum of squared deviations within :data:`MAX_VARIANCE_RTOL` of the
    largest. One value has no spread: every candidate ties and ``i = 0``."""
    q, g = values.shape
    if keep <= 1:
        return torch.zeros(q, 1, dtype=torch.long, device=values.device)
    d = values - (values[:, :1] + values[:, -1:]) / 2  # [Q, G] centred on the mid-range: |d| <= spread / 2
    zero = d.new_zeros(q, 1)
    p1 = torch.cat([zero, d.cumsum(1)], dim=1)  # [Q, G + 1] exclusive prefix sums
    p2 = torch.cat([zero, (d * d).cumsum(1)], dim=1)
    i = torch.arange(keep + 1, device=values.device)  # [keep + 1] candidates
    s1 = p1[:, i] + (p1[:, g:] - p1[:, g - keep + i])  # [Q, keep + 1]
    s2 = p2[:, i] + (p2[:, g:] - p2[:, g - keep + i])
    ssd = s2 - s1 * s1 / keep  # [Q, keep + 1]
    threshold = ssd.amax(dim=1, keepdim=True) * (1 - MAX_VARIANCE_RTOL)  # [Q, 1]
    return (ssd >= threshold).to(torch.uint8).argmax(dim=1, keepdim=True)  # the first candidate at the threshold


def cppo_select(
    rewards: Tensor, group_size: int, count: int, options: SelectOptions, draws: Tensor | None
) -> tuple[Tensor, Tensor]:
    """:func:`group_advantages` then :func:`select_completions` on those advantages."""
    adv = group_advantages(rewards, group_size, options)  # [N]
    return adv, select_completions(adv, group_size, count, options, draws)
