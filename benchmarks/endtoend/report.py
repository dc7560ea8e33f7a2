"""The result rows and the report of ``benchmarks/speedup.py``: pure functions of what the runs measured.

Phase seconds summed over a run, the rows with their speedups (:func:`build_rows`), the accuracy columns (Wilson
intervals, the curve, the time to reach the lower end of GRPO's final 95% interval), the Markdown tables,
``NAME.json``, the two PNGs, and where and how the numbers were measured (:func:`collect_meta`). Nothing here trains
or times anything; every file is written atomically through :mod:`cppo.fileio`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

from benchkit.plots import label_axes, pyplot, save_figure

from cppo import TrainConfig, fileio

#: Phase in the results -> (the trainer metric with its seconds in one step, plot label, plot colour): greys for
#: the phases pruning leaves alone, colours for the training phases; ``other`` is the rest of a step's wall clock.
PHASE_TABLE = {
    "generation": ("time/generate", "generation", "#9e9e9e"),
    "reward": ("time/reward", "reward", "#bdbdbd"),
    "selection": ("time/select", "selection", "#e0e0e0"),
    "old_ref_logprobs": ("time/logprobs", "old/ref log-probs", "#1f77b4"),
    "policy_fwd_bwd": ("time/update", "policy fwd+bwd", "#ff7f0e"),
    "optimizer": ("time/optimizer", "optimizer", "#2ca02c"),
    "other": (None, "other", "#d6d6f5"),
}
PHASES = tuple(PHASE_TABLE)
PHASE_METRICS = {phase: metric for phase, (metric, _, _) in PHASE_TABLE.items() if metric}
#: The phases whose work CPPO prunes: their sum is ``train_seconds``.
TRAIN_PHASES = ("old_ref_logprobs", "policy_fwd_bwd", "optimizer")
#: Step metrics summed over a rate's steps (``questions`` is reported as ``questions_seen``).
COUNTERS = ("tokens_trained", "tokens_forward", "completions", "completions_kept", "questions")
#: Counters summed when a step reports them, 0 where one does not (issue 30: trained rows with A = 0, generation
#: calls, GRESO's skips).
OPTIONAL_COUNTERS = {"kept_zero_advantage": "kept_zero_advantage", "generation_calls": "generation_calls",
                     "greso_questions_skipped": "greso/questions_skipped", "rollout_stopped": "rollout_stop/stopped",
                     # tokens per phase (issue 41): generation's prefill and decode, the training passes' prompt and
                     # completion positions
                     **{f"tokens_{k}": f"tokens/{k}" for k in ("generate_prompt", "generate_completion",
                                                              "train_prompt", "train_completion")}}  # fmt: skip
#: Speedups reported by the paper (GSM8K, Qwen2.5-1.5B-Instruct, G = 16, whole training run vs GRPO).
PAPER_SPEEDUP_GSM8K = {0.0: 1.0, 0.5: 1.81, 0.75: 3.27, 0.875: 4.89, 0.9375: 8.32}
#: The standard normal quantile of a two-sided 95% interval.
Z95 = 1.959963984540054


def wilson_interval(correct: int, total: int, *, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``correct / total`` (95% with the default ``z``); ValueError unless
    0 <= correct <= total and total >= 1."""
    if not (total >= 1 and 0 <= correct <= total):
        raise ValueError(f"a proportion needs 0 <= correct <= total and total >= 1, got {correct} / {total}")
    phat, z2 = correct / total, z * z
    centre = (phat + z2 / (2 * total)) / (1 + z2 / total)
    half = z / (1 + z2 / total) * math.sqrt(phat * (1 - phat) / total + z2 / (4 * total * total))
    lo, hi = max(0.0, centre - half), min(1.0, centre + half)
    return 0.0 if correct == 0 else lo, 1.0 if correct == total else hi  # exact at the ends, not 1 - 1e-16


