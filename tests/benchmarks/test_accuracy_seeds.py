"""benchmarks/accuracy_seeds.py and seeds_report.py: methods named from rows, the paired differences and their t
intervals against a hand computation, the time ratios, the target, bad arguments, and the combination of per-seed
JSONs (--from-runs) into the JSON and plot; a seconds-long run of two seeds on a tiny model."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest
from sweeps import report as seeds_report
from sweeps import seeds as accuracy_seeds
from sweeps import stats as seeds_stats

from cppo import fileio


def _row(seed, p, metric, acc, seconds, train=None):
    return {
        "seed": seed, "pruning_rate": p, "selection_metric": metric, "accuracy_after": acc, "total_seconds": seconds,
        "cpu_seconds": seconds - 40.0, "train_seconds": train if train is not None else seconds / 2,
        "eval_problems": 300, "eval_problems_scored": 300,
        "questions": 64, "group_size": 8,
    }  # fmt: skip


ACC = {  # seed: (GRPO, CPPO, random) final accuracies
    42: (0.40, 0.42, 0.30),
    43: (0.35, 0.31, 0.33),
    44: (0.50, 0.49, 0.41),
}


def _rows():
    rows = []
    for seed, (g, c, r) in ACC.items():
        rows += [_row(seed, 0.0, "smallest", g, 1000.0 + seed), _row(seed, 0.75, "smallest", c, 300.0 + seed)]
        rows.append(_row(seed, 0.75, "random", r, 320.0))
    return rows


def test_method_names():
    assert seeds_report.method(_row(1, 0.0, "smallest", 0.1, 1)) == "GRPO"
    assert seeds_report.method(_row(1, 0.75, "smallest", 0.1, 1)) == "CPPO P=0.75"
    assert seeds_report.method(_row(1, 0.75, "max-variance", 0.1, 1)) == "max-variance P=0.75"


def test_paired_differences_and_t_intervals_match_a_hand_computation():
    s = seeds_report.summarise(_rows())
    assert s["seeds"] == [42, 43, 44] and s["methods"] == ["CPPO P=0.75", "GRPO", "random P=0.75"]
    d = s["accuracy_differences"]["CPPO P=0.75 - GRPO"]
    diffs = [c - g for g, c, _ in ACC.values()]
    assert list(d["per_seed"].values()) == pytest.approx(diffs)
    half = 4.302653 * statistics.stdev(diffs) / math.sqrt(3)  # t(0.975, df=2)
    assert d["mean"] == pytest.approx(sum(diffs) / 3)
    assert d["ci95"] == pytest.approx([d["mean"] - half, d["mean"] + half])
    r = s["accuracy_differences"]["CPPO P=0.75 - random P=0.75"]
    assert r["mean"] == pytest.approx(sum(c - x for _, c, x in ACC.values()) / 3)
    t = s["time_ratio_total"]  # CPU seconds by default
    assert t["per_seed"][42] == pytest.approx(302.0 / 1002.0) and s["time_basis"].startswith("cpu_seconds")
    assert t["of_sums"] == pytest.approx((302 + 303 + 304) / (1002 + 1003 + 1004))
    assert s["time_ratios"]["CPPO P=0.75"]["cpu"] is t
    wall = seeds_report.summarise(_rows(), time="wall")["time_ratio_total"]
    assert wall["per_seed"][42] == pytest.approx(342.0 / 1042.0)
    assert wall["of_sums"] == pytest.approx((342 + 343 + 344) / (1042 + 1043 + 1044))
    assert s["target"]["within_grpo"] is True and s["target"]["at_most_half_the_time"] is True
    assert s["target"]["above_random"] is True


def test_cpu_time_ratios_need_cpu_seconds_in_every_row():
    rows = [{k: v for k, v in r.items() if k != "cpu_seconds"} if r["pruning_rate"] == 0 else r for r in _rows()]
    with pytest.raises(ValueError, match=r"--time cpu: rows of \['GRPO'\] have no cpu_seconds"):
        seeds_report.summarise(rows)
    wall = seeds_report.summarise(rows, time="wall")
    assert wall["time_ratio_total"]["n"] == 3
    text = seeds_report.format_summary(wall, seeds_report.by_seed(rows))  # the per-seed table in wall seconds too
    assert "seed 42: accuracy, wall s" in text and "CPU s" not in text.split("\n\n", 1)[0]
    with pytest.raises(ValueError, match="--time must be one of"):
        seeds_report.summarise(_rows(), time="gpu")


def test_target_misses_are_reported():
    rows = [r | {"accuracy_after": r["accuracy_after"] - 0.2} if r["selection_metric"] == "smallest" and
            r["pruning_rate"] else r for r in _rows()]  # fmt: skip
    s = seeds_report.summarise(rows)
    assert s["target"]["within_grpo"] is False and s["target"]["above_random"] is False


def test_t_quantiles():
    # the printed tables' values (two-sided 95%): 12.706 at df 1, 4.303 at 2, 2.093 at 19, 1.984 at 100
    for df, q in ((1, 12.706), (2, 4.303), (19, 2.093), (100, 1.984)):
        assert seeds_stats.t95(df) == pytest.approx(q, abs=5e-4)
    assert seeds_stats.t_quantile(5, 0.90) == pytest.approx(2.015, abs=5e-4)  # the equivalence test's 90%
    with pytest.raises(ValueError, match="2 seeds"):
        seeds_stats.t95(0)
    for bad in (0, 1, 95, -0.5):  # a percentage or a bound: an error naming it, not NaN
        with pytest.raises(ValueError, match=f"confidence must lie in \\(0, 1\\), got {bad}"):
            seeds_stats.t_quantile(5, bad)


def test_methods_missing_on_a_seed_pair_over_the_seeds_they_share():
    rows = _rows()[:-1]  # seed 44 without its random run
    s = seeds_report.summarise(rows)
    r = s["accuracy_differences"]["CPPO P=0.75 - random P=0.75"]
    assert list(r["per_seed"]) == [42, 43] and r["n"] == 2
    assert r["mean"] == pytest.approx(((0.42 - 0.30) + (0.31 - 0.33)) / 2)
    assert r["signs"] == {"positive": 1, "negative": 1, "zero": 0}
    assert s["per_method"]["random P=0.75"]["seeds"] == [42, 43] and s["per_method"]["GRPO"]["seeds"] == [42, 43, 44]
    with pytest.raises(ValueError, match="two GRPO rows"):
        seeds_report.summarise(_rows() + [_row(42, 0.0, "smallest", 0.1, 1.0)])


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--seeds", "1"], "--seeds must be >= 2"),
        (["--seeds", "1", "1"], "--seeds must be >= 2 distinct"),
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--", "--config", "tiny-cpu", "--seed", "3"], "must not set \\['--seed'\\]"),
    ],
)
def test_bad_arguments(argv, match):
    with pytest.raises(ValueError, match=match):
        accuracy_seeds.parse_args(argv)


def test_seed_commands_set_seed_threads_schedule_and_names(tmp_path):
    args = accuracy_seeds.parse_args(["--seeds", "5", "6"])
    cmd = accuracy_seeds.seed_command(args, 5, tmp_path)
    assert cmd[2 : 2 + len(accuracy_seeds.DEFAULT_SPEEDUP_ARGS)] == list(accuracy_seeds.DEFAULT_SPEEDUP_ARGS)
    tail = " ".join(cmd)
    assert "--seed 5 --threads 1 --schedule sequential" in tail and "--name accuracy-smollm2-seed5" in tail


def test_from_runs_combines_the_seed_files(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    args = accuracy_seeds.parse_args([])
    for seed in ACC:
        rows = [r for r in _rows() if r["seed"] == seed]
        argv = accuracy_seeds.seed_command(args, seed, runs)[2:]  # the command line speedup.py records
        meta = {"model": "m", "seed": seed, "argv": argv}
        fileio.write_json(runs / f"accuracy-smollm2-seed{seed}.json", {"meta": meta, "rows": rows})
    out = tmp_path / "out"
    data = accuracy_seeds.main(["--from-runs", str(runs), "--out", str(out)])
    written = json.loads((out / "accuracy-smollm2-seeds.json").read_text())
    assert written["summary"] == json.loads(json.dumps(data["summary"]))
    assert len(written["rows"]) == 9 and (out / "accuracy-smollm2-seeds.png").stat().st_size > 0
    assert written["meta"]["seeds"] == [42, 43, 44] and "seed" not in written["meta"]
    (runs / "accuracy-smollm2-seed43.json").write_text('{"meta": {}, "rows": [{"pruning_rate": 0}]}')
    with pytest.raises(ValueError, match="rows lack \\['accuracy_after'"):
        accuracy_seeds.main(["--from-runs", str(runs), "--out", str(out)])
    (runs / "accuracy-smollm2-seed43.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a speedup.py result"):
        accuracy_seeds.main(["--from-runs", str(runs), "--out", str(out)])
    with pytest.raises(ValueError, match="seed 45 did not finish"):
        accuracy_seeds.main(["--from-runs", str(runs), "--out", str(out), "--seeds", "44", "45"])


def test_two_tiny_seeds_end_to_end(tmp_path):
    """The driver runs speedup.py per seed (here the tiny preset, one eval problem) and the rows carry the issue's
    fields: seed, the seed's own training questions, distinct evaluation problems."""
    speedup_args = ["--config", "tiny-cpu", "--pruning-rates", "0", "0.5", "--selection-metric", "random@0.5",
                    "max-variance@0.5", "--questions", "2", "--questions-per-step", "1", "--eval", "3",
                    "--eval-points", "1", "--no-warmup", "--set", "max_completion_length=4",
                    "group_size=4"]  # fmt: skip
    cmd = [sys.executable, str(accuracy_seeds.HERE / "accuracy_seeds.py"), "--seeds", "1", "2", "--out",
           str(tmp_path), "--", *speedup_args]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads((tmp_path / "accuracy-smollm2-seeds.json").read_text())
    rows = data["rows"]
    assert {r["seed"] for r in rows} == {1, 2} and len(rows) == 8
    for r in rows:
        assert r["eval_problems"] == r["eval_problems_scored"] == 3 and r["question_seed"] == r["seed"]
        assert {"selection_metric", "allocation", "accuracy_after", "total_seconds", "pruning_rate"} <= set(r)
    ids = {r["seed"]: tuple(r["train_question_ids"]) for r in rows if r["pruning_rate"] == 0}
    assert ids[1] != ids[2] and all(len(v) == 2 for v in ids.values())
    assert {r["selection_scope"] for r in rows if r["selection_metric"] == "max-variance"} == {"group"}
    assert set(data["summary"]["accuracy_differences"]) == {
        "CPPO P=0.5 - GRPO", "CPPO P=0.5 - random P=0.5", "CPPO P=0.5 - max-variance P=0.5",
        "random P=0.5 - GRPO", "max-variance P=0.5 - GRPO",
    }  # fmt: skip


