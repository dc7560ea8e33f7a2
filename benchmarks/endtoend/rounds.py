"""Rounds of ``benchmarks/speedup.py --rounds N``: every arm run again from scratch, round after round, each finished
round written as its own file so that a run spanning sessions resumes, and the report that combines them.

A round is one interleaved run of every arm over the same questions and seed (the same work; what changes between
rounds is the machine). ``--out/NAME-roundK.json`` holds round K's rows (:func:`endtoend.report.build_rows`, each with
its step walls), the settings that define the measurement (:func:`round_settings`) and where it ran. A rerun with
the same ``--out`` reads the finished rounds (:func:`finished_rounds`) and runs only the missing ones; with other
settings it refuses. :func:`combine` turns the rounds into one row per arm: each total as the mean over rounds with
the 95% Student-t interval of the per-round totals, each speedup as the mean of the per-round ratios (every ratio
between two arms of the same round, interleaved step by step) with its t interval, and the seconds a step takes
pooled over every step of every round with its t interval (steps of one arm differ in their questions' lengths).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

from sweeps.stats import mean_interval

from cppo import TrainConfig, fileio
from endtoend.report import PHASES, format_mean

#: The environment a round's threads depend on: part of its settings (a resumed run must set them alike).
THREAD_ENV = (
    "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING",
)  # fmt: skip
#: Row fields every round of an arm shares (its plan), copied into the combined row.
IDENTITY = ("pruning_rate", "selection_metric", "allocation", "steps_per_generation", "max_staleness", "keep",
            "group_size", "questions", "questions_per_step", "steps", "seed", "train_question_ids",
            "ideal_speedup_train", "paper_speedup_gsm8k")  # fmt: skip
#: Seconds summed over an arm's steps in a round: the combined row holds their mean and interval over rounds.
TOTALS = ("total_seconds", "train_seconds", "cpu_seconds", "reload_seconds", "reload_cpu_seconds", "setup_seconds")


def round_settings(
    plans: Sequence[TrainConfig], *, schedule: str, threads: int | None, warmup: bool, env=None
) -> dict[str, Any]:
    """What a round measures, as JSON: every arm's trainer config (its output folder aside), the schedule, the torch
    threads, the warm-up, and :data:`THREAD_ENV` as set (``env``: default ``os.environ``)."""
    env = os.environ if env is None else env
    arms = [{k: v for k, v in plan.to_dict().items() if k != "output_dir"} for plan in plans]
    settings = {"arms": arms, "schedule": schedule, "threads": threads, "warmup": warmup,
                "env": {k: env.get(k) for k in THREAD_ENV}}  # fmt: skip
    return json.loads(json.dumps(fileio.json_safe(settings)))


def round_path(out: pathlib.Path, name: str, k: int) -> pathlib.Path:
    return pathlib.Path(out) / f"{name}-round{k}.json"


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The settings that differ: top-level keys, an arm's trainer settings by name, the count of arms. A trainer
    setting only one side has is left out: one added to ``TrainConfig`` between two rounds (its default is the run
    as it was, the project's rule for a new setting); each round records its git commit."""
    found = [k for k in sorted(set(old) | set(new)) if k != "arms" and old.get(k) != new.get(k)]
    a, b = old.get("arms", []), new.get("arms", [])
    if len(a) != len(b):
        return [*found, f"arms ({len(a)} against {len(b)})"]
    for i, (x, y) in enumerate(zip(a, b)):
        found += [f"arm {i} {k}" for k in sorted(set(x) & set(y)) if x[k] != y[k]]
    return found


