"""Triton backend of the advantages and the completion selection: kernels and their launchers.

The launchers take input already validated by :mod:`cppo_kernels.advantages` and do not check it again.
Three kernels, all sharing the same jitted helpers so a value computed by one is bit-identical
when another recomputes it:

- ``_group_kernel``: one program per tile of ``BLOCK_Q`` whole groups. Computes the advantages
  and/or keeps ``keep`` completions per group by rank (a completion is kept when fewer than
  ``keep`` peers beat it: higher score, or equal score and lower index); the exclusive prefix
  count of kept flags is each kept completion's output slot, so indices come out ascending
  without a sort. ``cppo_select(scope="group")`` is this one launch.
- ``_batch_std_kernel``: one program looping over the batch (two passes, shifted by the first
  reward); only for ``scale="batch"`` with ``scope="group"``.
- ``_batch_kernel``: one program for ``scope="batch"``: (optionally) the batch std and the
  advantages, then a radix select of the ``keep * num_groups``-th largest score (4 passes of
  256-bin histograms over order-preserving 32-bit keys), then one compaction pass with running
  counts. O(N) work in one launch instead of the O(N^2) pairwise rank (4e9 comparisons at
  N=65,536). Single-program, so latency-bound: 5 to 8 sequential passes over N (not yet
  timed on a GPU; O(N) reads by one SM, expected well under a millisecond at N=65,536).

Arithmetic: rewards are upcast at load to fp64, whatever their dtype, and the statistics and advantages are
computed in fp64 (each group shifted by its first reward before summing: exact differences for clustered
rewards), then rounded to fp32 once, as the PyTorch backend does. Advantages that are equal in exact arithmetic
then come out as the same fp32 value (barring an fp64 error straddling an fp32 rounding boundary), so exact ties
go to the lower index on both backends. In fp32 they did not: with G = 3, ``1 - fl(1/3)`` rounds to one ulp below
``fl(2/3)``, so the advantage 2/3 of the reward 1 in ``[0, 0, 1]`` lost its tie with the -2/3 of the 0 in
``[0, 1, 1]``. A group whose rewards are all equal gets exactly 0.
Tile shapes and ``num_warps`` depend only on ``group_size``, never on the batch, so a group's
advantages do not depend on what else is in the launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Compile-time codes of the options, read by name inside the kernels (launches pass their ``.value``).
SCALE_GROUP, SCALE_BATCH, SCALE_NONE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
METRIC_SMALLEST, METRIC_LARGEST, METRIC_RANDOM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
#: What a launch does: advantages only, selection from given advantages, or both (advantages, then selection).
MODE_ADVANTAGES, MODE_SELECT, MODE_FUSED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
SCALE_CODE = {"group": SCALE_GROUP, "batch": SCALE_BATCH, "none": SCALE_NONE}
METRIC_CODE = {"smallest": METRIC_SMALLEST, "largest": METRIC_LARGEST, "random": METRIC_RANDOM}

#: Elements of the ``[BLOCK_Q, BLOCK_G, BLOCK_J]`` pairwise-comparison tile of the group rank.
COMPARE_BUDGET = 8192
#: Largest ``[BLOCK_Q, BLOCK_G]`` tile of rewards per program.
TILE_BUDGET = 1024
#: 1-D tile of the batch passes (std, radix histograms, compaction).
BATCH_BLOCK = 4096
RADIX_BINS = 256


@dataclass(frozen=True)
class GroupConfig:
    """Launch configuration of every kernel for one group size (a function of ``group_size`` only)."""

    block_g: int
    block_q: int
    block_j: int
    num_warps: int
    block: int = BATCH_BLOCK


def group_config(group_size: int) -> GroupConfig:
    block_g = triton.next_power_of_2(group_size)
    block_q = max(1, min(TILE_BUDGET // block_g, COMPARE_BUDGET // (block_g * block_g)))
    block_j = min(block_g, max(1, COMPARE_BUDGET // (block_q * block_g)))
    return GroupConfig(block_g=block_g, block_q=block_q, block_j=block_j, num_warps=8)


# --------------------------------------------------------------------------------------------
# Shared jitted helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _score(a, METRIC: tl.constexpr):
    """Score kept first: |A| for "smallest" (prune the smallest), -|A| for "largest"; ``a`` fp32."""
    if METRIC == METRIC_SMALLEST:
        s = tl.abs(a)
    else:
        s = -tl.abs(a)
    return s


@triton.jit
def _sort_key(s):
    """fp32 -> int64 in [0, 2^32) with the same order as ``s``.

    -0.0 and 0.0 get different keys, but never meet: |A| is never -0.0, -|A| never +0.0, draws never -0.0.
    """
    b = s.to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return b.to(tl.int64) + 2147483648


@triton.jit
def _batch_std(x_ptr, n, ddof, BLOCK: tl.constexpr):
    """fp64 std of all ``n`` rewards (two passes over tiles, shifted by the first reward)."""
    offs = tl.arange(0, BLOCK)
    pivot = tl.load(x_ptr).to(tl.float64)
    acc = tl.zeros([BLOCK], tl.float64)
    for start in range(0, n, BLOCK):
        o = tl.cast(start, tl.int64) + offs  # [BLOCK]
        m = o < n
        x = tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float64)
        acc += tl.where(m, x - pivot, 0.0)
    mean = tl.sum(acc, axis=0) / tl.cast(n, tl.float64)
    acc = tl.zeros([BLOCK], tl.float64)
    for start in range(0, n, BLOCK):
        o = tl.cast(start, tl.int64) + offs
        m = o < n
        x = tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float64)
        c = tl.where(m, (x - pivot) - mean, 0.0)
        acc += c * c
    var = tl.sum(acc, axis=0) / tl.cast(tl.maximum(n - ddof, 1), tl.float64)
    return tl.sqrt(var)


@triton.jit
def _advantage(x, pivot, mean, denom, constant, SCALE: tl.constexpr):
    """Elementwise advantage (fp64 arithmetic, rounded to fp32) of fp64 rewards ``x`` given their group's fp64
    statistics (broadcastable).

    A constant group has ``c`` exactly 0 (every reward equals the pivot), hence an advantage of exactly 0.
    """
    c = (x - pivot) - mean
    if SCALE == SCALE_NONE:
        a = c
    else:
        a = c / tl.where(constant, 1.0, denom)  # no 0/0 when eps=0 and the group is constant
    return a.to(tl.float32)


@triton.jit
def _tile_advantages(
    x_ptr,
    adv_ptr,
    rows,
    cols,
    num_groups,
    group_size,
    std_b,
    eps,
    ddof,
    SCALE: tl.constexpr,
):
    """Advantages of the groups ``rows`` (``[BLOCK_Q, BLOCK_G]``), stored to ``adv_ptr``; returns the statistics."""
    row_ok = rows < num_groups  # [BQ]
    mask = row_ok[:, None] & (cols < group_size)[None, :]  # [BQ, BG]
    base = rows.to(tl.int64) * group_size  # [BQ]
    offs = base[:, None] + cols[None, :]  # [BQ, BG]
    pivot = tl.load(x_ptr + base, mask=row_ok, other=0.0).to(tl.float64)  # [BQ]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    x = tl.where(mask, x, pivot[:, None])  # padding equal to the pivot: no effect on max, min or sums
    d = x - pivot[:, None]
    mean = tl.sum(d, axis=1) / tl.cast(group_size, tl.float64)  # [BQ]
    c = tl.where(mask, d - mean[:, None], 0.0)
    constant = tl.max(x, axis=1) == tl.min(x, axis=1)  # [BQ]
    if SCALE == SCALE_GROUP:
        var = tl.sum(c * c, axis=1) / tl.cast(tl.maximum(group_size - ddof, 1), tl.float64)
        denom = tl.sqrt(var) + tl.cast(eps, tl.float64)  # [BQ]
    else:
        denom = tl.zeros([rows.shape[0]], tl.float64) + (std_b + tl.cast(eps, tl.float64))
    adv = _advantage(x, pivot[:, None], mean[:, None], denom[:, None], constant[:, None], SCALE)  # [BQ, BG]
    tl.store(adv_ptr + offs, adv, mask=mask)
    return adv, pivot, mean, denom, constant


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _batch_std_kernel(x_ptr, std_ptr, n, ddof, BLOCK: tl.constexpr):
    tl.store(std_ptr, _batch_std(x_ptr, n, ddof, BLOCK))


@triton.jit
def _group_kernel(
    x_ptr,  # [N] rewards (MODE_ADVANTAGES, MODE_FUSED) or advantages (MODE_SELECT)
    rand_ptr,  # [N] fp32 uniform scores (METRIC_RANDOM)
    std_ptr,  # [1] fp64 batch std (SCALE_BATCH)
    adv_ptr,  # [N] fp32 advantages out (MODE_ADVANTAGES, MODE_FUSED)
    idx_ptr,  # [num_groups * keep] int64 kept indices out (MODE_SELECT, MODE_FUSED)
    num_groups,
    group_size,
    keep,
    eps,
    ddof,
    SCALE: tl.constexpr,
    MODE: tl.constexpr,
    METRIC: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # [BQ]
    cols = tl.arange(0, BLOCK_G)  # [BG]
    row_ok = rows < num_groups
    mask = row_ok[:, None] & (cols < group_size)[None, :]  # [BQ, BG]
    base = rows.to(tl.int64) * group_size  # [BQ]
    offs = base[:, None] + cols[None, :]  # [BQ, BG]
    if MODE != MODE_SELECT:
        std_b = 0.0
        if SCALE == SCALE_BATCH:
            std_b = tl.load(std_ptr)
        adv, pivot, mean, denom, constant = _tile_advantages(
            x_ptr, adv_ptr, rows, cols, num_groups, group_size, std_b, eps, ddof, SCALE
        )
    if MODE != MODE_ADVANTAGES:
        if METRIC == METRIC_RANDOM:
            s = tl.load(rand_ptr + offs, mask=mask, other=0.0)
        elif MODE == MODE_SELECT:
            s = _score(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), METRIC)
        else:
            s = _score(adv, METRIC)
        rank = tl.zeros([BLOCK_Q, BLOCK_G], tl.int32)
        for j0 in range(0, group_size, BLOCK_J):
            pcols = j0 + tl.arange(0, BLOCK_J)  # [BJ]
            pmask = row_ok[:, None] & (pcols < group_size)[None, :]  # [BQ, BJ]
            poffs = base[:, None] + pcols[None, :]
            if METRIC == METRIC_RANDOM:
                ps = tl.load(rand_ptr + poffs, mask=pmask, other=0.0)
            elif MODE == MODE_SELECT:
                ps = _score(tl.load(x_ptr + poffs, mask=pmask, other=0.0).to(tl.float32), METRIC)
            else:
                xp = tl.load(x_ptr + poffs, mask=pmask, other=0.0).to(tl.float64)
                ps = _score(
                    _advantage(xp, pivot[:, None], mean[:, None], denom[:, None], constant[:, None], SCALE), METRIC
                )
            peer = ps[:, None, :]  # [BQ, 1, BJ]
            own = s[:, :, None]  # [BQ, BG, 1]
            beats = (peer > own) | ((peer == own) & (pcols[None, None, :] < cols[None, :, None]))
            rank += tl.sum((beats & pmask[:, None, :]).to(tl.int32), axis=2)
        kept = (rank < keep) & mask
        k = kept.to(tl.int32)
        pos = tl.cumsum(k, axis=1) - k  # [BQ, BG] slot among the group's kept completions
        tl.store(idx_ptr + rows.to(tl.int64)[:, None] * keep + pos, offs, mask=kept)


@triton.jit
def _batch_key(src_ptr, o, m, METRIC: tl.constexpr):
    # ".cg" (L2, never the read-only path): in MODE_FUSED this program wrote these advantages itself.
    if METRIC == METRIC_RANDOM:
        s = tl.load(src_ptr + o, mask=m, other=0.0, cache_modifier=".cg")
    else:
        s = _score(tl.load(src_ptr + o, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32), METRIC)
    return _sort_key(s)


@triton.jit
def _batch_kernel(
    x_ptr,  # [N] rewards (MODE_FUSED)
    src_ptr,  # [N] what the scores come from: advantages (any float dtype) or fp32 uniform draws
    adv_ptr,  # [N] fp32 advantages out (MODE_FUSED; then also src_ptr unless METRIC_RANDOM)
    idx_ptr,  # [keep_total] int64 kept indices out
    num_groups,
    group_size,
    n,
    keep_total,
    eps,
    ddof,
    SCALE: tl.constexpr,
    MODE: tl.constexpr,
    METRIC: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK: tl.constexpr,
    BINS: tl.constexpr,
):
    if MODE == MODE_FUSED:
        std_b = 0.0
        if SCALE == SCALE_BATCH:
            std_b = _batch_std(x_ptr, n, ddof, BLOCK)
        cols = tl.arange(0, BLOCK_G)
        for q0 in range(0, num_groups, BLOCK_Q):
            rows = q0 + tl.arange(0, BLOCK_Q)
            _tile_advantages(x_ptr, adv_ptr, rows, cols, num_groups, group_size, std_b, eps, ddof, SCALE)
        tl.debug_barrier()  # the advantages written above are read back by other threads below

    # Radix select: the keep_total-th largest key, one 8-bit digit per pass, most significant first.
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, BINS)
    need = keep_total  # how many of the keys matching `prefix` still have to be kept
    prefix = tl.cast(0, tl.int64)
    for p in tl.static_range(4):
        hist = tl.zeros([BINS], tl.int32)
        for start in range(0, n, BLOCK):
            o = tl.cast(start, tl.int64) + offs  # [BLOCK]
            m = o < n
            key = _batch_key(src_ptr, o, m, METRIC)
            if p > 0:
                m = m & ((key >> (32 - 8 * p)) == prefix)
            hist += tl.histogram(((key >> (24 - 8 * p)) & (BINS - 1)).to(tl.int32), BINS, mask=m)
        at_least = tl.cumsum(hist, axis=0, reverse=True)  # [BINS] matching keys with this digit or above
        digit = tl.max(tl.where(at_least >= need, bins, 0), axis=0)
        above = tl.sum(tl.where(bins == digit, at_least - hist, 0), axis=0)
        need = need - above
        prefix = prefix * BINS + digit
    # Keys above `prefix` are kept, and the first `need` (in index order) equal to it.
    kept_before = tl.cast(0, tl.int64)
    ties_before = tl.cast(0, tl.int64)
    for start in range(0, n, BLOCK):
        o = tl.cast(start, tl.int64) + offs
        m = o < n
        key = _batch_key(src_ptr, o, m, METRIC)
        tie = (m & (key == prefix)).to(tl.int64)
        kept = (m & (key > prefix)) | ((tie == 1) & (ties_before + tl.cumsum(tie, axis=0) - tie < need))
        k = kept.to(tl.int64)
        tl.store(idx_ptr + kept_before + tl.cumsum(k, axis=0) - k, o, mask=kept)
        kept_before += tl.sum(k, axis=0)
        ties_before += tl.sum(tie, axis=0)


# --------------------------------------------------------------------------------------------
# Host launchers: allocate, launch (the input is validated by cppo_kernels.advantages)
# --------------------------------------------------------------------------------------------


def _launch_group(x, rand, std, adv, idx, num_groups, group_size, keep, eps, ddof, *, scale, mode, metric) -> None:
    cfg = group_config(group_size)
    grid = (triton.cdiv(num_groups, cfg.block_q),)
    _group_kernel[grid](
        x,
        rand,
        std,
        adv,
        idx,
        num_groups,
        group_size,
        keep,
        eps,
        ddof,
        SCALE=SCALE_CODE[scale].value,
        MODE=mode.value,
        METRIC=METRIC_CODE[metric].value,
        BLOCK_Q=cfg.block_q,
        BLOCK_G=cfg.block_g,
        BLOCK_J=cfg.block_j,
        num_warps=cfg.num_warps,
    )


def _launch_batch_std(x: torch.Tensor, group_size: int, ddof: int) -> torch.Tensor:
    cfg = group_config(group_size)
    std = torch.empty(1, dtype=torch.float64, device=x.device)  # [1]
    _batch_std_kernel[(1,)](x, std, x.numel(), ddof, BLOCK=cfg.block, num_warps=cfg.num_warps)
    return std


def _launch_batch(x, src, adv, num_groups, group_size, keep, eps, ddof, *, scale, mode, metric) -> torch.Tensor:
    cfg = group_config(group_size)
    idx = torch.empty(keep * num_groups, dtype=torch.long, device=x.device)  # [K]
    _batch_kernel[(1,)](
        x,
        src,
        adv,
        idx,
        num_groups,
        group_size,
        x.numel(),
        keep * num_groups,
        eps,
        ddof,
        SCALE=SCALE_CODE[scale].value,
        MODE=mode.value,
        METRIC=METRIC_CODE[metric].value,
        BLOCK_Q=cfg.block_q,
        BLOCK_G=cfg.block_g,
        BLOCK=cfg.block,
        BINS=RADIX_BINS,
        num_warps=cfg.num_warps,
    )
    return idx


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: str, unbiased: bool, eps: float) -> torch.Tensor:
    """The advantages of :func:`cppo_select` with ``keep=0``: one launch (two for ``scale="batch"``)."""
    adv, _ = cppo_select(
        rewards, group_size, 0, scale=scale, unbiased=unbiased, eps=eps, scope="group", metric="smallest", draws=None
    )
    return adv


def select_completions(
    advantages: torch.Tensor, group_size: int, keep: int, *, scope: str, metric: str, draws: torch.Tensor | None
) -> torch.Tensor:
    """Ascending int64 indices of the kept completions: one launch. ``draws``: fp32 ``[N]`` for "random"."""
    x = advantages.detach().contiguous()  # [N]
    num_groups = x.numel() // group_size
    rand = draws if metric == "random" else x  # [N]
    if keep == 0 or num_groups == 0:
        return torch.empty(0, dtype=torch.long, device=x.device)
    if scope == "batch":
        return _launch_batch(
            x, rand, x, num_groups, group_size, keep, 0.0, 0, scale="none", mode=MODE_SELECT, metric=metric
        )
    idx = torch.empty(num_groups * keep, dtype=torch.long, device=x.device)  # [Q * keep]
    _launch_group(
        x, rand, x, x, idx, num_groups, group_size, keep, 0.0, 0, scale="none", mode=MODE_SELECT, metric=metric
    )
    return idx


def cppo_select(
    rewards: torch.Tensor,
    group_size: int,
    keep: int,
    *,
    scale: str,
    unbiased: bool,
    eps: float,
    scope: str,
    metric: str,
    draws: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages fp32 [N], kept indices)``: one fused launch, plus a batch-std launch for ``scale="batch"``
    with ``scope="group"``."""
    x = rewards.detach().contiguous()  # [N]
    num_groups = x.numel() // group_size
    rand = draws if metric == "random" else x  # [N]
    adv = torch.empty(x.numel(), dtype=torch.float32, device=x.device)  # [N]
    if num_groups == 0:
        return adv, torch.empty(0, dtype=torch.long, device=x.device)
    ddof = int(unbiased)
    if scope == "batch" and keep > 0:
        src = rand if metric == "random" else adv
        idx = _launch_batch(
            x, src, adv, num_groups, group_size, keep, eps, ddof, scale=scale, mode=MODE_FUSED, metric=metric
        )
        return adv, idx
    std = _launch_batch_std(x, group_size, ddof) if scale == "batch" else adv
    idx = torch.empty(num_groups * keep if scope == "group" else 0, dtype=torch.long, device=x.device)
    mode = MODE_FUSED if scope == "group" and keep > 0 else MODE_ADVANTAGES  # keep=0: no rank pass
    _launch_group(
        x, rand, std, adv, idx, num_groups, group_size, keep, eps, ddof, scale=scale, mode=mode, metric=metric
    )
    return adv, idx
