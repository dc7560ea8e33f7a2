"""The result files the accuracy runs combine (``accuracy_seeds.py``): reading one, what every file combined must
agree on (refused in one line naming the file, the setting and both values), and writing the combination.

**What a file may hold.** Strict JSON: a NaN or an infinity anywhere (``json.dumps`` writes them; cppo's writer
writes null) is refused naming the file and the field, and so is a field the reports read as a number
(:data:`NUMBER_KEYS`) that holds something else. **What the combination writes.** ``NAME-seeds.json``, its plot,
and the per-problem records of every row beside it (:func:`write_combined`); a row that carries none for some of
its evaluations (a unit that finished without them, a ``--with`` file whose records are not beside it) is listed in
the meta's ``per_problem_missing`` and in the report (:func:`per_problem_gaps`). A ``--with`` file gets its records
back from the ``NAME-seeds-per-problem.jsonl`` beside it (:func:`with_records`), so a combination of combinations
keeps them.

**What may differ, what must agree, what is only recorded.** The settings that may differ between the files and rows
combined are an explicit allow-list (:data:`MAY_DIFFER`): what an arm or the sweep sets per unit
(:data:`accuracy_arm.OWN_SETTINGS`: the pruning settings, ``seed``, ``question_seed``, ``num_steps``,
``max_questions``, ``output_dir``, and what the arms set, e.g. the ``num_epochs``, ``filter_groups`` and ``greso`` of
issue 30's arms; every setting an arm of :data:`accuracy_arm.ARMS` sets) and ``preset`` (the name the settings came
from: the settings themselves are compared). EVERY other :class:`~cppo.config.TrainConfig` setting must agree
(:data:`SETTING_KEYS`, derived from the dataclass, so that a setting added later is covered without an edit here),
and so must the environment that computes (:data:`ENVIRONMENT_KEYS`: the Python version, every library version
:func:`cppo.fileio.run_metadata` records, torch's threads), the questions per seed, the evaluation and the rows'
:data:`ROW_AGREE_KEYS`. Where and when a file ran (:data:`RECORDED_KEYS`: date, git commit and whether the tree was
dirty, the machine, the command line, the warm-up) is recorded per file, never compared: the committed sweep pools
units of two commits and two machines by design, and its seconds compare only within a seed anyway.

A key missing from a file written before its setting existed counts as that setting's default (a library missing
from the record: not installed), as a checkpoint's settings do on resume (:meth:`TrainConfig.changes_from`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

from endtoend import args as speedup_args

from cppo import TrainConfig, fileio
from cppo.config import TINY_MODELS
from sweeps import arm as accuracy_arm
from sweeps.report import by_seed, format_summary, method, plot

#: What the summary reads of every row.
ROW_KEYS = ("pruning_rate", "selection_metric", "accuracy_after", "total_seconds", "train_seconds", "eval_problems")
#: The row fields the reports read as numbers (where present and not None): each must be an int or a float.
NUMBER_KEYS = ("pruning_rate", "accuracy_after", "accuracy_before", "total_seconds", "train_seconds", "cpu_seconds",
               "eval_problems", "eval_problems_scored", "questions", "group_size", "steps", "completions",
               "completions_kept", "kept_zero_advantage", "tokens_generate_completion", "tokens_generate_prompt",
               "rollout_stopped", "greso_questions_skipped", "ideal_speedup_train")  # fmt: skip
#: The settings that may differ between the files combined: what an arm or the sweep sets per unit, and ``preset``.
MAY_DIFFER = (
    frozenset(accuracy_arm.OWN_SETTINGS)
    | {key for arm in accuracy_arm.ARMS for key in accuracy_arm.arm_settings(arm)}
    | {"preset"}
)
#: Every other trainer setting (in every result's ``meta``): these must agree between every file combined.
SETTING_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in MAY_DIFFER)
#: The environment that computes (``meta``, :func:`cppo.fileio.run_metadata`): must agree too.
ENVIRONMENT_KEYS = ("python", *fileio.LIBRARIES, "torch_threads")
#: Every ``meta`` key that must agree (a missing one: :func:`meta_value`).
AGREE_KEYS = SETTING_KEYS + ENVIRONMENT_KEYS
#: Where and when a file ran: recorded per file in the combined meta's ``sources``, not compared.
RECORDED_KEYS = ("date", "git_commit", "git_dirty", "device_name", "cpu_count", "python_executable", "argv",
                 "warmup_seconds")  # fmt: skip
#: Besides :data:`AGREE_KEYS`: the questions per seed and the evaluation (``meta.questions``, ``meta.eval``'s
#: problems and points), and in every row its questions, G, evaluated and distinct problems; for a model read from a
#: file also the untrained model's accuracy (every seed starts from the same weights).
ROW_AGREE_KEYS = ("questions", "group_size", "eval_problems", "eval_problems_scored")
_DEFAULTS = TrainConfig().to_dict()


def meta_value(meta: dict[str, Any], key: str) -> Any:
    """``meta[key]``; missing, a setting's default (the file predates the setting), or None (an environment fact
    not recorded: a library not installed)."""
    return meta[key] if key in meta else _DEFAULTS.get(key)


def read_result(path: pathlib.Path, what: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(meta, rows)`` of a result JSON; ValueError naming the file when it is not ``what`` (or its rows lack
    :data:`ROW_KEYS`)."""
    try:
        data = json.loads(path.read_text())
        meta, rows = data["meta"], list(data["rows"])
        if not isinstance(meta, dict) or not all(isinstance(r, dict) for r in rows):
            raise TypeError("meta must be an object and rows a list of objects")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not {what} ({type(e).__name__}: {e})") from None
    bad = _not_finite({"meta": meta, "rows": rows}, "")
    if bad is not None:
        raise ValueError(f"{path}: {bad[0]} is {json.dumps(bad[1])}, not a finite number (strict JSON has none)")
    missing = sorted({k for r in rows for k in ROW_KEYS if r.get(k) is None})
    if missing or not rows:
        raise ValueError(f"{path}: its rows lack {missing or 'rows'} (not {what} with --eval)")
    for i, r in enumerate(rows):
        for key in NUMBER_KEYS:
            value = r.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{path}: rows[{i}].{key} is {value!r}, not a number")
    return meta, rows


