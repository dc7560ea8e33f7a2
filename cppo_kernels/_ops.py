"""The public ops as ``torch.library`` custom ops, so that ``torch.compile(fullgraph=True)`` keeps them in the graph.

Three ops (``torch.ops.cppo_kernels.*``), each with a fake (meta) implementation for tracing:

- ``fused_cppo_loss``: the whole loss of :func:`cppo_kernels.fused_cppo_loss` in one node. Its real implementation
  runs the eager public function (same validation, same execution modes and backends, same results) and returns the
  gradients with respect to hidden, weight and bias next to the loss (those that are wanted, in their dtypes);
  its registered backward scales them by the loss's incoming gradient. Under ``torch.compile`` both modes therefore
  compute the gradients in the forward node (the two-pass mode's backward kernels run there): the ``[V, H]``
  weight gradient is held from the forward to the backward, as in the eager gradient-in-forward mode.
- ``fused_logprobs``: :func:`cppo_kernels.fused_logprobs` (no gradient: the old-policy and reference passes).
- ``cppo_select``: :func:`cppo_kernels.cppo_select` (advantages and kept indices, one Triton launch on CUDA).

Schemas are stable under new options: the loss and head options travel as one string and one tensor
(:func:`encode`; :func:`decode` reads them back), so a new scalar option (a :class:`cppo_kernels.LossConfig` field,
a head transform's float) needs no schema change; the loss's tensors are the LM head's and the fields of
:class:`cppo_kernels._carriers.LossInputs`, so a new input (a field there) is one more ``Tensor?`` argument of the
schema built from them (:func:`_loss_schema`), flattened and read back by one helper pair (:func:`_loss_args`,
:func:`_loss_call`). The string
holds the options that choose code (names, bools, None) as ``name=repr(value)``; every number (a float or int
option) travels as data, in a float64 CPU tensor, and is never formatted into the string. Dynamo traces a number
that can change as a symbol (every number under ``dynamic=True``; under the default ``dynamic=None``, one whose
value changed since the last compile): a symbol cannot be formatted into a string, and as data a new value (TRL's
adaptive ``entropy_coef``, another ``FusedCPPOLoss`` config) runs the same graph, with no recompilation (the default
``dynamic=None`` compiles once more at the first change, then makes the number symbolic). What the fakes need to know
(the metrics a loss reports, which depends on comparisons of numbers: :func:`_metric_key`) is decided while tracing,
where dynamo guards the comparison, not the value. Sizes that change every step (token counts, sequence counts, the
kept count) are symbolic ints in the fakes, so they do not recompile either: the kept count is ``keep * num_groups``
or ``num_kept``, a function of the input sizes and ints, not of the data.

Value checks that read tensors back (finite values, targets in range, offsets) run inside the real implementations
(they are the eager functions), so a compiled call raises the eager one-line ``ValueError`` at run time. The
:class:`cppo_kernels.LossConfig` is validated by the public function, and once more where the op rebuilds it
(:func:`_config`): a number that travels as data reaches the op without the public function running again.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from ._carriers import LossInputs, SelectOptions
from .config import LOSS_OPTIONS, LossConfig

#: The eager functions behind the ops, registered by the modules that define them (:func:`implements`): this module
#: imports neither :mod:`cppo_kernels.loss` nor :mod:`cppo_kernels.advantages`, which import it.
_EAGER: dict[str, Callable] = {}


def implements(name: str) -> Callable[[Callable], Callable]:
    """Registers the decorated function as the eager implementation behind the op ``name`` ("loss", "logprobs",
    "select"); returns it unchanged."""

    def register(fn: Callable) -> Callable:
        _EAGER[name] = fn
        return fn

    return register


__all__ = ["encode", "decode", "compiled_loss", "compiled_logprobs", "compiled_select", "metric_names"]

_NS = "cppo_kernels"


def encode(**options) -> tuple[str, Tensor]:
    """``options`` as ``(text, numbers)``: the constants (str, bool, None) as ``name=repr(value)`` in ``text``, each
    number (int or float: a symbol under dynamo when it can change) as ``name=float#i`` / ``name=int#i`` with its
    value at ``numbers[i]``, a float64 CPU tensor (exact for every float and for ints up to 2**53): a new value runs
    the same graph."""
    items, numbers = [], []
    for name, value in options.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            kind = "int" if isinstance(value, int) else "float"
            items.append(f"{name}={kind}#{len(numbers)}")  # the value is never formatted: it may be a symbol
            numbers.append(value)
        else:
            items.append(f"{name}={value!r}")
    # each number enters the tensor through a tensor op (an add), so that dynamo turns a symbolic float into an input
    # tensor of the graph (its "tensorify" pass); any other use (torch.tensor of a list) would specialize it again
    zero = torch.zeros((), dtype=torch.float64)
    return ";".join(items), torch.stack([zero + value for value in numbers]) if numbers else zero.new_zeros(0)


@functools.lru_cache(maxsize=256)
def _decode(text: str) -> tuple[tuple[str, object], ...]:
    """``(name, value)`` of the constants of :func:`encode`'s text; a number's value is its ``(kind, index)``."""
    out = []
    for name, _, value in (item.partition("=") for item in text.split(";") if item):
        kind, hash_, index = value.partition("#")
        out.append((name, (kind, int(index)) if hash_ and kind in ("int", "float") else ast.literal_eval(value)))
    return tuple(out)


def decode(text: str, numbers: Tensor | None = None) -> dict[str, object]:
    """The options of :func:`encode`'s ``(text, numbers)``; without ``numbers`` (a fake, which cannot read them) the
    constants only."""
    values = None if numbers is None else numbers.tolist()
    out = {}
    for name, value in _decode(text):
        if isinstance(value, tuple):
            if values is None:
                continue
            kind, index = value
            value = int(values[index]) if kind == "int" else values[index]
        out[name] = value
    return out


# --------------------------------------------------------------------------------------------
# fused_cppo_loss
# --------------------------------------------------------------------------------------------


def _config(options: dict) -> LossConfig:
    """The LossConfig of the decoded ``options`` (its fields, every number exact in float64; the other keys are the
    op's own)."""
    # Validated again, on purpose (eager calls never come here): a number that travels as data (an input of the graph)
    # reaches here with a new value without the public function running again, and dynamo does not guard every check
    # of it (beta, entropy_coef, temperature or off_policy_mask_threshold at +-inf ran the graph traced at 0.01 under
    # torch 2.13; tests/kernels/test_loss_options.py): this is that value's one check, ~20 comparisons beside a loss.
    return LossConfig(**{k: v for k, v in options.items() if k in LOSS_OPTIONS})


def _split(options: dict) -> tuple[LossConfig, str, tuple[bool, bool, bool], dict[str, object]]:
    """(LossConfig, mode, which of hidden / weight / bias want gradients, the keywords of the head's transform) of
    the loss options of :func:`compiled_loss`, decoded with their numbers."""
    head = {k[5:]: v for k, v in options.items() if k.startswith("head.")}
    return _config(options), options["mode"], _needs(options), head


def _needs(options: dict) -> tuple[bool, bool, bool]:
    return tuple(c == "1" for c in options["needs"])


#: Each loss option's default (:func:`_metric_key` compares the numbers with it).
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LossConfig)}


