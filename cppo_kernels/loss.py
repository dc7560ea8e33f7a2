"""Fused log-prob + clipped-ratio + KL policy loss from hidden states and the LM-head weight: the public layer.

The public functions validate their input once (shape and dtype checks on the host, value checks read back with one
host sync; after the forward, one more on the per-token log-sum-exp, which catches NaN/inf in hidden, weight or
bias without scanning them), convert the padded layout to the packed one, and run one of two modes (``MODES``,
chosen per call by ``mode=`` or, for ``"auto"``, by the per-shape-class rule table :data:`MODE_RULES`):

- two-pass: the per-token log-probs through :class:`_FusedLogProbs` (the autograd Function over a backend:
  ``_loss_triton``, Triton kernels; ``_loss_torch``, chunked PyTorch; neither validates again nor materialises
  ``[T, V]`` logits), then the O(T) policy math of :mod:`cppo_kernels._policy` under autograd; the backward
  recomputes the logits (4 matmuls in all);
- gradient-in-forward (token-level importance sampling, gradients wanted): :class:`_GradInForward`, whose forward
  computes the gradients too, chunk by chunk while the logits are in memory (3 matmuls in all).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from . import _loss_torch
from ._dispatch import backend_module, use_triton
from ._policy import Batch, aggregate, batch_constants, metrics, policy_loss, token_grad, token_terms, token_weights
from .config import LossConfig, check_choice

__all__ = ["fused_cppo_loss", "fused_logprobs", "cppo_loss_from_logits", "FusedCPPOLoss", "MODES", "MODE_RULES"]

_HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------------------------

_OPTIONS = tuple(f.name for f in dataclasses.fields(LossConfig))
_DEFAULTS = LossConfig()


def _loss_config(config: LossConfig | None, options: dict[str, Any]) -> LossConfig:
    """The :class:`LossConfig` of a call: ``config`` when given, else one built from the keyword ``options``.

    ``options`` maps LossConfig field names to the keywords passed (a caller's ``locals()`` may be given: other
    names are ignored). With ``config``, a keyword that differs from its LossConfig default is an error: it
    would be silently overridden otherwise.
    """
    options = {name: options[name] for name in _OPTIONS if name in options}
    if config is None:
        return LossConfig(**options)
    if not isinstance(config, LossConfig):
        raise ValueError(f"config must be a LossConfig or None, got {type(config).__name__}")
    for name, value in options.items():
        if value != getattr(_DEFAULTS, name):
            raise ValueError(f"{name}={value!r} conflicts with config=: pass {name} inside the LossConfig")
    return config


# --------------------------------------------------------------------------------------------
# Validation and packing
# --------------------------------------------------------------------------------------------


def _tensor(name: str, x, *, device: torch.device | None = None) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} must be on {device}, got {x.device}")
    return x


def _is_int(x: Tensor) -> bool:
    return not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool


def _shape(name: str, x: Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} must have shape {what} = {list(expected)}, got {list(x.shape)}")


class _Checks:
    """Checks on tensor values, read back with one host sync (:meth:`raise_first`) instead of one each.

    Each entry is a 0-d bool tensor that is True when the input is bad, and a function making the error
    message (called only then, so messages may sync).
    """

    def __init__(self) -> None:
        self._items: list[tuple[Tensor, Callable[[], str]]] = []

    def add(self, bad: Tensor, message: Callable[[], str]) -> None:
        self._items.append((bad, message))

    def finite(self, name: str, x: Tensor) -> None:
        if x.numel():
            self.add(~torch.isfinite(x).all(), lambda: f"{name} must be finite (found NaN or inf)")

    def in_range(self, targets: Tensor, vocab: int) -> None:
        """Targets in ``[0, vocab)``."""
        if targets.numel():
            lo, hi = torch.aminmax(targets)
            self.add(
                (lo < 0) | (hi >= vocab),
                lambda: f"targets must lie in [0, V={vocab}), got values in [{int(lo)}, {int(hi)}]",
            )

    def raise_first(self) -> None:
        """Raises the ValueError of the first failed check, in the order they were added."""
        if not self._items:
            return
        failed = torch.stack([bad for bad, _ in self._items]).tolist()  # the one host sync
        for flag, (_, message) in zip(failed, self._items):
            if flag:
                raise ValueError(message())
        self._items.clear()


def _check_head(hidden: Tensor, weight, bias) -> None:
    """LM head: ``weight [V, H]`` with hidden's dtype, ``bias [V]`` with weight's dtype."""
    if hidden.dtype not in _HIDDEN_DTYPES:
        raise ValueError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    weight = _tensor("weight", weight, device=hidden.device)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {list(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H] with H = {hidden.shape[-1]} (hidden's), got {list(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (V >= 1)")
    if bias is not None:
        bias = _tensor("bias", bias, device=hidden.device)
        _shape("bias", bias, (weight.shape[0],), "[V]")
        if bias.dtype != weight.dtype:
            raise ValueError(f"bias dtype {bias.dtype} must match weight dtype {weight.dtype}")


def _check_targets(targets, lead: tuple[int, ...], device: torch.device, what: str) -> Tensor:
    targets = _tensor("targets", targets, device=device)
    if not _is_int(targets):
        raise ValueError(f"targets must have an integer dtype, got {targets.dtype}")
    _shape("targets", targets, lead, what)
    return targets


class _Layout(NamedTuple):
    """Where the tokens are: the leading shape of the per-token inputs and the packed sequence offsets."""

    lead: tuple[int, ...]  # (T,) packed, (B, L) padded
    what: str  # the name of `lead` in error messages
    cu_seqlens: Tensor  # [S+1] int64
    flat: Tensor | None  # [T] indices of the valid rows of the flattened [B*L] padded layout; None when packed


def _packed_from_padded(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Maps a padded ``mask [B, L]`` to (flat indices of its valid positions ``[T]``, ``cu_seqlens [B+1]``)."""
    flat = mask.reshape(-1).nonzero().squeeze(-1)  # [T]
    lengths = mask.to(torch.int64).sum(dim=1)  # [B]
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=mask.device)  # [B+1]
    cu[1:] = lengths.cumsum(0)
    return flat, cu