def _not_finite(value: Any, where: str) -> tuple[str, float] | None:
    """The first NaN or infinity in ``value`` (a parsed JSON document): ``(its path, e.g. rows[0].accuracy_after,
    the value)``, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _not_finite(item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


def agreed_values(meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What must agree (:data:`AGREE_KEYS` as :func:`meta_value` reads them, :data:`ROW_AGREE_KEYS`) as one file
    holds it; ValueError when its rows disagree among themselves on a row key."""
    evaluation = meta.get("eval") or {}
    if not isinstance(evaluation, dict):
        raise ValueError(f"its meta.eval is {evaluation!r}, not an object (the evaluation's problems and points)")
    values = {"questions (per seed)": meta.get("questions"), "eval problems": evaluation.get("problems"),
              "eval points": evaluation.get("points"), **{k: meta_value(meta, k) for k in AGREE_KEYS}}  # fmt: skip
    keys = ROW_AGREE_KEYS + (() if values["model"] in TINY_MODELS else ("accuracy_before",))
    for key in keys:
        found = sorted({json.dumps(r.get(key)) for r in rows})
        if len(found) > 1:
            raise ValueError(f"its rows disagree on {key}: {', '.join(found)}")
        values[f"rows' {key}"] = json.loads(found[0])
    return values


def _shown(meta: dict[str, Any], key: str, value: Any) -> str:
    """``value`` as a refusal names it, saying when the file did not record it."""
    if key in AGREE_KEYS and key not in meta:
        return f"{value!r} (not recorded: {'the default' if key in SETTING_KEYS else 'none'})"
    return repr(value)