@dataclasses.dataclass(frozen=True)
class EvalPoint:
    """One accuracy measurement of a run: after ``step`` steps and ``train_seconds`` of training wall clock,
    ``correct`` of ``total`` test problems right; ``eval_seconds`` it took (not training time)."""

    train_seconds: float
    step: int
    correct: int
    total: int
    format_rate: float = float("nan")
    eval_seconds: float = 0.0
    distinct: int | None = None  # distinct questions among the ``total`` (None: not counted)
    #: One record per graded completion (:data:`cppo.evaluate.PER_PROBLEM_KEYS`: index, id, sample, correct,
    #: format_ok, completion_tokens); None where the evaluation kept only counts (results written before them).
    per_problem: list[dict[str, Any]] | None = None

    @property
    def accuracy(self) -> float:
        return self.correct / self.total


def time_to_reach(curve: Sequence[EvalPoint], target: float) -> float | None:
    """The training wall seconds of the first point of ``curve`` whose accuracy is at least ``target``; None if none."""
    return next((p.train_seconds for p in curve if p.accuracy >= target), None)


def accuracy_fields(curve: Sequence[EvalPoint], *, target: float | None, grpo_seconds: float) -> dict[str, Any]:
    """A run's accuracy columns from its ``curve`` (the measurement before training first, the end of the run last;
    empty: every column None): before and after with 95% Wilson intervals, the curve as ``[training wall seconds,
    step, accuracy]``, the official format reward's rate, the seconds spent evaluating (before training excluded),
    the time to reach ``target`` (GRPO's final lower 95% bound) in seconds and as a share of ``grpo_seconds``, and
    every point's per-problem records (``eval_per_problem``: ``[{"step", "records"}]``, the points that kept them)."""
    if not curve:
        return dict.fromkeys(ACCURACY_KEYS)
    first, last = curve[0], curve[-1]
    reach = None if target is None else time_to_reach(curve, target)
    return {
        "eval_problems": last.distinct,
        "eval_problems_scored": last.total,
        "accuracy_before": first.accuracy,
        "accuracy_before_ci95": list(wilson_interval(first.correct, first.total)),
        "accuracy_after": last.accuracy,
        "accuracy_after_ci95": list(wilson_interval(last.correct, last.total)),
        "accuracy_curve": [[p.train_seconds, p.step, p.accuracy] for p in curve],
        "format_rate_before": first.format_rate,
        "format_rate_after": last.format_rate,
        "eval_seconds": sum(p.eval_seconds for p in curve[1:]),
        "time_to_grpo_accuracy": reach,
        "time_to_grpo_accuracy_fraction": None if reach is None else _ratio(reach, grpo_seconds),
        "eval_per_problem": [{"step": p.step, "records": p.per_problem} for p in curve if p.per_problem is not None],
    }


#: The columns :func:`accuracy_fields` adds to every row (None without ``--eval``).
ACCURACY_KEYS = (
    "eval_problems", "eval_problems_scored", "accuracy_before", "accuracy_before_ci95", "accuracy_after",
    "accuracy_after_ci95", "accuracy_curve", "format_rate_before", "format_rate_after", "eval_seconds",
    "time_to_grpo_accuracy", "time_to_grpo_accuracy_fraction", "eval_per_problem",
)  # fmt: skip


@dataclasses.dataclass
class RateRun:
    """What one run measured: its planned trainer config, :func:`accumulate`'s sums over its steps and, with
    ``--eval``, its accuracy curve (the shared measurement before training first)."""

    config: TrainConfig
    sums: dict[str, Any]
    setup_seconds: float = 0.0
    cpu_seconds: float = float("nan")
    curve: list[EvalPoint] = dataclasses.field(default_factory=list)
    # cppo.tasks.data.question_id of every training question (None: not read)
    train_question_ids: list[str] | None = None