def test_dry_run_checks_every_seed_plan(capsys):
    tiny = ["--config", "tiny-cpu", "--questions", "4", "--eval", "3"]
    plan = accuracy_seeds.main(["--seeds", "3", "4", "--dry-run", "--", *tiny, "--pruning-rates", "0", "0.5"])
    assert plan["dry_run"] == "ok" and set(plan["seeds"]) == {3, 4}
    assert json.loads(capsys.readouterr().out)["seeds"]["3"]["rates"][1]["pruning_rate"] == 0.5
    with pytest.raises(ValueError, match="seed 3: .*--pruning-rates"):
        accuracy_seeds.main(["--seeds", "3", "4", "--dry-run", "--", *tiny, "--pruning-rates", "0.5"])


def _prereg_rows(group_minus_pooled, group_minus_grpo):
    """Rows of GRPO, CPPO pooled and CPPO per-question on seeds 51.. with the given paired differences (points)."""
    rows = []
    for i, (dp, dg) in enumerate(zip(group_minus_pooled, group_minus_grpo)):
        group = 0.40 + 0.01 * i
        rows += [_row(51 + i, 0.0, "smallest", group - dg / 100, 1000.0),
                 _row(51 + i, 0.75, "smallest", group - dp / 100, 400.0),
                 _row(51 + i, 0.75, "smallest", group, 450.0) | {"selection_scope": "group"}]  # fmt: skip
    return rows