def finished_rounds(out: pathlib.Path, name: str, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The rounds already in ``out`` (``NAME-round1.json``, 2, ... up to the first missing one), in order.
    ValueError naming the file and the settings that differ when one was measured with other ``settings``."""
    rounds = []
    while (path := round_path(out, name, len(rounds) + 1)).exists():
        data = json.loads(path.read_text())
        differ = ", ".join(differences(data.get("settings") or {}, settings))
        if differ:
            raise ValueError(
                f"--out {out}: {path.name} was measured with other settings ({differ}); resume with the same "
                "settings or use another --out"
            )
        rounds.append(data)
    return rounds


def write_round(out: pathlib.Path, name: str, k: int, *, settings: dict[str, Any], rows, meta) -> pathlib.Path:
    """Round ``k``'s file, written atomically (an interrupted write leaves none: the round runs again)."""
    path = round_path(out, name, k)
    fileio.write_json(path, {"round": k, "settings": settings, "meta": meta, "rows": list(rows)})
    return path


def interval(values: Sequence[float | None]) -> dict[str, Any] | None:
    """Mean, sd and 95% t interval of ``values`` (:func:`sweeps.stats.mean_interval`; ``ci95`` None with one) and
    the values themselves; None when any is missing."""
    if not values or any(v is None for v in values):
        return None
    return {**mean_interval([float(v) for v in values]), "values": [float(v) for v in values]}


def _per_round_ratio(num: Sequence[dict], den: Sequence[dict], key: str) -> dict[str, Any] | None:
    """Per round ``num[key] / den[key]`` (the rows of two arms of each round), with :func:`interval`."""
    pairs = [(n.get(key), d.get(key)) for n, d in zip(num, den)]
    return interval([None if a is None or not b else a / b for a, b in pairs])


def batched_partner(rows: Sequence[dict[str, Any]], row: dict[str, Any]) -> int | None:
    """The index of the GRPO arm that generates ``row``'s questions per call in as many calls (P = 0,
    ``steps_per_generation`` = ``row``'s questions per step): the pruning-only baseline of a CPPO arm; None."""
    if row["pruning_rate"] == 0.0 or row.get("steps_per_generation", 1) != 1:
        return None
    q = row["questions_per_step"]
    return next((j for j, r in enumerate(rows) if r["pruning_rate"] == 0.0 and r.get("steps_per_generation") == q
                 and r.get("questions_per_step") == 1), None)  # fmt: skip


def combine(rounds: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per arm over ``rounds`` (each ``{"rows": [...]}``, arm 0 GRPO): its plan (:data:`IDENTITY`), each of
    :data:`TOTALS`, each phase's wall and CPU seconds as :func:`interval` over rounds, ``speedup_total`` /
    ``speedup_train`` / ``speedup_total_cpu`` (GRPO's over this arm's, per round), ``speedup_total_over_batched``
    (the :func:`batched_partner`'s total over this arm's, per round: what pruning alone buys) and ``step_seconds``
    (every step of every round pooled)."""
    per_arm = list(zip(*(r["rows"] for r in rounds)))
    grpo, firsts = per_arm[0], [rows[0] for rows in per_arm]
    out = []
    for arm, rows in enumerate(per_arm):
        first = rows[0]
        row = {"arm": arm, "label": arm_label(first), "rounds": len(rows), **{k: first.get(k) for k in IDENTITY}}
        spg = first.get("steps_per_generation") or 1  # a call per step, a batched arm's per Q steps
        row["generation_calls"] = first.get("generation_calls") or -(-first["steps"] // spg)
        row |= {key: interval([r.get(key) for r in rows]) for key in TOTALS}
        row["phase_seconds"] = {p: interval([r["phase_seconds"][p] for r in rows]) for p in PHASES}
        cpu = [r.get("phase_cpu_seconds") or {} for r in rows]
        row["phase_cpu_seconds"] = {p: interval([c.get(p) for c in cpu]) for p in PHASES if p in cpu[0]}
        row["speedup_total"] = _per_round_ratio(grpo, rows, "total_seconds")
        row["speedup_train"] = _per_round_ratio(grpo, rows, "train_seconds")
        row["speedup_total_cpu"] = _per_round_ratio(grpo, rows, "cpu_seconds")
        partner = batched_partner(firsts, first)
        row["batched_partner"] = None if partner is None else arm_label(per_arm[partner][0])
        row["speedup_total_over_batched"] = None if partner is None else _per_round_ratio(
            per_arm[partner], rows, "total_seconds")  # fmt: skip
        row["step_seconds"] = interval([w for r in rows for w in r.get("step_seconds") or []])
        row["reward_mean"] = interval([r.get("reward_mean") for r in rows])
        out.append(row)
    return out


def arm_label(row: dict[str, Any]) -> str:
    """``GRPO``, ``CPPO P=0.75``, ``GRPO batched 4`` (4 steps' questions per generation call), ``P=0.75 random``."""
    p, metric = row["pruning_rate"], row.get("selection_metric", "smallest")
    if (spg := row.get("steps_per_generation") or 1) > 1:
        return f"GRPO batched {spg}" if p == 0.0 else f"P={p:g} batched {spg}"
    if metric != "smallest":
        return f"P={p:g} {metric}"
    return "GRPO" if p == 0.0 else f"CPPO P={p:g}"


def _cell(value: dict[str, Any] | None, spec: str, suffix: str = "", *, ci: bool = True) -> str:
    """``mean [lo, hi]`` (the 95% interval; without one, or ``ci=False``, the mean alone)."""
    if value is None:
        return "-"
    mean = format_mean(value["mean"], spec, suffix)
    if not ci or value.get("ci95") is None:
        return mean
    lo, hi = value["ci95"]
    return f"{mean} [{lo:{spec}}, {hi:{spec}}]"


ROUNDS_HEAD = ("arm", "keep", "steps", "calls", "total s", "speedup", "CPU speedup", "over batched", "gen s",
               "train s", "CPU s", "s/step", "reload s")  # fmt: skip
ROUNDS_NOTES = (
    "Means over rounds with [95% t intervals] (per-round totals; speedups: the per-round ratios of two arms of the "
    "same round; s/step: every step of every round pooled). speedup: GRPO's total seconds over the arm's; CPU speedup: "
    "the same in CPU seconds (robust to a shared machine's load); over batched: the total of GRPO generating the arm's "
    "questions per call (GRPO batched Q, training unchanged) over the arm's, what pruning alone buys. calls: "
    "generation calls. reload s: the shared vLLM engine's weight reloads that interleaving adds, measured apart and "
    "in no other column.",
)


def format_rounds_table(rows: Sequence[dict[str, Any]]) -> str:
    """The combined rows as a Markdown table of :data:`ROUNDS_HEAD`, then :data:`ROUNDS_NOTES`."""
    lines = ["| " + " | ".join(ROUNDS_HEAD) + " |", "|" + "|".join("---:" for _ in ROUNDS_HEAD) + "|"]
    for r in rows:
        cells = [
            r["label"], f"{r['keep']}/{r['group_size']}", str(r["steps"]), str(r.get("generation_calls") or "-"),
            _cell(r["total_seconds"], ".0f"), _cell(r["speedup_total"], ".2f", "x"),
            _cell(r["speedup_total_cpu"], ".2f", "x", ci=False), _cell(r["speedup_total_over_batched"], ".2f", "x"),
            _cell(r["phase_seconds"]["generation"], ".0f", ci=False), _cell(r["train_seconds"], ".0f", ci=False),
            _cell(r["cpu_seconds"], ".0f", ci=False), _cell(r["step_seconds"], ".1f"),
            _cell(r["reload_seconds"], ".1f", ci=False),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *(f"- {n}" for n in ROUNDS_NOTES)])


def mean_row(row: dict[str, Any]) -> dict[str, Any]:
    """A combined row with every interval replaced by its mean: the shape :func:`endtoend.report.plot` draws."""

    def mean(v):
        return v["mean"] if isinstance(v, dict) and "mean" in v else v

    out = {k: mean(v) for k, v in row.items()}
    out["phase_seconds"] = {p: mean(v) for p, v in row["phase_seconds"].items()}
    return out