def accumulate(steps_metrics: Iterable[dict[str, float]], step_walls: Iterable[float]) -> dict[str, Any]:
    """Sums a rate's step metrics (``phase_seconds``, ``total_seconds``, :data:`COUNTERS`; averages ``reward_mean``
    and ``accuracy``). ``other`` is each step's wall clock minus its named phases (never below 0); a phase absent from
    a step's metrics did not run in it (0 s). ValueError when a counter is missing from a step, or a phase from all.
    """
    steps, nan = list(zip(steps_metrics, step_walls, strict=True)), float("nan")
    missing = {k for m, _ in steps for k in COUNTERS if k not in m}
    missing |= {k for k in PHASE_METRICS.values() if steps and not any(k in m for m, _ in steps)}
    if missing:
        raise ValueError(f"train_step metrics lack {sorted(missing)}; the benchmark needs them")
    # a phase a step did not run is absent from its metrics (a batched GRPO step that trains rollouts generated by an
    # earlier step's call): 0 seconds
    phases = {phase: sum(float(m.get(key, 0.0)) for m, _ in steps) for phase, key in PHASE_METRICS.items()}
    phases["other"] = sum(max(0.0, w - sum(float(m.get(k, 0.0)) for k in PHASE_METRICS.values())) for m, w in steps)
    counters = {key: sum(int(round(float(m[key]))) for m, _ in steps) for key in COUNTERS}
    counters |= {name: sum(int(round(float(m.get(key, 0)))) for m, _ in steps)
                 for name, key in OPTIONAL_COUNTERS.items() if steps and any(key in m for m, _ in steps)}  # fmt: skip
    means = {k: sum(float(m.get(k, nan)) for m, _ in steps) / (len(steps) or nan) for k in ("reward_mean", "accuracy")}
    cpu = {phase: sum(float(m.get(key.replace("time/", "time/cpu/"), 0.0)) for m, _ in steps)
           for phase, key in PHASE_METRICS.items()
           if steps and any(key.replace("time/", "time/cpu/") in m for m, _ in steps)}  # fmt: skip
    extra = {"phase_cpu_seconds": cpu} if cpu else {}
    for key in ("rollout_stop/auc", "rollout_stop/brier"):  # the quality head over the run, step by step
        if steps and any(key in m for m, _ in steps):
            extra[key.replace("/", "_")] = [m.get(key) for m, _ in steps]
    return {"phase_seconds": phases, "total_seconds": sum(w for _, w in steps), **counters, **means, **extra}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def build_rows(runs: Sequence[RateRun]) -> list[dict[str, Any]]:
    """Result rows, one per rate, with speedups against the first run (which must be P = 0): :func:`run_row` of each
    run with :func:`relative_fields` against the first run's row.

    - ``keep``, ``kept_per_step``, ``questions_per_step``, ``steps``, ``questions``: the rate's
      ``TrainConfig.pruning.keep`` (per question), ``kept_per_step`` (the step's official count), ``questions_drawn``,
      ``num_steps`` and ``max_questions``; ``questions_seen``: what its steps reported;
    - ``train_seconds``: old/ref log-probs + policy forward/backward + optimizer;
    - ``speedup_train`` / ``speedup_total``: P = 0's train / total seconds over this rate's;
    - ``ideal_speedup_train``: 1 / (1 - P); ``fraction_of_ideal``: speedup_train / ideal;
    - ``amdahl_speedup_total``: Amdahl's law for pruning the training alone: the whole-run speedup if the
      training phases shrank by (1 - P) and everything else cost what it cost at P = 0. A measured speedup above
      it means the unpruned phases got cheaper too (allocation's bigger generation batches);
    - ``speedup_total_cpu``: the same from the process's CPU seconds over the steps, a check on a shared machine
      (other processes' load slows wall clocks, not this process's CPU time; NaN/None where not measured);
    - ``generation_share``: generation seconds / total seconds of this rate;
    - ``paper_speedup_gsm8k``: the paper's reported whole-run speedup at this P (None where it reports none, for an
      ablation, and without allocation: the paper's CPPO always allocates);
    - ``seed``, ``question_seed`` (the seed that drew the training questions), ``train_question_ids``
      (:func:`cppo.tasks.data.question_id` of each), ``allocation``, ``selection_scope``;
    - ``selection_metric``: what the run prunes (``smallest`` |A|: CPPO; ``random`` / ``largest``: ablations);
    - the accuracy columns of :func:`accuracy_fields` (None without an accuracy curve), the time to reach GRPO's
      final accuracy measured against the lower end of its 95% interval.
    """
    if not runs:
        raise ValueError("runs must not be empty")
    if runs[0].config.pruning_rate != 0.0:
        raise ValueError(f"runs[0] must be the P = 0 baseline, got P = {runs[0].config.pruning_rate}")
    rows = [run_row(run) for run in runs]
    return [{**row, **relative_fields(row, rows[0])} for row in rows]


