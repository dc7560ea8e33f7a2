"""Group-normalised advantages and completion selection: the public functions, which validate their input once
(one host sync) and hand it to a backend (``_advantages_triton``: Triton kernels; ``_advantages_torch``: PyTorch),
picked per call by :func:`cppo_kernels._dispatch.backend_module` (groups above :data:`TRITON_MAX_GROUP_SIZE` always
run the PyTorch backend). The backends do not validate again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _advantages_torch
from ._carriers import SelectOptions, takes_advantage_options, takes_cppo_select_options, takes_select_options
from ._dispatch import backend_module
from ._ops import compiled_select, implements
from .config import METRICS, SCALES, SCOPES, check_choice, check_float, check_int

__all__ = ["group_advantages", "select_completions", "cppo_select"]

#: Largest group size the Triton kernels take (``_advantages_triton.MAX_GROUP_SIZE``, kept here so that this module
#: imports without triton): larger groups run the PyTorch backend on the same device, whatever the backend choice.
TRITON_MAX_GROUP_SIZE = 4096


def _backend(x: Tensor, group_size: int):
    """The backend module for ``x``: :func:`backend_module`'s choice, the PyTorch one above the Triton group limit."""
    if group_size > TRITON_MAX_GROUP_SIZE:
        return _advantages_torch
    return backend_module("advantages", x)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_grouped_vector(name: str, x, group_size: int) -> None:
    """A 1-D finite floating tensor laid out group after group (the finiteness check is the one host sync)."""
    _check_grouped_shape(name, x, group_size)
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be finite (found NaN or inf)")


