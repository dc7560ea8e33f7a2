"""Issue 38's report in a multi-seed accuracy run (pruning while generating: a quality head stops hopeless
completions mid-rollout): for every method ``M + stop R (scorer)`` whose plain ``M`` ran on a shared seed, per
method the means over its seeds (95% t intervals) of the accuracy, the completion tokens generated, the CPU seconds
of generation and of the whole run, the completions stopped and the head's AUC over training; the paired per-seed
accuracy differences and token / CPU ratios against plain ``M`` (and GRPO's, when it ran), the learned head against
the random scorer, and the issue's targets. :mod:`sweeps.report` summarises, prints and plots with it. Nothing here
runs a model.

The head's AUC: the trainer records it per step (``rollout_stop_auc``, None where undefined: a step without both
right and wrong completions among those that ran to the end). Per seed, ``auc`` is the mean over the steps after the
warm-up (the first ``rollout_stop_warmup`` steps stop nothing and only train the head: excluded, the learned head
being untrained at the first), ``auc_last_quarter`` the mean over the last quarter of the steps (at least one; the
head learns online, so its late AUC is the one that tells), ``auc_all`` over every step; None-valued steps are
skipped, and a seed without any defined step has none.

``kept_zero_share``: the share of the completions CPPO kept for the training passes whose advantage is 0 (their
group's survivors all scored alike: they carry no gradient), ``kept_zero_advantage / completions_kept``; stopping
leaves fewer survivors per group, so more groups whose survivors all agree.
"""

from __future__ import annotations

import math
import pathlib
import re
from typing import Any

from benchkit.plots import label_axes, pyplot, save_figure
from endtoend.report import wilson_interval

from cppo.config import rollout_stop_defaults
from sweeps.stats import format_interval, format_signs, mean_interval, paired, per_method_means, ratio, shared

#: A method with issue 38's stopping: ``<plain method> + stop <rate> (<scorer>)`` (:func:`sweeps.report.method`).
STOP = re.compile(r"^(?P<plain>.+) \+ stop (?P<rate>\S+) \((?P<scorer>[\w-]+)\)$")
#: Issue 38's targets: stopping generates at most this share of plain CPPO's completion tokens ...
TARGET_TOKENS_RATIO = 0.6
#: ... in at most this share of its whole-run CPU seconds.
TARGET_CPU_RATIO = 0.7
#: The trainer's ``rollout_stop.warmup`` (a row that does not record its own ran with it; the sweep's files agree).
WARMUP = rollout_stop_defaults()["warmup"]
#: Per method, the row's keys (and derived ones) averaged over its seeds.
KEYS = (
    "accuracy_after",
    "tokens_generate_completion",
    "tokens_generate_prompt",
    "generation_cpu_seconds",
    "cpu_seconds",
    "total_seconds",
    "completions",
    "rollout_stopped",
    "kept_zero_share",
    "auc",
    "auc_last_quarter",
    "auc_all",
)


def auc_means(row: dict[str, Any]) -> dict[str, float | None]:
    """The row's head AUC over training (module doc): ``auc`` (after the warm-up), ``auc_last_quarter``, ``auc_all``;
    None where no step of the span has one (or the row has no head)."""
    steps = [None if v is None or math.isnan(v) else float(v) for v in row.get("rollout_stop_auc") or []]
    warmup = row.get("rollout_stop_warmup", WARMUP)
    quarter = max(1, math.ceil(len(steps) / 4))

    def mean(values: list[float | None]) -> float | None:
        defined = [v for v in values if v is not None]
        return sum(defined) / len(defined) if defined else None

    return {"auc": mean(steps[warmup:]), "auc_last_quarter": mean(steps[max(warmup, len(steps) - quarter) :]),
            "auc_all": mean(steps)}  # fmt: skip


def derived(row: dict[str, Any]) -> dict[str, Any]:
    """The row with ``generation_cpu_seconds`` (``phase_cpu_seconds["generation"]``), ``kept_zero_share`` (module
    doc; None without the counts) and :func:`auc_means`."""
    generation = (row.get("phase_cpu_seconds") or {}).get("generation")
    kept, zero = row.get("completions_kept"), row.get("kept_zero_advantage")
    share = zero / kept if kept and zero is not None else None
    return {**row, "generation_cpu_seconds": generation, "kept_zero_share": share, **auc_means(row)}


