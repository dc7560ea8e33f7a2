"""Input validation and layout conversion of the loss ops (:mod:`cppo_kernels.loss`): the checks of every argument
(shapes and dtypes on the host, values read back with one host sync), the padded ``[B, L, ...]`` -> packed
``[T, ...]`` conversion, and the check of the per-token log-sum-exp after a forward (non-finite hidden, weight or
bias found without scanning them). The backends (``_loss_triton``, ``_loss_torch``) never validate again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ._carriers import LossInputs
from ._policy import Batch, batch_constants
from .config import LossConfig, check_float

_HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name: str, x, *, device: torch.device | None = None) -> Tensor:
    """``x`` when it is a tensor (on ``device`` when given), else a ``ValueError`` naming ``name``."""
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


class Checks:
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

    def finite_lse(self, lse: Tensor, logits: Tensor, temperature: float) -> None:
        """The log-sum-exp ``lse [N]`` of the counted rows of ``logits / temperature`` is finite; the message names
        the cause: NaN or inf in ``logits``, or a quotient by the temperature beyond float32."""
        if lse.numel():
            self.add(~torch.isfinite(lse).all(), lambda: _lse_message(logits, temperature))

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


def _lse_message(logits: Tensor, temperature: float) -> str:
    finite = not bool((torch.isnan(logits) | torch.isposinf(logits)).any())  # -inf: a masked logit
    if finite and temperature != 1.0 and bool((torch.isinf(logits.float() / temperature) & logits.isfinite()).any()):
        return f"logits / temperature overflows float32 (temperature={temperature!r}): give a larger temperature"
    return "logits must be finite (found NaN or inf)"


def check_head(hidden: Tensor, weight, bias) -> None:
    """LM head: ``weight [V, H]`` with hidden's dtype, ``bias [V]`` with weight's dtype."""
    if hidden.dtype not in _HIDDEN_DTYPES:
        raise ValueError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    weight = check_tensor("weight", weight, device=hidden.device)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {list(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H] with H = {hidden.shape[-1]} (hidden's), got {list(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one row (V >= 1)")
    if bias is not None:
        bias = check_tensor("bias", bias, device=hidden.device)
        _shape("bias", bias, (weight.shape[0],), "[V]")
        if bias.dtype != weight.dtype:
            raise ValueError(f"bias dtype {bias.dtype} must match weight dtype {weight.dtype}")


def check_targets(targets, lead: tuple[int, ...], device: torch.device, what: str) -> Tensor:
    """``targets``: integer token ids of the leading shape ``lead`` (named ``what`` in errors), on ``device``."""
    targets = check_tensor("targets", targets, device=device)
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


def _layout(xname: str, x: Tensor, cu_seqlens, mask, checks: Checks) -> _Layout:
    """Validates ``cu_seqlens`` (packed: ``x [T, D]``) or ``mask`` (padded: ``x [B, L, D]``), exactly one given."""
    if (cu_seqlens is None) == (mask is None):
        raise ValueError("pass exactly one of cu_seqlens (packed layout) or mask (padded layout)")
    dname = "H" if xname == "hidden" else "V"
    if cu_seqlens is not None:
        if x.dim() != 2:
            raise ValueError(f"{xname} must be 2-D [T, {dname}] with cu_seqlens, got shape {list(x.shape)}")
        num_tokens = x.shape[0]
        cu = check_tensor("cu_seqlens", cu_seqlens, device=x.device)
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
    mask = check_tensor("mask", mask, device=x.device)
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


class Packed(NamedTuple):
    """The inputs in the packed layout: rows ``x`` and the packed :class:`LossInputs` (``cu_seqlens`` set, ``mask``
    None, every per-token tensor ``[T]``)."""

    x: Tensor  # [T, D] ([B*L, D] with gather_rows=False)
    inputs: LossInputs  # targets [T] ([B*L] with gather_rows=False), cu_seqlens [S+1] int64
    flat: Tensor | None  # [T] indices of the valid rows of the flattened [B*L] padded layout; None when packed
    weights_per_seq: bool = False  # importance_weights is [S]

    def batch(self, num_tokens: int) -> Batch:
        """The fp32 per-token constants of the policy math (:func:`cppo_kernels._policy.batch_constants`)."""
        return batch_constants(self.inputs, num_tokens, weights_per_seq=self.weights_per_seq)


def pack(xname: str, x, inputs: LossInputs, *, cfg: LossConfig, gather_rows: bool) -> tuple[Packed, Checks]:
    """Validates the per-token arguments ``inputs`` of a loss over rows ``x`` (``hidden`` or ``logits``, named
    ``xname``) and converts the padded layout to the packed one.

    Shapes and dtypes are checked here; value checks go into the returned :class:`Checks` (the caller adds its
    own and raises them). With ``gather_rows=False`` the rows of ``x`` stay in the padded layout (``[B*L, D]``).
    """
    if cfg.beta > 0 and inputs.ref_logprobs is None:
        raise ValueError("ref_logprobs is required when beta > 0")
    checks = Checks()
    x = check_tensor(xname, x)
    if not x.is_floating_point():
        raise ValueError(f"{xname} must have a floating dtype, got {x.dtype}")
    layout = _layout(xname, x, inputs.cu_seqlens, inputs.mask, checks)
    targets = check_targets(inputs.targets, layout.lead, x.device, layout.what)
    advantages = check_tensor("advantages", inputs.advantages, device=x.device)
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must have a floating dtype, got {advantages.dtype}")
    num_seqs = layout.cu_seqlens.numel() - 1
    _shape("advantages", advantages, (num_seqs,), "[S]" if layout.flat is None else "[B]")
    checks.finite("advantages", advantages)
    logprobs = {}
    for name in ("old_logprobs", "ref_logprobs"):
        lp = _per_token(name, getattr(inputs, name), layout, x.device)
        if lp is not None:
            checks.finite(name, lp)
        logprobs[name] = lp
    sampling = _per_token("sampling_logprobs", inputs.sampling_logprobs, layout, x.device)
    if sampling is not None and sampling.numel():  # NaN marks a token the sampler did not score (TRL's rule)
        checks.add(torch.isinf(sampling).any(), lambda: "sampling_logprobs must not hold inf (NaN: not scored)")
    weights, per_seq = _importance_weights(inputs.importance_weights, layout, num_seqs, x.device)
    if weights is not None and weights.numel():
        checks.add(
            ~(torch.isfinite(weights) & (weights >= 0)).all(),
            lambda: "importance_weights must be finite and >= 0",
        )
    if layout.flat is not None:
        targets = targets.reshape(-1)
        x = x.reshape(-1, x.shape[-1])
        if gather_rows:
            x, targets = x[layout.flat], targets[layout.flat]
    packed = LossInputs(
        targets, advantages, cu_seqlens=layout.cu_seqlens, importance_weights=weights, sampling_logprobs=sampling,
        **logprobs,
    )  # fmt: skip
    return Packed(x, packed, layout.flat, per_seq), checks


def _per_token(name: str, x, layout: _Layout, device: torch.device) -> Tensor | None:
    """A per-token floating tensor of the leading shape, packed (``[T]``); None stays None."""
    if x is None:
        return None
    x = check_tensor(name, x, device=device)
    if not x.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
    _shape(name, x, layout.lead, layout.what)
    return x if layout.flat is None else x.reshape(-1)[layout.flat]


def _importance_weights(x, layout: _Layout, num_seqs: int, device: torch.device) -> tuple[Tensor | None, bool]:
    """``(weights, per_seq)``: ``importance_weights`` per token (the leading shape, packed to ``[T]``) or per
    sequence (``[S]`` / ``[B]``); packed with ``T == S``, per token."""
    if x is None:
        return None, False
    x = check_tensor("importance_weights", x, device=device)
    if not x.is_floating_point():
        raise ValueError(f"importance_weights must have a floating dtype, got {x.dtype}")
    if tuple(x.shape) == layout.lead:
        return (x if layout.flat is None else x.reshape(-1)[layout.flat]), False
    if tuple(x.shape) == (num_seqs,):
        return x, True
    seqs = "[S]" if layout.flat is None else "[B]"
    raise ValueError(
        f"importance_weights must have shape {layout.what} = {list(layout.lead)} (per token) or {seqs} = "
        f"[{num_seqs}] (per sequence), got {list(x.shape)}"
    )


def check_logits(lse: Tensor, logp: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> None:
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
        "hidden, weight and bias are finite, but (hidden @ weight^T + bias) * logit_scale / temperature overflows "
        "float32"
    )


class LogitFactors(NamedTuple):
    """The model's own logit transform and the temperature, as the backends apply them to the raw head output
    ``y = h W^T + b``: ``z = y * z_scale`` without a cap, ``z = tanh(y * z_scale) * cap_out`` with one (so
    ``z = softcap * tanh(y * logit_scale / softcap) / temperature``); ``dz / dy = grad_scale`` times, with a cap,
    ``1 - (z / cap_out)^2``."""

    z_scale: float
    cap_out: float | None
    grad_scale: float


def logit_factors(temperature: float, logit_scale: float = 1.0, softcap: float | None = None) -> LogitFactors:
    """:class:`LogitFactors` of ``softcap * tanh(y * logit_scale / softcap) / temperature`` (``y * logit_scale /
    temperature`` without a cap); the arguments are already validated."""
    inv_t = 1.0 / temperature
    if softcap is None:
        return LogitFactors(logit_scale * inv_t, None, logit_scale * inv_t)
    return LogitFactors(logit_scale / softcap, softcap * inv_t, logit_scale * inv_t)


#: float32's largest finite value: the backends hold the factors of :class:`LogitFactors` in fp32.
FP32_MAX = float(torch.finfo(torch.float32).max)


class HeadTransform(NamedTuple):
    """The head's transform, checked: the keywords ``logit_scale`` / ``logit_softcap`` of the loss ops."""

    logit_scale: float
    logit_softcap: float | None