def test_the_preregistered_analyses_match_a_hand_computation():
    dp = [1.0, 3.0, -1.0, 2.0, 4.0, 0.0]  # per-question - pooled, points
    dg = [0.5, -0.5, 1.0, -1.0, 0.0, 0.5]  # per-question - GRPO, points
    pre = seeds_report.summarise(_prereg_rows(dp, dg))["preregistered"]
    assert pre["seeds"] == [51, 52, 53, 54, 55, 56] and pre["alpha"] == 0.05 and pre["margin_points"] == 3.0
    p = pre["primary"]
    assert (p["a"], p["b"], p["n"], p["df"]) == ("CPPO group P=0.75", "CPPO P=0.75", 6, 5)
    mean, sd = statistics.fmean(dp), statistics.stdev(dp)
    t = mean / (sd / math.sqrt(6))
    assert p["mean_points"] == pytest.approx(mean) and p["t"] == pytest.approx(t)
    # t(0.975, 5) = 2.5706: the 95% interval; p two-sided from the t distribution with 5 df (t = 1.964 -> p = 0.107)
    assert p["ci95_points"] == pytest.approx([mean - 2.570582 * sd / math.sqrt(6), mean + 2.570582 * sd / math.sqrt(6)])
    assert p["p"] == pytest.approx(0.1067, abs=5e-4) and p["significant"] is False
    s = pre["secondary"]
    mean_g, sd_g = statistics.fmean(dg), statistics.stdev(dg)
    half = 2.015048 * sd_g / math.sqrt(6)  # t(0.95, 5): the 90% interval of the equivalence test
    assert s["ci90_points"] == pytest.approx([mean_g - half, mean_g + half]) and s["equivalent"] is True
    # a wide secondary interval is not equivalence; a consistent gain is significant
    wide = seeds_report.summarise(_prereg_rows([3.0, 3.5, 2.5, 3.0, 3.2, 2.8], [5.0, -6.0, 4.0, -3.0, 6.0, -5.0]))
    assert wide["preregistered"]["secondary"]["equivalent"] is False
    assert wide["preregistered"]["primary"]["significant"] is True and wide["preregistered"]["primary"]["p"] < 1e-4
    wide_rows = _prereg_rows([3.0, 3.5, 2.5, 3.0, 3.2, 2.8], [5.0, -6.0, 4.0, -3.0, 6.0, -5.0])
    text = seeds_report.format_summary(wide, seeds_report.by_seed(wide_rows))
    assert "| primary: CPPO group P=0.75 - CPPO P=0.75 | 6 |" in text and "not inside +-3" in text
    # reported before anything else; the per-seed seconds are the process's CPU seconds (wall - 40 here)
    assert text.startswith("pre-registered (") and text.index("| primary:") < text.index("| method |")
    assert "seed 51: accuracy, CPU s" in text and "| GRPO | 35.0%, 960 |" in text  # 0.40 - 5 points, 1000 - 40 s