def _having(table: dict[int, dict[str, dict[str, Any]]], key: str, *methods: str) -> dict:
    """The seeds of ``table`` that hold every one of ``methods`` with ``key`` not None."""
    return {s: table[s] for s in shared(table, *methods) if all(table[s][m].get(key) is not None for m in methods)}


def _paired(table: dict, a: str, b: str, key: str) -> dict[str, Any] | None:
    """:func:`sweeps.report.paired` over the seeds where both hold ``key`` (None without one)."""
    sub = _having(table, key, a, b)
    return paired(sub, a, b, key) if sub else None


def _ratio(table: dict, a: str, b: str, key: str) -> dict[str, Any] | None:
    """:func:`sweeps.report.ratio` over the seeds where both hold ``key`` (None without one)."""
    sub = _having(table, key, a, b)
    return ratio(sub, a, b, key) if sub else None


def _holds_zero(d: dict[str, Any] | None) -> bool | None:
    return None if d is None or d["ci95"] is None else d["ci95"][0] <= 0.0 <= d["ci95"][1]


def _above(d: dict[str, Any] | None, *, clearly: bool = False) -> bool | None:
    if d is None:
        return None
    return bool(d["ci95"] is not None and d["ci95"][0] > 0.0) if clearly else d["mean"] > 0.0


def _at_most(r: dict[str, Any] | None, limit: float) -> bool | None:
    return None if r is None else r["mean"] <= limit


def compare(table: dict, a: str, b: str) -> dict[str, Any]:
    """``a`` against ``b`` on the seeds they share: the paired accuracy difference ``a - b`` and the per-seed ratios
    ``a / b`` of the completion tokens generated, the generation CPU seconds, the whole run's CPU and wall seconds."""
    return {
        "a": a, "b": b, "seeds": shared(table, a, b), "accuracy_difference": _paired(table, a, b, "accuracy_after"),
        "tokens_ratio": _ratio(table, a, b, "tokens_generate_completion"),
        "generation_cpu_ratio": _ratio(table, a, b, "generation_cpu_seconds"),
        "cpu_ratio": _ratio(table, a, b, "cpu_seconds"), "wall_ratio": _ratio(table, a, b, "total_seconds"),
    }  # fmt: skip


