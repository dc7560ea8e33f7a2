"""The summary of a multi-seed accuracy run (``benchmarks/accuracy_seeds.py``): each seed's speedup.py rows paired
by seed, the mean paired accuracy differences with 95% Student-t intervals over the seeds, the wall-time ratios,
the issue's target checked, a text table and the plot. Nothing here runs a model.

A run is named by its method (:func:`method`): ``GRPO`` (P = 0), ``CPPO P=0.75`` (the smallest |A| pruned: CPPO
itself), ``random P=0.75``, ``max-variance P=0.75`` and so on. Every seed must hold the same methods.
"""

from __future__ import annotations

import math
import pathlib
import statistics
from collections.abc import Sequence
from typing import Any

from speedup_report import _pyplot, _save, label_axes, wilson_interval

#: Two-sided 95% quantiles of Student's t by degrees of freedom (1-30); beyond 30 the normal's 1.96 is within 4%.
T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120,
    2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
#: The issue's target: CPPO in at most this share of GRPO's wall time.
TARGET_TIME_RATIO = 0.5


def t95(df: int) -> float:
    """The two-sided 95% Student-t quantile for ``df`` >= 1 degrees of freedom (1.96 past the table)."""
    if df < 1:
        raise ValueError(f"a t interval needs >= 2 seeds (df >= 1), got df = {df}")
    return T95[df - 1] if df <= len(T95) else 1.96


def method(row: dict[str, Any]) -> str:
    """``GRPO`` for P = 0, ``CPPO P=0.75`` for the smallest |A| at 0.75, ``METRIC P=0.75`` for an ablation."""
    p, metric = row["pruning_rate"], row["selection_metric"]
    if p == 0.0:
        return "GRPO"
    return f"{'CPPO' if metric == 'smallest' else metric} P={p:g}"