def check_logit_transform(logit_scale, logit_softcap, temperature=1.0) -> HeadTransform:
    """``(logit_scale, logit_softcap)`` as floats: each finite and > 0 (the cap may be None), and with ``temperature``
    (finite, > 0) every factor of :func:`logit_factors` (``logit_scale / temperature``; with a cap ``logit_scale /
    logit_softcap`` and ``logit_softcap / temperature``) at most float32's largest value, else a one-line
    ``ValueError`` naming the arguments (a factor beyond it cannot be applied in fp32: ``temperature=1e-39``)."""
    scale = check_float("logit_scale", logit_scale, low=0.0, low_open=True)
    cap = None if logit_softcap is None else check_float("logit_softcap", logit_softcap, low=0.0, low_open=True)
    temp = check_float("temperature", temperature, low=0.0, low_open=True)
    factors = {"logit_scale / temperature": scale / temp}
    if cap is not None:
        factors.update({"logit_scale / logit_softcap": scale / cap, "logit_softcap / temperature": cap / temp})
    for name, value in factors.items():
        if not value <= FP32_MAX:
            raise ValueError(
                f"{name} must be at most float32's {FP32_MAX:.4g}, got {value:.4g} (temperature={temp!r}, "
                f"logit_scale={scale!r}, logit_softcap={cap!r}): the logits' factor must be a float32"
            )
    return HeadTransform(scale, cap)
