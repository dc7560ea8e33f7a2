"""The statistics of a multi-seed run's table (``{seed: {method: row}}``, :func:`sweeps.report.by_seed`): means with
95% Student-t intervals, paired differences and ratios over the seeds two methods share, sign counts, and their
formatting. Shared by :mod:`sweeps.report` and :mod:`sweeps.stop`; nothing here knows a method's name."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def t_quantile(df: int, confidence: float = 0.95) -> float:
    """The two-sided ``confidence`` quantile of Student's t with ``df`` >= 1 degrees of freedom
    (:func:`scipy.stats.t.ppf`): every interval of a seeds report is built with it."""
    from scipy import stats

    if df < 1:
        raise ValueError(f"a t interval needs >= 2 seeds (df >= 1), got df = {df}")
    if not 0 < confidence < 1:
        raise ValueError(f"a t interval's confidence must lie in (0, 1), got {confidence}")
    return float(stats.t.ppf(1 - (1 - confidence) / 2, df))


def t95(df: int) -> float:
    """:func:`t_quantile` at 95%."""
    return t_quantile(df, 0.95)


def mean_interval(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation and the 95% t interval of the mean (None with one value)."""
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "ci95": None}
    sd = statistics.stdev(values)
    half = t95(n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci95": [mean - half, mean + half]}


def shared(table: dict[int, dict[str, dict[str, Any]]], *methods: str) -> list[int]:
    """The seeds that hold every one of ``methods``."""
    return [seed for seed, runs in table.items() if all(m in runs for m in methods)]


def signs(values: Sequence[float]) -> dict[str, int]:
    """How many of ``values`` are above, below and exactly at zero."""
    return {"positive": sum(v > 0 for v in values), "negative": sum(v < 0 for v in values),
            "zero": sum(v == 0 for v in values)}  # fmt: skip


def paired(table: dict[int, dict[str, dict[str, Any]]], a: str, b: str, key: str) -> dict[str, Any]:
    """Per shared seed ``a[key] - b[key]``, their :func:`mean_interval` and :func:`signs`."""
    diffs = {seed: table[seed][a][key] - table[seed][b][key] for seed in shared(table, a, b)}
    values = list(diffs.values())
    return {"a": a, "b": b, "per_seed": diffs, **mean_interval(values), "signs": signs(values)}


def ratio(table: dict[int, dict[str, dict[str, Any]]], a: str, b: str, key: str) -> dict[str, Any]:
    """Per shared seed ``a[key] / b[key]``, their mean with its t interval, and the ratio of the summed seconds."""
    seeds = shared(table, a, b)
    ratios = {seed: table[seed][a][key] / table[seed][b][key] for seed in seeds}
    pooled = sum(table[s][a][key] for s in seeds) / sum(table[s][b][key] for s in seeds)
    return {"a": a, "b": b, "per_seed": ratios, "of_sums": pooled, **mean_interval(list(ratios.values()))}


def per_method_means(table: dict[int, dict[str, dict[str, Any]]], m: str, keys: Sequence[str]) -> dict[str, Any]:
    """``{"seeds", key: mean_interval over the seeds that ran m}`` for each key every one of its rows holds."""
    seeds = shared(table, m)
    return {"seeds": seeds} | {
        k: mean_interval([table[s][m][k] for s in seeds])
        for k in keys
        if all(table[s][m].get(k) is not None for s in seeds)
    }


def format_mean(interval: dict[str, Any] | None) -> str:
    """A :func:`mean_interval`'s mean, whole, or ``-`` where there is none."""
    return "-" if interval is None else f"{interval['mean']:.0f}"


def format_interval(interval: Sequence[float] | None) -> str:
    """A ``(low, high)`` interval of fractions as signed percentages, or ``-`` where there is none."""
    return "-" if interval is None else f"[{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]"


def format_signs(d: dict[str, Any]) -> str:
    """A :func:`paired` difference's :func:`signs` as ``P+ / N- / Z=``."""
    return "{positive}+ / {negative}- / {zero}=".format(**d["signs"])