def _layout(xname: str, x: Tensor, cu_seqlens, mask, checks: _Checks) -> _Layout:
    """Validates ``cu_seqlens`` (packed: ``x [T, D]``) or ``mask`` (padded: ``x [B, L, D]``), exactly one given."""
    if (cu_seqlens is None) == (mask is None):
        raise ValueError("pass exactly one of cu_seqlens (packed layout) or mask (padded layout)")
    dname = "H" if xname == "hidden" else "V"
    if cu_seqlens is not None:
        if x.dim() != 2:
            raise ValueError(f"{xname} must be 2-D [T, {dname}] with cu_seqlens, got shape {list(x.shape)}")
        num_tokens = x.shape[0]
        cu = _tensor("cu_seqlens", cu_seqlens, device=x.device)
        if not _is_int(cu) or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [S+1], got {cu.dtype} {list(cu.shape)}")
        cu = cu.to(torch.int64)
        checks.add(cu[0] != 0, lambda: f"cu_seqlens must start at 0, got {int(cu[0])}")
        checks.add((cu[1:] < cu[:-1]).any(), lambda: "cu_seqlens must be non-decreasing")
        checks.add(
            cu[-1] != num_tokens,
            lambda: f"cu_seqlens must end at T = {num_tokens} (rows of {xname}), got {int(cu[-1])}",
        )
        return _Layout((num_tokens,), "[T]", cu, None)
    if x.dim() != 3:
        raise ValueError(f"{xname} must be 3-D [B, L, {dname}] with mask, got shape {list(x.shape)}")
    lead = tuple(x.shape[:2])
    mask = _tensor("mask", mask, device=x.device)
    if mask.dtype != torch.bool and not _is_int(mask) and not mask.is_floating_point():
        raise ValueError(f"mask must be bool, integer or floating (0/1 values), got {mask.dtype}")
    _shape("mask", mask, lead, "[B, L]")
    if mask.dtype != torch.bool:
        dtype = mask.dtype
        if mask.numel():  # NaN is neither 0 nor 1
            checks.add(((mask != 0) & (mask != 1)).any(), lambda: f"mask ({dtype}) must hold only 0 and 1")
        mask = mask != 0
    flat, cu = _packed_from_padded(mask)
    return _Layout(lead, "[B, L]", cu, flat)


