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

Schemas are stable under new options: the loss and head options travel as one string (:func:`encode`, a
``name=repr(value)`` list that dynamo traces and :func:`decode` reads back with ``ast.literal_eval``), so a new
scalar option (a :class:`cppo_kernels.LossConfig` field, a head transform's float) needs no schema change; a new
optional tensor is one more ``Tensor?`` argument. Sizes that change every step (token counts, sequence counts, the
kept count) are symbolic ints in the fakes, never baked into an option string, so they do not recompile: the kept
count is ``keep * num_groups`` or ``num_kept``, a function of the input sizes and ints, not of the data.

Value checks that read tensors back (finite values, targets in range, offsets) run inside the real implementations
(they are the eager functions), so a compiled call raises the eager one-line ``ValueError`` at run time.
"""

from __future__ import annotations

import ast
import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

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


def encode(**options) -> str:
    """``options`` (constants: float, int, bool, str, None) as one string ``name=repr(value);...`` (traced by
    dynamo: an f-string join)."""
    return ";".join(f"{name}={value!r}" for name, value in options.items())


@functools.lru_cache(maxsize=256)
def _decode(text: str) -> tuple[tuple[str, object], ...]:
    return tuple((k, ast.literal_eval(v)) for k, _, v in (item.partition("=") for item in text.split(";") if item))


def decode(text: str) -> dict[str, object]:
    """The options of :func:`encode`'s string."""
    return dict(_decode(text))


# --------------------------------------------------------------------------------------------
# fused_cppo_loss
# --------------------------------------------------------------------------------------------


def _split(options: dict) -> tuple[LossConfig, str, tuple[bool, bool, bool], dict[str, object]]:
    """(LossConfig, mode, which of hidden / weight / bias want gradients, the keywords of the head's transform) of a
    decoded loss options string (:func:`compiled_loss`)."""
    cfg = LossConfig(**{k: v for k, v in options.items() if k in LOSS_OPTIONS})
    needs = tuple(c == "1" for c in options["needs"])
    head = {k.removeprefix("head."): v for k, v in options.items() if k.startswith("head.")}
    return cfg, options["mode"], needs, head


@functools.lru_cache(maxsize=64)
def _metric_names(config: str) -> tuple[str, ...]:
    """The metric names of the loss options ``config`` (an :func:`encode` string of LossConfig fields): the keys of
    the eager function's metrics on a one-token problem (so new metrics need no list here)."""
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.enable_grad():
        return _probe_metric_names(LossConfig(**decode(config)))


def _probe_metric_names(cfg: LossConfig) -> tuple[str, ...]:
    one = torch.zeros(1, 1)
    zero = torch.zeros(1)
    kwargs = dict(cu_seqlens=torch.tensor([0, 1]), mask=None, old_logprobs=zero, ref_logprobs=zero, bias=None)
    _, metrics = _EAGER["loss"](one, one, torch.zeros(1, dtype=torch.long), zero, **kwargs, cfg=cfg, mode="two-pass")
    return tuple(metrics)


@torch._dynamo.assume_constant_result
def metric_names(config: str) -> str:
    """``_metric_names`` joined by commas: a constant for dynamo (computed once per option string)."""
    return ",".join(_metric_names(config))


@contextlib.contextmanager
def _autograd_dispatch() -> Iterator[None]:
    """Autograd recorded again inside an op's real implementation (the op's autograd layer runs it with the
    autograd dispatch keys excluded): the eager loss's own graph gives the gradients."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"):
        exclude = exclude.remove(getattr(torch._C.DispatchKey, name))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


@torch.library.custom_op(f"{_NS}::fused_cppo_loss", mutates_args=())
def _loss_op(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    advantages: Tensor,
    cu_seqlens: Tensor | None,
    mask: Tensor | None,
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    bias: Tensor | None,
    importance_weights: Tensor | None,
    sampling_logprobs: Tensor | None,
    options: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, metrics [M], dhidden, dweight, dbias)``: the eager loss and its gradients (an empty tensor for a
    gradient not wanted), computed here; the metrics in the order of :func:`metric_names`."""
    cfg, mode, needs, head = _split(decode(options))
    with _autograd_dispatch(), torch.enable_grad():
        leaves = [None if x is None else x.detach().requires_grad_(n) for x, n in zip((hidden, weight, bias), needs)]
        loss, metrics = _EAGER["loss"](
            leaves[0], leaves[1], targets, advantages, cu_seqlens=cu_seqlens, mask=mask, old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs, bias=leaves[2], importance_weights=importance_weights,
            sampling_logprobs=sampling_logprobs, cfg=cfg, mode=mode, **head,
        )  # fmt: skip
        wanted = [x for x, n in zip(leaves, needs) if n and x is not None]
        grads = [None] * len(wanted)
        if wanted and loss.requires_grad:
            grads = torch.autograd.grad(loss, wanted, allow_unused=True, materialize_grads=True)
    grads, out = iter(grads), []
    for x, n in zip(leaves, needs):
        if not n or x is None:
            out.append(hidden.new_empty(0))  # not wanted: the fake's empty tensor
            continue
        g = next(grads)
        out.append(torch.zeros_like(x, memory_format=torch.contiguous_format) if g is None else g.detach())
    return (loss.detach(), torch.stack(list(metrics.values())), *out)


@_loss_op.register_fake
def _loss_fake(
    hidden, weight, targets, advantages, cu_seqlens, mask, old_logprobs, ref_logprobs, bias, importance_weights,
    sampling_logprobs, options,
):  # fmt: skip
    decoded = decode(options)
    cfg, _, needs, _ = _split(decoded)
    num_metrics = len(_metric_names(encode(**{k: getattr(cfg, k) for k in LOSS_OPTIONS})))
    f32 = dict(dtype=torch.float32, device=hidden.device)
    grads = [
        torch.empty_like(x, memory_format=torch.contiguous_format) if n and x is not None else hidden.new_empty(0)
        for x, n in zip((hidden, weight, bias), needs)
    ]
    return (torch.empty((), **f32), torch.empty(num_metrics, **f32), *grads)


def _loss_setup(ctx, inputs, output) -> None:
    needs = _split(decode(inputs[-1]))[2]
    ctx.needs = [n and x is not None for x, n in zip((inputs[0], inputs[1], inputs[8]), needs)]
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
    dhidden, dweight, dbias = (g * grad_loss if n else None for g, n in zip(ctx.saved_tensors, ctx.needs))
    return dhidden, dweight, None, None, None, None, None, None, dbias, None, None, None


_loss_op.register_autograd(_loss_backward, setup_context=_loss_setup)


def compiled_loss(hidden, weight, targets, advantages, *, cu_seqlens, mask, old_logprobs, ref_logprobs, bias,
                  importance_weights=None, sampling_logprobs=None, cfg: LossConfig, mode: str,
                  **head) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """:func:`cppo_kernels.fused_cppo_loss` as one ``cppo_kernels::fused_cppo_loss`` node (its compiled path).

    ``head``: scalar keywords of the LM head's logit transform, handed to :func:`cppo_kernels.loss.eager_loss` as
    they are (they travel in the options string as ``head.NAME``: a new one changes no schema)."""
    grad = torch.is_grad_enabled()
    needs = "".join("1" if grad and x is not None and x.requires_grad else "0" for x in (hidden, weight, bias))
    config = encode(**{k: getattr(cfg, k) for k in LOSS_OPTIONS})
    options = f"{config};mode={mode!r};needs={needs!r}"
    if head:
        options += ";" + encode(**{f"head.{k}": v for k, v in head.items()})
    loss, metrics, *_ = _loss_op(
        hidden, weight, targets, advantages, cu_seqlens, mask, old_logprobs, ref_logprobs, bias, importance_weights,
        sampling_logprobs, options,
    )  # fmt: skip
    names = metric_names(config).split(",")
    metrics = metrics.detach()  # as the eager metrics: no gradient
    return loss, {name: metrics[i] for i, name in enumerate(names)}


# --------------------------------------------------------------------------------------------
# fused_logprobs
# --------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_NS}::fused_logprobs", mutates_args=())
def _logprobs_op(
    hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, head: str
) -> tuple[Tensor, Tensor]:
    """``(logp, entropy)`` of the eager function (``entropy`` empty without ``compute_entropy``)."""
    options = decode(head)
    with torch.no_grad():
        out = _EAGER["logprobs"](hidden, weight, targets, bias=bias, **options)
    if options.get("compute_entropy"):
        return out
    return out, out.new_empty(0)


@_logprobs_op.register_fake
def _logprobs_fake(hidden, weight, targets, bias, head):
    logp = hidden.new_empty(hidden.shape[:-1], dtype=torch.float32)
    return logp, torch.empty_like(logp) if decode(head).get("compute_entropy") else logp.new_empty(0)


def compiled_logprobs(hidden, weight, targets, *, bias, **head) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`cppo_kernels.fused_logprobs` as one ``cppo_kernels::fused_logprobs`` node."""
    logp, entropy = _logprobs_op(hidden, weight, targets, bias, encode(**head))
    return (logp, entropy) if head.get("compute_entropy") else logp


# --------------------------------------------------------------------------------------------
# cppo_select
# --------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_NS}::cppo_select", mutates_args=())
def _select_op(
    rewards: Tensor, draws: Tensor | None, group_size: int, keep: int, num_kept: int, options: str
) -> tuple[Tensor, Tensor]:
    """``(advantages, kept)`` of the eager function, with the ``metric="random"`` draws given (``keep`` or
    ``num_kept`` is -1 when not given)."""
    return _EAGER["select"](rewards, group_size, None if keep < 0 else keep, None if num_kept < 0 else num_kept,
                       draws=draws, **decode(options))  # fmt: skip


@_select_op.register_fake
def _select_fake(rewards, draws, group_size, keep, num_kept, options):
    n = rewards.shape[0]
    count = num_kept if num_kept >= 0 else keep * (n // group_size)
    return rewards.new_empty(n, dtype=torch.float32), rewards.new_empty(count, dtype=torch.long)


def compiled_select(rewards, group_size, keep, num_kept, draws, **options) -> tuple[Tensor, Tensor]:
    """:func:`cppo_kernels.cppo_select` as one ``cppo_kernels::cppo_select`` node (options validated already)."""
    return _select_op(rewards, draws, group_size, -1 if keep is None else keep,
                      -1 if num_kept is None else num_kept, encode(**options))  # fmt: skip
