"""Group-normalised advantages and completion selection: public functionals.

The Triton kernels live in :mod:`cppo_kernels._advantages_triton`; the PyTorch path is
:mod:`cppo_kernels.reference`. :mod:`cppo_kernels._dispatch` picks one per call.
"""

from __future__ import annotations

import torch

from . import reference
from ._dispatch import use_triton

__all__ = ["group_advantages", "select_completions", "cppo_select"]


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: str = "group", unbiased: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Group-normalised advantages, fp32 ``[N]`` (``N = num_groups * group_size``, group after group).

    A_i = (r_i - mean_g) / (std + eps). ``scale``: ``"group"`` (each group's std), ``"batch"``
    (one std over the batch, group means still per group), ``"none"`` (only subtract the group
    mean: Dr. GRPO). ``unbiased=True`` applies Bessel's correction (TRL and the CPPO code).
    A group whose rewards are all equal gets exactly 0.
    """
    if use_triton(rewards):
        raise NotImplementedError("triton path pending")
    return reference.group_advantages(rewards, group_size, scale=scale, unbiased=unbiased, eps=eps)


def select_completions(
    advantages: torch.Tensor,
    group_size: int,
    keep: int,
    *,
    scope: str = "group",
    metric: str = "smallest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Ascending int64 indices of the retained completions (see :func:`cppo_kernels.reference.select_completions`)."""
    if use_triton(advantages):
        raise NotImplementedError("triton path pending")
    return reference.select_completions(advantages, group_size, keep, scope=scope, metric=metric, generator=generator)


def cppo_select(
    rewards: torch.Tensor,
    group_size: int,
    keep: int,
    *,
    scale: str = "group",
    unbiased: bool = True,
    eps: float = 1e-4,
    scope: str = "group",
    metric: str = "smallest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages [N] fp32, kept indices)``: one fused kernel launch on the Triton path."""
    if use_triton(rewards):
        raise NotImplementedError("triton path pending")
    return reference.cppo_select(
        rewards,
        group_size,
        keep,
        scale=scale,
        unbiased=unbiased,
        eps=eps,
        scope=scope,
        metric=metric,
        generator=generator,
    )