class _Packed(NamedTuple):
    """The inputs in the packed layout: rows ``x`` and their per-token / per-sequence tensors."""

    x: Tensor  # [T, D] ([B*L, D] with gather_rows=False)
    targets: Tensor  # [T] ([B*L] with gather_rows=False)
    advantages: Tensor  # [S]
    cu_seqlens: Tensor  # [S+1] int64
    old_logprobs: Tensor | None  # [T]
    ref_logprobs: Tensor | None  # [T]
    flat: Tensor | None  # [T] indices of the valid rows of the flattened [B*L] padded layout; None when packed


def _pack(
    xname: str,
    x,
    targets,
    advantages,
    cu_seqlens,
    mask,
    old_logprobs,
    ref_logprobs,
    cfg: LossConfig,
    *,
    gather_rows: bool,
) -> tuple[_Packed, _Checks]:
    """Validates the layout arguments and converts the padded layout to the packed one.

    Shapes and dtypes are checked here; value checks go into the returned :class:`_Checks` (the caller adds its
    own and raises them). With ``gather_rows=False`` the rows of ``x`` stay in the padded layout (``[B*L, D]``).
    """
    if cfg.beta > 0 and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when beta > 0")
    checks = _Checks()
    x = _tensor(xname, x)
    if not x.is_floating_point():
        raise ValueError(f"{xname} must have a floating dtype, got {x.dtype}")
    layout = _layout(xname, x, cu_seqlens, mask, checks)
    targets = _check_targets(targets, layout.lead, x.device, layout.what)
    advantages = _tensor("advantages", advantages, device=x.device)
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must have a floating dtype, got {advantages.dtype}")
    num_seqs = layout.cu_seqlens.numel() - 1
    _shape("advantages", advantages, (num_seqs,), "[S]" if layout.flat is None else "[B]")
    checks.finite("advantages", advantages)
    logprobs = {}
    for name, lp in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if lp is not None:
            lp = _tensor(name, lp, device=x.device)
            if not lp.is_floating_point():
                raise ValueError(f"{name} must have a floating dtype, got {lp.dtype}")
            _shape(name, lp, layout.lead, layout.what)
            if layout.flat is not None:
                lp = lp.reshape(-1)[layout.flat]
            checks.finite(name, lp)
        logprobs[name] = lp
    if layout.flat is not None:
        targets = targets.reshape(-1)
        x = x.reshape(-1, x.shape[-1])
        if gather_rows:
            x, targets = x[layout.flat], targets[layout.flat]
    packed = _Packed(x, targets, advantages, layout.cu_seqlens, *logprobs.values(), layout.flat)
    return packed, checks


def _policy_loss(p: _Packed, logp: Tensor, entropy: Tensor | None, cfg: LossConfig):
    """:func:`cppo_kernels._policy.policy_loss` on the packed per-token log-probs."""
    return policy_loss(
        logp,
        p.advantages,
        p.cu_seqlens,
        old_logprobs=p.old_logprobs,
        ref_logprobs=p.ref_logprobs,
        entropy=entropy,
        config=cfg,
    )


# --------------------------------------------------------------------------------------------
# Autograd Functions over the backends
# --------------------------------------------------------------------------------------------