#: The columns of a row measured against the P = 0 row of the same seed and questions (:func:`relative_fields`).
RELATIVE_KEYS = (
    "speedup_train", "speedup_total", "fraction_of_ideal", "speedup_total_cpu", "amdahl_speedup_total",
    "time_to_grpo_accuracy", "time_to_grpo_accuracy_fraction",
)  # fmt: skip


def run_row(run: RateRun) -> dict[str, Any]:
    """One run's row (the columns of :func:`build_rows`) on its own: the columns of :data:`RELATIVE_KEYS` are None
    (:func:`relative_fields` fills them against a P = 0 row)."""
    c, sums, p = run.config, run.sums, run.config.pruning_rate
    phases = {k: float(sums["phase_seconds"].get(k, 0.0)) for k in PHASES}
    total = sums["total_seconds"]
    return {
        "pruning_rate": p, "selection_metric": c.selection_metric, "selection_scope": c.selection_scope,
        "allocation": c.allocation, "seed": c.seed, "question_seed": c.training_question_seed,
        "train_question_ids": run.train_question_ids, "keep": c.pruning.keep,
        "kept_per_step": c.pruning.kept_per_step, "group_size": c.group_size,
        "questions": c.max_questions,
        "questions_seen": sums["questions"], "questions_per_step": c.pruning.questions_drawn,
        "steps": sums.get("steps", c.num_steps), "planned_steps": c.num_steps or c.steps_for(c.max_questions or 1),
        "num_epochs": None if c.num_steps else c.num_epochs, "filter_groups": c.filter_groups, "greso": c.greso,
        "rollout_stop_rate": c.rollout_stop["rate"], "rollout_stop_at": c.rollout_stop["at"],
        "rollout_stop_scorer": c.rollout_stop["scorer"], "steps_per_generation": c.steps_per_generation,
        "max_staleness": c.max_staleness,
        **{k: sums.get(k) for k in OPTIONAL_COUNTERS},
        "phase_seconds": phases, "total_seconds": total, "train_seconds": sum(phases[k] for k in TRAIN_PHASES),
        "setup_seconds": run.setup_seconds, "cpu_seconds": run.cpu_seconds,
        "phase_cpu_seconds": sums.get("phase_cpu_seconds"),  # this process's CPU seconds per phase
        **{k: sums[k] for k in ("rollout_stop_auc", "rollout_stop_brier") if k in sums},
        # each step's wall; a shared vLLM engine's reloads, timed apart (benchmarks/endtoend/runner.py)
        **{k: sums[k] for k in ("step_seconds", "reload_seconds", "reload_cpu_seconds", "reloads") if k in sums},
        **{k: sums[k] for k in COUNTERS[:-1]},
        "speedup_train": None, "speedup_total": None, "ideal_speedup_train": 1.0 / (1.0 - p),
        "fraction_of_ideal": None, "speedup_total_cpu": None, "amdahl_speedup_total": None,
        "generation_share": _ratio(phases["generation"], total),
        "paper_speedup_gsm8k": PAPER_SPEEDUP_GSM8K.get(p)
        if c.selection_metric == "smallest" and (c.allocation or p == 0.0) and c.steps_per_generation == 1
        else None,
        "reward_mean": sums["reward_mean"], "accuracy": sums["accuracy"],
        **accuracy_fields(run.curve, target=None, grpo_seconds=total),
    }  # fmt: skip


