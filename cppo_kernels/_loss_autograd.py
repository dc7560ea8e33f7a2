"""The autograd Functions of :func:`cppo_kernels.fused_cppo_loss`, one per execution mode, each over the backend
module the dispatcher (:func:`cppo_kernels._dispatch.backend_module`) gave for that mode:

- :class:`FusedLogProbs` (two-pass): the per-token log-probs in the forward; the backward recomputes the logits
  (4 matmuls in all with the forward);
- :class:`GradInForward` (gradient-in-forward, token-level importance sampling): the loss, its gradients computed in
  the forward chunk by chunk while the logits are in memory (3 matmuls in all).

Their inputs are already validated (:mod:`cppo_kernels._loss_inputs`); neither supports double backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from . import _loss_torch
from ._loss_inputs import check_logits
from ._policy import (
    Batch,
    aggregate,
    policy_terms,
    sequence_slice,
    token_grad,
    token_terms,
    token_weights,
    vespo_weights,
)  # fmt: skip
from .config import LossConfig


def _first_order(backward: Callable) -> Callable:
    """A Function's backward that refuses ``create_graph=True`` with a clear error (it is not differentiable: its
    gradients would silently carry no second derivative)."""

    @functools.wraps(backward)
    def first_order_backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fused_cppo_loss does not support double backward (create_graph=True): its backward is not "
                "differentiable; for second derivatives use cppo_loss_from_logits on materialised logits"
            )
        return backward(ctx, *grads)

    return first_order_backward


class FusedLogProbs(torch.autograd.Function):
    """(hidden [T, H], weight [V, H], bias [V]) -> (logp fp32 [T], entropy fp32 [T] or None): the two-pass path
    over ``backend`` (a module of mode "two-pass": its ``logprobs_fwd`` and ``logprobs_bwd``; the backward recomputes
    the logits). ``transform``: the head's ``(logit_scale, softcap or None)``. With ``entropy_grad`` the entropy is
    differentiable too (the entropy bonus): its backward runs :mod:`cppo_kernels._loss_torch`'s ``logprobs_bwd``
    (the Triton kernels have no entropy gradient yet)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature: float, compute_entropy: bool, backend: ModuleType,
        transform: tuple[float, float | None] = (1.0, None), entropy_grad: bool = False,
    ):  # fmt: skip
        logit_scale, softcap = transform
        logp, lse, entropy = backend.logprobs_fwd(
            hidden, weight, targets, bias, temperature=temperature, compute_entropy=compute_entropy,
            logit_scale=logit_scale, softcap=softcap,
        )  # fmt: skip
        check_logits(lse, logp, hidden, weight, bias)
        saved = (entropy,) if entropy_grad else ()
        ctx.save_for_backward(hidden, weight, bias, targets, lse, *saved)
        ctx.temperature = temperature
        ctx.transform = transform
        ctx.backend = backend
        ctx.set_materialize_grads(False)
        if entropy is not None and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @_first_order
    def backward(ctx, grad_logp, grad_entropy):
        if grad_logp is None and grad_entropy is None:
            return (None,) * 9
        hidden, weight, bias, targets, lse, *entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if grad_entropy is None or not entropy:
            grads = ctx.backend.logprobs_bwd(
                hidden, weight, targets, bias, lse, grad_logp.float().contiguous(), **_needs(ctx, bias)
            )
        else:
            grads = _loss_torch.logprobs_bwd(
                hidden, weight, targets, bias, lse, grad_logp.float().contiguous(), **_needs(ctx, bias),
                grad_entropy=grad_entropy.float().contiguous(), entropy=entropy[0],
            )  # fmt: skip
        return *grads, None, None, None, None, None, None


def _needs(ctx, bias: Tensor | None) -> dict[str, Any]:
    """The ``logprobs_bwd`` keywords of a backward: the temperature, the head's transform and which of hidden /
    weight / bias need grads."""
    return dict(
        temperature=ctx.temperature,
        logit_scale=ctx.transform[0],
        softcap=ctx.transform[1],
        needs_hidden_grad=ctx.needs_input_grad[0],
        needs_weight_grad=ctx.needs_input_grad[1],
        needs_bias_grad=bias is not None and ctx.needs_input_grad[2],
    )


def backend_chunk(hidden: Tensor) -> int:
    """The forward chunk of the gradient-in-forward backend (:mod:`cppo_kernels._loss_torch`) on hidden's device."""
    return _loss_torch.chunk_tokens(hidden.device)