def _check_logits(lse: Tensor, logp: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """A ``ValueError`` unless every token's log-sum-exp and log-prob (fp32 ``[T]``, already computed) are finite.

    One host sync on the per-token results instead of a scan of the ``[V, H]`` weight; only on failure are the
    inputs scanned, to name the one holding NaN or inf.
    """
    bad = ~(torch.isfinite(lse) & torch.isfinite(logp))  # [T]
    if not bool(bad.any()):
        return
    for name, x in (("hidden", hidden[bad]), ("weight", weight), ("bias", bias)):
        if x is not None and not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} must be finite (found NaN or inf)")
    first, count = int(bad.nonzero()[0, 0]), int(bad.sum())
    raise ValueError(
        f"the log-sum-exp of the logits is not finite for {count} of {lse.numel()} tokens (first: token {first}): "
        "hidden, weight and bias are finite, but (hidden @ weight^T + bias) / temperature overflows float32"
    )


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


class _FusedLogProbs(torch.autograd.Function):
    """(hidden [T, H], weight [V, H], bias [V]) -> (logp fp32 [T], entropy fp32 [T] or None): the two-pass path
    (the backward recomputes the logits)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, compute_entropy, backend):
        logp, lse, entropy = backend.logprobs_fwd(
            hidden, weight, targets, bias, temperature=temperature, compute_entropy=compute_entropy
        )
        _check_logits(lse, logp, hidden, weight, bias)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature = temperature
        ctx.backend = backend
        ctx.set_materialize_grads(False)
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @_first_order
    def backward(ctx, grad_logp, grad_entropy):
        if grad_logp is None:
            return (None,) * 7
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        grads = ctx.backend.logprobs_bwd(
            hidden, weight, targets, bias, lse, grad_logp.float().contiguous(), **_needs(ctx, bias)
        )
        return *grads, None, None, None, None


def _needs(ctx, bias: Tensor | None) -> dict[str, Any]:
    """The ``logprobs_bwd`` keywords of a backward: the temperature and which of hidden / weight / bias need grads."""
    return dict(
        temperature=ctx.temperature,
        needs_hidden_grad=ctx.needs_input_grad[0],
        needs_weight_grad=ctx.needs_input_grad[1],
        needs_bias_grad=bias is not None and ctx.needs_input_grad[2],
    )


class _GradInForward(torch.autograd.Function):
    """(hidden [T, H], weight [V, H], bias [V]) -> (loss, logp, ratio, kl or None, entropy or None): the loss of
    token-level importance sampling, its gradients computed in the forward pass.

    The forward runs :func:`cppo_kernels._loss_torch.logprobs_fwd_grads`, which asks for each chunk's upstream
    gradient ``d loss / d logp_t`` (:func:`cppo_kernels._policy.token_grad` times the aggregation weight, known
    from the token and the counts alone) while the chunk's logits are in memory: 3 matmuls in all. The backward
    only scales the fp32 gradients by the loss's incoming gradient (skipped when it is 1 on the CPU), rounds them to
    the inputs' dtypes and hands them over (released: the first backward owns them). A second backward through
    the same graph (``retain_graph``) recomputes them with the two-pass backward from the saved per-token upstream
    gradients; double backward (``create_graph``) raises a ``RuntimeError``, as on the two-pass path.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, batch: Batch, cfg: LossConfig):
        T = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        per_token, ratio, upstream = torch.empty(T, **f32), torch.empty(T, **f32), torch.empty(T, **f32)  # [T]
        kl = None if batch.ref is None else torch.empty(T, **f32)  # [T]
        weights = token_weights(batch, cfg)  # [T]

        def chunk_upstream(start: int, stop: int, logp: Tensor) -> Tensor:
            rows = slice(start, stop)
            old, ref = (None if x is None else x[rows] for x in (batch.old, batch.ref))
            terms = token_terms(logp, batch.adv[rows], old, ref, cfg)
            for buffer, value in zip((per_token, ratio, kl), terms):
                if buffer is not None:
                    buffer[rows] = value
            upstream[rows] = token_grad(logp, batch.adv[rows], old, ref, cfg) * weights[rows]
            return upstream[rows]

        needs = ctx.needs_input_grad
        logp, lse, entropy, *grads = _loss_torch.logprobs_fwd_grads(
            hidden, weight, targets, bias, chunk_upstream, temperature=cfg.temperature,
            compute_entropy=cfg.compute_entropy, needs_hidden_grad=needs[0], needs_weight_grad=needs[1],
            needs_bias_grad=bias is not None and needs[2],
        )  # fmt: skip
        _check_logits(lse, logp, hidden, weight, bias)
        ctx.grads = grads
        ctx.save_for_backward(hidden, weight, bias, targets, lse, upstream)
        ctx.temperature = cfg.temperature
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(x for x in (logp, ratio, kl, entropy) if x is not None))
        return aggregate(per_token, batch, cfg), logp, ratio, kl, entropy

    @staticmethod
    @_first_order
    def backward(ctx, grad_loss, *_):
        if grad_loss is None:
            return (None,) * 6
        grads, ctx.grads = ctx.grads, None
        if grads is None:  # a second backward through this graph: recompute (two-pass backward, same gradients)
            hidden, weight, bias, targets, lse, upstream = ctx.saved_tensors
            grads = _loss_torch.logprobs_bwd(
                hidden, weight, targets, bias, lse, upstream * grad_loss, **_needs(ctx, bias)
            )
            return *grads, None, None, None
        if grad_loss.device.type != "cpu" or float(grad_loss) != 1.0:  # no host sync on an accelerator
            for g in grads:
                if g is not None:
                    g.mul_(grad_loss)
        return *(None if g is None else g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)), None, None, None


