"""The device code, in one place: which ``device`` settings exist, resolving ``"auto"``, and the autocast context the
forward passes compute in (fp32 master weights, compute dtype on the fly)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["DEVICES", "check_device", "resolve_device", "autocast"]

#: ``device``: these, or ``"cuda:N"`` (:func:`resolve_device` resolves ``"auto"``).
DEVICES = ("auto", "cpu", "cuda")


def check_device(device: str) -> str:
    """``device`` when it is one of :data:`DEVICES` or ``"cuda:N"``, else a ``ValueError`` (the format only: whether
    CUDA is there is checked when the device is resolved)."""
    numbered = isinstance(device, str) and device.startswith("cuda:") and device.removeprefix("cuda:").isdigit()
    if not (device in DEVICES or numbered):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return device


def autocast(device: torch.device | str, dtype: torch.dtype | None):
    """The context that computes in ``dtype`` from fp32 master weights: ``torch.autocast`` on ``device``'s type, or a
    null context for ``None`` / float32."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def resolve_device(device: str, *, local_rank: int | None = None) -> torch.device:
    """The torch device of a ``device`` setting: the one function that resolves ``"auto"`` (CUDA when available, else
    the CPU), for the trainer, ``cppo eval`` and :func:`cppo.distributed.init_distributed`.

    Args:
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        local_rank: this process's rank on its node under torchrun (one GPU per rank): ``"cuda"`` then means
            ``cuda:local_rank`` and ``"cuda:N"`` is refused. ``None`` for a single process.

    Returns:
        The device. ``ValueError`` for a malformed setting, for CUDA asked where there is none, or for a GPU index
        the node lacks.
    """
    check_device(device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if local_rank is not None and device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda' under torchrun (one GPU per rank), got {device!r}")
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available: use device=cpu (or auto)")
    resolved = torch.device("cuda", local_rank) if local_rank is not None else torch.device(device)
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        where = f"LOCAL_RANK={local_rank}" if local_rank is not None else f"device={device!r}"
        raise ValueError(f"{where} but this node has {torch.cuda.device_count()} CUDA devices")
    return resolved