class GradInForward(torch.autograd.Function):
    """(hidden [T, H], weight [V, H], bias [V]) -> (loss, logp, ratio, kl or None, entropy or None): the loss of
    token-level importance sampling, its gradients computed in the forward pass.

    The forward runs ``backend.logprobs_fwd_grads`` (a backend of mode "grad-in-forward": today only
    :mod:`cppo_kernels._loss_torch`, which the dispatcher gives whatever the backend asked for), which asks for each
    chunk's upstream gradient ``d loss / d logp_t`` (:func:`cppo_kernels._policy.token_grad` times the aggregation
    weight, known from the token and the counts alone) while the chunk's logits are in memory: 3 matmuls in all. The
    backward only scales the fp32 gradients by the loss's incoming gradient (skipped when it is 1 on the CPU), rounds
    them to the inputs' dtypes and hands them over (released: the first backward owns them). A second backward
    through the same graph (``retain_graph``) recomputes them with the backend's two-pass backward from the saved
    per-token upstream gradients; double backward (``create_graph``) raises a ``RuntimeError``, as on the two-pass
    path.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, batch: Batch, cfg: LossConfig, backend: ModuleType,
        transform: tuple[float, float | None] = (1.0, None),
    ):  # fmt: skip
        T = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        per_token, ratio, upstream = torch.empty(T, **f32), torch.empty(T, **f32), torch.empty(T, **f32)  # [T]
        kl = None if batch.ref is None else torch.empty(T, **f32)  # [T]
        phi = torch.zeros(batch.num_seqs, **f32) if cfg.sequence_weighted else None  # [S]
        weights = token_weights(batch, cfg)  # [T]
        chunks = None
        if cfg.sequence_rule is not None:  # chunks of whole sequences: (start, stop) -> (first, end sequence)
            seqs = {
                (a, b): (s0, s1) for a, b, s0, s1 in _loss_torch.sequence_chunks(batch.lengths, backend_chunk(hidden))
            }
            chunks = list(seqs)

        def chunk_upstream(start: int, stop: int, logp: Tensor) -> Tensor:
            rows = slice(start, stop)
            old, ref, w = (None if x is None else x[rows] for x in (batch.old, batch.ref, batch.weight))
            if chunks is not None:  # autograd through the chunk's sequences' terms (VESPO's phi, sequence ratios)
                s0, s1 = seqs[start, stop]
                with torch.enable_grad():
                    x = logp.detach().requires_grad_()
                    *terms, seq_phi, _ = policy_terms(x, sequence_slice(batch, s0, s1, start, stop), cfg)
                    (upstream[rows],) = torch.autograd.grad(terms[0], x, grad_outputs=weights[rows])
                if phi is not None:
                    phi[s0:s1] = seq_phi.detach()
            elif cfg.plain and w is None:
                terms = token_terms(logp, batch.adv[rows], old, ref, cfg)
                upstream[rows] = token_grad(logp, batch.adv[rows], old, ref, cfg) * weights[rows]
            else:  # autograd through the elementwise terms: each token's own derivative
                with torch.enable_grad():
                    x = logp.detach().requires_grad_()
                    terms = token_terms(x, batch.adv[rows], old, ref, cfg, weight=w)
                    (upstream[rows],) = torch.autograd.grad(terms[0], x, grad_outputs=weights[rows])
            for buffer, value in zip((per_token, ratio, kl), terms):
                if buffer is not None:
                    buffer[rows] = value.detach()
            return upstream[rows]

        needs = ctx.needs_input_grad
        logp, lse, entropy, *grads = backend.logprobs_fwd_grads(
            hidden, weight, targets, bias, chunk_upstream, temperature=cfg.temperature,
            compute_entropy=cfg.compute_entropy, logit_scale=transform[0], softcap=transform[1],
            needs_hidden_grad=needs[0], needs_weight_grad=needs[1],
            needs_bias_grad=bias is not None and needs[2], chunks=chunks,
        )  # fmt: skip
        check_logits(lse, logp, hidden, weight, bias)
        if phi is not None and T == 0:  # no chunk ran: the empty sequences' gamma weights, as the two-pass path's
            phi = vespo_weights(logp, batch, cfg)
        ctx.grads = grads
        ctx.save_for_backward(hidden, weight, bias, targets, lse, upstream)
        ctx.temperature = cfg.temperature
        ctx.transform = transform
        ctx.backend = backend
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(x for x in (logp, ratio, kl, entropy, phi) if x is not None))
        return aggregate(per_token, batch, cfg), logp, ratio, kl, entropy, phi

    @staticmethod
    @_first_order
    def backward(ctx, grad_loss, *_):
        if grad_loss is None:
            return (None,) * 8
        grads, ctx.grads = ctx.grads, None
        if grads is None:  # a second backward through this graph: recompute (two-pass backward, same gradients)
            hidden, weight, bias, targets, lse, upstream = ctx.saved_tensors
            grads = ctx.backend.logprobs_bwd(
                hidden, weight, targets, bias, lse, upstream * grad_loss, **_needs(ctx, bias)
            )
            return *grads, None, None, None, None, None
        scale = grad_loss.device.type != "cpu" or float(grad_loss) != 1.0  # no host sync on an accelerator
        grads = (_scaled(g, grad_loss if scale else None, dtype) for g, dtype in zip(grads, ctx.dtypes))
        return *grads, None, None, None, None, None


def _scaled(g: Tensor | None, by: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``g * by`` (``by`` None: 1) in ``dtype``: one pass over the fp32 gradient (the scale and the cast in one
    kernel: the product is rounded to ``dtype`` as it is stored), in place when ``dtype`` is fp32."""
    if g is None:
        return None
    if by is None:
        return g if g.dtype == dtype else g.to(dtype)
    if g.dtype == dtype:
        return g.mul_(by)
    return torch.mul(g, by, out=torch.empty(g.shape, dtype=dtype, device=g.device))