# --------------------------------------------------------------------------------------------
# Execution modes
# --------------------------------------------------------------------------------------------

#: Execution modes of :func:`fused_cppo_loss`: same results within fp32 rounding, different work.
MODES = ("auto", "two-pass", "grad-in-forward")

#: The mode ``mode="auto"`` picks, per shape class ``(device type, backend, dtype name or None for any)``:
#: a rule, read at each call, never a timing at call time. A class is not keyed on the token count: the two modes
#: may round a logit differently on CUDA, and a token's log-prob must not depend on the batch it comes in.
#: CPU torch backend: gradient-in-forward (measured, benchmarks/results/loss.json). CUDA: the Triton two-pass
#: kernels, and gradient-in-forward (cuBLAS) for the torch backend, until the GPU kit's first run
#: (benchmarks/gpu_check.py) times both at its shapes and sets these CUDA rows to the faster mode per class.
#: The interpreter (Triton on CPU: the tests) runs the Triton two-pass kernels.
MODE_RULES: dict[tuple[str, str, str | None], str] = {
    ("cpu", "torch", None): "grad-in-forward",
    ("cpu", "triton", None): "two-pass",
    ("cuda", "torch", None): "grad-in-forward",
    ("cuda", "triton", None): "two-pass",
}


def resolve_mode(mode: str, hidden: Tensor) -> str:
    """``mode`` itself, or for ``"auto"`` the :data:`MODE_RULES` entry of ``hidden``'s shape class ("two-pass"
    when none matches)."""
    check_choice("mode", mode, MODES)
    if mode != "auto":
        return mode
    key = (hidden.device.type, "triton" if use_triton(hidden) else "torch")
    dtype = str(hidden.dtype).removeprefix("torch.")
    return MODE_RULES.get((*key, dtype), MODE_RULES.get((*key, None), "two-pass"))