def _metric_key(cfg: LossConfig) -> str:
    """What the metric names of ``cfg`` can depend on, as a constant string (``name=repr,...``) even when ``cfg``'s
    numbers are dynamo symbols: every choice, bool and None as it is, and of each number only whether it equals its
    default (an ``if``: dynamo guards that outcome, not the value, so every value on the same side runs the same graph
    and the other side compiles its own). ``tests/kernels/test_ops_dynamic.py`` checks that it determines the names."""
    key = []
    for name in LOSS_OPTIONS:
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, (str, bool)):
            value = "default" if value == _DEFAULTS[name] else "other"
        key.append(f"{name}={value!r}")
    return ",".join(key)


@functools.lru_cache(maxsize=64)
def _stand_in(name: str) -> object:
    """A valid value of the number ``name`` other than its default, the other options at theirs."""
    for value in (0.5, 2):
        with contextlib.suppress(ValueError):
            LossConfig(**{name: value})
            return value
    raise AssertionError(f"no stand-in value for the loss option {name}")


@functools.lru_cache(maxsize=64)
def _metric_names(key: str) -> tuple[str, ...]:
    """The metric names of the loss options of a :func:`_metric_key`: the keys of the eager function's metrics on a
    one-token problem (so new metrics need no list here), the numbers at their defaults or a stand-in."""
    options = {}
    for name, _, text in (item.partition("=") for item in key.split(",")):
        value = ast.literal_eval(text)
        options[name] = _DEFAULTS[name] if value == "default" else _stand_in(name) if value == "other" else value
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.enable_grad():
        return _probe_metric_names(LossConfig(**options))


