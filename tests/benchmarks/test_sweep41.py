"""Issue 41's pre-registered run (``benchmarks/results/sweep41``): its committed units combined again on a copy, the
pre-registered analyses recomputed independently from the units' own per-problem records with scipy, each unit
checked to have run what its arm claims, and the numbers docs/results.md and the README quote."""

from __future__ import annotations

import json
import shutil
import statistics

import pytest
from sweep_cases import REPO
from sweeps import report as seeds_report
from sweeps import seeds as accuracy_seeds

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
    # and the README states the primary interval and the secondary's 90% interval, each with the verdict it had
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    p, s = saved["summary"]["preregistered"]["primary"], saved["summary"]["preregistered"]["secondary"]
    found = "found no difference" if not p["significant"] else "found a difference"
    ci = p["ci95_points"]
    interval = f"({p['mean_points']:+.1f} points, 95% interval [{ci[0]:+.1f}, {ci[1]:+.1f}])"
    assert f"{found} between per-question and pooled pruning {interval}" in readme
    shown = "did not show" if not s["equivalent"] else "showed"
    ci = s["ci90_points"]
    interval = f"({s['mean_points']:+.1f}, 90% interval [{ci[0]:+.1f}, {ci[1]:+.1f}])"
    assert f"{shown} per-question pruning within 3 points of GRPO {interval}" in readme


def test_the_exploratory_figures_the_docs_quote_are_what_the_committed_files_give():
    """docs/results.md's exploratory paragraph and time table (not pre-registered): pooled - GRPO, the tests without
    seed 59 and Wilcoxon's, the per-problem counts of problems one arm solved and the other did not, and each arm's
    mean training CPU seconds and tokens forwarded."""
    from scipy import stats

    acc = _accuracies()
    docs = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    section = docs[docs.index("##### The result (reported 2026-12-05") : docs.index("**What this changes.**")]
    text = " ".join(section.split())  # the paragraph's line breaks
    d = [acc["cppo-pooled", s] - acc["grpo", s] for s in SEEDS]
    lo, hi = stats.t.interval(0.95, len(d) - 1, loc=statistics.fmean(d), scale=stats.sem(d))
    down = sum(x < 0 for x in d)
    interval = f"{statistics.fmean(d):+.1f} points, 95% interval [{lo:+.1f}, {hi:+.1f}]"
    assert f"Pooled CPPO - GRPO: {interval}, lower on {down} of 20 seeds" in text
    found = []
    for b in ("cppo-pooled", "grpo"):
        d = [acc["cppo-group", s] - acc[b, s] for s in SEEDS]
        kept = [acc["cppo-group", s] - acc[b, s] for s in SEEDS if s != 59]
        found.append((statistics.fmean(kept), stats.ttest_1samp(kept, 0).pvalue, stats.wilcoxon(d).pvalue))
    (m1, p1, w1), (m2, p2, w2) = found
    without = f"the primary comparison is {m1:+.1f} points (t test p = {p1:.2f}) and the secondary {m2:+.1f}"
    assert f"without it {without} (p = {p2:.3f})" in text
    assert f"gives p = {w1:.2f} and p = {w2:.3f}" in text
    solved: dict[tuple, dict[str, bool]] = {}
    for line in (SWEEP / "sweep41-seeds-per-problem.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["arm"] != "untrained":
            solved.setdefault((r["seed"], r["id"], r["sample"]), {})[r["arm"]] = bool(r["correct"])
    assert len(solved) == 20 * 300

    def only(a, b):
        return sum(v[a] and not v[b] for v in solved.values())

    assert (
        f"per-question {only('cppo-group', 'cppo-pooled')} against pooled {only('cppo-pooled', 'cppo-group')}; "
        f"per-question {only('cppo-group', 'grpo')} against GRPO {only('grpo', 'cppo-group')}; "
        f"pooled {only('cppo-pooled', 'grpo')} against GRPO {only('grpo', 'cppo-pooled')}"
    ) in text
    rows = {line.split(" | ")[0][2:]: line for line in section.splitlines() if line.startswith("| ")}
    names = {"grpo": "GRPO", "cppo-pooled": "CPPO pooled P = 0.75", "cppo-group": "CPPO per question P = 0.75"}
    for arm, name in names.items():
        cpu = statistics.fmean(_unit(s, arm)["cpu_seconds"] for s in SEEDS)
        tokens = statistics.fmean(_unit(s, arm)["tokens_forward"] for s in SEEDS)
        assert rows[name].endswith(f"| {cpu:.0f} | {tokens:,.0f} |"), rows[name]
    summary = json.loads((SWEEP / "sweep41-seeds.json").read_text())["summary"]
    for method, name in (("CPPO P=0.75", names["cppo-pooled"]), ("CPPO group P=0.75", names["cppo-group"])):
        cpu, wall = summary["time_ratios"][method]["cpu"], summary["time_ratios"][method]["total"]
        on_cpu = f"**{cpu['mean']:.3f}** [{cpu['ci95'][0]:.3f}, {cpu['ci95'][1]:.3f}]"
        on_wall = f"{wall['mean']:.3f} [{wall['ci95'][0]:.3f}, {wall['ci95'][1]:.3f}]"
        assert f"| {on_cpu} | {on_wall} |" in rows[name], rows[name]
    means = {m: f"{100 * summary['per_method'][m]['accuracy_after']['mean']:.1f}%" for m in summary["methods"]}
    assert f"GRPO {means['GRPO']}, pooled {means['CPPO P=0.75']}, per-question {means['CPPO group P=0.75']}" in text