def _wants_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def fused_cppo_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    advantages: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    mask: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    bias: Tensor | None = None,
    config: LossConfig | None = None,
    temperature: float = 1.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    dual_clip: float | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    importance_sampling: str = "token",
    loss_agg: str = "token-mean",
    max_completion_length: int | None = None,
    compute_entropy: bool = False,
    mode: str = "auto",
) -> tuple[Tensor, dict[str, Tensor]]:
    """CPPO/GRPO policy loss straight from hidden states, never materialising ``[T, V]`` logits.

    Per token t of sequence s: ``logp = log_softmax((h W^T + b) / temperature)[target]``; ratio
    ``r = exp(clamp(logp - old, -20, 20))`` (``old = logp.detach()`` without ``old_logprobs``);
    ``pg = -min(r A_s, clip(r, 1 - epsilon_low, 1 + epsilon_high) A_s)``, capped at ``-dual_clip * A_s`` where
    ``A_s < 0``; plus ``beta`` times the KL estimate against ``ref_logprobs`` (k3's exponent ``ref - logp`` clamped
    to ``[-20, 20]`` too); aggregated by ``loss_agg``. The clamps are verl's: in-range values are exact, and the loss
    and its gradients stay finite for any finite log-probs (a clamped token has the bound's loss and no gradient
    through the clamped term; see :mod:`cppo_kernels._policy`). ``advantages``, ``old_logprobs`` and
    ``ref_logprobs`` are constants: detached, no gradient flows into them. Deterministic, and a token's log-prob
    does not depend on the other tokens of the batch.

    Modes (same results within fp32 rounding): ``"two-pass"`` computes the log-probs in the forward and the
    gradients in the backward, recomputing the logits (4 matmuls); ``"grad-in-forward"`` computes the gradients in
    the forward, chunk by chunk while the logits are in memory, and the backward only scales them (3 matmuls; the
    ``[V, H]`` gradient is then held from the forward on). Gradient-in-forward needs token-level importance
    sampling and runs only when gradients are wanted (grad mode on and hidden, weight or bias requiring grad):
    otherwise nothing beyond the log-probs is computed. It runs the chunked PyTorch code (CPU BLAS, or cuBLAS on
    CUDA) whatever the backend. It supports a scaled loss, gradient accumulation over micro-batches, a loss used
    several times in one graph and a second backward through a retained graph (recomputed); neither mode supports
    double backward (``create_graph=True`` raises).

    Layouts (exactly one of ``cu_seqlens`` / ``mask``): packed ``[T, ...]`` or padded ``[B, L, ...]`` (TRL,
    Liger-Kernel), where only positions with ``mask`` set count (padding content is never read into the loss).

    Args:
        hidden: ``[T, H]`` (packed) or ``[B, L, H]`` (padded), fp32 / bf16 / fp16, finite; row t predicts
            ``targets[t]``.
        weight: ``[V, H]`` LM-head weight, hidden's dtype, finite (checked through the log-sum-exp of each token's
            logits: non-finite logits raise a ``ValueError`` naming hidden, weight or bias, or saying they overflow).
        targets: ``[T]`` or ``[B, L]`` integer token ids in ``[0, V)``.
        advantages: ``[S]`` (packed) or ``[B]`` (padded), one per sequence, finite.
        cu_seqlens: ``[S+1]`` integer offsets of the packed sequences (0, non-decreasing, ending at T).
        mask: ``[B, L]`` bool, or integer / floating holding only 0 and 1: the positions that count (padded layout).
        old_logprobs: ``[T]`` or ``[B, L]`` log-probs of the policy that sampled (finite where counted).
        ref_logprobs: ``[T]`` or ``[B, L]`` log-probs of the reference model (required when ``beta > 0``).
        bias: ``[V]`` LM-head bias, weight's dtype.
        config: the options below as one :class:`LossConfig`; an option also passed as a keyword must then keep
            its default (else ``ValueError``).
        temperature, epsilon_low, epsilon_high, dual_clip, beta, kl_estimator, importance_sampling, loss_agg,
            max_completion_length, compute_entropy: the loss options, each documented in :class:`LossConfig`.
        mode: ``"auto"`` (the :data:`MODE_RULES` entry of the inputs' shape class: gradient-in-forward for the
            PyTorch backend, the Triton two-pass kernels on CUDA until the GPU kit decides), ``"two-pass"`` or
            ``"grad-in-forward"`` (a ``ValueError`` with ``importance_sampling="sequence"``).

    Returns:
        ``(loss, metrics)``: the fp32 scalar loss, with gradients to ``hidden``, ``weight`` and ``bias`` (in their
        dtypes), and detached fp32 scalars: ``kl`` (mean over tokens, 0 without ``ref_logprobs``),
        ``clip_fraction_low`` / ``clip_fraction_high`` (fraction of tokens whose ratio is clipped below with
        ``A < 0`` / above with ``A > 0``), ``ratio_mean``, ``ratio_min``, ``ratio_max`` (1 without tokens),
        ``num_tokens``, and ``entropy`` (mean) with ``compute_entropy``. Empty sequences and empty batches give
        0, never NaN.
    """
    cfg = _loss_config(config, locals())
    check_choice("mode", mode, MODES)
    if mode == "grad-in-forward" and cfg.importance_sampling == "sequence":
        raise ValueError(
            "mode='grad-in-forward' needs importance_sampling='token': a sequence-level ratio (GSPO) depends on the "
            "whole sequence, so its gradients take the two-pass path (mode='auto' or 'two-pass')"
        )
    p, checks = _pack(
        "hidden", hidden, targets, advantages, cu_seqlens, mask, old_logprobs, ref_logprobs, cfg, gather_rows=True
    )
    _check_head(p.x, weight, bias)
    checks.in_range(p.targets, weight.shape[0])
    checks.raise_first()
    h = p.x.contiguous()  # [T, H]
    head = (weight.contiguous(), None if bias is None else bias.contiguous())  # [V, H], [V]
    tgt = p.targets.to(torch.int64).contiguous()  # [T]
    token_level = cfg.importance_sampling == "token"
    if token_level and resolve_mode(mode, h) == "grad-in-forward" and _wants_grad(h, *head):
        batch = batch_constants(p.advantages, p.cu_seqlens, p.old_logprobs, p.ref_logprobs, h.shape[0])
        loss, logp, ratio, kl, entropy = _GradInForward.apply(h, *head, tgt, batch, cfg)
        return loss, metrics(logp, ratio, batch.adv, kl, entropy, cfg)
    backend = backend_module("loss", h)
    logp, entropy = _FusedLogProbs.apply(h, *head, tgt, cfg.temperature, cfg.compute_entropy, backend)
    return _policy_loss(p, logp, entropy, cfg)


