"""What the ops take, declared once: :class:`LossInputs` (the loss's tensors) and :class:`SelectOptions` (the
advantages' and the selection's options), and :func:`expands`, which gives a function taking one carrier the public
signature of its fields.

:func:`cppo_kernels.fused_cppo_loss`, :func:`cppo_kernels.cppo_loss_from_logits`, ``FusedCPPOLoss.forward`` and
the float64 oracle :func:`cppo_kernels.reference.fused_cppo_loss` take LossInputs' fields as their own parameters
(the first two positional, the others keyword-only), bound into one LossInputs at the call; the loss's validation
and packing, its modes, the custom op's real and fake implementations (flattened at the op's boundary by
``cppo_kernels._ops``' one helper pair) and the autograd Functions hand it on whole. A new per-token or
per-sequence input is a field here, its check in :func:`cppo_kernels._loss_inputs.pack`, its use in the policy math
(:func:`cppo_kernels._policy.batch_constants`) and its line in the docstring of ``fused_cppo_loss``. Likewise the
selection: ``group_advantages``, ``select_completions`` and ``cppo_select`` (the public ones and the oracles) take
the fields of :class:`SelectOptions` they use, and the backends one SelectOptions. Declarations only (no logic), so
the oracles may share them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

__all__ = [
    "LossInputs",
    "SelectOptions",
    "ADVANTAGE_FIELDS",
    "SELECT_FIELDS",
    "expands",
    "takes_loss_inputs",
    "takes_advantage_options",
    "takes_select_options",
    "takes_cppo_select_options",
]


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


class SelectOptions(NamedTuple):
    """The options of the group-normalised advantages and of the completion selection, with their defaults; meaning:
    :func:`cppo_kernels.cppo_select`. ``keep`` is positional, the others keyword-only; each function takes the
    fields it uses (:data:`ADVANTAGE_FIELDS`, :data:`SELECT_FIELDS`, or all)."""

    keep: int | None = None  # completions kept per group
    num_kept: int | None = None  # or: kept over the whole batch (scope="batch")
    scale: str = "group"  # the advantages' std: "group", "batch" or "none"
    unbiased: bool = True
    eps: float = 1e-4
    scope: str = "group"  # "group" or "batch"
    metric: str = "smallest"  # "smallest", "largest", "random" or "max-variance"
    generator: torch.Generator | None = None  # the draws of metric="random"


#: The fields of :class:`SelectOptions` that ``group_advantages`` takes, and those ``select_completions`` takes.
ADVANTAGE_FIELDS = ("scale", "unbiased", "eps")
SELECT_FIELDS = ("keep", "num_kept", "scope", "metric", "generator")

F = TypeVar("F", bound=Callable)


def _parameters(carrier: type, fields: tuple[str, ...], positional: tuple[str, ...]) -> list[inspect.Parameter]:
    """``carrier``'s ``fields`` as parameters (``positional`` ones first, then keyword-only), annotated and with
    their defaults as the carrier declares them."""
    hints = {name: getattr(hint, "__forward_arg__", hint) for name, hint in carrier.__annotations__.items()}
    defaults = carrier._field_defaults
    out = []
    for kind, names in (
        (inspect.Parameter.POSITIONAL_OR_KEYWORD, [n for n in fields if n in positional]),
        (inspect.Parameter.KEYWORD_ONLY, [n for n in fields if n not in positional]),
    ):
        out += [inspect.Parameter(n, kind, default=defaults.get(n, inspect.Parameter.empty), annotation=hints[n])
                for n in names]  # fmt: skip
    return out


def expands(param: str, carrier: type, fields: tuple[str, ...], positional: tuple[str, ...] = ()) -> Callable[[F], F]:
    """A decorator: ``fn``'s parameter ``param`` stands for the ``fields`` of the NamedTuple ``carrier``, the
    ``positional`` ones positional in its place, the others keyword-only (before ``fn``'s own keywords), bound into
    one carrier at each call (a field not taken keeps the carrier's default). The parameters of ``fn`` before
    ``param`` are positional, those after it keyword-only. ``inspect.signature`` and ``help`` show the expanded
    signature; the undecorated function is ``__wrapped__``."""

    def decorate(fn: F) -> F:
        own = list(inspect.signature(fn).parameters.values())
        at = [p.name for p in own].index(param)
        before, after = own[:at], own[at + 1 :]
        if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in before) or any(
            p.kind not in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in after
        ):
            raise TypeError(f"{fn.__qualname__}: positional parameters before {param!r}, keyword-only after it")
        expanded = _parameters(carrier, fields, positional)
        names = [p.name for p in expanded if p.kind is p.POSITIONAL_OR_KEYWORD]
        required = [p.name for p in expanded if p.default is p.empty]
        lead, count = len(before), len(before) + len(names)

        @functools.wraps(fn)
        def bound(*args, **kwargs):
            if len(args) > count:
                raise TypeError(f"{fn.__name__}() takes {count} positional arguments but {len(args)} were given")
            values = {name: kwargs.pop(name) for name in fields if name in kwargs}
            for name, value in zip(names, args[lead:]):
                if name in values:
                    raise TypeError(f"{fn.__name__}() got multiple values for argument {name!r}")
                values[name] = value
            missing = [name for name in required if name not in values]
            if missing:
                raise TypeError(f"{fn.__name__}() missing required arguments: {', '.join(map(repr, missing))}")
            return fn(*args[:lead], **{param: carrier(**values)}, **kwargs)

        bound.__signature__ = inspect.signature(fn).replace(parameters=[*before, *expanded, *after])
        return bound  # type: ignore[return-value]

    return decorate


#: The loss's tensors as parameters: ``targets, advantages`` positional, the others keyword-only (default None).
_REQUIRED = tuple(name for name in LossInputs._fields if name not in LossInputs._field_defaults)
takes_loss_inputs = expands("inputs", LossInputs, LossInputs._fields, _REQUIRED)
#: ``group_advantages``' options (keyword-only), ``select_completions``' (``keep`` positional) and ``cppo_select``'s.
takes_advantage_options = expands("options", SelectOptions, ADVANTAGE_FIELDS)
takes_select_options = expands("options", SelectOptions, SELECT_FIELDS, ("keep",))
takes_cppo_select_options = expands("options", SelectOptions, SelectOptions._fields, ("keep",))
