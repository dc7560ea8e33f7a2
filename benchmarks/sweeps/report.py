"""The summary of a multi-seed accuracy run (``benchmarks/accuracy_seeds.py``): each seed's speedup.py rows paired
by seed, the mean paired accuracy differences with 95% Student-t intervals over the seeds each pair shares and how
many seeds each difference is positive / negative / zero on, the wall-time ratios to GRPO, the issue's target
checked, a text table and the plot. Nothing here runs a model.

A run is named by its method (:func:`method`): ``GRPO`` (P = 0), ``CPPO P=0.75`` (the smallest |A| pruned over the
step's pooled completions with allocation: CPPO itself), ``CPPO group P=0.75`` (per question), ``CPPO P=0.75 no
allocation`` (the step-budget control), ``random P=0.75``, ``max-variance P=0.75`` and so on. Seeds may hold
different methods (a sweep adds arms to former seeds): every statistic uses the seeds that hold what it compares.
"""

from __future__ import annotations

import math
import pathlib
import statistics
from collections.abc import Sequence
from typing import Any

from benchkit.plots import label_axes, pyplot, save_figure
from endtoend.report import wilson_interval

from sweeps.stats import (
    format_interval,
    format_mean,
    format_signs,
    mean_interval,
    paired,
    per_method_means,
    ratio,
    shared,
    signs,
    t_quantile,
)

#: The issue's target: CPPO in at most this share of GRPO's wall time.
TARGET_TIME_RATIO = 0.5
#: Issue 30's target: CPPO with dynamic sampling + GRESO in at most this share of plain CPPO's whole-run time.
TARGET_DYNAMIC_TIME_RATIO = 0.7
#: What a method with both of issue 30's features adds to its name.
DYNAMIC = " + filter_groups + greso"


def method(row: dict[str, Any]) -> str:
    """``GRPO`` for P = 0; else the metric (``CPPO`` for the smallest |A|), the scope unless it is the pooled
    ``batch`` one (max-variance is per question by definition), the rate, and ``no allocation`` without allocation:
    ``CPPO P=0.75``, ``CPPO group P=0.75``, ``CPPO P=0.75 no allocation``, ``max-variance P=0.75``; a run bounded
    by epochs adds them (``CPPO P=0.75 3 epochs``), and issue 30's features their names (``... + filter_groups``);
    generating ahead (issue 51) adds its settings (``CPPO P=0.75 + max_staleness=1``)."""
    return _method(row) + "".join(ahead_suffixes(row))


#: Generating ahead of training (issue 51) and the value of a synchronous run (a row written before these settings
#: existed has none: it ran synchronously). A method named with a suffix of these is never the pooled CPPO baseline.
AHEAD_DEFAULTS = {"max_staleness": 0, "steps_per_generation": 1}


def ahead_suffixes(row: dict[str, Any]) -> list[str]:
    """``[" + max_staleness=1", ...]``: the settings of :data:`AHEAD_DEFAULTS` a row sets away from the default."""
    return [f" + {k}={row[k]}" for k, default in AHEAD_DEFAULTS.items() if row.get(k, default) not in (default, None)]


def _method(row: dict[str, Any]) -> str:
    p, metric = row["pruning_rate"], row["selection_metric"]
    if p == 0.0:
        return "GRPO"
    scope = row.get("selection_scope", "batch")
    name = ("CPPO" if metric == "smallest" else metric) + ("" if scope == "batch" or metric == "max-variance"
                                                           else f" {scope}")  # fmt: skip
    name = f"{name} P={p:g}" + ("" if row.get("allocation", True) else " no allocation")
    name += f" {row['num_epochs']} epochs" if row.get("num_epochs") else ""
    name += "".join(f" + {k}" for k in ("filter_groups", "greso") if row.get(k))
    if row.get("rollout_stop_rate"):  # issue 38: pruning while generating
        name += f" + stop {row['rollout_stop_rate']:g} ({row.get('rollout_stop_scorer', 'learned')})"
    return name


