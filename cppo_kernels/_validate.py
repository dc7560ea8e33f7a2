"""Input checks shared by every op: a clear ``ValueError`` naming the argument, never a wrong answer."""

from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")
SCOPES = ("group", "batch")
METRICS = ("smallest", "largest", "random")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_float(name: str, value, *, low: float | None = None, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    return value


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