def _compute_rows(epochs_minus_grpo, epochs_minus_pooled, cpu_ratio=1.05):
    """Rows of GRPO, CPPO pooled and CPPO pooled for 2 epochs on seeds 51.. with the given paired differences
    (points); the 2-epoch arm's CPU seconds ``cpu_ratio`` x GRPO's (+ 1% per seed)."""
    rows = []
    for i, (dg, dp) in enumerate(zip(epochs_minus_grpo, epochs_minus_pooled)):
        two = 0.45 + 0.01 * i
        grpo = _row(51 + i, 0.0, "smallest", two - dg / 100, 1040.0)
        epochs = _row(51 + i, 0.75, "smallest", two, 1000.0) | {"num_epochs": 2}
        epochs["cpu_seconds"] = grpo["cpu_seconds"] * (cpu_ratio + 0.01 * i)
        rows += [grpo, _row(51 + i, 0.75, "smallest", two - dp / 100, 600.0), epochs]
    return rows


def test_the_preregistered_compute_analysis_matches_a_hand_computation():
    """Issue 52's plan: primary 2 epochs - GRPO with the verdict rules fixed in advance, secondary 2 epochs - pooled,
    the CPU ratio to GRPO against the equal-compute range [0.9, 1.2]."""
    dg = [1.0, -2.0, 0.5, 2.5, -1.0, 0.0, 1.5, -0.5]
    dp = [3.0, 1.0, 4.0, 2.0, 5.0, 3.5, 2.5, 4.5]
    summary = seeds_report.summarise(_compute_rows(dg, dp))
    pre = summary["preregistered"]
    assert pre["kind"] == "compute" and pre["seeds"] == list(range(51, 59))
    p = pre["primary"]
    assert (p["a"], p["b"], p["n"]) == ("CPPO P=0.75 2 epochs", "GRPO", 8)
    mean, sd = statistics.fmean(dg), statistics.stdev(dg)
    half95, half90 = 2.364624 * sd / math.sqrt(8), 1.894579 * sd / math.sqrt(8)  # t(0.975, 7), t(0.95, 7)
    assert p["ci95_points"] == pytest.approx([mean - half95, mean + half95])
    assert p["ci90_points"] == pytest.approx([mean - half90, mean + half90])
    assert -3 < mean - half90 and mean + half90 < 3 and p["verdict"] == "equivalent"
    s = pre["secondary"]
    assert (s["a"], s["b"]) == ("CPPO P=0.75 2 epochs", "CPPO P=0.75") and s["significant"] is True
    assert s["mean_points"] == pytest.approx(statistics.fmean(dp))
    c = pre["compute"]
    ratios = [1.05 + 0.01 * i for i in range(8)]
    assert c["mean"] == pytest.approx(statistics.fmean(ratios)) and c["equal_compute"] is True
    assert c["range"] == [0.9, 1.2] and c["key"] == "cpu_seconds"
    text = seeds_report.format_summary(summary, seeds_report.by_seed(_compute_rows(dg, dp)))
    assert text.startswith("pre-registered (docs/results.md, Pre-registered: CPPO at GRPO's compute (issue 52))")
    assert "| primary: CPPO P=0.75 2 epochs - GRPO | 8 |" in text and "| equivalent |" in text
    assert "inside the equal-compute range [0.9, 1.2]" in text
    # the verdicts, in their order: a 95% interval above 0 is "better", below "worse"; a wide one leans
    assert seeds_report.summarise(_compute_rows([3.0, 4.0, 5.0, 3.5], dp[:4]))["preregistered"]["primary"][
        "verdict"] == "better"  # fmt: skip
    assert seeds_report.summarise(_compute_rows([-3.0, -4.0, -5.0, -3.5], dp[:4]))["preregistered"]["primary"][
        "verdict"] == "worse"  # fmt: skip
    wide = seeds_report.summarise(_compute_rows([9.0, -6.0, 8.0, -5.0], dp[:4], cpu_ratio=1.3))["preregistered"]
    assert wide["primary"]["verdict"] == "inconclusive, leaning above" and wide["compute"]["equal_compute"] is False