def mean_interval(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation and the 95% t interval of the mean (None with one value)."""
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "ci95": None}
    sd = statistics.stdev(values)
    half = t95(n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci95": [mean - half, mean + half]}


def by_seed(rows: Sequence[dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """``{seed: {method: row}}``; ValueError when a seed repeats a method or the seeds hold different methods."""
    table: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        runs = table.setdefault(int(r["seed"]), {})
        if method(r) in runs:
            raise ValueError(f"seed {r['seed']} has two {method(r)} rows")
        runs[method(r)] = r
    kinds = {tuple(sorted(runs)) for runs in table.values()}
    if len(kinds) > 1:
        raise ValueError(f"the seeds ran different methods: {sorted(kinds)}")
    return table


def paired(table: dict[int, dict[str, dict[str, Any]]], a: str, b: str, key: str) -> dict[str, Any]:
    """Per seed ``a[key] - b[key]`` and their :func:`mean_interval`."""
    diffs = {seed: runs[a][key] - runs[b][key] for seed, runs in sorted(table.items())}
    return {"a": a, "b": b, "per_seed": diffs, **mean_interval(list(diffs.values()))}


def ratio(table: dict[int, dict[str, dict[str, Any]]], a: str, b: str, key: str) -> dict[str, Any]:
    """Per seed ``a[key] / b[key]``, their mean with its t interval, and the ratio of the summed seconds."""
    ratios = {seed: runs[a][key] / runs[b][key] for seed, runs in sorted(table.items())}
    pooled = sum(r[a][key] for r in table.values()) / sum(r[b][key] for r in table.values())
    return {"a": a, "b": b, "per_seed": ratios, "of_sums": pooled, **mean_interval(list(ratios.values()))}


def summarise(rows: Sequence[dict[str, Any]], *, cppo: str | None = None) -> dict[str, Any]:
    """The run's summary (``cppo``: the CPPO method to compare, by default the rows' only one): per method the
    seeds' accuracies and seconds (means with t intervals), the paired differences of CPPO's final accuracy against
    every other method, CPPO's wall-time and training-time ratios to GRPO, and the issue's target (CPPO - GRPO's
    interval includes 0 or lies above it; at most half GRPO's wall time; above random pruning: CPPO - random's mean
    above 0, "clearly" when its interval is)."""
    table = by_seed(rows)
    methods = sorted(next(iter(table.values())))
    if cppo is None:  # the one CPPO run
        found = [m for m in methods if m.startswith("CPPO ")]
        cppo = found[0] if len(found) == 1 else f"CPPO ({len(found)} rates: name one)"
    if cppo not in methods or "GRPO" not in methods:
        raise ValueError(f"the rows need GRPO and {cppo} for every seed, got {methods}")
    per_method = {
        m: {
            "accuracy_after": mean_interval([runs[m]["accuracy_after"] for runs in table.values()]),
            "total_seconds": mean_interval([runs[m]["total_seconds"] for runs in table.values()]),
            "train_seconds": mean_interval([runs[m]["train_seconds"] for runs in table.values()]),
        }
        for m in methods
    }
    diffs = {f"{cppo} - {m}": paired(table, cppo, m, "accuracy_after") for m in methods if m != cppo}
    time = ratio(table, cppo, "GRPO", "total_seconds")
    within = diffs[f"{cppo} - GRPO"]
    random_key = next((k for k in diffs if k.endswith(" - random " + cppo.removeprefix("CPPO "))), None)
    target = {
        "within_grpo": within["ci95"] is not None and within["ci95"][1] >= 0.0,
        "at_most_half_the_time": time["mean"] <= TARGET_TIME_RATIO,
        "above_random": None if random_key is None else diffs[random_key]["mean"] > 0.0,
        "clearly_above_random": None if random_key is None else bool((diffs[random_key]["ci95"] or [0])[0] > 0.0),
    }
    return {
        "seeds": sorted(table),
        "methods": methods,
        "interval": "95% Student t over the seeds (df = seeds - 1) of the per-seed values or paired differences",
        "per_method": per_method,
        "accuracy_differences": diffs,
        "time_ratio_total": time,
        "time_ratio_train": ratio(table, cppo, "GRPO", "train_seconds"),
        "target": target,
    }


def _pct(interval: Sequence[float] | None) -> str:
    return "-" if interval is None else f"[{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]"


def format_summary(summary: dict[str, Any], table: dict[int, dict[str, dict[str, Any]]]) -> str:
    """A Markdown table of accuracy and time per method and seed, then the paired differences."""
    seeds, methods = summary["seeds"], summary["methods"]
    head = "| method | " + " | ".join(f"seed {s}: accuracy, s" for s in seeds) + " | mean accuracy | mean s |"
    lines = [head, "|" + " --- |" * (len(seeds) + 3)]
    for m in methods:
        cells = [f"{100 * table[s][m]['accuracy_after']:.1f}%, {table[s][m]['total_seconds']:.0f}" for s in seeds]
        pm = summary["per_method"][m]
        lines.append(
            f"| {m} | " + " | ".join(cells) + f" | {100 * pm['accuracy_after']['mean']:.1f}% | "
            f"{pm['total_seconds']['mean']:.0f} |"
        )
    lines += ["", "| paired difference (points) | per seed | mean | 95% interval |", "| --- | --- | --- | --- |"]
    for name, d in summary["accuracy_differences"].items():
        per = ", ".join(f"{100 * v:+.1f}" for v in d["per_seed"].values())
        lines.append(f"| {name} | {per} | {100 * d['mean']:+.1f} | {_pct(d['ci95'])} |")
    t = summary["time_ratio_total"]
    lines.append(
        f"\nCPPO / GRPO wall time: {t['mean']:.3f} (per seed "
        + ", ".join(f"{v:.3f}" for v in t["per_seed"].values())
        + f"; of the summed seconds {t['of_sums']:.3f}); target: {summary['target']}"
    )
    return "\n".join(lines)


def plot(path: pathlib.Path, summary: dict[str, Any], table: dict[int, dict[str, dict[str, Any]]], meta: dict) -> None:
    """Final accuracy against whole-run wall time: one small marker per seed and method (95% Wilson bar of its
    own test problems), one large marker per method at the seeds' means with the t interval of the mean."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 5.0))
    for i, m in enumerate(summary["methods"]):
        color = f"C{i}"
        for s in summary["seeds"]:
            r = table[s][m]
            n = r["eval_problems_scored"]
            lo, hi = wilson_interval(round(r["accuracy_after"] * n), n)
            y = 100 * r["accuracy_after"]
            ax.errorbar(r["total_seconds"], y, yerr=[[y - 100 * lo], [100 * hi - y]], color=color, marker="o",
                        markersize=4, capsize=2, alpha=0.45, ls="none")  # fmt: skip
        pm = summary["per_method"][m]
        acc, ci = pm["accuracy_after"], pm["accuracy_after"]["ci95"] or [pm["accuracy_after"]["mean"]] * 2
        mean = 100 * acc["mean"]
        label = f"{m}: {mean:.1f}% in {pm['total_seconds']['mean']:.0f} s (mean of {acc['n']} seeds)"
        ax.errorbar(pm["total_seconds"]["mean"], mean, yerr=[[mean - 100 * ci[0]], [100 * ci[1] - mean]],
                    color=color, marker="D", markersize=9, capsize=5, ls="none", label=label)  # fmt: skip
    first = table[summary["seeds"][0]][summary["methods"][0]]
    model = pathlib.Path(str(meta.get("model", "?"))).name
    label_axes(
        ax,
        x="whole-run wall-clock seconds (generation + training; evaluation excluded)",
        y=f"greedy accuracy after training, % of {first['eval_problems']} distinct test problems",
        title=f"{model} on {meta.get('dataset', '?')}: {first['questions']} training questions per seed (other "
        f"questions per seed), G={first['group_size']}\nsmall: one seed (95% Wilson); large: mean over seeds (95% t)",
    )
    _save(plt, fig, path)