def _probe_metric_names(cfg: LossConfig) -> tuple[str, ...]:
    one = torch.zeros(1, 1)
    zero = torch.zeros(1)
    inputs = LossInputs(
        torch.zeros(1, dtype=torch.long), zero, cu_seqlens=torch.tensor([0, 1]), old_logprobs=zero, ref_logprobs=zero
    )
    _, metrics = _EAGER["loss"](one, one, inputs, bias=None, cfg=cfg, mode="two-pass")
    return tuple(metrics)


@torch._dynamo.assume_constant_result
def metric_names(key: str) -> str:
    """``_metric_names`` joined by commas: a constant for dynamo (computed once per key)."""
    return ",".join(_metric_names(key))


@contextlib.contextmanager
def _autograd_dispatch() -> Iterator[None]:
    """Autograd recorded again inside an op's real implementation (the op's autograd layer runs it with the
    autograd dispatch keys excluded): the eager loss's own graph gives the gradients."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"):
        exclude = exclude.remove(getattr(torch._C.DispatchKey, name))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


#: The loss op's arguments: the LM head's tensors (their gradients are the op's outputs), the fields of
#: :class:`LossInputs` in their order, then :func:`encode`'s ``(options, numbers)``.
_HEAD = ("hidden", "weight", "bias")


def _loss_schema() -> str:
    """The op's schema, from :class:`LossInputs`: a field with a default is an optional tensor (``Tensor?``)."""
    optional = {"bias", *LossInputs._field_defaults}
    tensors = [f"Tensor{'?' if name in optional else ''} {name}" for name in (*_HEAD, *LossInputs._fields)]
    return f"({', '.join(tensors)}, str options, Tensor numbers) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"


def _loss_args(head: tuple[Tensor, Tensor, Tensor | None], inputs: LossInputs, options: str, numbers: Tensor) -> tuple:
    """The op's flat arguments of ``(hidden, weight, bias)``, the carrier and the encoded options."""
    return (*head, *inputs, options, numbers)


def _loss_call(args: tuple) -> tuple[tuple[Tensor, Tensor, Tensor | None], LossInputs, str, Tensor]:
    """:func:`_loss_args` read back: ``((hidden, weight, bias), inputs, options, numbers)``."""
    head, tensors, (options, numbers) = args[:3], args[3:-2], args[-2:]
    return head, LossInputs(*tensors), options, numbers