@torch.no_grad()
def fused_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probs (and entropies) without autograd: the old-policy and reference passes.

    Args:
        hidden: ``[T, H]`` or ``[B, L, H]``, fp32 / bf16 / fp16, finite.
        weight: ``[V, H]`` LM-head weight, hidden's dtype.
        targets: integer token ids in ``[0, V)`` of hidden's leading shape (``[T]`` or ``[B, L]``).
        bias: ``[V]`` LM-head bias, weight's dtype.
        temperature: divides the logits (> 0).
        compute_entropy: also return each token distribution's entropy.

    Returns:
        fp32 ``logp`` of the leading shape, or ``(logp, entropy)`` with ``compute_entropy=True``. Deterministic,
        and a token's values do not depend on the other tokens of the batch.
    """
    hidden = _tensor("hidden", hidden)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [T, H] or [B, L, H], got shape {list(hidden.shape)}")
    cfg = LossConfig(temperature=temperature, compute_entropy=compute_entropy)
    _check_head(hidden, weight, bias)
    lead = tuple(hidden.shape[:-1])
    targets = _check_targets(targets, lead, hidden.device, "[T]" if len(lead) == 1 else "[B, L]")
    checks = _Checks()
    checks.in_range(targets, weight.shape[0])
    checks.raise_first()
    h = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # [T, H]
    logp, lse, entropy = backend_module("loss", h).logprobs_fwd(
        h,
        weight.contiguous(),
        targets.reshape(-1).to(torch.int64).contiguous(),
        bias,
        temperature=cfg.temperature,
        compute_entropy=cfg.compute_entropy,
    )
    _check_logits(lse, logp, h, weight, bias)
    logp = logp.reshape(lead)
    return (logp, entropy.reshape(lead)) if cfg.compute_entropy else logp


def cppo_loss_from_logits(
    logits: Tensor,
    targets: Tensor,
    advantages: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    mask: Tensor | None = None,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    config: LossConfig | None = None,
    temperature: float = 1.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    dual_clip: float | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    importance_sampling: str = "token",
    loss_agg: str = "token-mean",
    max_completion_length: int | None = None,
    compute_entropy: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`fused_cppo_loss` for callers that already hold the logits: same layouts, options and results.

    Computes in fp32 (one fp32 ``[T, V]`` copy when the logits are bf16/fp16 or temperature != 1).

    Args:
        logits: ``[T, V]`` (packed) or ``[B, L, V]`` (padded), floating, finite where counted.
        targets, advantages, cu_seqlens, mask, old_logprobs, ref_logprobs: as in :func:`fused_cppo_loss`.
        config, temperature, ..., compute_entropy: the options, as in :func:`fused_cppo_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`fused_cppo_loss`, the loss with gradients to ``logits``.
    """
    cfg = _loss_config(config, locals())
    p, checks = _pack(
        "logits", logits, targets, advantages, cu_seqlens, mask, old_logprobs, ref_logprobs, cfg, gather_rows=False
    )
    vocab = p.x.shape[-1]
    if vocab == 0:
        raise ValueError("logits must have a non-empty last dimension (V >= 1)")
    checks.in_range(p.targets if p.flat is None else p.targets[p.flat], vocab)
    z = p.x.float()  # [N, V]
    if cfg.temperature != 1.0:
        z = z / cfg.temperature
    lse = torch.logsumexp(z, dim=-1)  # [N]
    checks.finite("logits", (lse if p.flat is None else lse[p.flat]).detach())
    checks.raise_first()
    # Targets at padding (any value) are clamped into range; their rows are dropped below.
    targets = p.targets if p.flat is None else p.targets.clamp(0, vocab - 1)
    logp = z.gather(-1, targets.to(torch.int64).unsqueeze(-1)).squeeze(-1) - lse  # [N]
    entropy = None
    if cfg.compute_entropy:
        with torch.no_grad():
            entropy = torch.special.entr(torch.softmax(z, dim=-1)).sum(-1)  # [N]
    if p.flat is not None:
        logp = logp[p.flat]
        entropy = None if entropy is None else entropy[p.flat]
    return _policy_loss(p, logp, entropy, cfg)