def stop_pairs(table: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Issue 38's comparison (``{"M + stop R": ...}``) for every method ``M + stop R (scorer)`` whose plain ``M`` ran
    on a seed it shares: ``methods``, per method (plain, each scorer's, GRPO's when it ran) the means over its seeds
    (:data:`KEYS`, 95% t intervals); ``pairs``, each stop method against plain (:func:`compare`, with its target:
    tokens at most :data:`TARGET_TOKENS_RATIO`, whole-run CPU at most :data:`TARGET_CPU_RATIO`, the accuracy
    difference's 95% interval holding 0, None with one seed); ``learned_vs_random``: the paired accuracy and AUC
    differences learned - random; ``against_grpo``: plain's and each stop method's :func:`compare` to GRPO; and
    ``target``: the learned pair's and whether the learned head beats the random scorer on accuracy or on AUC (mean
    difference above 0; ``clearly``: its 95% interval above 0)."""
    table = {s: {m: derived(r) for m, r in runs.items()} for s, runs in table.items()}
    methods = {m for runs in table.values() for m in runs}
    groups: dict[str, dict[str, str]] = {}
    for m in sorted(methods):
        match = STOP.match(m)
        if match and match["plain"] in methods and shared(table, m, match["plain"]):
            groups.setdefault(m.rsplit(" (", 1)[0], {})[match["scorer"]] = m
    out = {}
    for name, stops in groups.items():
        plain = STOP.match(next(iter(stops.values())))["plain"]
        grpo = "GRPO" if "GRPO" in methods else None
        shown = [plain, *stops.values(), *([grpo] if grpo else [])]
        pairs = {}
        for stop in stops.values():
            pair = compare(table, stop, plain)
            pair["target"] = {
                "tokens_at_most_0.6x": _at_most(pair["tokens_ratio"], TARGET_TOKENS_RATIO),
                "cpu_at_most_0.7x": _at_most(pair["cpu_ratio"], TARGET_CPU_RATIO),
                "accuracy_interval_holds_0": _holds_zero(pair["accuracy_difference"]),
            }
            pairs[f"{stop} vs {plain}"] = pair
        learned, rand = stops.get("learned"), stops.get("random")
        versus = None
        if learned and rand and shared(table, learned, rand):
            versus = compare(table, learned, rand) | {
                "auc_difference": _paired(table, learned, rand, "auc"),
                "auc_last_quarter_difference": _paired(table, learned, rand, "auc_last_quarter"),
            }
        learned_target = pairs[f"{learned} vs {plain}"]["target"] if learned else {}
        acc, auc = (versus or {}).get("accuracy_difference"), (versus or {}).get("auc_difference")
        target = {
            **{k: learned_target.get(k) for k in ("tokens_at_most_0.6x", "cpu_at_most_0.7x",
                                                   "accuracy_interval_holds_0")},
            "learned_beats_random_on_accuracy": _above(acc), "learned_clearly_beats_random_on_accuracy":
            _above(acc, clearly=True), "learned_beats_random_on_auc": _above(auc),
            "learned_clearly_beats_random_on_auc": _above(auc, clearly=True),
        }  # fmt: skip
        out[name] = {
            "plain": plain, "stops": stops, "grpo": grpo,
            "warmup_steps": sorted({table[s][m].get("rollout_stop_warmup", WARMUP) for m in stops.values()
                                    for s in shared(table, m)}),
            "methods": {m: {"seeds": shared(table, m)} | {k: mean_interval(v) for k in KEYS
                                                         if (v := [table[s][m][k] for s in shared(table, m)
                                                                   if table[s][m].get(k) is not None])}
                        for m in shown},
            "pairs": pairs, "learned_vs_random": versus,
            "against_grpo": {f"{m} vs GRPO": compare(table, m, grpo) for m in (plain, *stops.values())
                             if grpo and shared(table, m, grpo)},
            "target": target,
        }  # fmt: skip
    return out


def stop_summary(table: dict[int, dict[str, dict[str, Any]]], methods: list[str], stop: dict) -> dict[str, Any]:
    """The summary of rows that hold issue 38's pairs but no pooled CPPO: :func:`sweeps.report.summarise`'s keys,
    the accuracy differences being each stop method's against plain, learned - random's and every method's against
    GRPO (when it ran), the time ratios GRPO's, ``stop``: :func:`stop_pairs`."""
    diffs, times = {}, {}
    for group in stop.values():
        comparisons = [*group["pairs"].values(), *([group["learned_vs_random"]] if group["learned_vs_random"] else []),
                       *group["against_grpo"].values()]  # fmt: skip
        for c in comparisons:
            if c["accuracy_difference"] is not None:
                diffs[f"{c['a']} - {c['b']}"] = c["accuracy_difference"]
    if "GRPO" in methods:
        for m in methods:
            if m != "GRPO" and shared(table, m, "GRPO"):
                keys = {"total": "total_seconds", "train": "train_seconds", "cpu": "cpu_seconds"}
                found = {k: _ratio(table, m, "GRPO", key) for k, key in keys.items()}
                if found["total"] is not None and found["train"] is not None:  # as format_summary prints them
                    times[m] = found
    per_method = {m: per_method_means(table, m, ("accuracy_after", "total_seconds", "train_seconds", "cpu_seconds"))
                  for m in methods}  # fmt: skip
    return {
        "seeds": list(table), "methods": methods, "cppo": None,
        "interval": "95% Student t over the seeds each statistic shares (df = seeds - 1) of the per-seed values, "
        "paired differences or ratios; signs: seeds on which the difference is positive / negative / zero",
        "per_method": per_method, "accuracy_differences": diffs, "time_ratios": times, "stop": stop,
        "target": {name: group["target"] for name, group in stop.items()},
    }  # fmt: skip


def _fewer(d: dict[str, Any], of: int | None) -> str:
    """`` (n of N seeds)`` when the statistic covers fewer seeds than the ``of`` its table's seeds column shows (a
    seed whose row lacks the value is skipped: said, not hidden)."""
    return f" ({d['n']} of {of} seeds)" if of is not None and d["n"] < of else ""


def _num(d: dict[str, Any] | None, scale: float = 1.0, fmt: str = ".0f", unit: str = "", of: int | None = None) -> str:
    """``mean [lo, hi]`` of a :func:`mean_interval` (``-`` without one; no interval with one seed; :func:`_fewer`)."""
    if d is None:
        return "-"
    ci = "" if d["ci95"] is None else f" [{scale * d['ci95'][0]:{fmt}}, {scale * d['ci95'][1]:{fmt}}]"
    return f"{scale * d['mean']:{fmt}}{unit}{ci}{_fewer(d, of)}"


def _diff(d: dict[str, Any] | None, points: bool = True, of: int | None = None) -> str:
    """A paired difference: mean, 95% interval and signs (accuracy in points; AUC as is; :func:`_fewer`)."""
    if d is None:
        return "-"
    if points:
        return f"{100 * d['mean']:+.1f} {format_interval(d['ci95'])}, {format_signs(d)}{_fewer(d, of)}"
    ci = "-" if d["ci95"] is None else f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"
    return f"{d['mean']:+.3f} {ci}, {format_signs(d)}{_fewer(d, of)}"


def _yes(value: bool | None) -> str:
    return "?" if value is None else "yes" if value else "NO"


def _verdict(target: dict[str, bool | None]) -> str:
    """A pair's target in words: ``tokens <= 0.6x: yes; CPU <= 0.7x: NO; interval holds 0: yes``."""
    words = {"tokens_at_most_0.6x": f"tokens <= {TARGET_TOKENS_RATIO:g}x", "cpu_at_most_0.7x":
             f"CPU <= {TARGET_CPU_RATIO:g}x", "accuracy_interval_holds_0": "interval holds 0"}  # fmt: skip
    return "; ".join(f"{words[k]}: {_yes(v)}" for k, v in target.items())


def format_stop(stop: dict[str, Any]) -> list[str]:
    """Issue 38's two tables: per method its means over seeds (95% t intervals); then each comparison's paired
    accuracy difference, ratios and target; then each group's target in words."""
    lines = [
        "",
        "| method | seeds | accuracy, % | completion tokens generated | generation CPU s | whole-run CPU s | "
        "completions stopped | kept with zero advantage, % | head AUC after warm-up | AUC, last quarter of steps |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for group in stop.values():
        for m, pm in group["methods"].items():
            n = len(pm["seeds"])
            cells = [_num(pm.get("accuracy_after"), 100, ".1f", of=n),
                     *(_num(pm.get(k), of=n) for k in ("tokens_generate_completion", "generation_cpu_seconds",
                                                       "cpu_seconds", "rollout_stopped")),
                     _num(pm.get("kept_zero_share"), 100, ".1f", of=n), _num(pm.get("auc"), fmt=".3f", of=n),
                     _num(pm.get("auc_last_quarter"), fmt=".3f", of=n)]  # fmt: skip
            lines.append(f"| {m} | {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| comparison (a vs b) | seeds | accuracy a - b, points (95%), seeds +/-/= | completion tokens a / b | "
        "generation CPU a / b | whole-run CPU a / b | head AUC a - b (after warm-up; last quarter) | target |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for group in stop.values():
        versus = group["learned_vs_random"]
        rows = [(name, pair, _verdict(pair["target"])) for name, pair in group["pairs"].items()]
        if versus:
            t = group["target"]
            rows.append((f"{versus['a']} vs {versus['b']}", versus, "; ".join(
                f"beats random on {what}: {_yes(t[f'learned_beats_random_on_{key}'])}"
                + (" (clearly)" if t[f"learned_clearly_beats_random_on_{key}"] else "")
                for what, key in (("accuracy", "accuracy"), ("AUC", "auc")))))  # fmt: skip
        rows += [(name, c, "-") for name, c in group["against_grpo"].items()]
        for name, c, target in rows:
            n = len(c["seeds"])
            auc = "-" if "auc_difference" not in c else "; ".join(
                _diff(c[k], False, n) for k in ("auc_difference", "auc_last_quarter_difference"))  # fmt: skip
            ratios = [_num(c[k], fmt=".3f", of=n) for k in ("tokens_ratio", "generation_cpu_ratio", "cpu_ratio")]
            lines.append(f"| {name} | {n} | {_diff(c['accuracy_difference'], of=n)} | " + " | ".join(ratios)
                         + f" | {auc} | {target} |")  # fmt: skip
    for name, group in stop.items():
        lines.append(f"\ntarget ({name}; warm-up steps {group['warmup_steps']} left out of the AUC): {group['target']}")
        t = group["target"]
        if group["learned_vs_random"] is None:
            lines.append("the learned head has no random-scorer run on a shared seed to be compared with")
        elif not (t["learned_beats_random_on_accuracy"] or t["learned_beats_random_on_auc"]):
            lines.append("the learned head does NOT beat the random scorer: neither on accuracy nor on AUC (means of "
                         "the paired differences at or below 0)")  # fmt: skip
    return lines


def auc_curve(table: dict, m: str) -> list[float | None]:
    """Per step the mean over the seeds of ``m``'s ``rollout_stop_auc`` where defined (None where no seed has one)."""
    curves = [table[s][m].get("rollout_stop_auc") or [] for s in shared(table, m)]
    out = []
    for i in range(max(map(len, curves), default=0)):
        values = [c[i] for c in curves if i < len(c) and c[i] is not None and not math.isnan(c[i])]
        out.append(sum(values) / len(values) if values else None)
    return out


def plot_stop(path: pathlib.Path, summary: dict[str, Any], table: dict, meta: dict) -> None:
    """Two panels. Left: final accuracy against whole-run CPU seconds, one small marker per seed and method (95%
    Wilson bar of its test problems), one large per method at its seeds' means (95% t intervals both ways). Right:
    each stop method's head AUC per step, the mean over its seeds (thin: each seed), the warm-up shaded."""
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14.0, 5.5), gridspec_kw={"width_ratios": [1.25, 1.0]})
    shown = list(dict.fromkeys(m for group in summary["stop"].values() for m in group["methods"]))
    for i, m in enumerate(shown):
        color, seeds = f"C{i}", shared(table, m)
        for s in seeds:
            r = table[s][m]
            n = r.get("eval_problems_scored") or 1
            lo, hi = wilson_interval(round(r["accuracy_after"] * n), n)
            y = 100 * r["accuracy_after"]
            ax.errorbar(r["cpu_seconds"], y, yerr=[[y - 100 * lo], [100 * hi - y]], color=color, marker="o",
                        markersize=4, capsize=2, alpha=0.45, ls="none")  # fmt: skip
        acc, cpu = (mean_interval([table[s][m][k] for s in seeds]) for k in ("accuracy_after", "cpu_seconds"))
        y, x = 100 * acc["mean"], cpu["mean"]
        yci, xci = acc["ci95"] or [acc["mean"]] * 2, cpu["ci95"] or [x, x]
        ax.errorbar(x, y, yerr=[[y - 100 * yci[0]], [100 * yci[1] - y]], xerr=[[x - xci[0]], [xci[1] - x]],
                    color=color, marker="D", markersize=9, capsize=5, ls="none",
                    label=f"{m}: {y:.1f}% in {x:.0f} CPU s (mean of {acc['n']} seeds)")  # fmt: skip
    first = next(iter(table[summary["seeds"][0]].values()))
    label_axes(ax, x="whole-run CPU seconds of the process (generation + training; evaluation excluded)",
               y=f"greedy accuracy after training, % of {first.get('eval_problems', '?')} test problems",
               title="small: one seed (95% Wilson); large: mean over seeds (95% t)")  # fmt: skip
    warmup = 0
    for group in summary["stop"].values():
        warmup = max(warmup, *group["warmup_steps"], 0)
        for m in group["stops"].values():
            color = f"C{shown.index(m)}"
            for s in shared(table, m):
                auc = [float("nan") if v is None else v for v in table[s][m].get("rollout_stop_auc") or []]
                bx.plot(range(len(auc)), auc, color=color, lw=0.6, alpha=0.3, marker=".", ms=3)
            curve = [float("nan") if v is None else v for v in auc_curve(table, m)]
            bx.plot(range(len(curve)), curve, color=color, lw=2.0, marker="o", ms=4, label=f"{m} (mean over seeds)")
    if warmup:
        bx.axvspan(-0.5, warmup - 0.5, color="C7", alpha=0.15, label=f"warm-up ({warmup} steps: nothing stopped)")
    bx.axhline(0.5, color="k", lw=0.8, ls="--")
    label_axes(bx, x="training step", y="head AUC (completions that ran to the end; 0.5: chance)",
               title="the quality head's AUC per step (undefined steps left out)")  # fmt: skip
    model = pathlib.Path(str(meta.get("model", "?"))).name
    fig.suptitle(f"{model} on {meta.get('dataset', '?')}: pruning while generating (issue 38), "
                 f"{first.get('questions', '?')} training questions per seed, G={first.get('group_size', '?')}",
                 fontsize=10)  # fmt: skip
    save_figure(plt, fig, path)
