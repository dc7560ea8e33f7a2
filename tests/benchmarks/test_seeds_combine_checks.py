"""Issue 49: what ``accuracy_seeds.py --combine`` reads and writes, checked. A row that carries no per-problem records
(a unit that finished without them, a ``--with`` file's rows) is named in the meta and the report, never hidden
under "one JSON line per graded completion of every evaluation"; a number that is NaN, infinite or not a number in a
file combined is refused in one line naming the file and the field (it was a raw AttributeError from
``statistics.stdev``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from sweep_cases import SWEEP, argv_of, summary_inputs, sweep_args, unit_row, write_unit
from sweeps import arm as accuracy_arm
from sweeps import report as seeds_report
from sweeps import seeds as accuracy_seeds
from sweeps import stop as seeds_stop


def records(step, correct):
    return {"step": step, "records": [{"index": 0, "id": "a", "sample": 0, "correct": correct, "format_ok": True,
                                       "completion_tokens": 5}]}  # fmt: skip


def with_records(out, *, skip=(), steps=(0, 16)):
    """Every unit of :func:`summary_inputs` rewritten with per-problem records at ``steps`` (its curve: 0 and 16),
    but the units named in ``skip``."""
    for folder in sorted((out / "units").iterdir()):
        if folder.name in skip:
            continue
        path = folder / "result.json"
        data = json.loads(path.read_text())
        data["rows"][0]["eval_per_problem"] = [records(s, s > 0) for s in steps]
        path.write_text(json.dumps(data))


def test_rows_without_per_problem_records_are_named_in_the_meta_and_the_report(tmp_path, capsys):
    out, former = summary_inputs(tmp_path)
    with_records(out, skip={"seed46-control"})
    data = accuracy_seeds.main(argv_of(sweep_args(out, "--combine", "--with", str(former))))
    meta = data["meta"]
    missing = {(m["seed"], m["arm"], m["method"]): m["steps"] for m in meta["per_problem_missing"]}
    former_rows = {(seed, arm, name) for seed in (42, 43, 44)
                   for arm, name in (("grpo", "GRPO"), ("cppo-pooled", "CPPO P=0.75"),
                                     ("max-variance", "max-variance P=0.75"))}  # fmt: skip
    assert set(missing) == former_rows | {(46, "control", "CPPO P=0.75 no allocation")}
    assert all(steps == [0, 16] for steps in missing.values())  # every evaluation of theirs: their curves' steps
    assert "but those of the 10 rows in per_problem_missing" in meta["per_problem"]
    lines = (out / "accuracy-smollm2-seeds-per-problem.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 14  # the shared untrained evaluation once, the final one of each unit that has it
    report = capsys.readouterr().out
    assert "per-problem records: none for 10 rows (per_problem_missing):" in report
    assert "seed 46 CPPO P=0.75 no allocation (steps 0, 16)" in report and "seed 42 GRPO (steps 0, 16)" in report


def test_a_row_missing_one_evaluation_s_records_is_named_with_that_step(tmp_path):
    out, former = summary_inputs(tmp_path)
    with_records(out)
    path = out / "units" / "seed45-grpo" / "result.json"
    data = json.loads(path.read_text())
    data["rows"][0]["eval_per_problem"] = [records(0, False)]  # its final evaluation kept none
    path.write_text(json.dumps(data))
    meta = accuracy_seeds.main(argv_of(sweep_args(out, "--combine")))["meta"]
    assert meta["per_problem_missing"] == [{"seed": 45, "arm": "grpo", "method": "GRPO", "steps": [16]}]


def test_rows_that_all_carry_records_or_none_write_the_meta_as_before(tmp_path):
    out, _ = summary_inputs(tmp_path)
    meta = accuracy_seeds.main(argv_of(sweep_args(out, "--combine")))["meta"]
    assert "per_problem" not in meta and "per_problem_missing" not in meta  # no records: no file, no claim
    assert not (out / "accuracy-smollm2-seeds-per-problem.jsonl").exists()
    with_records(out)
    meta = accuracy_seeds.main(argv_of(sweep_args(out, "--combine")))["meta"]
    assert meta["per_problem"] == (
        "accuracy-smollm2-seeds-per-problem.jsonl: one JSON line per graded completion of every evaluation"
    )
    assert "per_problem_missing" not in meta


def write_raw_unit(out, seed, arm, **row):
    """A unit's result.json as a writer that is not ours writes it (``json.dumps`` keeps NaN and infinities)."""
    write_unit(out, seed, arm, 0.3)
    path = out / "units" / f"seed{seed}-{arm}" / "result.json"
    data = json.loads(path.read_text())
    data["rows"][0].update(row)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"accuracy_after": math.nan}, r"rows\[0\]\.accuracy_after is NaN, not a finite number"),
        ({"total_seconds": math.inf}, r"rows\[0\]\.total_seconds is Infinity, not a finite number"),
        ({"cpu_seconds": math.nan}, r"rows\[0\]\.cpu_seconds is NaN"),
        ({"accuracy_curve": [[0, 0, 0.2], [400.0, 16, math.nan]]}, r"rows\[0\]\.accuracy_curve\[1\]\[2\] is NaN"),
        ({"accuracy_after": "0.3"}, r"rows\[0\]\.accuracy_after is '0.3', not a number"),
        ({"cpu_seconds": True}, r"rows\[0\]\.cpu_seconds is True, not a number"),
        ({"pruning_rate": "0.75"}, r"rows\[0\]\.pruning_rate is '0.75', not a number"),
    ],
)
def test_a_number_that_is_not_finite_or_not_a_number_is_refused_naming_the_file_and_field(tmp_path, row, match):
    out, former = summary_inputs(tmp_path)
    write_raw_unit(out, 46, "cppo-group", **row)
    with pytest.raises(ValueError, match=rf"seed46-cppo-group/result.json: .*{match}"):
        accuracy_seeds.main(argv_of(sweep_args(out, "--combine", "--with", str(former))))