def check_agree(sources: Sequence[tuple[pathlib.Path, dict[str, Any], Sequence[dict[str, Any]]]]) -> None:
    """Every ``(file, meta, rows)`` agrees with the first on :func:`agreed_values`, every row names its seed, and
    every seed's rows (across files) trained the same question ids; ValueError in one line naming the file, the
    first setting that differs and both values."""
    first: tuple[pathlib.Path, dict[str, Any], dict[str, Any]] | None = None
    ids: dict[int, tuple[pathlib.Path, list[str]]] = {}
    for path, meta, rows in sources:
        try:
            values = agreed_values(meta, rows)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        first = first or (path, meta, values)
        wrong = next((k for k in first[2] if values[k] != first[2][k]), None)
        if wrong is not None:
            ours, theirs = _shown(meta, wrong, values[wrong]), _shown(first[1], wrong, first[2][wrong])
            raise ValueError(f"{path}: {wrong} is {ours}, but {theirs} in {first[0]} (the runs would not compare)")
        for r in rows:
            if not isinstance(r.get("seed"), int) or isinstance(r["seed"], bool):
                raise ValueError(f"{path}: a row's seed is {r.get('seed')!r}, not an integer")
            seen = ids.setdefault(r["seed"], (path, sorted(r.get("train_question_ids") or [])))
            if sorted(r.get("train_question_ids") or []) != seen[1]:
                raise ValueError(
                    f"{path}: seed {r['seed']}'s {method(r)} trained other questions than the seed's rows in {seen[0]}"
                )


def agreed_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """What a combined file records of the settings every file agreed on (:data:`AGREE_KEYS`, missing ones as
    :func:`meta_value` reads them), so that it can itself be combined later (``--with``)."""
    return {k: meta_value(meta, k) for k in AGREE_KEYS}


def _without(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``argv`` less ``flags`` (and the value of those that take one) as speedup.py's parser reads them."""
    actions, kept, skip = speedup_args.build_parser()._option_string_actions, [], False
    for token in argv:
        name = token.partition("=")[0]
        if skip or name in flags:
            skip = not skip and name in flags and "=" not in token and actions[name].nargs != 0
            continue
        kept.append(token)
    return kept


def check_command(path: pathlib.Path, meta: dict[str, Any], expected: Sequence[str], own: Sequence[str]) -> None:
    """A per-seed file (``--from-runs``) ran the ``speedup.py`` arguments this command passes: its ``meta.argv`` and
    ``expected``, less ``own`` (the flags the driver sets per seed), parse to the same settings
    (:func:`endtoend.args.parse_args`); ValueError naming the file, the setting and both values."""
    argv = meta.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"{path}: its meta.argv is {argv!r}, not the speedup.py command line it ran")
    try:
        ran = vars(speedup_args.parse_args(_without(argv, own)))
    except (SystemExit, ValueError, KeyError) as e:
        raise ValueError(f"{path}: its meta.argv {argv} is not a speedup.py command line ({e})") from None
    wanted = vars(speedup_args.parse_args(list(expected)))
    wrong = next((k for k in wanted if ran.get(k) != wanted[k]), None)
    if wrong is not None:
        raise ValueError(
            f"{path}: it ran speedup.py with {wrong} {ran.get(wrong)!r}, but this command passes {wanted[wrong]!r} "
            "(the arguments after --; default: DEFAULT_SPEEDUP_ARGS)"
        )


