"""Input checks shared by every op: a clear ``ValueError`` naming the argument, never a wrong answer."""

from __future__ import annotations

import torch

from .config import check_int


def check_grouped_vector(name: str, x, group_size: int) -> int:
    """Checks a 1-D finite floating tensor laid out group after group; returns the number of groups."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D [num_groups * group_size], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
    check_int("group_size", group_size, low=1)
    n = x.numel()
    if n % group_size != 0:
        raise ValueError(f"{name} has {n} elements, not divisible by group_size={group_size}")
    if n and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be finite (found NaN or inf)")
    return n // group_size
