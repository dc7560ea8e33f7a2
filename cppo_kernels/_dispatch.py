"""Backend choice: Triton kernels (CUDA, or the interpreter when forced) or the PyTorch path.

``CPPO_KERNELS_BACKEND`` selects the backend at call time:

- ``auto`` (default): Triton for CUDA tensors when Triton is importable, PyTorch otherwise.
- ``triton``: always Triton. On CPU tensors this needs ``TRITON_INTERPRET=1`` set before
  ``cppo_kernels`` is imported (that is how the tests exercise the kernels without a GPU).
- ``torch``: always the PyTorch path.
"""

from __future__ import annotations

import os

import torch

_ENV = "CPPO_KERNELS_BACKEND"
_CHOICES = ("auto", "triton", "torch")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requested_backend(backend: str | None = None) -> str:
    """The backend asked for: the ``backend`` argument, else ``$CPPO_KERNELS_BACKEND``, else ``auto``."""
    choice = (backend if backend is not None else os.environ.get(_ENV, "auto")).strip().lower()
    if choice not in _CHOICES:
        source = "backend" if backend is not None else _ENV
        raise ValueError(f"{source} must be one of {_CHOICES}, got {choice!r}")
    return choice


def use_triton(tensor: torch.Tensor, backend: str | None = None) -> bool:
    """Whether an op on ``tensor`` runs the Triton kernels."""
    choice = requested_backend(backend)
    if choice == "torch":
        return False
    if choice == "auto":
        return tensor.is_cuda and triton_available()
    if not triton_available():
        raise RuntimeError(f"{_ENV}=triton but triton is not installed")
    if not tensor.is_cuda and not interpreter_enabled():
        raise RuntimeError(
            f"{_ENV}=triton on a {tensor.device.type} tensor needs TRITON_INTERPRET=1 set before importing cppo_kernels"
        )
    return True
