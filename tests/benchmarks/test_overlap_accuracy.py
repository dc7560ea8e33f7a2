"""Issue 51's accuracy check (``benchmarks/results/overlap-accuracy``): the arm generating ahead (``max_staleness: 1``)
against sweep 41's synchronous units of the same seeds, recomputed from the units' own per-problem records; the
combination of a unit folder with a former combined file, which keeps the former's per-problem records
(:func:`sweeps.files.with_records`); and the sweep naming the arm by its settings, old rows (written before
``max_staleness`` existed) read as synchronous."""

from __future__ import annotations

import json
import shutil
import statistics

import pytest
from sweep_cases import REPO
from sweeps import arm as accuracy_arm
from sweeps import files as sweep_files
from sweeps import report as seeds_report
from sweeps import seeds as accuracy_seeds

CHECK = REPO / "benchmarks" / "results" / "overlap-accuracy"
SWEEP41 = REPO / "benchmarks" / "results" / "sweep41"
SEEDS = [51, 52, 53]
AHEAD, SYNC = "CPPO P=0.75 + max_staleness=1", "CPPO P=0.75"


def _row(path) -> dict:
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 1
    return rows[0]


def _final_accuracy(row: dict) -> float:
    """Points of greedy accuracy counted from the row's records of its last evaluation (300 problems)."""
    last = row["eval_per_problem"][-1]
    assert last["step"] == row["steps"] == 16 and len(last["records"]) == 300
    acc = 100 * statistics.fmean(bool(r["correct"]) for r in last["records"])
    assert acc == pytest.approx(100 * row["accuracy_after"], abs=1e-9)
    return acc


def test_the_paired_difference_recomputed_from_the_units_records_is_the_committed_one():
    from scipy import stats

    ahead, sync = [], []
    for seed in SEEDS:
        a = _row(CHECK / "units" / f"seed{seed}-cppo-pooled-overlap" / "result.json")
        s = _row(SWEEP41 / "units" / f"seed{seed}-cppo-pooled" / "result.json")
        assert a["max_staleness"] == 1 and a["steps_per_generation"] == 1 and "max_staleness" not in s
        assert a["train_question_ids"] == s["train_question_ids"]  # the same questions, in the same order
        assert {k: a[k] for k in ("pruning_rate", "selection_scope", "allocation", "seed")} == {
            k: s[k] for k in ("pruning_rate", "selection_scope", "allocation", "seed")
        }
        ahead.append(_final_accuracy(a))
        sync.append(_final_accuracy(s))
    d = [x - y for x, y in zip(sync, ahead)]
    lo, hi = stats.t.interval(0.95, len(d) - 1, loc=statistics.fmean(d), scale=stats.sem(d))
    got = json.loads((CHECK / "overlap-accuracy-seeds.json").read_text())["summary"]["accuracy_differences"]
    pair = got[f"{SYNC} - {AHEAD}"]
    assert pair["n"] == 3 and 100 * pair["mean"] == pytest.approx(statistics.fmean(d), abs=1e-9)
    assert [100 * v for v in pair["ci95"]] == pytest.approx([lo, hi])
    assert round(statistics.fmean(d), 1) == -2.7 and (round(lo, 1), round(hi, 1)) == (-5.7, 0.3)  # as the docs say


def test_the_synchronous_rerun_equals_sweep41s_unit_problem_by_problem():
    rerun = _row(CHECK / "repro" / "seed51-cppo-pooled" / "result.json")
    committed = _row(SWEEP41 / "units" / "seed51-cppo-pooled" / "result.json")
    assert rerun["eval_per_problem"] == committed["eval_per_problem"]
    for key in ("accuracy_after", "tokens_forward", "tokens_trained", "train_question_ids", "reward_mean"):
        assert rerun[key] == committed[key], key