def test_no_preregistered_analysis_without_the_three_arms():
    assert "preregistered" not in seeds_report.summarise(_rows())


def test_per_problem_records_leave_the_rows_for_their_own_file():
    def recs(ok):
        return [{"index": 0, "id": "a", "sample": 0, "correct": ok, "format_ok": True, "completion_tokens": 5}]

    before = {"step": 0, "records": recs(False)}
    rows = [
        {**_row(51, 0.0, "smallest", 0.4, 1.0), "arm": "grpo",
         "eval_per_problem": [before, {"step": 16, "records": recs(True)}]},
        {**_row(51, 0.75, "smallest", 0.4, 1.0), "arm": "cppo-pooled",
         "eval_per_problem": [before, {"step": 4, "records": recs(False)}]},
    ]  # fmt: skip
    bare, lines = accuracy_seeds.per_problem_lines(rows)
    assert all("eval_per_problem" not in r for r in bare) and bare[0]["seed"] == 51
    got = [json.loads(line) for line in lines]
    assert [(g["arm"], g["method"], g["step"], g["correct"]) for g in got] == [
        ("untrained", None, 0, False), ("grpo", "GRPO", 16, True), ("cppo-pooled", "CPPO P=0.75", 4, False)
    ]  # the shared untrained evaluation once  # fmt: skip