def per_problem_lines(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows without their per-problem records, and the records as JSON lines: one per graded completion,
    ``{"seed", "arm", "method", "step", **record}`` (the untrained model's evaluation, step 0, once per distinct
    measurement: every arm of a sweep starts from the same one, written with ``"arm": "untrained"``)."""
    lines, seen, bare = [], set(), []
    for r in rows:
        for point in r.get("eval_per_problem") or []:
            if point["step"] == 0:  # the untrained model's
                ident = json.dumps(point["records"])
                if ident in seen:
                    continue
                seen.add(ident)
            arm, name = ("untrained", None) if point["step"] == 0 else (r.get("arm"), method(r))
            lines += [json.dumps({"seed": r["seed"], "arm": arm, "method": name, "step": point["step"], **rec})
                      for rec in point["records"]]  # fmt: skip
        bare.append({k: v for k, v in r.items() if k != "eval_per_problem"})
    return bare, lines


def with_records(path: pathlib.Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of a combined file (``NAME-seeds.json``) with the per-problem records :func:`per_problem_lines` wrote
    beside it put back (``eval_per_problem``, by seed and method; the untrained model's, written once, to every row
    when the file holds one untrained evaluation); the rows unchanged when no records file is there. ValueError
    naming the file when a record names a row the file does not hold."""
    records = path.with_name(path.name.removesuffix(".json") + "-per-problem.jsonl")
    if not path.name.endswith("-seeds.json") or not records.is_file():
        return rows
    points: dict[tuple[Any, Any], dict[int, list[dict[str, Any]]]] = {}
    for n, line in enumerate(records.read_text().splitlines(), 1):
        try:
            rec = json.loads(line)
            key = ("untrained", rec["seed"]) if rec["arm"] == "untrained" else (rec["seed"], rec["method"])
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{records}:{n} is not a per-problem record ({type(e).__name__}: {e})") from None
        fields = {k: v for k, v in rec.items() if k not in ("seed", "arm", "method", "step")}
        points.setdefault(key, {}).setdefault(step, []).append(fields)
    measured = [points.pop(key) for key in [k for k in points if k[0] == "untrained"]]  # written once each
    untrained = measured[0] if len(measured) == 1 else {}  # several: which row had which is not recorded
    unknown = set(points) - {(r["seed"], method(r)) for r in rows}
    if unknown:
        raise ValueError(f"{records}: records of {sorted(unknown, key=str)[0]} (seed, method), a row {path} lacks")
    out = []
    for r in rows:
        own = {**untrained, **points.get((r["seed"], method(r)), {})}
        out.append({**r, "eval_per_problem": [{"step": s, "records": own[s]} for s in sorted(own)]} if own else r)
    return out


def per_problem_gaps(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with an evaluation that carries no per-problem records of its own: ``{"seed", "arm", "method",
    "steps"}``, the steps of its ``accuracy_curve`` without records (None: a row without a curve and without
    records, every evaluation of it)."""
    gaps = []
    for r in rows:
        kept = {point["step"] for point in r.get("eval_per_problem") or []}
        curve = r.get("accuracy_curve")
        steps = None if not curve and not kept else [int(p[1]) for p in curve or [] if int(p[1]) not in kept]
        if steps is None or steps:
            gaps.append({"seed": r["seed"], "arm": r.get("arm"), "method": method(r), "steps": steps})
    return gaps


def _gap_words(gap: dict[str, Any]) -> str:
    steps = "every evaluation" if gap["steps"] is None else "steps " + ", ".join(map(str, gap["steps"]))
    return f"seed {gap['seed']} {gap['method']} ({steps})"


def write_combined(data: dict[str, Any], out: pathlib.Path, name: str) -> None:
    """``OUT/NAME-seeds.json`` and ``.png``, the per-problem records beside them (``NAME-seeds-per-problem.jsonl``,
    :func:`per_problem_lines`; the JSON's rows keep the counts), and the summary printed. When some rows carry
    records and others do not (:func:`per_problem_gaps`), the meta's ``per_problem_missing`` and the report list
    those that do not."""
    path, png = out / f"{name}-seeds.json", out / f"{name}-seeds.png"
    out.mkdir(parents=True, exist_ok=True)
    gaps = per_problem_gaps(data["rows"])
    data["rows"], lines = per_problem_lines(data["rows"])
    if lines:
        records = out / f"{name}-seeds-per-problem.jsonl"
        fileio.atomic_write(records, "\n".join(lines) + "\n")
        data["meta"]["per_problem"] = f"{records.name}: one JSON line per graded completion of every evaluation"
        if gaps:
            data["meta"]["per_problem"] += (
                f" but those of the {len(gaps)} rows in per_problem_missing (they carry no per-problem records; "
                "steps: the evaluations without them)"
            )
            data["meta"]["per_problem_missing"] = gaps
        print(f"wrote {records} ({len(lines)} records)")
    fileio.write_json(path, data)
    table = by_seed(data["rows"])
    plot(png, data["summary"], table, data["meta"])
    print(format_summary(data["summary"], table))
    if lines and gaps:
        print(f"\nper-problem records: none for {len(gaps)} rows (per_problem_missing): "
              + "; ".join(map(_gap_words, gaps)))  # fmt: skip
    print(f"\nwrote {path}, {png}", flush=True)