def _check_grouped_shape(name: str, x, group_size: int) -> None:
    """:func:`_check_grouped_vector` without the value check (no host sync: what a compiled call checks)."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{name} must be 1-D [num_groups * group_size], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
    check_int("group_size", group_size, low=1)
    if x.numel() % group_size != 0:
        raise ValueError(f"{name} has {x.numel()} elements, not divisible by group_size={group_size}")


def _check_advantage_options(options: SelectOptions) -> None:
    check_choice("scale", options.scale, SCALES)
    if not isinstance(options.unbiased, bool):
        raise ValueError(f"unbiased must be a bool, got {type(options.unbiased).__name__}")
    check_float("eps", options.eps, low=0.0)


def _kept_count(n: int, group_size: int, options: SelectOptions) -> int:
    """Validates the selection options; returns the backends' count: kept per group (``scope="group"``) or over the
    whole batch (``"batch"``)."""
    keep, num_kept, scope, metric = options.keep, options.num_kept, options.scope, options.metric
    check_choice("scope", scope, SCOPES)
    check_choice("metric", metric, METRICS)
    if metric == "max-variance" and (scope != "group" or num_kept is not None):
        raise ValueError(
            "metric='max-variance' (the keep-subset of largest variance of each group) needs scope='group' and "
            f"keep, got scope={scope!r}, num_kept={num_kept!r}"
        )
    if options.generator is not None and not isinstance(options.generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(options.generator).__name__}")
    if (keep is None) == (num_kept is None):
        raise ValueError(
            "give exactly one of keep (completions kept per group) and num_kept (kept over the batch, "
            f"scope='batch'), got keep={keep!r}, num_kept={num_kept!r}"
        )
    if num_kept is None:
        check_int("keep", keep, low=0, high=group_size)
        return keep if scope == "group" else keep * (n // group_size)
    if scope != "batch":
        raise ValueError(f"num_kept (kept over the whole batch) needs scope='batch', got scope={scope!r}")
    return check_int("num_kept", num_kept, low=0, high=n)


def _draws(x: Tensor, options: SelectOptions) -> Tensor | None:
    """fp32 ``[N]`` uniform scores for ``metric="random"`` (drawn here, after validation, so both backends consume
    the generator alike), else None."""
    if options.metric != "random":
        return None
    return torch.rand(x.shape, generator=options.generator, device=x.device, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


@takes_advantage_options
def group_advantages(rewards: Tensor, group_size: int, *, options: SelectOptions) -> Tensor:
    """Group-normalised advantages ``A_i = (r_i - mean_g) / (std + eps)``.

    Args:
        rewards: ``[N]`` floating, finite, laid out group after group (``N = num_groups * group_size``).
        group_size: completions per question ``G`` (>= 1, divides ``N``).
        scale: ``"group"`` (each group's std), ``"batch"`` (one std over all ``N`` rewards, group means still per
            group) or ``"none"`` (only subtract the group mean: Dr. GRPO).
        unbiased: Bessel's correction in the std (TRL and the CPPO code); a std over one value is 0.
        eps: added to the std (>= 0).

    Returns:
        fp32 ``[N]``, right for every finite input (each group is scaled by a power of two before any square, so
        rewards near fp32's or fp64's range neither overflow nor vanish); ``scale="none"`` saturates at the largest
        fp32 where the difference exceeds it. A group whose rewards are all equal gets exactly 0 (never NaN, also
        with ``eps=0``). Group sizes above :data:`TRITON_MAX_GROUP_SIZE` run the PyTorch backend.
    """
    _check_grouped_vector("rewards", rewards, group_size)
    _check_advantage_options(options)
    return _backend(rewards, group_size).group_advantages(rewards, group_size, options)


@takes_select_options
def select_completions(advantages: Tensor, group_size: int, options: SelectOptions) -> Tensor:
    """Indices of the completions kept by CPPO's pruning.

    Each completion gets a score and the highest scores are kept, ties going to the lower index: ``|A|`` (in fp32)
    for ``metric="smallest"`` (prune the smallest |A|: CPPO's default), ``-|A|`` for ``"largest"``, a uniform
    draw from ``generator`` for ``"random"``.

    ``metric="max-variance"`` (PODS, Xu et al., arXiv 2504.13818; ``scope="group"`` only) keeps the ``keep``
    completions of each group whose advantages (rounded to fp32, saturating) have the largest variance. The optimum
    takes the ``i`` highest and ``keep - i`` lowest for some ``i``, so only those ``keep + 1`` candidates are scored
    (fp64 sums of squared deviations); the smallest ``i`` within
    :data:`cppo_kernels.config.MAX_VARIANCE_RTOL` (2^-24, relative) of the largest variance wins (exact ties, such
    as ``j`` against ``keep - j`` correct answers under binary rewards, go to the fewer highest), and of equal
    advantages the lowest indices are kept. The advantages are scored, not the rewards: within a group they are
    an increasing affine map of the rewards (``(r - mean) / (std + eps)``, or ``r - mean``), which preserves the
    order and scales every variance alike, so both give the same subset (up to fp32 rounding of near-ties), and
    this function never sees the rewards.

    Args:
        advantages: ``[N]`` floating, finite, laid out group after group.
        group_size: completions per question ``G`` (>= 1, divides ``N``).
        keep: completions kept per question, ``0 <= keep <= G``.
        num_kept: instead of ``keep``, with ``scope="batch"`` only: completions kept over the whole batch,
            ``0 <= num_kept <= N``, any count (the official ``N - int(N * P)``). Give exactly one of the two.
        scope: ``"group"`` keeps exactly ``keep`` per group; ``"batch"`` keeps ``keep * num_groups`` (or
            ``num_kept``) pooled over the whole batch (the official Open-R1 code).
        metric: ``"smallest"``, ``"largest"``, ``"random"`` or ``"max-variance"`` (with ``scope="group"``).
        generator: the generator of the ``"random"`` draws (``N`` fp32 draws on the advantages' device).

    Returns:
        int64 ``[K]`` with ``K = keep * num_groups`` (or ``num_kept``), ascending; exactly that many, whatever the
        scores (the Triton kernels rank by a total order and bound every store by construction; the batch kernel
        takes the count at run time, so a new count compiles nothing).
    """
    _check_grouped_vector("advantages", advantages, group_size)
    count = _kept_count(advantages.numel(), group_size, options)
    backend = _backend(advantages, group_size)
    draws = _draws(advantages, options)  # [N] or None
    return backend.select_completions(advantages, group_size, count, options, draws)


@takes_cppo_select_options
def cppo_select(rewards: Tensor, group_size: int, options: SelectOptions) -> tuple[Tensor, Tensor]:
    """:func:`group_advantages` then :func:`select_completions` on those advantages, fused.

    On the Triton path this is one kernel launch (advantages, rank selection and compaction), plus a batch-std
    launch for ``scale="batch"`` with ``scope="group"``, plus ``torch.rand`` for ``metric="random"``;
    ``metric="max-variance"`` is :func:`group_advantages`' launch then the max-variance kernel on its fp32
    advantages (the advantages are scored, see :func:`select_completions`).

    Args:
        rewards: ``[N]`` floating, finite, laid out group after group.
        group_size, keep, num_kept: as in :func:`select_completions` (exactly one of ``keep`` and ``num_kept``).
        scale, unbiased, eps: as in :func:`group_advantages`.
        scope, metric, generator: as in :func:`select_completions`.

    Returns:
        ``(advantages, kept)``: fp32 ``[N]`` advantages of all completions (index them with ``kept``) and the
        ascending int64 ``[K]`` indices of the kept completions (``K = keep * num_groups``, or ``num_kept``).
    """
    if torch.compiler.is_compiling():  # one cppo_kernels::cppo_select node; the value check runs inside it
        _check_grouped_shape("rewards", rewards, group_size)
        _check_advantage_options(options)
        _kept_count(rewards.numel(), group_size, options)
        return compiled_select(rewards, group_size, options, _draws(rewards, options))
    _check_grouped_vector("rewards", rewards, group_size)
    _check_advantage_options(options)
    _kept_count(rewards.numel(), group_size, options)
    return select_impl(rewards, group_size, options, draws=_draws(rewards, options), checked=True)


@implements("select")
def select_impl(
    rewards: Tensor, group_size: int, options: SelectOptions, *, draws: Tensor | None, checked: bool = False
) -> tuple[Tensor, Tensor]:
    """:func:`cppo_select` with the ``metric="random"`` draws given (``[N]`` fp32, or None; ``options.generator``
    is not read): validates (unless ``checked``), then runs the backend. The real implementation of the
    ``cppo_kernels::cppo_select`` op."""
    if not checked:
        _check_grouped_vector("rewards", rewards, group_size)
        _check_advantage_options(options)
    count = _kept_count(rewards.numel(), group_size, options._replace(generator=None))
    return _backend(rewards, group_size).cppo_select(rewards, group_size, count, options, draws)