def by_seed(rows: Sequence[dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """``{seed: {method: row}}`` (seeds ascending); ValueError when a seed repeats a method."""
    table: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        runs = table.setdefault(int(r["seed"]), {})
        if method(r) in runs:
            raise ValueError(f"seed {r['seed']} has two {method(r)} rows")
        runs[method(r)] = r
    return dict(sorted(table.items()))


#: ``--time``: which seconds the time ratios to GRPO use (CPU seconds by default: on a shared machine a unit's wall
#: time includes the waits its neighbours cause, its process's CPU time does not).
TIME_BASES = {"cpu": "cpu_seconds", "wall": "total_seconds"}
#: The pre-registered confirmation (issue 41, ``docs/results.md``): the primary comparison, a two-sided paired t test
#: at ``alpha``; the secondary, an equivalence test (the ``1 - 2 * alpha`` interval inside +-``margin`` points).
PREREGISTERED = {"primary": ("CPPO group P=0.75", "CPPO P=0.75"), "secondary": ("CPPO group P=0.75", "GRPO"),
                 "alpha": 0.05, "margin_points": 3.0}  # fmt: skip
#: The pre-registered comparison at GRPO's compute (issue 52, ``docs/results.md``, committed before its units ran):
#: primary ``a - b`` with the verdict rules of :func:`compute_verdict`; secondary, what the second epoch buys (a
#: two-sided paired t test); and the arm's process CPU seconds over GRPO's, per seed, whose mean counts as equal
#: compute inside ``equal_compute``. When a combination holds this plan's three methods it is reported, not issue 41's.
PREREGISTERED_COMPUTE = {
    "plan": "docs/results.md, Pre-registered: CPPO at GRPO's compute (issue 52)",
    "primary": ("CPPO P=0.75 2 epochs", "GRPO"), "secondary": ("CPPO P=0.75 2 epochs", "CPPO P=0.75"),
    "alpha": 0.05, "margin_points": 3.0, "time_key": "cpu_seconds", "equal_compute": (0.9, 1.2),
}  # fmt: skip


def paired_test(table: dict[int, dict[str, dict[str, Any]]], a: str, b: str, *, alpha: float) -> dict[str, Any]:
    """The paired difference ``a - b`` of final accuracy in points over the seeds both hold: mean, sd, the two-sided
    paired t test (``t``, ``df``, ``p``: :func:`scipy.stats.ttest_rel`), and its ``1 - alpha`` and ``1 - 2 alpha``
    t intervals."""
    from scipy import stats

    seeds = shared(table, a, b)
    if len(seeds) < 2:
        raise ValueError(f"a paired t test of {a} - {b} needs >= 2 seeds holding both, got {seeds}")
    x = [100 * table[s][a]["accuracy_after"] for s in seeds]
    y = [100 * table[s][b]["accuracy_after"] for s in seeds]
    d = [u - v for u, v in zip(x, y)]
    n, mean, sd = len(d), statistics.fmean(d), statistics.stdev(d)
    test = stats.ttest_rel(x, y)
    half = {q: t_quantile(n - 1, 1 - q) * sd / math.sqrt(n) for q in (alpha, 2 * alpha)}
    return {
        "a": a, "b": b, "seeds": seeds, "per_seed_points": dict(zip(seeds, d)), "n": n, "mean_points": mean,
        "sd_points": sd, "t": float(test.statistic), "df": n - 1, "p": float(test.pvalue), "signs": signs(d),
        f"ci{round(100 * (1 - alpha))}_points": [mean - half[alpha], mean + half[alpha]],
        f"ci{round(100 * (1 - 2 * alpha))}_points": [mean - half[2 * alpha], mean + half[2 * alpha]],
    }  # fmt: skip


def compute_verdict(d: dict[str, Any], *, alpha: float, margin: float) -> str:
    """Issue 52's verdict rules, fixed before its data: ``better`` when the ``1 - alpha`` interval lies above 0,
    ``worse`` when it lies below; else ``equivalent`` when the ``1 - 2 alpha`` interval lies inside +-margin; else
    ``inconclusive, leaning above`` / ``below`` (by the mean's sign; ``level`` at a mean of exactly 0)."""
    lo, hi = d[f"ci{round(100 * (1 - alpha))}_points"]
    lo2, hi2 = d[f"ci{round(100 * (1 - 2 * alpha))}_points"]
    if lo > 0:
        return "better"
    if hi < 0:
        return "worse"
    if -margin < lo2 and hi2 < margin:
        return "equivalent"
    mean = d["mean_points"]
    return "inconclusive, " + ("leaning above" if mean > 0 else "leaning below" if mean < 0 else "level")


def preregistered_compute(table: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any] | None:
    """Exactly the analyses of :data:`PREREGISTERED_COMPUTE` over the seeds that hold its three methods (None when
    fewer than two seeds do): the primary paired test with its verdict (:func:`compute_verdict`); the secondary
    paired test (``significant``: p below alpha); the CPU-seconds ratio to GRPO per seed, its mean with the 95% t
    interval, and ``equal_compute``: the mean inside the plan's range."""
    plan = PREREGISTERED_COMPUTE
    methods = {*plan["primary"], *plan["secondary"]}
    seeds = shared(table, *methods)
    if len(seeds) < 2:
        return None
    sub = {s: table[s] for s in seeds}
    alpha, margin = plan["alpha"], plan["margin_points"]
    primary = paired_test(sub, *plan["primary"], alpha=alpha)
    secondary = paired_test(sub, *plan["secondary"], alpha=alpha)
    time = ratio(sub, *plan["primary"], plan["time_key"])
    low, high = plan["equal_compute"]
    return {
        "plan": plan["plan"], "kind": "compute", "seeds": seeds, "alpha": alpha, "margin_points": margin,
        "primary": {**primary, "verdict": compute_verdict(primary, alpha=alpha, margin=margin)},
        "secondary": {**secondary, "significant": secondary["p"] < alpha},
        "compute": {**time, "key": plan["time_key"], "range": [low, high],
                    "equal_compute": low <= time["mean"] <= high},
    }  # fmt: skip


def preregistered(table: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any] | None:
    """The pre-registered analyses the rows hold: issue 52's (:func:`preregistered_compute`) when they hold its
    methods, else exactly those of :data:`PREREGISTERED` over the seeds that hold all three methods (None when no
    two seeds do): the primary test's ``p`` and whether it is below alpha; the secondary's interval and whether it
    lies inside the margin (``equivalent``)."""
    if (compute := preregistered_compute(table)) is not None:
        return compute
    plan = PREREGISTERED
    methods = {*plan["primary"], *plan["secondary"]}
    if len(shared(table, *methods)) < 2:
        return None
    sub = {s: table[s] for s in shared(table, *methods)}
    alpha, margin = plan["alpha"], plan["margin_points"]
    primary = paired_test(sub, *plan["primary"], alpha=alpha)
    secondary = paired_test(sub, *plan["secondary"], alpha=alpha)
    lo, hi = secondary[f"ci{round(100 * (1 - 2 * alpha))}_points"]
    return {
        "plan": "docs/results.md, Pre-registered confirmation (issue 41)", "seeds": list(sub), "alpha": alpha,
        "margin_points": margin,
        "primary": {**primary, "significant": primary["p"] < alpha},
        "secondary": {**secondary, "equivalent": -margin < lo and hi < margin},
    }  # fmt: skip


def summarise(rows: Sequence[dict[str, Any]], *, cppo: str | None = None, time: str = "cpu") -> dict[str, Any]:
    """The run's summary (``cppo``: the CPPO method to compare, by default the rows' only pooled CPPO with
    allocation, ``CPPO P=...``): per method the seeds' accuracies and seconds (means with t intervals, over the seeds
    that ran it); the paired accuracy differences, over the seeds each pair shares, of CPPO against every other
    method and of every other method against GRPO; every method's CPU-time, wall-time and training-time ratios to
    GRPO (``time``: which of the first two the target uses, :data:`TIME_BASES`); :func:`preregistered`; and
    the issue's target (CPPO - GRPO's interval includes 0 or lies above it; at most half GRPO's wall time; above
    random pruning: CPPO - random's mean above 0, "clearly" when its interval is)."""
    time_key = time_basis(rows, time)
    table = by_seed(rows)
    methods = sorted({m for runs in table.values() for m in runs})
    if "GRPO" not in methods and dynamic_pairs(table):  # issue 30's benchmark: the pairs alone
        return dynamic_summary(table, methods)
    from sweeps.stop import stop_pairs, stop_summary  # issue 38's pairs (sweeps.stop imports this module)

    stop = stop_pairs(table)
    found = [m for m in methods if m.startswith("CPPO P=") and not m.endswith(" no allocation") and "epochs" not in m
             and not any(f" + {k}=" in m for k in AHEAD_DEFAULTS)]  # fmt: skip
    if stop and cppo is None and not found:  # issue 38's benchmark: the pairs (and GRPO) alone
        return stop_summary(table, methods, stop)
    if cppo is None:  # the one pooled CPPO run with allocation
        cppo = (
            found[0] if len(found) == 1
            else f"one CPPO rate (found {found}: name one)" if found
            else "a pooled CPPO row with allocation (arm cppo-pooled; a --with file may hold them)"
        )  # fmt: skip
    if cppo not in methods or "GRPO" not in methods or not shared(table, cppo, "GRPO"):
        raise ValueError(f"the rows need GRPO and {cppo} on a seed they share, got {methods} over seeds {list(table)}")
    per_method = {
        m: {"seeds": shared(table, m)}
        | {key: mean_interval([table[s][m][key] for s in shared(table, m)])
           for key in ("accuracy_after", "total_seconds", "train_seconds", *(("cpu_seconds",) if time == "cpu" else ()))
           }
        for m in methods
    }  # fmt: skip
    pairs = [(cppo, m) for m in methods if m != cppo] + [(m, "GRPO") for m in methods if m not in (cppo, "GRPO")]
    diffs = {f"{a} - {b}": paired(table, a, b, "accuracy_after") for a, b in pairs if shared(table, a, b)}
    times = {
        m: {"total": ratio(table, m, "GRPO", "total_seconds"), "train": ratio(table, m, "GRPO", "train_seconds")}
        | ({"cpu": ratio(table, m, "GRPO", "cpu_seconds")} if time == "cpu" else {})
        for m in methods
        if m != "GRPO" and shared(table, m, "GRPO")
    }
    chosen = times[cppo]["cpu" if time == "cpu" else "total"]
    return {
        "seeds": list(table),
        "methods": methods,
        "cppo": cppo,
        "interval": "95% Student t over the seeds each statistic shares (df = seeds - 1) of the per-seed values or "
        "paired differences; signs: seeds on which the difference is positive / negative / zero",
        "per_method": per_method,
        "accuracy_differences": diffs,
        "time_basis": f"{time_key}: the target's and time_ratio_total's ratios to GRPO (the whole run's "
        f"{'process CPU' if time == 'cpu' else 'wall'} seconds, evaluation excluded)",
        "time_ratios": times,
        "time_ratio_total": chosen,
        "time_ratio_train": times[cppo]["train"],
        "target": target(cppo, diffs, chosen),
        **({"dynamic": dynamic_pairs(table)} if dynamic_pairs(table) else {}),
        **({"stop": stop} if stop else {}),
        **({"preregistered": pre} if (pre := preregistered(table)) else {}),
    }


def time_basis(rows: Sequence[dict[str, Any]], time: str) -> str:
    """The rows' key of the seconds ``time`` names (:data:`TIME_BASES`); ValueError for another ``time`` or where a
    row lacks them."""
    if time not in TIME_BASES:
        raise ValueError(f"--time must be one of {sorted(TIME_BASES)}, got {time!r}")
    time_key = TIME_BASES[time]
    lacking = sorted({method(r) for r in rows if r.get(time_key) is None})
    if lacking:
        raise ValueError(f"--time {time}: rows of {lacking} have no {time_key} (--time wall uses their wall seconds)")
    return time_key


def target(cppo: str, diffs: dict[str, dict[str, Any]], chosen: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's target for ``cppo`` from the paired accuracy differences and its chosen time ratio to GRPO: within
    GRPO (the interval of CPPO - GRPO includes 0 or lies above it), at most half GRPO's time, above random pruning."""
    within = diffs[f"{cppo} - GRPO"]
    random_key = next((k for k in diffs if k == f"{cppo} - random " + cppo.removeprefix("CPPO ")), None)
    return {
        "within_grpo": within["ci95"] is not None and within["ci95"][1] >= 0.0,
        "at_most_half_the_time": chosen["mean"] <= TARGET_TIME_RATIO,
        "above_random": None if random_key is None else diffs[random_key]["mean"] > 0.0,
        "clearly_above_random": None if random_key is None else bool((diffs[random_key]["ci95"] or [0])[0] > 0.0),
    }


def dynamic_pairs(table: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Issue 30's comparison for every method ``M + filter_groups + greso`` whose plain ``M`` ran on a shared seed:
    per method the completions generated, whole-run seconds and trained rows with A = 0 (means over its seeds); the
    paired accuracy difference (with both - plain) and whole-run time ratio; the target (the difference's 95%
    interval holds 0, and at most :data:`TARGET_DYNAMIC_TIME_RATIO` of plain's time)."""
    methods = {m for runs in table.values() for m in runs}
    out = {}
    for dyn in sorted(m for m in methods if m.endswith(DYNAMIC)):
        plain = dyn.removesuffix(DYNAMIC)
        if plain not in methods or not shared(table, dyn, plain):
            continue
        diff, time = paired(table, dyn, plain, "accuracy_after"), ratio(table, dyn, plain, "total_seconds")
        keys = ("completions", "total_seconds", "kept_zero_advantage", "greso_questions_skipped", "steps")
        out[f"{dyn} vs {plain}"] = {
            "methods": {m: per_method_means(table, m, keys) for m in (plain, dyn)},
            "accuracy_difference": diff, "time_ratio": time,
            "target": {
                "same_accuracy": diff["ci95"] is not None and diff["ci95"][0] <= 0.0 <= diff["ci95"][1],
                "at_most_0.7x_time": time["mean"] <= TARGET_DYNAMIC_TIME_RATIO,
            },
        }  # fmt: skip
    return out


def dynamic_summary(table: dict[int, dict[str, dict[str, Any]]], methods: list[str]) -> dict[str, Any]:
    """The summary of rows without GRPO that hold issue 30's pairs: :func:`summarise`'s keys (no time ratios to
    GRPO), the accuracy differences being the pairs', ``dynamic``: :func:`dynamic_pairs`."""
    dyn = dynamic_pairs(table)
    return {
        "seeds": list(table), "methods": methods, "cppo": None,
        "interval": "95% Student t over the seeds each statistic shares (df = seeds - 1) of the per-seed values or "
        "paired differences; signs: seeds on which the difference is positive / negative / zero",
        "per_method": {m: per_method_means(table, m, ("accuracy_after", "total_seconds", "train_seconds"))
                       for m in methods},
        "accuracy_differences": {f"{d['accuracy_difference']['a']} - {d['accuracy_difference']['b']}":
                                 d["accuracy_difference"] for d in dyn.values()},
        "time_ratios": {}, "dynamic": dyn, "target": {name: d["target"] for name, d in dyn.items()},
    }  # fmt: skip


def format_dynamic(dynamic: dict[str, Any]) -> list[str]:
    """Issue 30's table: per method of each pair, its means over seeds; then the pair's difference and time ratio."""
    lines = [
        "",
        "| method | seeds | steps | completions generated | whole-run s | trained rows with A = 0 | GRESO skips |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d in dynamic.values():
        for m, pm in d["methods"].items():
            cells = [format_mean(pm.get(k)) for k in ("steps", "completions", "total_seconds", "kept_zero_advantage",
                                                "greso_questions_skipped")]  # fmt: skip
            lines.append(f"| {m} | {len(pm['seeds'])} | " + " | ".join(cells) + " |")
    lines += ["", "| pair | seeds | accuracy difference, points (95%) | whole-run time ratio (95%) | target |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, d in dynamic.items():
        diff, t = d["accuracy_difference"], d["time_ratio"]
        ci = "-" if t["ci95"] is None else f"[{t['ci95'][0]:.3f}, {t['ci95'][1]:.3f}]"
        lines.append(f"| {name} | {diff['n']} | {100 * diff['mean']:+.1f} {format_interval(diff['ci95'])} "
                     f"| {t['mean']:.3f} {ci} | {d['target']} |")  # fmt: skip
    return lines


def format_summary(summary: dict[str, Any], table: dict[int, dict[str, dict[str, Any]]]) -> str:
    """The pre-registered analyses first (when the rows hold them), then a Markdown table of accuracy and time per
    method and seed (``-``: not run on that seed; in the summary's time basis, :func:`summarise`'s ``time``: the
    process's CPU seconds, else the wall seconds, which a shared machine's load inflates), the paired differences
    with their seeds, intervals and signs, and the time ratios to GRPO."""
    seeds, methods = summary["seeds"], summary["methods"]
    lines = [*format_preregistered(summary["preregistered"]), ""] if summary.get("preregistered") else []
    cpu = "cpu_seconds" in summary["per_method"][methods[0]]  # summarise keeps them exactly when time == "cpu"
    key, unit = ("cpu_seconds", "CPU s") if cpu else ("total_seconds", "wall s")
    head = (
        "| method | "
        + " | ".join(f"seed {s}: accuracy, {unit}" for s in seeds)
        + f" | seeds | mean accuracy | mean {unit} |"
    )
    lines += [head, "|" + " --- |" * (len(seeds) + 4)]
    for m in methods:
        cells = [f"{100 * table[s][m]['accuracy_after']:.1f}%, {table[s][m][key]:.0f}" if m in table[s] else "-"
                 for s in seeds]  # fmt: skip
        pm = summary["per_method"][m]
        lines.append(
            f"| {m} | " + " | ".join(cells) + f" | {len(pm['seeds'])} | {100 * pm['accuracy_after']['mean']:.1f}% | "
            f"{pm[key]['mean']:.0f} |"
        )
    lines += [
        "",
        "| paired difference (points) | seeds | per seed | mean | 95% interval | seeds +/-/= |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, d in summary["accuracy_differences"].items():
        per = ", ".join(f"{100 * v:+.1f}" for v in d["per_seed"].values())
        lines.append(
            f"| {name} | {d['n']} | {per} | {100 * d['mean']:+.1f} | {format_interval(d['ci95'])} | {format_signs(d)} |"
        )
    timed = summary["time_ratios"] or not summary.get("stop")  # issue 38's rows without GRPO: no table
    lines += [
        "",
        "| time / GRPO's | seeds | CPU seconds, mean (95% interval) | wall, mean (95% interval) | wall of the summed "
        "seconds | training wall |",
        "| --- | --- | --- | --- | --- | --- |",
    ] if timed else []  # fmt: skip

    def mean_ci(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        return f"{r['mean']:.3f}" + ("" if r["ci95"] is None else f" [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]")

    for m, t in summary["time_ratios"].items():
        total, train = t["total"], t["train"]
        lines.append(
            f"| {m} | {total['n']} | {mean_ci(t.get('cpu'))} | {mean_ci(total)} | {total['of_sums']:.3f} | "
            f"{train['mean']:.3f} |"
        )
    lines += format_dynamic(summary["dynamic"]) if summary.get("dynamic") else []
    if summary.get("stop"):
        from sweeps.stop import format_stop

        lines += format_stop(summary["stop"])
    if summary["cppo"] or not summary.get("stop"):  # issue 38's alone: format_stop gave each group's target
        lines.append(f"\ntarget ({summary['cppo'] or 'issue 30'}): {summary['target']}")
    return "\n".join(lines)


def format_preregistered(pre: dict[str, Any]) -> list[str]:
    """The pre-registered analyses (:func:`preregistered`) as a Markdown table, reported before anything else."""
    a = round(100 * (1 - pre["alpha"]))
    b = round(100 * (1 - 2 * pre["alpha"]))
    lines = [
        f"pre-registered ({pre['plan']}), seeds {pre['seeds'][0]}-{pre['seeds'][-1]} ({len(pre['seeds'])}):",
        "",
        f"| comparison (points) | seeds | mean | {a}% interval | {b}% interval | t (df) | p | seeds +/-/= | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, d in (("primary", pre["primary"]), ("secondary", pre["secondary"])):
        ci_a, ci_b = d[f"ci{a}_points"], d[f"ci{b}_points"]
        verdict = (
            d["verdict"] if "verdict" in d
            else f"p {'<' if d['significant'] else '>='} {pre['alpha']}" if "significant" in d
            else f"{b}% interval {'inside' if d['equivalent'] else 'not inside'} +-{pre['margin_points']:g}"
        )  # fmt: skip
        lines.append(
            f"| {name}: {d['a']} - {d['b']} | {d['n']} | {d['mean_points']:+.2f} | [{ci_a[0]:+.2f}, {ci_a[1]:+.2f}] "
            f"| [{ci_b[0]:+.2f}, {ci_b[1]:+.2f}] | {d['t']:.2f} ({d['df']}) | {d['p']:.3f} | {format_signs(d)} "
            f"| {verdict} |"
        )
    if "compute" in pre:
        c = pre["compute"]
        ci = "-" if c["ci95"] is None else f"[{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]"
        low, high = c["range"]
        lines += [
            "",
            f"compute: {c['a']} / {c['b']} ({c['key']}), seeds {c['n']}: mean {c['mean']:.3f}, 95% {ci}, "
            f"{'inside' if c['equal_compute'] else 'outside'} the equal-compute range [{low:g}, {high:g}]",
        ]
    return lines


def plot(path: pathlib.Path, summary: dict[str, Any], table: dict[int, dict[str, dict[str, Any]]], meta: dict) -> None:
    """Two panels. Left: final accuracy against whole-run wall time, one small marker per seed and method (95%
    Wilson bar of its own test problems), one large marker per method at its seeds' means with the t interval of
    the mean. Right: every paired accuracy difference, its mean over the seeds the pair shares with the 95% t
    interval, labelled with the seeds and their signs. Issue 38's rows alone: :func:`sweeps.stop.plot_stop`."""
    if summary.get("stop") and summary["cppo"] is None:
        from sweeps.stop import plot_stop

        return plot_stop(path, summary, table, meta)
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14.0, 5.5), gridspec_kw={"width_ratios": [1.25, 1.0]})
    for i, m in enumerate(summary["methods"]):
        color = f"C{i}"
        pm = summary["per_method"][m]
        for s in pm["seeds"]:
            r = table[s][m]
            n = r["eval_problems_scored"]
            lo, hi = wilson_interval(round(r["accuracy_after"] * n), n)
            y = 100 * r["accuracy_after"]
            ax.errorbar(r["total_seconds"], y, yerr=[[y - 100 * lo], [100 * hi - y]], color=color, marker="o",
                        markersize=4, capsize=2, alpha=0.45, ls="none")  # fmt: skip
        acc = pm["accuracy_after"]
        ci, mean = acc["ci95"] or [acc["mean"]] * 2, 100 * acc["mean"]
        label = f"{m}: {mean:.1f}% in {pm['total_seconds']['mean']:.0f} s (mean of {acc['n']} seeds)"
        ax.errorbar(pm["total_seconds"]["mean"], mean, yerr=[[mean - 100 * ci[0]], [100 * ci[1] - mean]],
                    color=color, marker="D", markersize=9, capsize=5, ls="none", label=label)  # fmt: skip
    first = next(iter(table[summary["seeds"][0]].values()))
    model = pathlib.Path(str(meta.get("model", "?"))).name
    label_axes(
        ax,
        x="whole-run wall-clock seconds (generation + training; evaluation excluded)",
        y=f"greedy accuracy after training, % of {first['eval_problems']} distinct test problems",
        title="small: one seed (95% Wilson); large: mean over seeds (95% t)",
    )
    fig.suptitle(
        f"{model} on {meta.get('dataset', '?')}: {first['questions']} training questions per seed (other questions "
        f"per seed), G={first['group_size']}",
        fontsize=10,
    )
    diffs = list(summary["accuracy_differences"].items())
    for y, (_, d) in enumerate(reversed(diffs)):
        ci = d["ci95"] or [d["mean"]] * 2
        mean = 100 * d["mean"]
        bx.errorbar(mean, y, xerr=[[mean - 100 * ci[0]], [100 * ci[1] - mean]], color="C0" if d["ci95"] else "C7",
                    marker="D", capsize=4, ls="none")  # fmt: skip
        bx.scatter([100 * v for v in d["per_seed"].values()], [y] * d["n"], color="C7", s=10, alpha=0.6, zorder=3)
    bx.set_yticks(range(len(diffs)))
    names = [name.replace(" - ", "\n- ") for name, _ in reversed(diffs)]  # a pair on two lines: the panel stays wide
    bx.set_yticklabels(
        [f"{n}\n{d['n']} seeds, {format_signs(d)}" for n, (_, d) in zip(names, reversed(diffs))], fontsize=7
    )
    bx.axvline(0.0, color="k", lw=0.8)
    bx.set_xlabel("accuracy difference, points (dots: seeds; diamond: mean, 95% t interval)")
    bx.set_title("paired differences over the seeds each pair shares", fontsize=9)
    bx.grid(alpha=0.3, axis="x")
    save_figure(plt, fig, path)