@torch.library.custom_op(f"{_NS}::fused_cppo_loss", mutates_args=(), schema=_loss_schema())
def _loss_op(*args) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, metrics [M], dhidden, dweight, dbias)``: the eager loss and its gradients (an empty tensor for a
    gradient not wanted), computed here; the metrics in the order of :func:`metric_names`. Arguments:
    :func:`_loss_args` (``options``, ``numbers``: :func:`encode`'s of the loss options, the mode, ``needs`` and
    ``head.*``, :func:`compiled_loss`)."""
    params, inputs, options, numbers = _loss_call(args)
    cfg, mode, needs, head = _split(decode(options, numbers))
    with _autograd_dispatch(), torch.enable_grad():
        leaves = [None if x is None else x.detach().requires_grad_(n) for x, n in zip(params, needs)]
        loss, metrics = _EAGER["loss"](leaves[0], leaves[1], inputs, bias=leaves[2], cfg=cfg, mode=mode, **head)
        wanted = [x for x, n in zip(leaves, needs) if n and x is not None]
        grads = [None] * len(wanted)
        if wanted and loss.requires_grad:
            grads = torch.autograd.grad(loss, wanted, allow_unused=True, materialize_grads=True)
    grads, out = iter(grads), []
    for x, n in zip(leaves, needs):
        if not n or x is None:
            out.append(params[0].new_empty(0))  # not wanted: the fake's empty tensor
            continue
        g = next(grads)
        out.append(torch.zeros_like(x, memory_format=torch.contiguous_format) if g is None else g.detach())
    return (loss.detach(), torch.stack(list(metrics.values())), *out)


@_loss_op.register_fake
def _loss_fake(*args):
    params, _, options, _ = _loss_call(args)
    decoded = decode(options)  # the constants: the numbers are data, not read here
    needs, num_metrics = _needs(decoded), len(_metric_names(decoded["metrics"]))
    hidden = params[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    grads = [
        torch.empty_like(x, memory_format=torch.contiguous_format) if n and x is not None else hidden.new_empty(0)
        for x, n in zip(params, needs)
    ]
    return (torch.empty((), **f32), torch.empty(num_metrics, **f32), *grads)


def _loss_setup(ctx, inputs, output) -> None:
    params, _, options, _ = _loss_call(inputs)
    ctx.needs = [n and x is not None for x, n in zip(params, _needs(decode(options)))]
    ctx.save_for_backward(*output[2:])


def _tracing(t: Tensor) -> bool:
    """Whether ``t`` is a tracer's tensor (AOTAutograd traces the backward with ``create_graph``)."""
    return torch.compiler.is_compiling() or type(t) is not torch.Tensor


def _loss_backward(ctx, grad_loss, *_unused):
    if torch.is_grad_enabled() and not _tracing(grad_loss):
        raise RuntimeError(
            "fused_cppo_loss does not support double backward (create_graph=True): its backward is not "
            "differentiable; for second derivatives use cppo_loss_from_logits on materialised logits"
        )
    grads = (g * grad_loss if n else None for g, n in zip(ctx.saved_tensors, ctx.needs))
    return *grads, *(None,) * (len(LossInputs._fields) + 2)  # the head's gradients; none for the rest


_loss_op.register_autograd(_loss_backward, setup_context=_loss_setup)