def test_a_nan_accuracy_is_one_line_and_a_failing_exit(tmp_path):
    out, _ = summary_inputs(tmp_path)
    write_raw_unit(out, 46, "cppo-group", accuracy_after=math.nan)
    argv = argv_of(sweep_args(out, "--combine", seeds=list(SWEEP)))
    done = subprocess.run([sys.executable, str(accuracy_seeds.HERE / "accuracy_seeds.py"), *argv],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    line = done.stderr.strip()
    assert done.returncode != 0 and "\n" not in line and "Traceback" not in line, done.stderr
    assert line.startswith("accuracy_seeds.py: error: ") and "seed46-cppo-group/result.json" in line, line
    assert "rows[0].accuracy_after is NaN" in line, line


def stop_rows(lacking):
    """Issue 38's four arms on three seeds; the learned stop arm's row of seed 44 lacks ``lacking``."""
    rows = []
    for seed in (42, 43, 44):
        for arm in ("grpo-epochs", "cppo-group-epochs", "cppo-group-stop", "cppo-group-stop-random"):
            stopping = accuracy_arm.arm_settings(arm).get("rollout_stop_rate")
            row = unit_row(seed, arm, 0.4, 400.0, cpu_seconds=200.0 + seed, tokens_generate_completion=1000 + seed,
                           tokens_generate_prompt=300, phase_cpu_seconds={"generation": 100.0}, completions=192,
                           rollout_stopped=90 if stopping else None, completions_kept=48,
                           kept_zero_advantage=12)  # fmt: skip
            if arm == "cppo-group-stop" and seed == 44:
                row[lacking] = None
            rows.append(row)
    return rows


@pytest.mark.parametrize("lacking", ["tokens_generate_completion", "cpu_seconds"])
def test_the_stop_tables_say_when_a_statistic_covers_fewer_seeds_than_their_seeds_column(lacking):
    """seeds_stop's means and ratios skip a seed whose row lacks the value; its tables printed the method's or the
    pair's seeds (3) beside a value over 2, the dropped seed unsaid."""
    lines = seeds_stop.format_stop(seeds_stop.stop_pairs(seeds_report.by_seed(stop_rows(lacking))))
    learned = "CPPO group P=0.75 3 epochs + stop 0.625 (learned)"
    method = next(line for line in lines if line.startswith(f"| {learned} | 3 |"))
    pair = next(line for line in lines if line.startswith(f"| {learned} vs CPPO group P=0.75 3 epochs | 3 |"))
    assert method.count("(2 of 3 seeds)") == 1 and pair.count("(2 of 3 seeds)") == 1, (method, pair)
    full = seeds_stop.format_stop(seeds_stop.stop_pairs(seeds_report.by_seed(stop_rows("rollout_stop_auc"))))
    assert not any("of 3 seeds" in line for line in full)  # every value over every seed: the tables as before