def test_the_committed_combination_holds_every_rows_records_and_combines_again(tmp_path):
    data = json.loads((CHECK / "overlap-accuracy-seeds.json").read_text())
    assert "per_problem_missing" not in data["meta"]
    lines = (CHECK / "overlap-accuracy-seeds-per-problem.jsonl").read_text().splitlines()
    former = (SWEEP41 / "sweep41-seeds-per-problem.jsonl").read_text().splitlines()
    assert set(former) <= set(lines) and len(lines) == len(former) + 3 * 300  # sweep 41's, then each unit's last
    shutil.copytree(CHECK / "units", tmp_path / "units")
    shutil.copy(CHECK / "sweep.json", tmp_path / "sweep.json")
    argv = ["--seeds", *map(str, SEEDS), "--arms", "cppo-pooled-overlap", "--combine", "--out", str(tmp_path),
            "--name", "overlap-accuracy", "--with", str(SWEEP41 / "sweep41-seeds.json")]  # fmt: skip
    again = accuracy_seeds.main(argv)
    again = json.loads(json.dumps(again))  # as written (per-seed keys as strings)
    assert again["summary"]["accuracy_differences"] == data["summary"]["accuracy_differences"]
    assert (tmp_path / "overlap-accuracy-seeds-per-problem.jsonl").read_text().splitlines() == lines


def test_rows_written_before_generating_ahead_existed_read_as_synchronous():
    old = _row(SWEEP41 / "units" / "seed51-cppo-pooled" / "result.json")
    ahead = _row(CHECK / "units" / "seed51-cppo-pooled-overlap" / "result.json")
    assert accuracy_arm.arm_of(old) == "cppo-pooled" and accuracy_arm.arm_of(ahead) == "cppo-pooled-overlap"
    assert seeds_report.method(old) == SYNC and seeds_report.method(ahead) == AHEAD
    batched = {**old, "pruning_rate": 0.0, "steps_per_generation": 4, "max_staleness": 3}
    assert seeds_report.method(batched) == "GRPO + max_staleness=3 + steps_per_generation=4"
    assert accuracy_arm.arm_of(batched) is None  # no arm generates 4 steps at once


def _combined(tmp_path, rows, records):
    path = tmp_path / "x-seeds.json"
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    if records is not None:
        (tmp_path / "x-seeds-per-problem.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_with_records_puts_back_each_rows_records_and_refuses_a_stray_one(tmp_path):
    row = {"seed": 7, "pruning_rate": 0.0, "selection_metric": "smallest"}
    rec = {"index": 0, "id": "a", "correct": True}
    untrained = {"seed": 7, "arm": "untrained", "method": None, "step": 0, **rec}
    trained = {"seed": 7, "arm": "grpo", "method": "GRPO", "step": 4, **rec, "correct": False}
    assert sweep_files.with_records(_combined(tmp_path, [row], None), [row]) == [row]  # nothing beside it
    path = _combined(tmp_path, [row], [untrained, trained])
    back = sweep_files.with_records(path, [row])
    wrong = {**rec, "correct": False}
    assert back[0]["eval_per_problem"] == [{"step": 0, "records": [rec]}, {"step": 4, "records": [wrong]}]
    # two distinct untrained evaluations (written once each, under their first row's seed): neither is guessed
    other = {**untrained, "seed": 9, "correct": False}
    back = sweep_files.with_records(_combined(tmp_path, [row], [untrained, other, trained]), [row])
    assert back[0]["eval_per_problem"] == [{"step": 4, "records": [wrong]}]
    stray = {**trained, "seed": 8}
    with pytest.raises(ValueError, match=r"x-seeds-per-problem.jsonl: records of \(8, 'GRPO'\)"):
        sweep_files.with_records(_combined(tmp_path, [row], [stray]), [row])
    with pytest.raises(ValueError, match=r"x-seeds-per-problem.jsonl:1 is not a per-problem record"):
        sweep_files.with_records(_combined(tmp_path, [row], [{"seed": 7}]), [row])