def compiled_loss(
    hidden, weight, inputs: LossInputs, *, bias, cfg: LossConfig, mode: str, **head
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`cppo_kernels.fused_cppo_loss` as one ``cppo_kernels::fused_cppo_loss`` node (its compiled path).

    ``head``: scalar keywords of the LM head's logit transform, handed to :func:`cppo_kernels.loss.eager_loss` as
    they are (they travel in the options string as ``head.NAME``: a new one changes no schema)."""
    grad = torch.is_grad_enabled()
    needs = "".join("1" if grad and x is not None and x.requires_grad else "0" for x in (hidden, weight, bias))
    key = _metric_key(cfg)
    options, numbers = encode(
        **{k: getattr(cfg, k) for k in LOSS_OPTIONS}, mode=mode, needs=needs, metrics=key,
        **{f"head.{k}": v for k, v in head.items()},
    )  # fmt: skip
    loss, metrics, *_ = _loss_op(*_loss_args((hidden, weight, bias), inputs, options, numbers))
    names = metric_names(key).split(",")
    metrics = metrics.detach()  # as the eager metrics: no gradient
    return loss, {name: metrics[i] for i, name in enumerate(names)}


# --------------------------------------------------------------------------------------------
# fused_logprobs
# --------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_NS}::fused_logprobs", mutates_args=())
def _logprobs_op(
    hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, head: str, numbers: Tensor
) -> tuple[Tensor, Tensor]:
    """``(logp, entropy)`` of the eager function (``entropy`` empty without ``compute_entropy``); ``head``,
    ``numbers``: :func:`encode`'s of its LossConfig fields (``temperature``, ``compute_entropy``) and the head's
    transform (``logit_scale``, ``logit_softcap``)."""
    options = decode(head, numbers)
    cfg = _config(options)
    with torch.no_grad():
        out = _EAGER["logprobs"](
            hidden, weight, targets, bias=bias, cfg=cfg, **{k: v for k, v in options.items() if k not in LOSS_OPTIONS}
        )
    if cfg.compute_entropy:
        return out
    return out, out.new_empty(0)


@_logprobs_op.register_fake
def _logprobs_fake(hidden, weight, targets, bias, head, numbers):
    logp = hidden.new_empty(hidden.shape[:-1], dtype=torch.float32)
    return logp, torch.empty_like(logp) if decode(head).get("compute_entropy") else logp.new_empty(0)


def compiled_logprobs(hidden, weight, targets, *, bias, cfg: LossConfig, **head) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`cppo_kernels.fused_logprobs` as one ``cppo_kernels::fused_logprobs`` node: of ``cfg``, the two fields
    the op reads travel (another field changes neither the text nor the graph)."""
    options = encode(temperature=cfg.temperature, compute_entropy=cfg.compute_entropy, **head)
    logp, entropy = _logprobs_op(hidden, weight, targets, bias, *options)
    return (logp, entropy) if cfg.compute_entropy else logp


# --------------------------------------------------------------------------------------------
# cppo_select
# --------------------------------------------------------------------------------------------


#: The :class:`SelectOptions` fields that travel in the options string: ``keep`` and ``num_kept`` are ints of the
#: schema, and the generator does not travel (its draws do, as a tensor).
_SELECT_ENCODED = tuple(name for name in SelectOptions._fields if name not in ("keep", "num_kept", "generator"))


@torch.library.custom_op(f"{_NS}::cppo_select", mutates_args=())
def _select_op(
    rewards: Tensor, draws: Tensor | None, group_size: int, keep: int, num_kept: int, options: str, numbers: Tensor
) -> tuple[Tensor, Tensor]:
    """``(advantages, kept)`` of the eager function, with the ``metric="random"`` draws given (``keep`` or
    ``num_kept`` is -1 when not given); ``options``, ``numbers``: :func:`encode`'s of the other options."""
    given = SelectOptions(None if keep < 0 else keep, None if num_kept < 0 else num_kept, **decode(options, numbers))
    return _EAGER["select"](rewards, group_size, given, draws=draws)


@_select_op.register_fake
def _select_fake(rewards, draws, group_size, keep, num_kept, options, numbers):
    n = rewards.shape[0]
    count = num_kept if num_kept >= 0 else keep * (n // group_size)
    return rewards.new_empty(n, dtype=torch.float32), rewards.new_empty(count, dtype=torch.long)


def compiled_select(rewards, group_size, options: SelectOptions, draws) -> tuple[Tensor, Tensor]:
    """:func:`cppo_kernels.cppo_select` as one ``cppo_kernels::cppo_select`` node (options validated already)."""
    keep = -1 if options.keep is None else options.keep
    num_kept = -1 if options.num_kept is None else options.num_kept
    encoded = encode(**{name: getattr(options, name) for name in _SELECT_ENCODED})
    return _select_op(rewards, draws, group_size, keep, num_kept, *encoded)
