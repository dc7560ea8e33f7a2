"""Issue 41's pre-registered run (``benchmarks/results/sweep41``): its committed units combined again on a copy, the
pre-registered analyses recomputed independently from the units' own per-problem records with scipy, each unit
checked to have run what its arm claims, and the numbers docs/results.md and the README quote."""

from __future__ import annotations

import json
import shutil
import statistics

import accuracy_seeds
import pytest
import seeds_report
from sweep_cases import REPO

SWEEP = REPO / "benchmarks" / "results" / "sweep41"
SEEDS = list(range(51, 71))
ARMS = ["grpo", "cppo-pooled", "cppo-group"]
#: what each arm sets (benchmarks/accuracy_arm.py ARMS, as the plan in docs/results.md names them)
CLAIMS = {
    "grpo": {"pruning_rate": 0.0, "selection_scope": "batch", "allocation": True},
    "cppo-pooled": {"pruning_rate": 0.75, "selection_scope": "batch", "allocation": True},
    "cppo-group": {"pruning_rate": 0.75, "selection_scope": "group", "allocation": True},
}


def _unit(seed: int, arm: str) -> dict:
    rows = json.loads((SWEEP / "units" / f"seed{seed}-{arm}" / "result.json").read_text())["rows"]
    assert len(rows) == 1
    return rows[0]


def _accuracies() -> dict[tuple[str, int], float]:
    """Final greedy accuracy in points per (arm, seed), counted from the unit's per-problem records of its last
    evaluation, which must agree with the count the unit reports."""
    acc, questions = {}, {}
    for seed in SEEDS:
        for arm in ARMS:
            row = _unit(seed, arm)
            assert row["seed"] == row["question_seed"] == seed and row["arm"] == arm
            assert {k: row[k] for k in CLAIMS[arm]} == CLAIMS[arm]
            assert row["questions_seen"] == row["questions"] == 64 and row["group_size"] == 8
            last = row["eval_per_problem"][-1]
            assert last["step"] == row["steps"] and len(last["records"]) == row["eval_problems"] == 300
            acc[arm, seed] = 100 * statistics.fmean(bool(r["correct"]) for r in last["records"])
            assert acc[arm, seed] == pytest.approx(100 * row["accuracy_after"], abs=1e-9)
            questions.setdefault(seed, row["train_question_ids"])
            assert row["train_question_ids"] == questions[seed]  # the arms of a seed train the same questions
    assert len(set(map(str, questions.values()))) == len(SEEDS)  # each seed its own questions
    return acc


def test_the_preregistered_analyses_recomputed_from_the_units_agree_with_the_committed_report():
    from scipy import stats

    acc = _accuracies()
    pre = json.loads((SWEEP / "sweep41-seeds.json").read_text())["summary"]["preregistered"]
    assert pre["seeds"] == SEEDS and pre["alpha"] == 0.05 and pre["margin_points"] == 3.0
    plan = (("primary", ("cppo-group", "cppo-pooled"), 0.95), ("secondary", ("cppo-group", "grpo"), 0.90))
    for key, (a, b), level in plan:
        x, y = [acc[a, s] for s in SEEDS], [acc[b, s] for s in SEEDS]
        d = [u - v for u, v in zip(x, y)]
        test = stats.ttest_rel(x, y)
        lo, hi = stats.t.interval(level, len(d) - 1, loc=statistics.fmean(d), scale=stats.sem(d))
        got = pre[key]
        assert got["n"] == 20 and got["df"] == 19
        assert got["mean_points"] == pytest.approx(statistics.fmean(d), abs=1e-9)
        assert got["t"] == pytest.approx(test.statistic) and got["p"] == pytest.approx(test.pvalue)
        assert got[f"ci{round(100 * level)}_points"] == pytest.approx([lo, hi])
    assert pre["primary"]["significant"] == (pre["primary"]["p"] < 0.05)
    lo, hi = pre["secondary"]["ci90_points"]
    assert pre["secondary"]["equivalent"] == (-3 < lo and hi < 3)


def test_the_committed_run_combines_again_as_committed_and_as_the_docs_say(tmp_path):
    shutil.copytree(SWEEP / "units", tmp_path / "units")
    shutil.copy(SWEEP / "sweep.json", tmp_path / "sweep.json")
    seeds = [str(s) for s in SEEDS]
    argv = ["--seeds", *seeds, "--arms", *ARMS, "--name", "sweep41", "--out", str(tmp_path), "--combine"]
    data = accuracy_seeds.main(argv)
    saved = json.loads((SWEEP / "sweep41-seeds.json").read_text())
    assert data["meta"]["sweep"]["missing"] == [] and len(data["rows"]) == len(saved["rows"]) == 60
    found = json.loads(json.dumps(data["summary"]))
    assert found["preregistered"] == saved["summary"]["preregistered"]
    assert found["accuracy_differences"] == saved["summary"]["accuracy_differences"]
    # the per-problem file: every unit's evaluations and the shared untrained one, 300 problems each
    lines = (SWEEP / "sweep41-seeds-per-problem.jsonl").read_text().splitlines()
    assert lines == (tmp_path / "sweep41-seeds-per-problem.jsonl").read_text().splitlines()
    assert len(lines) == 300 * (60 + 1)
    # docs/results.md quotes the pre-registered table exactly as the report prints it
    docs = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    for line in seeds_report.format_preregistered(saved["summary"]["preregistered"])[2:]:
        assert line in docs
    # and the README states the primary interval and the secondary's 90% interval as the report gives them
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    p, s = saved["summary"]["preregistered"]["primary"], saved["summary"]["preregistered"]["secondary"]
    assert (
        f"({p['mean_points']:+.1f} points, 95% interval [{p['ci95_points'][0]:+.1f}, {p['ci95_points'][1]:+.1f}])"
        in readme
    )
    assert f"({s['mean_points']:+.1f}, 90% interval [{s['ci90_points'][0]:+.1f}, {s['ci90_points'][1]:+.1f}])" in readme
    assert ("no difference" in readme) == (not p["significant"]) and ("not within" in readme) == (not s["equivalent"])
