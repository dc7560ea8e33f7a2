"""Group-normalised advantages and completion selection: public functionals.

The Triton kernels live in :mod:`cppo_kernels._advantages_triton`; the PyTorch path is
:mod:`cppo_kernels.reference`. :mod:`cppo_kernels._dispatch` picks one per call.
"""

from __future__ import annotations

import torch

from . import reference
from ._dispatch import use_triton

__all__ = ["group_advantages", "select_completions", "cppo_select"]


def _backend(x):
    """The Triton launchers for tensors the dispatcher sends there, else the reference (which also rejects
    non-tensors). Imported lazily: triton is not installed everywhere."""
    if isinstance(x, torch.Tensor) and use_triton(x):
        from . import _advantages_triton

        return _advantages_triton
    return reference


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: str = "group", unbiased: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """Group-normalised advantages, fp32 ``[N]`` (``N = num_groups * group_size``, group after group).

    A_i = (r_i - mean_g) / (std + eps). ``scale``: ``"group"`` (each group's std), ``"batch"``
    (one std over the batch, group means still per group), ``"none"`` (only subtract the group
    mean: Dr. GRPO). ``unbiased=True`` applies Bessel's correction (TRL and the CPPO code).
    A group whose rewards are all equal gets exactly 0.
    """
    return _backend(rewards).group_advantages(rewards, group_size, scale=scale, unbiased=unbiased, eps=eps)


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
    return _backend(advantages).select_completions(
        advantages, group_size, keep, scope=scope, metric=metric, generator=generator
    )


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
    """``(advantages [N] fp32, kept indices)``: ``group_advantages`` then ``select_completions``, fused.

    On the Triton path this is one kernel launch (advantages, rank selection and compaction),
    plus a batch-std launch for ``scale="batch"`` with ``scope="group"``, plus ``torch.rand``
    for ``metric="random"``. Validation (incl. a finiteness check) runs before any launch.
    """
    return _backend(rewards).cppo_select(
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
