"""The loss's tensors, declared once: :class:`LossInputs`, and :func:`takes_loss_inputs`, which gives a function
taking one LossInputs the public signature of its fields.

:func:`cppo_kernels.fused_cppo_loss`, :func:`cppo_kernels.cppo_loss_from_logits`, ``FusedCPPOLoss.forward`` and
the float64 oracle :func:`cppo_kernels.reference.fused_cppo_loss` take the fields as their own parameters (the
first two positional, the others keyword-only), bound into one LossInputs at the call; the loss's validation and
packing, its modes, the custom op's real and fake implementations (flattened at the op's boundary by
``cppo_kernels._ops``' one helper pair) and the autograd Functions hand it on whole. A new per-token or
per-sequence input is a field here, its check in :func:`cppo_kernels._loss_inputs.pack`, its use in the policy math
(:func:`cppo_kernels._policy.batch_constants`) and its line in the docstring of ``fused_cppo_loss``. A declaration
only (no logic), so the oracle may share it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from torch import Tensor

__all__ = ["LossInputs", "takes_loss_inputs"]


class LossInputs(NamedTuple):
    """The per-token and per-sequence tensors of one loss call, in the caller's layout (packed: ``cu_seqlens``;
    padded: ``mask``) or, after :func:`cppo_kernels._loss_inputs.pack`, packed (``cu_seqlens`` set, ``mask`` None,
    every per-token tensor ``[T]``). Fields without a default are positional parameters of the public functions,
    the others keyword-only, each None when not given. Shapes and meaning: :func:`cppo_kernels.fused_cppo_loss`."""

    targets: Tensor  # [T] or [B, L] integer token ids
    advantages: Tensor  # [S] or [B]
    cu_seqlens: Tensor | None = None  # [S+1] packed layout
    mask: Tensor | None = None  # [B, L] padded layout
    old_logprobs: Tensor | None = None  # [T] or [B, L]
    ref_logprobs: Tensor | None = None  # [T] or [B, L]
    importance_weights: Tensor | None = None  # per token ([T] / [B, L]) or per sequence ([S] / [B])
    sampling_logprobs: Tensor | None = None  # [T] or [B, L]


#: The fields given positionally (no default) and those given by keyword (default None).
_POSITIONAL = tuple(name for name in LossInputs._fields if name not in LossInputs._field_defaults)
_KEYWORD = tuple(name for name in LossInputs._fields if name in LossInputs._field_defaults)

F = TypeVar("F", bound=Callable)


def _parameters() -> tuple[list[inspect.Parameter], list[inspect.Parameter]]:
    """LossInputs' fields as parameters: (positional, keyword-only), annotated as the fields are."""
    hints = {name: getattr(hint, "__forward_arg__", hint) for name, hint in LossInputs.__annotations__.items()}
    positional = [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hints[n]) for n in _POSITIONAL
    ]
    keyword = [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hints[n]) for n in _KEYWORD
    ]
    return positional, keyword


def takes_loss_inputs(fn: F) -> F:
    """``fn(..., inputs, *, ...)`` as ``fn(..., targets, advantages, *, cu_seqlens=None, ..., ...)``: its parameter
    ``inputs`` stands for the fields of :class:`LossInputs` (those without a default positional, in its place; the
    others keyword-only, before ``fn``'s own keywords), bound into one LossInputs at each call. The parameters before
    ``inputs`` are positional (``self``, ``hidden``, ``weight``), those after it keyword-only. ``inspect.signature``
    and ``help`` show the expanded signature; the undecorated function is ``__wrapped__``."""
    own = list(inspect.signature(fn).parameters.values())
    at = [p.name for p in own].index("inputs")
    before, after = own[:at], own[at + 1 :]
    if any(p.kind not in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in after):
        raise TypeError(f"{fn.__qualname__}: the parameters after 'inputs' must be keyword-only")
    positional, keyword = _parameters()
    lead, count = len(before), len(before) + len(positional)

    @functools.wraps(fn)
    def bound(*args, **kwargs):
        if len(args) > count:
            raise TypeError(f"{fn.__name__}() takes {count} positional arguments but {len(args)} were given")
        tensors = {name: kwargs.pop(name) for name in LossInputs._fields if name in kwargs}
        missing = [name for name in _POSITIONAL[max(len(args) - lead, 0) :] if name not in tensors]
        if missing:
            raise TypeError(f"{fn.__name__}() missing required arguments: {', '.join(map(repr, missing))}")
        return fn(*args[:lead], inputs=LossInputs(*args[lead:], **tensors), **kwargs)

    bound.__signature__ = inspect.signature(fn).replace(parameters=[*before, *positional, *keyword, *after])
    return bound  # type: ignore[return-value]