def relative_fields(row: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The columns of :data:`RELATIVE_KEYS` of ``row`` against ``base``, the P = 0 row of the same seed and
    questions (``row is base``: GRPO itself, speedups 1). The time to GRPO's accuracy is the training seconds of
    ``row``'s first curve point at or above the lower end of ``base``'s final 95% interval (None without curves)."""
    p, same = row["pruning_rate"], row is base
    base_train, base_total = base["train_seconds"], base["total_seconds"]
    speedup_train = 1.0 if same else _ratio(base_train, row["train_seconds"])
    amdahl = 1.0 if same else _ratio(base_total, base_total - base_train + base_train * (1.0 - p))
    target = None if base.get("accuracy_after_ci95") is None else base["accuracy_after_ci95"][0]
    curve = row.get("accuracy_curve") or []
    reach = None if target is None else next((s for s, _, acc in curve if acc >= target), None)
    return {
        "speedup_train": speedup_train,
        "speedup_total": 1.0 if same else _ratio(base_total, row["total_seconds"]),
        "fraction_of_ideal": None if speedup_train is None else speedup_train / row["ideal_speedup_train"],
        "speedup_total_cpu": 1.0 if same else _ratio(base["cpu_seconds"], row["cpu_seconds"]),
        "amdahl_speedup_total": amdahl,
        "time_to_grpo_accuracy": reach,
        "time_to_grpo_accuracy_fraction": None if reach is None else _ratio(reach, base_total),
    }


def format_mean(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{suffix}"


def _rate_cell(row: dict[str, Any]) -> str:
    """``0.75``, ``0.75 random`` for an ablation row, ``0 batched 4`` for GRPO generating 4 steps' questions a call,
    ``0.75 prefix_sharing=false`` for a ``--compare`` run."""
    metric = row.get("selection_metric", "smallest")
    cell = f"{row['pruning_rate']:g}" + ("" if metric == "smallest" else f" {metric}")
    cell += f" batched {row['steps_per_generation']}" if (row.get("steps_per_generation") or 1) > 1 else ""
    return cell + (f" {row['variant']}" if row.get("variant") else "")


def compare_rows(rows: Sequence[dict[str, Any]], setting: str) -> dict[str, Any]:
    """``meta.compare`` of a ``--compare SETTING`` run: per rate, the changed run's generation seconds, train
    seconds, total seconds, tokens through the model and tokens trained over the base run's (a ratio above 1: the
    change costs that much more; for ``prefix_sharing=false`` it is the speedup sharing brings)."""
    base = {r["pruning_rate"]: r for r in rows if r.get("variant") is None}
    pairs = []
    for r in (r for r in rows if r.get("variant") == setting):
        b = base[r["pruning_rate"]]
        keys = ("generation_seconds", "train_seconds", "total_seconds", "tokens_forward", "tokens_trained")
        b, r = ({**x, "generation_seconds": x["phase_seconds"]["generation"]} for x in (b, r))
        pairs.append({
            "pruning_rate": r["pruning_rate"],
            **{k: [b[k], r[k]] for k in keys},
            **{f"ratio_{k}": _ratio(r[k], b[k]) for k in keys},
            "reward_mean": [b["reward_mean"], r["reward_mean"]],
        })  # fmt: skip
    return {
        "setting": setting,
        "meaning": "per rate [base, changed] and changed / base; the two runs of a rate ran one after the other "
        "on the same seed and questions",
        "pairs": pairs,
    }


def _accuracy_cell(accuracy: float | None, ci: Sequence[float] | None) -> str:
    return "-" if accuracy is None or ci is None else f"{100 * accuracy:.1f}% [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def format_accuracy_table(rows: Sequence[dict[str, Any]]) -> str:
    """The accuracy rows as a Markdown table: wall time and speedup of the whole run against P = 0, accuracy before
    and after with 95% Wilson intervals, and when the run reached the lower end of GRPO's final 95% interval
    (``-``: never)."""
    head = [
        "P", "keep", "steps", "wall s", "speedup", "accuracy before (95% CI)", "accuracy after (95% CI)",
        "time to the lower end of GRPO's final 95% CI", "eval s",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for r in rows:
        reach, share = r["time_to_grpo_accuracy"], r["time_to_grpo_accuracy_fraction"]
        cells = [
            _rate_cell(r),
            f"{r['keep']}/{r['group_size']}",
            str(r["steps"]),
            f"{r['total_seconds']:.0f}",
            format_mean(r["speedup_total"], ".2f", "x"),
            _accuracy_cell(r["accuracy_before"], r["accuracy_before_ci95"]),
            _accuracy_cell(r["accuracy_after"], r["accuracy_after_ci95"]),
            "-"
            if reach is None
            else f"{reach:.0f} s ({format_mean(None if share is None else 100 * share, '.0f', '%')})",
            format_mean(r["eval_seconds"], ".0f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: :func:`format_table`'s columns: the essential ones, 120 characters wide (every field of a row is in the JSON).
TABLE_HEAD = (
    "P", "keep", "steps", "train s", "total s", "speedup train", "ideal", "speedup total", "Amdahl", "gen share",
    "paper", "accuracy",
)  # fmt: skip
#: What the columns mean, printed under the table (each note wrapped at 120 characters).
TABLE_NOTES = (
    "keep: completions kept per question, of G. train s: old/ref log-probs + policy forward/backward + optimizer, the "
    "phases pruning shrinks; total s: the steps' whole wall clock (generation, reward and selection too).",
    "speedup train / total: P = 0's train / total seconds over this row's. ideal: 1/(1 - P), the training speedup if "
    "each kept completion cost what one did at P = 0; a measured one above it: the kept completions held fewer tokens "
    "(tokens_trained) or packed into fewer or shorter micro-batches than (1 - P) of P = 0's, or timing noise, which "
    "weighs more on a high rate's few steps.",
    "Amdahl (train only): the whole-run speedup had only the training phases shrunk, by (1 - P), the rest costing what "
    "it did at P = 0; speedup total above it: the rest got cheaper too (allocation's bigger generation batches).",
    "gen share: generation's share of the row's total seconds; pruning leaves generation alone, so a large share "
    "limits speedup total.",
    "paper: the CPPO paper's whole-run GSM8K speedup at this P. accuracy: the share of correct rollouts, mean over the "
    "steps.",
    "The JSON holds every field: each phase's seconds, the tokens, the CPU-time speedup (a check on a shared machine).",
)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table of :data:`TABLE_HEAD` (seconds summed over the run; speedups against P = 0),
    then :data:`TABLE_NOTES` as a list."""
    lines = ["| " + " | ".join(TABLE_HEAD) + " |", "|" + "|".join("---:" for _ in TABLE_HEAD) + "|"]
    for r in rows:
        percent = {k: None if r[k] is None else 100 * r[k] for k in ("generation_share", "accuracy")}
        cells = [
            _rate_cell(r),
            f"{r['keep']}/{r['group_size']}",
            str(r["steps"]),
            *(f"{r[k]:.2f}" for k in ("train_seconds", "total_seconds")),
            format_mean(r["speedup_train"], ".2f", "x"),
            f"{r['ideal_speedup_train']:.2f}x",
            *(format_mean(r[k], ".2f", "x") for k in ("speedup_total", "amdahl_speedup_total")),
            format_mean(percent["generation_share"], ".0f", "%"),
            format_mean(r["paper_speedup_gsm8k"], ".2f", "x"),
            format_mean(percent["accuracy"], ".1f", "%"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [textwrap.fill(note, 120, initial_indent="- ", subsequent_indent="  ") for note in TABLE_NOTES]
    return "\n".join([*lines, "", *notes])


def write_json(path: pathlib.Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """``{"meta": ..., "rows": [...]}``, NaN and infinities written as null; the file is replaced whole, atomically
    (:func:`cppo.fileio.write_json`: an interrupted write leaves the old file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fileio.write_json(path, {"meta": meta, "rows": list(rows)})


def plot(path: pathlib.Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Stacked bars of each phase's seconds per pruning rate, the speedups written above each bar."""
    plt = pyplot()
    labels = [f"P={_rate_cell(r)}\nkeep {r['keep']}/{r['group_size']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2.0), 5.0))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        heights = [r["phase_seconds"][phase] for r in rows]
        _, label, color = PHASE_TABLE[phase]
        ax.bar(labels, heights, bottom=bottom, label=label, color=color, edgecolor="white", linewidth=0.5)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, (r, top) in enumerate(zip(rows, bottom)):
        text = f"train {format_mean(r['speedup_train'], '.2f', 'x')} (ideal {r['ideal_speedup_train']:.2f}x)"
        text += f"\ntotal {format_mean(r['speedup_total'], '.2f', 'x')}"
        paper_setting = r.get("allocation", meta.get("allocation", True))  # the paper's CPPO allocates
        if r["paper_speedup_gsm8k"] is not None and r["pruning_rate"] > 0 and paper_setting:
            text += f" (paper {r['paper_speedup_gsm8k']:.2f}x)"
        ax.annotate(text, (x, top), ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_ylim(0, max(bottom) * 1.22 if max(bottom) > 0 else 1.0)
    ax.set_ylabel("seconds (summed over the run)")
    model, where = pathlib.Path(str(meta.get("model", "?"))).name, meta.get("device_name") or meta.get("device", "?")
    ax.set_title(
        f"CPPO vs GRPO on the same {rows[0]['questions']} questions, G={rows[0]['group_size']}, "
        f"{meta.get('max_completion_length', '?')} new tokens\n{model} on {where}",
        fontsize=9,
    )
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], fontsize=7, loc="upper right")  # top of the stack first
    save_figure(plt, fig, path)


def plot_accuracy(path: pathlib.Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Accuracy against training wall clock, one line per run with 95% Wilson error bars at each point; GRPO's
    final 95% interval shaded across (a run has reached that interval once it is at or above the band's
    lower edge)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 5.0))
    lo, hi = rows[0]["accuracy_after_ci95"]
    ax.axhspan(100 * lo, 100 * hi, color="#dddddd", zorder=0, label="GRPO's final accuracy, 95% CI")
    for r in rows:
        n, curve = r["eval_problems_scored"], r["accuracy_curve"]
        x, y = [s for s, _, _ in curve], [100 * a for _, _, a in curve]
        bounds = [wilson_interval(round(a * n), n) for _, _, a in curve]
        yerr = [[v - 100 * b[0] for v, b in zip(y, bounds)], [100 * b[1] - v for v, b in zip(y, bounds)]]
        dashed = r["selection_metric"] != "smallest"
        label = f"P={_rate_cell(r)} (keep {r['keep']}/{r['group_size']}), {r['total_seconds']:.0f} s"
        ax.errorbar(x, y, yerr=yerr, marker="o", markersize=4, capsize=3, ls="--" if dashed else "-", label=label)
    distinct = rows[0]["eval_problems"]
    model, where = pathlib.Path(str(meta.get("model", "?"))).name, meta.get("device_name") or meta.get("device", "?")
    label_axes(
        ax,
        x="training wall-clock seconds (evaluation excluded)",
        y=f"greedy accuracy, % of {rows[0]['eval_problems_scored']} test problems"
        + ("" if distinct is None else f" ({distinct} distinct)"),
        title=f"Accuracy vs training time on the same {rows[0]['questions']} questions, G={rows[0]['group_size']}; "
        f"error bars: 95% Wilson\n{model} on {meta.get('dataset', '?')}, {where}",
    )
    save_figure(plt, fig, path)


def collect_meta(config: TrainConfig, *, argv: Sequence[str]) -> dict[str, Any]:
    """Where and how the numbers were measured: every setting of the base trainer config, then
    :func:`cppo.fileio.run_metadata` (date, machine, torch threads, library versions, git commit, ``argv``) and what
    the timings mean."""
    return {
        **config.to_dict(),
        **fileio.run_metadata(device=config.device, argv=list(argv)),
        "timing": (
            "wall clock summed over every measured train_step; train = old/ref log-probs + policy forward/backward"
            " + optimizer; total = sum of train_step wall clocks; model build and warm-up excluded"
        ),
    }
