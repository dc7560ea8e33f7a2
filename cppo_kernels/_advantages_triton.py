"""Triton backend of the advantages and the completion selection: kernels and their launchers.

The launchers take input already validated by :mod:`cppo_kernels.advantages` and do not check it again.
Four kernels, all sharing the same jitted helpers so a value computed by one is bit-identical
when another recomputes it:

- ``_group_kernel``: one program per tile of ``BLOCK_Q`` whole groups. Computes the advantages
  and/or keeps ``keep`` completions per group by rank (a completion is kept when fewer than
  ``keep`` peers beat it: higher score, or equal score and lower index); the exclusive prefix
  count of kept flags is each kept completion's output slot, so indices come out ascending
  without a sort. ``cppo_select(scope="group")`` is this one launch.
- ``_batch_std_kernel``: one program looping over the batch (two passes, shifted by the first
  reward); only for ``scale="batch"`` with ``scope="group"``.
- ``_batch_kernel``: one program for ``scope="batch"``: (optionally) the batch std and the
  advantages, then a radix select of the ``keep_total``-th largest score (4 passes of
  256-bin histograms over order-preserving 32-bit keys), then one compaction pass with running
  counts. O(N) work in one launch instead of the O(N^2) pairwise rank (4e9 comparisons at
  N=65,536). ``keep_total`` (any count in ``[1, N]``: ``keep * num_groups`` or the official
  ``N - int(N * P)``) is a runtime argument the JIT does not specialise on, so a new count
  compiles nothing. Single-program, so latency-bound: 5 to 8 sequential passes over N (not yet
  timed on a GPU; O(N) reads by one SM, expected well under a millisecond at N=65,536).
- ``_max_variance_kernel``: ``metric="max-variance"`` (PODS), one program per group, the whole group in registers:
  each completion's position in the group sorted highest first (a pairwise count, as the group kernel's rank:
  higher value, or equal and lower index), then the sum of squared deviations of every candidate ``i`` in
  ``0..keep`` (the ``i`` highest and ``keep - i`` lowest: ``[BLOCK_I, BLOCK_G]`` masked fp64 tiles, two passes,
  mean then squares, so no cancellation), the smallest ``i`` within ``MAX_VARIANCE_RTOL`` of the largest, and the
  kept completions (of equal values the lowest indices) compacted in index order. O(G * (G + keep)) work per group,
  the order of the group kernel's rank; no scratch memory, no barrier. ``cppo_select`` runs it after the group
  kernel's advantages launch (the very launch of ``group_advantages``, so the scored advantages are bit-identical
  to it), as the selection needs the group's finished advantages in one program.

Arithmetic: rewards are upcast at load to fp64, whatever their dtype, divided by the power of two at or below their
group's largest magnitude (the batch's for ``scale="batch"``: exact, and it keeps every square and sum in range for
any finite input, fp64 ones near 1e308 included), and the statistics and advantages are computed in fp64 (each group
shifted by its first reward before summing: exact differences for clustered rewards), then rounded to fp32 once, as
the PyTorch backend does (``scale="none"`` saturates at the largest fp32 instead of overflowing to inf). Advantages
that are equal in exact arithmetic then come out as the same fp32 value (barring an fp64 error straddling an fp32
rounding boundary), so exact ties go to the lower index on both backends. In fp32 they did not: with G = 3,
``1 - fl(1/3)`` rounds to one ulp below ``fl(2/3)``, so the advantage 2/3 of the reward 1 in ``[0, 0, 1]`` lost its
tie with the -2/3 of the 0 in ``[0, 1, 1]``. A group whose rewards are all equal gets exactly 0.

Stores are bounded by construction, whatever the data: ranks compare integer keys of the fp32 scores (a total order
on every bit pattern, NaN included), so exactly ``keep`` completions of a group are kept, and each index store is
masked to its own output slots (``slot < keep`` per group, ``slot < keep_total`` for the batch).
Tile shapes and ``num_warps`` depend only on ``group_size``, never on the batch, so a group's
advantages do not depend on what else is in the launch. ``group_size`` is at most :data:`MAX_GROUP_SIZE`
(:func:`cppo_kernels.advantages` runs larger groups on the PyTorch path).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._carriers import SelectOptions
from .config import MAX_VARIANCE_RTOL

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
#: Largest group size of the kernels: compiled for sm_80/sm_90 without spilling (tests/test_compile_advantages.py);
#: 8192 spills on sm_80 (16384 on both), and Triton's tensor limit (2^20 elements) is above that.
MAX_GROUP_SIZE = 4096
#: 1-D tile of the batch passes (std, radix histograms, compaction).
BATCH_BLOCK = 4096
#: Elements of the max-variance kernel's ``[BLOCK_I, BLOCK_G]`` fp64 tile of candidate sums.
VARIANCE_BUDGET = 4096
RADIX_BINS = 256


@dataclass(frozen=True)
class GroupConfig:
    """Launch configuration of every kernel for one group size (a function of ``group_size`` only)."""

    block_g: int
    block_q: int
    block_j: int
    num_warps: int
    variance_j: int  # peers per pairwise step of the max-variance kernel (one group per program)
    variance_i: int  # candidates per fp64 tile of the max-variance kernel
    block: int = BATCH_BLOCK


def group_config(group_size: int) -> GroupConfig:
    if group_size > MAX_GROUP_SIZE:
        raise ValueError(f"group_size={group_size} is above the Triton kernels' limit of {MAX_GROUP_SIZE}")
    block_g = triton.next_power_of_2(group_size)
    block_q = max(1, min(TILE_BUDGET // block_g, COMPARE_BUDGET // (block_g * block_g)))
    block_j = min(block_g, max(1, COMPARE_BUDGET // (block_q * block_g)))
    variance_j = min(block_g, max(1, COMPARE_BUDGET // block_g))
    variance_i = min(triton.next_power_of_2(group_size + 1), max(1, VARIANCE_BUDGET // block_g))
    return GroupConfig(
        block_g=block_g, block_q=block_q, block_j=block_j, num_warps=8, variance_j=variance_j, variance_i=variance_i
    )


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
def _order_key(s):
    """fp32 -> int32 with the same order as ``s``, and a total order on every bit pattern: a NaN sorts above +inf
    (or below -inf with its sign bit set), so a rank by these keys counts each completion exactly once.

    -0.0 and 0.0 get different keys, but never meet: |A| is never -0.0, -|A| never +0.0, draws never -0.0.
    """
    b = s.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _sort_key(s):
    """:func:`_order_key` shifted to an int64 in [0, 2^32): unsigned 8-bit digits for the radix select."""
    return _order_key(s).to(tl.int64) + 2147483648


@triton.jit
def _pow2_scale(m):
    """``2^floor(log2 m)`` of fp64 ``m >= 0`` (at least 2^-1022, the smallest normal): dividing by it is exact, and
    rewards divided by the scale of their largest magnitude lie in (-2, 2), so no square or sum can overflow."""
    exponent = m.to(tl.int64, bitcast=True) & 0x7FF0000000000000  # the exponent bits alone: a power of two (or 0)
    return tl.maximum(exponent.to(tl.float64, bitcast=True), 2.2250738585072014e-308)


@triton.jit
def _batch_std(x_ptr, n, ddof, BLOCK: tl.constexpr):
    """``(std, scale)``: the fp64 std of all ``n`` rewards divided by ``scale``, the :func:`_pow2_scale` of their
    largest magnitude (three passes over tiles: magnitude, mean, squares; shifted by the first reward)."""
    offs = tl.arange(0, BLOCK)
    mag = tl.zeros([BLOCK], tl.float64)
    for start in range(0, n, BLOCK):
        o = tl.cast(start, tl.int64) + offs  # [BLOCK]
        mag = tl.maximum(mag, tl.abs(tl.load(x_ptr + o, mask=o < n, other=0.0).to(tl.float64)))
    scale = _pow2_scale(tl.max(mag, axis=0))
    pivot = tl.load(x_ptr).to(tl.float64) / scale
    acc = tl.zeros([BLOCK], tl.float64)
    for start in range(0, n, BLOCK):
        o = tl.cast(start, tl.int64) + offs  # [BLOCK]
        m = o < n
        x = tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float64) / scale
        acc += tl.where(m, x - pivot, 0.0)
    mean = tl.sum(acc, axis=0) / tl.cast(n, tl.float64)
    acc = tl.zeros([BLOCK], tl.float64)
    for start in range(0, n, BLOCK):
        o = tl.cast(start, tl.int64) + offs
        m = o < n
        x = tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float64) / scale
        c = tl.where(m, (x - pivot) - mean, 0.0)
        acc += c * c
    var = tl.sum(acc, axis=0) / tl.cast(tl.maximum(n - ddof, 1), tl.float64)
    return tl.sqrt(var), scale


@triton.jit
def _advantage(x, scale, pivot, mean, denom, constant, SCALE: tl.constexpr):
    """Elementwise advantage (fp64 arithmetic, rounded to fp32) of fp64 rewards ``x`` given their group's fp64
    statistics (broadcastable), all in units of ``scale``.

    A constant group has ``c`` exactly 0 (every reward equals the pivot), hence an advantage of exactly 0.
    ``SCALE_NONE`` saturates at the largest fp32 instead of rounding to inf.
    """
    c = (x / scale - pivot) - mean
    if SCALE == SCALE_NONE:
        a = tl.minimum(tl.maximum(c * scale, -3.4028234663852886e38), 3.4028234663852886e38)
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
    scale_b,
    eps,
    ddof,
    SCALE: tl.constexpr,
):
    """Advantages of the groups ``rows`` (``[BLOCK_Q, BLOCK_G]``), stored to ``adv_ptr``; returns the statistics.

    Each group is divided by the :func:`_pow2_scale` of its largest |reward| (``scale_b``, the batch's, for
    ``SCALE_BATCH``, whose ``std_b`` is in those units) before any arithmetic.
    """
    row_ok = rows < num_groups  # [BQ]
    mask = row_ok[:, None] & (cols < group_size)[None, :]  # [BQ, BG]
    base = rows.to(tl.int64) * group_size  # [BQ]
    offs = base[:, None] + cols[None, :]  # [BQ, BG]
    first = tl.load(x_ptr + base, mask=row_ok, other=0.0).to(tl.float64)  # [BQ]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float64)
    x = tl.where(mask, x, first[:, None])  # padding equal to the pivot: no effect on max, min or sums
    constant = tl.max(x, axis=1) == tl.min(x, axis=1)  # [BQ]
    if SCALE == SCALE_BATCH:
        scale = tl.zeros([rows.shape[0]], tl.float64) + scale_b
    else:
        scale = _pow2_scale(tl.max(tl.abs(x), axis=1))  # [BQ]
    pivot = first / scale  # [BQ]
    d = x / scale[:, None] - pivot[:, None]
    mean = tl.sum(d, axis=1) / tl.cast(group_size, tl.float64)  # [BQ]
    c = tl.where(mask, d - mean[:, None], 0.0)
    if SCALE == SCALE_GROUP:
        var = tl.sum(c * c, axis=1) / tl.cast(tl.maximum(group_size - ddof, 1), tl.float64)
        denom = tl.sqrt(var) + tl.cast(eps, tl.float64) / scale  # [BQ]
    else:
        denom = std_b + tl.cast(eps, tl.float64) / scale  # [BQ] (unused for SCALE_NONE)
    stats = (scale[:, None], pivot[:, None], mean[:, None], denom[:, None], constant[:, None])
    adv = _advantage(x, *stats, SCALE)  # [BQ, BG]
    tl.store(adv_ptr + offs, adv, mask=mask)
    return adv, stats


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _batch_std_kernel(x_ptr, std_ptr, n, ddof, BLOCK: tl.constexpr):
    std, scale = _batch_std(x_ptr, n, ddof, BLOCK)
    tl.store(std_ptr, std)
    tl.store(std_ptr + 1, scale)


@triton.jit
def _group_kernel(
    x_ptr,  # [N] rewards (MODE_ADVANTAGES, MODE_FUSED) or advantages (MODE_SELECT)
    rand_ptr,  # [N] fp32 uniform scores (METRIC_RANDOM)
    std_ptr,  # [2] fp64 batch std and its scale (SCALE_BATCH)
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
        scale_b = 1.0
        if SCALE == SCALE_BATCH:
            std_b = tl.load(std_ptr)
            scale_b = tl.load(std_ptr + 1)
        adv, stats = _tile_advantages(
            x_ptr, adv_ptr, rows, cols, num_groups, group_size, std_b, scale_b, eps, ddof, SCALE
        )
    if MODE != MODE_ADVANTAGES:
        if METRIC == METRIC_RANDOM:
            s = tl.load(rand_ptr + offs, mask=mask, other=0.0)
        elif MODE == MODE_SELECT:
            s = _score(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), METRIC)
        else:
            s = _score(adv, METRIC)
        own = _order_key(s)[:, :, None]  # [BQ, BG, 1]
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
                ps = _score(_advantage(xp, *stats, SCALE), METRIC)
            peer = _order_key(ps)[:, None, :]  # [BQ, 1, BJ]
            beats = (peer > own) | ((peer == own) & (pcols[None, None, :] < cols[None, :, None]))
            rank += tl.sum((beats & pmask[:, None, :]).to(tl.int32), axis=2)
        # Integer keys are a strict total order (ties go to the lower index), so the ranks of a group are 0..G-1 and
        # exactly `keep` are kept; the store is bounded by its own mask besides: slot < keep, row < num_groups.
        kept = (rank < keep) & mask
        k = kept.to(tl.int32)
        pos = tl.cumsum(k, axis=1) - k  # [BQ, BG] slot among the group's kept completions
        tl.store(idx_ptr + rows.to(tl.int64)[:, None] * keep + pos, offs, mask=kept & (pos < keep))


@triton.jit
def _batch_key(src_ptr, o, m, METRIC: tl.constexpr):
    # ".cg" (L2, never the read-only path): in MODE_FUSED this program wrote these advantages itself.
    if METRIC == METRIC_RANDOM:
        s = tl.load(src_ptr + o, mask=m, other=0.0, cache_modifier=".cg")
    else:
        s = _score(tl.load(src_ptr + o, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32), METRIC)
    return _sort_key(s)


@triton.jit(do_not_specialize=["keep_total"])  # one compile for every count (no ==1 or %16 variants)
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
        scale_b = 1.0
        if SCALE == SCALE_BATCH:
            std_b, scale_b = _batch_std(x_ptr, n, ddof, BLOCK)
        cols = tl.arange(0, BLOCK_G)
        for q0 in range(0, num_groups, BLOCK_Q):
            rows = q0 + tl.arange(0, BLOCK_Q)
            _tile_advantages(x_ptr, adv_ptr, rows, cols, num_groups, group_size, std_b, scale_b, eps, ddof, SCALE)
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
    # Keys above `prefix` are kept, and the first `need` (in index order) equal to it: keep_total in all, the keys
    # being integers; the store is bounded by its own mask besides (slot < keep_total).
    kept_before = tl.cast(0, tl.int64)
    ties_before = tl.cast(0, tl.int64)
    for start in range(0, n, BLOCK):
        o = tl.cast(start, tl.int64) + offs
        m = o < n
        key = _batch_key(src_ptr, o, m, METRIC)
        tie = (m & (key == prefix)).to(tl.int64)
        kept = (m & (key > prefix)) | ((tie == 1) & (ties_before + tl.cumsum(tie, axis=0) - tie < need))
        k = kept.to(tl.int64)
        slot = kept_before + tl.cumsum(k, axis=0) - k  # [BLOCK]
        tl.store(idx_ptr + slot, o, mask=kept & (slot < keep_total))
        kept_before += tl.sum(k, axis=0)
        ties_before += tl.sum(tie, axis=0)


@triton.jit
def _variance_value(v):
    """The max-variance score of loaded advantages ``v`` (any float dtype): rounded to fp32, saturating at the
    largest fp32, -0.0 read as 0.0 (one value, one key)."""
    v = tl.minimum(tl.maximum(v.to(tl.float64), -3.4028234663852886e38), 3.4028234663852886e38).to(tl.float32)
    return tl.where(v == 0.0, 0.0, v)


@triton.jit
def _candidate_ssd(d, pos, valid, i0, group_size, keep, BLOCK_I: tl.constexpr):
    """Sums of squared deviations ``[BLOCK_I]`` of the candidates ``i0 + arange(BLOCK_I)`` (-1 past ``keep``): the
    ``i`` highest and ``keep - i`` lowest of a group whose fp64 values ``d [BG]`` sit at sorted positions ``pos``."""
    ii = i0 + tl.arange(0, BLOCK_I)  # [BI]
    member = valid[None, :] & ((pos[None, :] < ii[:, None]) | (pos[None, :] >= (group_size - keep + ii)[:, None]))
    mean = tl.sum(tl.where(member, d[None, :], 0.0), axis=1) / tl.cast(keep, tl.float64)  # [BI]
    c = tl.where(member, d[None, :] - mean[:, None], 0.0)  # [BI, BG]
    return tl.where(ii <= keep, tl.sum(c * c, axis=1), -1.0)


@triton.jit
def _max_variance_kernel(
    x_ptr,  # [N] advantages (any float dtype)
    idx_ptr,  # [num_groups * keep] int64 kept indices out
    group_size,
    keep,  # >= 1
    rtol,  # MAX_VARIANCE_RTOL
    BLOCK_G: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    group = tl.program_id(0).to(tl.int64)
    base = group * group_size
    cols = tl.arange(0, BLOCK_G)
    valid = cols < group_size
    s = _variance_value(tl.load(x_ptr + base + cols, mask=valid, other=0.0))  # [BG] fp32
    own = _order_key(s)[:, None]  # [BG, 1]
    above = tl.zeros([BLOCK_G], tl.int32)  # peers with a higher value
    equal = tl.zeros([BLOCK_G], tl.int32)  # peers with the same value (itself included)
    before = tl.zeros([BLOCK_G], tl.int32)  # peers with the same value and a lower index
    for j0 in range(0, group_size, BLOCK_J):
        pcols = j0 + tl.arange(0, BLOCK_J)  # [BJ]
        pmask = (pcols < group_size)[None, :]
        peer = _order_key(_variance_value(tl.load(x_ptr + base + pcols, mask=pcols < group_size, other=0.0)))
        same = (peer[None, :] == own) & pmask  # [BG, BJ]
        above += tl.sum(((peer[None, :] > own) & pmask).to(tl.int32), axis=1)
        equal += tl.sum(same.to(tl.int32), axis=1)
        before += tl.sum((same & (pcols[None, :] < cols[:, None])).to(tl.int32), axis=1)
    pos = above + before  # [BG] a permutation of 0..G-1: the position sorted highest first
    v = s.to(tl.float64)
    mid = (tl.max(tl.where(valid, v, -3.5e38), axis=0) + tl.min(tl.where(valid, v, 3.5e38), axis=0)) / 2
    d = tl.where(valid, v - mid, 0.0)  # [BG] centred on the mid-range: |d| <= spread / 2
    best = tl.cast(0.0, tl.float64)
    for i0 in range(0, keep + 1, BLOCK_I):
        best = tl.maximum(best, tl.max(_candidate_ssd(d, pos, valid, i0, group_size, keep, BLOCK_I), axis=0))
    threshold = best * (1.0 - tl.cast(rtol, tl.float64))
    first = keep  # the smallest candidate at the threshold (recomputed bit for bit; `keep` only if none is: NaN)
    for i0 in range(0, keep + 1, BLOCK_I):
        ssd = _candidate_ssd(d, pos, valid, i0, group_size, keep, BLOCK_I)
        first = tl.minimum(first, tl.min(tl.where(ssd >= threshold, i0 + tl.arange(0, BLOCK_I), keep), axis=0))
    # Of each run of equal values [above, above + equal) the candidate takes its part above `first` and its part from
    # `bottom` on, `taken` in all: the run's `taken` lowest indices are kept, so exactly `keep` of the group (first is
    # in [0, keep]); the store is bounded by its own mask besides (slot < keep).
    bottom = group_size - keep + first
    end = above + equal
    taken = tl.maximum(tl.minimum(end, first) - above, 0) + tl.maximum(end - tl.maximum(above, bottom), 0)
    kept = valid & (before < taken)
    k = kept.to(tl.int32)
    slot = tl.cumsum(k, axis=0) - k  # [BG] slot among the group's kept completions, in index order
    tl.store(idx_ptr + group * keep + slot, base + cols, mask=kept & (slot < keep))


# --------------------------------------------------------------------------------------------
# Host launchers: allocate, launch (the input is validated by cppo_kernels.advantages)
# --------------------------------------------------------------------------------------------


def _launch_group(x, rand, adv, idx, num_groups, group_size, keep, eps, ddof, *, std, scale, mode, metric) -> None:
    """The group kernel; ``std``: the fp64 ``[2]`` of :func:`_launch_batch_std` (``scale="batch"``), else unread."""
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
    std = torch.empty(2, dtype=torch.float64, device=x.device)  # [2] the batch std and its scale
    _batch_std_kernel[(1,)](x, std, x.numel(), ddof, BLOCK=cfg.block, num_warps=cfg.num_warps)
    return std


def _launch_batch(x, src, adv, idx, num_groups, group_size, keep_total, eps, ddof, *, scale, mode, metric) -> None:
    """The single-program batch kernel: keeps ``keep_total`` (``= idx.numel()``, >= 1) completions, their ascending
    indices into ``idx``; same positional arguments as :func:`_launch_group`, whose ``keep`` is per group."""
    cfg = group_config(group_size)
    _batch_kernel[(1,)](
        x,
        src,
        adv,
        idx,
        num_groups,
        group_size,
        x.numel(),
        keep_total,
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


def _launch_max_variance(x: torch.Tensor, idx: torch.Tensor, num_groups: int, group_size: int, keep: int) -> None:
    """The max-variance kernel: ``keep`` (>= 1) indices per group of ``x`` into ``idx``, one program per group."""
    cfg = group_config(group_size)
    _max_variance_kernel[(num_groups,)](
        x,
        idx,
        group_size,
        keep,
        MAX_VARIANCE_RTOL,
        BLOCK_G=cfg.block_g,
        BLOCK_J=cfg.variance_j,
        BLOCK_I=cfg.variance_i,
        num_warps=cfg.num_warps,
    )


def group_advantages(rewards: torch.Tensor, group_size: int, options: SelectOptions) -> torch.Tensor:
    """The advantages of :func:`cppo_select` keeping nothing: one launch (two for ``scale="batch"``)."""
    adv, _ = cppo_select(rewards, group_size, 0, options._replace(scope="group", metric="smallest"), None)
    return adv


def select_completions(
    advantages: torch.Tensor, group_size: int, count: int, options: SelectOptions, draws: torch.Tensor | None
) -> torch.Tensor:
    """Ascending int64 indices of the kept completions, ``count`` per group (``options.scope="group"``) or over the
    batch (``"batch"``), by ``options.metric``: one launch. ``draws``: fp32 ``[N]`` for "random"."""
    scope, metric = options.scope, options.metric
    x = advantages.detach().contiguous()  # [N]
    num_groups = x.numel() // group_size
    rand = draws if metric == "random" else x  # [N]
    idx = torch.empty(_num_out(count, num_groups, scope), dtype=torch.long, device=x.device)  # [K]
    if idx.numel() == 0:
        return idx
    if metric == "max-variance":
        _launch_max_variance(x, idx, num_groups, group_size, count)
        return idx
    launch = _launch_batch if scope == "batch" else functools.partial(_launch_group, std=x)
    launch(x, rand, x, idx, num_groups, group_size, count, 0.0, 0, scale="none", mode=MODE_SELECT, metric=metric)
    return idx


def _num_out(count: int, num_groups: int, scope: str) -> int:
    """How many indices a selection of ``count`` per group (``scope="group"``) or in all (``"batch"``) returns."""
    return count * num_groups if scope == "group" else count


def cppo_select(
    rewards: torch.Tensor, group_size: int, count: int, options: SelectOptions, draws: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages fp32 [N], kept indices)``, ``count`` kept per group (``options.scope="group"``) or over the
    batch (``"batch"``): one fused launch, plus a batch-std launch for ``scale="batch"`` with ``scope="group"``."""
    scale, eps, scope, metric = options.scale, options.eps, options.scope, options.metric
    x = rewards.detach().contiguous()  # [N]
    num_groups = x.numel() // group_size
    rand = draws if metric == "random" else x  # [N]
    adv = torch.empty(x.numel(), dtype=torch.float32, device=x.device)  # [N]
    if num_groups == 0:
        return adv, torch.empty(0, dtype=torch.long, device=x.device)
    ddof = int(options.unbiased)
    idx = torch.empty(_num_out(count, num_groups, scope), dtype=torch.long, device=x.device)  # [K]
    if scope == "batch" and count > 0:
        src = rand if metric == "random" else adv
        _launch_batch(
            x, src, adv, idx, num_groups, group_size, count, eps, ddof, scale=scale, mode=MODE_FUSED, metric=metric
        )
        return adv, idx
    std = _launch_batch_std(x, group_size, ddof) if scale == "batch" else adv
    if metric == "max-variance":  # group_advantages' own launch (bit-identical advantages), then the selection
        _launch_group(
            x, rand, adv, idx, num_groups, group_size, 0, eps, ddof, std=std, scale=scale, mode=MODE_ADVANTAGES,
            metric="smallest",
        )  # fmt: skip
        if count > 0:
            _launch_max_variance(adv, idx, num_groups, group_size, count)
        return adv, idx
    mode = MODE_FUSED if count > 0 else MODE_ADVANTAGES  # nothing kept: no rank pass
    _launch_group(
        x, rand, adv, idx, num_groups, group_size, count, eps, ddof, std=std, scale=scale, mode=mode, metric=metric
    )
    return adv, idx
