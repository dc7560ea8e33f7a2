"""Backend choice: Triton kernels (CUDA, or the interpreter when forced) or the PyTorch path.

``CPPO_KERNELS_BACKEND`` selects the backend at call time:

- ``auto`` (default): Triton for CUDA tensors when Triton is importable, PyTorch otherwise.
- ``triton``: always Triton. On CPU tensors this needs ``TRITON_INTERPRET=1`` set before
  ``cppo_kernels`` is imported (that is how the tests exercise the kernels without a GPU).
- ``torch``: always the PyTorch path.

:func:`use_backend` forces a backend inside a ``with`` block (it takes precedence over the
environment variable and leaves the environment untouched), which is how the trainer honours its
``kernel_backend`` setting. :func:`backend_module` is the one place an op picks its backend module, for every
execution mode of the op: :data:`BACKEND_MODES` says which backend implements which mode, and a mode the chosen
backend lacks runs on the op's PyTorch twin, on the same device.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import torch

_ENV = "CPPO_KERNELS_BACKEND"
_CHOICES = ("auto", "triton", "torch")
_OVERRIDE: contextvars.ContextVar[str | None] = contextvars.ContextVar("cppo_kernels_backend", default=None)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def requested_backend(backend: str | None = None) -> str:
    """The backend asked for: the ``backend`` argument, else the innermost :func:`use_backend`, else
    ``$CPPO_KERNELS_BACKEND``, else ``auto``."""
    override = _OVERRIDE.get()
    if backend is not None:
        choice, source = backend, "backend"
    elif override is not None:
        choice, source = override, "use_backend"
    else:
        choice, source = os.environ.get(_ENV, "auto"), _ENV
    return _normalise(choice, source)


def _normalise(choice, source: str) -> str:
    name = choice.strip().lower() if isinstance(choice, str) else choice
    if name not in _CHOICES:
        raise ValueError(f"{source} must be one of {_CHOICES}, got {choice!r}")
    return name


@contextlib.contextmanager
def use_backend(backend: str) -> Iterator[None]:
    """Runs the ops inside the ``with`` block on ``backend``, whatever ``$CPPO_KERNELS_BACKEND`` says.

    Nests; thread- and task-local (a context variable).

    Args:
        backend: ``"auto"`` (Triton for CUDA tensors when Triton is importable), ``"triton"`` or ``"torch"``;
            checked before the block runs (``ValueError`` otherwise).
    """
    token = _OVERRIDE.set(_normalise(backend, "use_backend"))  # validated before anything runs
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


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


#: The execution modes each backend of an op implements, for the ops that have modes (``fused_cppo_loss``: see
#: ``cppo_kernels.loss.MODES``). The PyTorch twin implements every mode.
BACKEND_MODES: dict[str, dict[str, tuple[str, ...]]] = {
    "loss": {"triton": ("two-pass", "grad-in-forward"), "torch": ("two-pass", "grad-in-forward")},
}
#: A mode a backend implements in a module of its own (else ``cppo_kernels._{op}_{backend}``): the Triton backend's
#: gradient-in-forward is cuBLAS GEMMs around a Triton row pass (``cppo_kernels._loss_gemm``).
MODE_MODULES: dict[tuple[str, str, str], str] = {("loss", "triton", "grad-in-forward"): "_loss_gemm"}


def backend_module(op: str, tensor: torch.Tensor, *, mode: str | None = None) -> ModuleType:
    """The backend module of ``op`` for ``tensor``: ``cppo_kernels._{op}_triton`` when :func:`use_triton`, else
    ``cppo_kernels._{op}_torch``. Imported on first use: triton is not installed everywhere.

    With ``mode`` (an op of :data:`BACKEND_MODES`), the backend's module for that mode (:data:`MODE_MODULES`); a
    mode the Triton backend lacks takes ``cppo_kernels._{op}_torch`` on ``tensor``'s device whatever the backend
    asked for (without consulting :func:`use_triton`: the Triton backend is not used); an op without modes, or a
    mode no backend of the op implements, is a ``ValueError``.
    """
    if mode is not None:
        modes = BACKEND_MODES.get(op)
        if modes is None:
            raise ValueError(f"mode={mode!r}: op {op!r} has no execution modes (ops with modes: {list(BACKEND_MODES)})")
        if mode not in modes["torch"]:
            raise ValueError(f"mode must be one of {modes['torch']} for op {op!r}, got {mode!r}")
        if mode not in modes["triton"]:
            return _import(op, "torch")  # the Triton backend lacks the mode: its PyTorch twin
    return _import(op, "triton" if use_triton(tensor) else "torch", mode)


def _import(op: str, backend: str, mode: str | None = None) -> ModuleType:
    name = MODE_MODULES.get((op, backend, mode), f"_{op}_{backend}")
    return importlib.import_module(f"{__package__}.{name}")
