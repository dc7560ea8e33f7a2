"""Issue 52 (docs/results.md, "Pre-registered: CPPO at GRPO's compute"): the committed files of its run.

Part 2, the old units still stand: seed 51's ``cppo-pooled`` unit and the untrained evaluation, rerun at the plan's
commit, reproduce sweep 41's committed ones exactly (accuracy, every per-problem record, every token count); the
plan was committed before any of the run's units started.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import statistics

import pytest

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SWEEP41, SWEEP52 = RESULTS / "sweep41" / "units", RESULTS / "sweep52"
#: The commit of the plan (docs/results.md and the arm), and its time: every unit of the run ran after it, at it.
PLAN_COMMIT, PLAN_TIME = "067bb8a654b0010d3709b5e072d64b69b84d3e9a", "2026-12-07T18:06:08+00:00"
#: Row fields that are measured times (they differ between runs by nature).
TIMES = ("phase_seconds", "total_seconds", "train_seconds", "setup_seconds", "cpu_seconds", "phase_cpu_seconds",
         "generation_share", "eval_seconds")  # fmt: skip
#: Settings added to TrainConfig after sweep 41's commit, at their defaults (absent from its files: the default).
NEW_SETTINGS = {"rollout_stop_rate": 0.0, "rollout_stop_at": 0.25, "rollout_stop_scorer": "learned"}


def _read(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


def _units() -> list[pathlib.Path]:
    return sorted(p for p in SWEEP52.rglob("result.json") if "units" in p.parts)


def test_the_rerun_unit_reproduces_the_committed_one_exactly():
    new = _read(SWEEP52 / "repro" / "units" / "seed51-cppo-pooled" / "result.json")["rows"][0]
    old = _read(SWEEP41 / "seed51-cppo-pooled" / "result.json")["rows"][0]
    assert new["accuracy_after"] == old["accuracy_after"] == 0.43
    assert new["eval_per_problem"] == old["eval_per_problem"] and len(new["eval_per_problem"][-1]["records"]) == 300
    differs = {k for k in new if new[k] != old.get(k, NEW_SETTINGS.get(k))}
    assert differs <= {*TIMES, "accuracy_curve"}, differs  # every count, id, reward and record equal
    # the curve: the same steps and accuracies, at other wall-clock times
    assert [p[1:] for p in new["accuracy_curve"]] == [p[1:] for p in old["accuracy_curve"]]


def test_the_untrained_evaluation_reproduces_the_committed_one_exactly():
    new, old = (_read(d / "before" / "result.json")["point"] for d in (SWEEP52 / "repro" / "units", SWEEP41))
    assert {k: v for k, v in new.items() if k != "eval_seconds"} == {
        k: v for k, v in old.items() if k != "eval_seconds"
    }
    assert new["correct"] == 65 and len(new["per_problem"]) == 300


@pytest.mark.parametrize("path", _units(), ids=lambda p: str(p.relative_to(SWEEP52)))
def test_every_unit_ran_at_the_plans_commit_after_it(path):
    meta = _read(path)["meta"]
    assert meta["git_commit"] == PLAN_COMMIT and meta["git_dirty"] is False
    started = datetime.datetime.fromisoformat(meta["date"])
    assert started > datetime.datetime.fromisoformat(PLAN_TIME), meta["date"]


def test_the_agreement_check_accepts_the_new_units_beside_the_committed_ones():
    """The sweep's agreement check (settings and environment) accepts every finished unit of the new arm beside sweep
    41's grpo and cppo-pooled units of the same seeds, which the plan compares them with."""
    from sweeps import files

    new = sorted((SWEEP52 / "units").glob("seed*-cppo-pooled-2epochs/result.json"))
    assert new, "no finished unit of the arm committed yet"
    seeds = [p.parent.name.split("-")[0] for p in new]
    old = [SWEEP41 / f"{seed}-{arm}" / "result.json" for seed in seeds for arm in ("grpo", "cppo-pooled")]
    files.check_agree([(p, *files.read_result(p, "unit")) for p in [*old, *new]])
    # and refuses the same units where a compared setting or a library differs (its negative control)
    meta, rows = files.read_result(new[0], "unit")
    for key, value in (("beta", 0.0), ("transformers", "5.24.0")):
        with pytest.raises(ValueError, match=key):
            files.check_agree(
                [(p, *files.read_result(p, "unit")) for p in old] + [(new[0], {**meta, key: value}, rows)]
            )