class FusedCPPOLoss(nn.Module):
    """:func:`fused_cppo_loss` as a module that holds the options (the Liger-Kernel habit).

    Args:
        config: the options as a :class:`LossConfig`; or pass them as keywords (``beta=0.04, ...``), not both
            (a keyword that differs from its default next to ``config`` is a ``ValueError``).
        mode: the execution mode of :func:`fused_cppo_loss` (``"auto"``, ``"two-pass"``, ``"grad-in-forward"``).
        **options: the keyword options of :func:`fused_cppo_loss` (``temperature``, ``epsilon_low``, ...).

    ``forward(hidden, weight, targets, advantages, *, cu_seqlens=None, mask=None, old_logprobs=None,
    ref_logprobs=None, bias=None)`` takes the tensors of :func:`fused_cppo_loss` (same shapes and layouts) and
    returns its ``(loss, metrics)``.
    """

    def __init__(self, config: LossConfig | None = None, *, mode: str = "auto", **options: Any) -> None:
        super().__init__()
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}: the options are {list(_OPTIONS)}")
        self.config = _loss_config(config, options)
        self.mode = check_choice("mode", mode, MODES)

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        advantages: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        mask: Tensor | None = None,
        old_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        bias: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return fused_cppo_loss(
            hidden,
            weight,
            targets,
            advantages,
            cu_seqlens=cu_seqlens,
            mask=mask,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            bias=bias,
            config=self.config,
            mode=self.mode,
        )

    def extra_repr(self) -> str:
        return f"{self.config!r}, mode={self.mode!r}"