SEEDS = list(range(51, 71))


def _final_points(row: dict, steps: int) -> float:
    """Points of greedy accuracy counted from the row's records of its last evaluation (after ``steps`` steps, 300
    problems), checked against the accuracy the row reports."""
    last = row["eval_per_problem"][-1]
    assert last["step"] == row["steps"] == steps and len(last["records"]) == row["eval_problems"] == 300
    points = 100 * sum(bool(r["correct"]) for r in last["records"]) / 300
    assert points == pytest.approx(100 * row["accuracy_after"], abs=1e-9)
    return points


def _unit_row(path: pathlib.Path) -> dict:
    rows = _read(path)["rows"]
    assert len(rows) == 1
    return rows[0]


def test_the_preregistered_analysis_recomputed_from_the_units_records_is_the_reported_one():
    """The plan's analyses, recomputed independently (scipy) from the per-problem records of the 20 new units and of
    sweep 41's grpo and cppo-pooled units of the same seeds, equal the combined file's pre-registered summary; the
    verdict follows the plan's rules; the CPU-seconds ratio is the units' own."""
    from scipy import stats

    acc, cpu = {}, {}
    for seed in SEEDS:
        new = _unit_row(SWEEP52 / "units" / f"seed{seed}-cppo-pooled-2epochs" / "result.json")
        assert new["arm"] == "cppo-pooled-2epochs" and new["num_epochs"] == 2 and new["pruning_rate"] == 0.75
        assert new["seed"] == new["question_seed"] == seed and new["questions_seen"] == 128  # 64 questions twice
        acc["2epochs", seed], cpu["2epochs", seed] = _final_points(new, 32), new["cpu_seconds"]
        for arm, steps in (("grpo", 64), ("cppo-pooled", 16)):
            old = _unit_row(SWEEP41 / f"seed{seed}-{arm}" / "result.json")
            assert old["train_question_ids"] == new["train_question_ids"]  # the same 64 questions
            acc[arm, seed], cpu[arm, seed] = _final_points(old, steps), old["cpu_seconds"]
    pre = _read(SWEEP52 / "sweep52-seeds.json")["summary"]["preregistered"]
    assert pre["kind"] == "compute" and pre["seeds"] == SEEDS and pre["alpha"] == 0.05 and pre["margin_points"] == 3
    for key, b in (("primary", "grpo"), ("secondary", "cppo-pooled")):
        x, y = [acc["2epochs", s] for s in SEEDS], [acc[b, s] for s in SEEDS]
        d = [u - v for u, v in zip(x, y)]
        test = stats.ttest_rel(x, y)
        got = pre[key]
        assert got["n"] == 20 and got["df"] == 19 and got["mean_points"] == pytest.approx(statistics.fmean(d))
        assert got["t"] == pytest.approx(test.statistic) and got["p"] == pytest.approx(test.pvalue)
        for level in (0.95, 0.90):
            lo, hi = stats.t.interval(level, 19, loc=statistics.fmean(d), scale=stats.sem(d))
            assert got[f"ci{round(100 * level)}_points"] == pytest.approx([lo, hi])
    p = pre["primary"]
    (lo95, hi95), (lo90, hi90) = p["ci95_points"], p["ci90_points"]
    verdict = ("better" if lo95 > 0 else "worse" if hi95 < 0 else "equivalent" if -3 < lo90 and hi90 < 3
               else "inconclusive, leaning " + ("above" if p["mean_points"] > 0 else "below"))  # fmt: skip
    assert p["verdict"] == verdict
    assert pre["secondary"]["significant"] == (pre["secondary"]["p"] < 0.05)
    ratios = [cpu["2epochs", s] / cpu["grpo", s] for s in SEEDS]
    lo, hi = stats.t.interval(0.95, 19, loc=statistics.fmean(ratios), scale=stats.sem(ratios))
    got = pre["compute"]
    assert got["mean"] == pytest.approx(statistics.fmean(ratios)) and got["ci95"] == pytest.approx([lo, hi])
    assert got["range"] == [0.9, 1.2] and got["equal_compute"] == (0.9 <= statistics.fmean(ratios) <= 1.2)
