"""Issue 38's report in the accuracy sweep (``benchmarks/seeds_stop.py``): GRPO, CPPO per question and the same with
pruning while generating (the learned head, the random scorer), 3 epochs each, on three seeds of known numbers: the
per-method means, the paired accuracy differences and the token / CPU ratios against a hand computation, the
targets true and false, the head's AUC over training (warm-up steps left out, undefined steps skipped), the
tables printed by ``--combine`` and its plot; and a sweep without stopping summarised as before."""

from __future__ import annotations

import json
import math
import shutil
import statistics

import pytest
from sweep_cases import META, PRESET, REPO, unit_row
from sweeps import arm as accuracy_arm
from sweeps import report as seeds_report
from sweeps import seeds as accuracy_seeds
from sweeps import stop as seeds_stop

from cppo import fileio

ARMS = ["grpo-epochs", "cppo-group-epochs", "cppo-group-stop", "cppo-group-stop-random"]
PLAIN = "CPPO group P=0.75 3 epochs"
LEARNED, RANDOM = f"{PLAIN} + stop 0.625 (learned)", f"{PLAIN} + stop 0.625 (random)"
SEEDS = (42, 43, 44)
#: The learned head's AUC per step (8 steps, the first 2 the warm-up): after it 0.7, -, 0.8, 0.9, 0.7, 0.8 (mean
#: 3.9 / 5 = 0.78), the last quarter (2 steps) 0.75; the random scorer's around chance (after the warm-up 0.5, last
#: quarter 0.5).
AUC = {"learned": [0.5, 0.6, 0.7, None, 0.8, 0.9, 0.7, 0.8], "random": [0.5, 0.4, 0.5, 0.6, None, 0.4, 0.5, 0.5]}
#: seed -> arm -> (accuracy, completion tokens, generation CPU s, whole-run CPU s): the targets met.
GOOD = {
    42: {"grpo-epochs": (0.42, 4000, 300.0, 400.0), "cppo-group-epochs": (0.40, 1000, 100.0, 200.0),
         "cppo-group-stop": (0.41, 500, 50.0, 130.0), "cppo-group-stop-random": (0.38, 510, 52.0, 132.0)},
    43: {"grpo-epochs": (0.36, 4100, 310.0, 410.0), "cppo-group-epochs": (0.35, 1100, 110.0, 210.0),
         "cppo-group-stop": (0.34, 550, 55.0, 140.0), "cppo-group-stop-random": (0.33, 560, 56.0, 141.0)},
    44: {"grpo-epochs": (0.44, 3900, 290.0, 390.0), "cppo-group-epochs": (0.45, 1050, 105.0, 205.0),
         "cppo-group-stop": (0.45, 520, 52.0, 135.0), "cppo-group-stop-random": (0.44, 530, 53.0, 136.0)},
}  # fmt: skip
#: The targets missed: the learned arm generates 0.7x the tokens in 0.9x the CPU, loses 10-12 points, and is below
#: the random scorer on accuracy and on AUC.
BAD = {
    seed: {**arms, "cppo-group-stop": (arms["cppo-group-epochs"][0] - d, 700, 80.0, 180.0),
           "cppo-group-stop-random": (arms["cppo-group-epochs"][0], 510, 52.0, 132.0)}
    for (seed, arms), d in zip(GOOD.items(), (0.10, 0.12, 0.11))
}  # fmt: skip


def stop_row(seed, arm, numbers, *, auc=None):
    acc, tokens, generation, cpu = numbers
    settings = accuracy_arm.arm_settings(arm)
    stopping = settings.get("rollout_stop_rate")
    scorer = settings.get("rollout_stop_scorer", "learned")
    return unit_row(
        seed, arm, acc, 2 * cpu, cpu_seconds=cpu, tokens_generate_completion=tokens, tokens_generate_prompt=300,
        phase_cpu_seconds={"generation": generation, "policy_fwd_bwd": cpu - generation}, completions=192,
        rollout_stopped=90 if stopping else None, rollout_stop_auc=(auc or AUC)[scorer] if stopping else None,
        completions_kept=48, kept_zero_advantage=30 if stopping else 12,
    )  # fmt: skip


def rows_of(numbers, **kw):
    return [stop_row(seed, arm, n, **kw) for seed, arms in numbers.items() for arm, n in arms.items()]


def test_the_head_auc_skips_undefined_steps_and_the_warm_up():
    assert seeds_stop.WARMUP == 2  # the trainer's default rollout_stop_warmup
    means = seeds_stop.auc_means({"rollout_stop_auc": AUC["learned"]})
    assert means == pytest.approx({"auc": 0.78, "auc_last_quarter": 0.75, "auc_all": 5.0 / 7})
    nan = float("nan")
    row = {"rollout_stop_auc": [0.2, None, 0.6, nan, None, 0.9], "rollout_stop_warmup": 1}  # last quarter: 2 steps
    assert seeds_stop.auc_means(row) == pytest.approx({"auc": 0.75, "auc_last_quarter": 0.9, "auc_all": 1.7 / 3})
    assert seeds_stop.auc_means({"rollout_stop_auc": [0.5, 0.5, None, None]}) == {
        "auc": None, "auc_last_quarter": None, "auc_all": 0.5}  # fmt: skip
    assert seeds_stop.auc_means({"rollout_stop_auc": None}) == {"auc": None, "auc_last_quarter": None, "auc_all": None}
    two = {1: {"m": {"rollout_stop_auc": [0.5, None]}}, 2: {"m": {"rollout_stop_auc": [0.7, nan]}}}
    assert seeds_stop.auc_curve(two, "m") == pytest.approx([0.6, None])


def _ci(values):
    mean, half = statistics.fmean(values), 4.302653 * statistics.stdev(values) / math.sqrt(3)
    return [mean - half, mean + half]


def test_the_summary_gives_the_means_differences_ratios_and_targets_met():
    summary = seeds_report.summarise(rows_of(GOOD))
    assert summary["cppo"] is None and summary["methods"] == [PLAIN, LEARNED, RANDOM, "GRPO"]
    group = summary["stop"][f"{PLAIN} + stop 0.625"]
    assert (group["plain"], group["stops"], group["grpo"]) == (PLAIN, {"learned": LEARNED, "random": RANDOM}, "GRPO")
    assert group["warmup_steps"] == [2]
    learned = group["methods"][LEARNED]
    assert learned["seeds"] == list(SEEDS) and learned["tokens_generate_completion"]["mean"] == pytest.approx(1570 / 3)
    assert learned["generation_cpu_seconds"]["mean"] == pytest.approx(157 / 3)
    assert learned["cpu_seconds"]["ci95"] == pytest.approx(_ci([130.0, 140.0, 135.0]))
    assert learned["rollout_stopped"]["mean"] == 90
    assert learned["kept_zero_share"]["mean"] == pytest.approx(30 / 48)
    assert group["methods"][PLAIN]["kept_zero_share"]["mean"] == pytest.approx(12 / 48)
    assert (learned["auc"]["mean"], learned["auc_last_quarter"]["mean"]) == pytest.approx((0.78, 0.75))
    assert learned["auc"]["ci95"] is not None  # three equal seeds: an interval of width 0
    assert "rollout_stopped" not in group["methods"][PLAIN] and "auc" not in group["methods"]["GRPO"]
    pair = group["pairs"][f"{LEARNED} vs {PLAIN}"]
    diffs = [GOOD[s]["cppo-group-stop"][0] - GOOD[s]["cppo-group-epochs"][0] for s in SEEDS]  # +1, -1, 0 points
    assert pair["accuracy_difference"]["per_seed"] == pytest.approx(dict(zip(SEEDS, diffs)))
    assert pair["accuracy_difference"]["ci95"] == pytest.approx(_ci(diffs))
    assert pair["accuracy_difference"]["signs"] == {"positive": 1, "negative": 1, "zero": 1}
    tokens = [500 / 1000, 550 / 1100, 520 / 1050]
    assert pair["tokens_ratio"]["mean"] == pytest.approx(statistics.fmean(tokens))
    assert pair["tokens_ratio"]["ci95"] == pytest.approx(_ci(tokens))
    assert pair["generation_cpu_ratio"]["mean"] == pytest.approx(statistics.fmean([0.5, 0.5, 52 / 105]))
    cpu = [130 / 200, 140 / 210, 135 / 205]
    assert pair["cpu_ratio"]["mean"] == pytest.approx(statistics.fmean(cpu))
    assert pair["cpu_ratio"]["of_sums"] == pytest.approx(405 / 615)
    versus = group["learned_vs_random"]
    acc = [0.03, 0.01, 0.01]
    assert versus["accuracy_difference"]["mean"] == pytest.approx(sum(acc) / 3)
    assert versus["accuracy_difference"]["ci95"] == pytest.approx(_ci(acc))  # [-0.012, +0.045]: not clearly
    assert versus["auc_difference"]["mean"] == pytest.approx(0.78 - 0.5)
    assert versus["auc_last_quarter_difference"]["mean"] == pytest.approx(0.25)
    grpo = group["against_grpo"][f"{LEARNED} vs GRPO"]
    assert grpo["accuracy_difference"]["per_seed"] == pytest.approx({42: -0.01, 43: -0.02, 44: 0.01})
    assert grpo["cpu_ratio"]["mean"] == pytest.approx(statistics.fmean([130 / 400, 140 / 410, 135 / 390]))
    assert group["against_grpo"][f"{PLAIN} vs GRPO"]["tokens_ratio"]["mean"] == pytest.approx(
        statistics.fmean([1000 / 4000, 1100 / 4100, 1050 / 3900])
    )
    assert group["target"] == {
        "tokens_at_most_0.6x": True, "cpu_at_most_0.7x": True, "accuracy_interval_holds_0": True,
        "learned_beats_random_on_accuracy": True, "learned_clearly_beats_random_on_accuracy": False,
        "learned_beats_random_on_auc": True, "learned_clearly_beats_random_on_auc": True,
    }  # fmt: skip
    assert summary["target"] == {f"{PLAIN} + stop 0.625": group["target"]}
    assert summary["accuracy_differences"][f"{LEARNED} - {PLAIN}"] is pair["accuracy_difference"]
    assert f"{LEARNED} - {RANDOM}" in summary["accuracy_differences"]
    assert summary["time_ratios"][LEARNED]["cpu"]["mean"] == pytest.approx(grpo["cpu_ratio"]["mean"])


def test_the_targets_missed_read_false_and_say_so():
    summary = seeds_report.summarise(rows_of(BAD, auc={"learned": AUC["random"], "random": AUC["learned"]}))
    group = summary["stop"][f"{PLAIN} + stop 0.625"]
    pair = group["pairs"][f"{LEARNED} vs {PLAIN}"]
    assert pair["accuracy_difference"]["mean"] == pytest.approx(-0.11)
    assert pair["tokens_ratio"]["mean"] == pytest.approx(statistics.fmean([0.7, 700 / 1100, 700 / 1050]))
    assert group["target"] == {
        "tokens_at_most_0.6x": False, "cpu_at_most_0.7x": False, "accuracy_interval_holds_0": False,
        "learned_beats_random_on_accuracy": False, "learned_clearly_beats_random_on_accuracy": False,
        "learned_beats_random_on_auc": False, "learned_clearly_beats_random_on_auc": False,
    }  # fmt: skip
    text = seeds_report.format_summary(summary, seeds_report.by_seed(rows_of(BAD)))
    assert "tokens <= 0.6x: NO; CPU <= 0.7x: NO; interval holds 0: NO" in text
    assert "beats random on accuracy: NO; beats random on AUC: NO" in text
    assert "the learned head does NOT beat the random scorer: neither on accuracy nor on AUC" in text


def test_one_seed_has_no_interval_and_without_random_or_grpo_no_comparison():
    rows = [r for r in rows_of({42: GOOD[42]}) if r["arm"] not in ("cppo-group-stop-random", "grpo-epochs")]
    summary = seeds_report.summarise(rows)
    group = summary["stop"][f"{PLAIN} + stop 0.625"]
    assert group["grpo"] is None and group["against_grpo"] == {} and summary["time_ratios"] == {}
    text = seeds_report.format_summary(summary, seeds_report.by_seed(rows))
    assert "time / GRPO's" not in text and "head AUC after warm-up" in text  # no empty table of ratios to GRPO
    assert group["pairs"][f"{LEARNED} vs {PLAIN}"]["accuracy_difference"]["ci95"] is None
    assert group["learned_vs_random"] is None
    assert group["target"]["accuracy_interval_holds_0"] is None and group["target"]["tokens_at_most_0.6x"] is True
    assert group["target"]["learned_beats_random_on_auc"] is None
    assert "no random-scorer run" in "\n".join(seeds_stop.format_stop({"g": group}))


def _write_units(out):
    for row in rows_of(GOOD):
        folder = out / "units" / f"seed{row['seed']}-{row['arm']}"
        folder.mkdir(parents=True)
        fileio.write_json(folder / "result.json", {"meta": META, "rows": [row]})


def test_combine_prints_the_two_tables_and_plots(tmp_path, capsys):
    _write_units(tmp_path)
    argv = ["--seeds", *map(str, SEEDS), "--arms", *ARMS, "--out", str(tmp_path), "--name", "accuracy-stop"]
    accuracy_seeds.check_sweep_folder(accuracy_seeds.parse_args([*argv, "--", *PRESET]), tmp_path)
    data = accuracy_seeds.main([*argv, "--combine", "--", *PRESET])
    assert {(r["seed"], r["arm"]) for r in data["rows"]} == {(s, a) for s in SEEDS for a in ARMS}
    assert data["summary"]["stop"][f"{PLAIN} + stop 0.625"]["target"]["cpu_at_most_0.7x"] is True
    out = capsys.readouterr().out
    print(out)  # the report, for a reader of -s
    assert f"| {LEARNED} | 3 | 40.0 [26.2, 53.8] | 523 [461, 586] | 52 [46, 59] | 135 [123, 147] | 90 [90, 90] | " \
           "62.5 [62.5, 62.5] | 0.780 [0.780, 0.780] | 0.750 [0.750, 0.750] |" in out  # fmt: skip
    assert f"| {PLAIN} | 3 | 40.0 [27.6, 52.4] | 1050 [926, 1174] | 105 [93, 117] | 205 [193, 217] | - | " \
           "25.0 [25.0, 25.0] | - | - |" in out  # fmt: skip
    assert (
        f"| {LEARNED} vs {PLAIN} | 3 | +0.0 [-2.5, +2.5], 1+ / 1- / 1= | 0.498 [0.492, 0.505] | 0.498 [0.492, 0.505] "
        "| 0.658 [0.638, 0.679] | - | tokens <= 0.6x: yes; CPU <= 0.7x: yes; interval holds 0: yes |" in out
    )
    assert f"| {LEARNED} vs {RANDOM} | 3 | +1.7 [-1.2, +4.5], 3+ / 0- / 0= | " in out
    assert "| +0.280 [+0.280, +0.280], 3+ / 0- / 0=; +0.250 [+0.250, +0.250], 3+ / 0- / 0= | beats random on " \
           "accuracy: yes; beats random on AUC: yes (clearly) |" in out  # fmt: skip
    assert f"| {LEARNED} vs GRPO | 3 | -0.7 " in out
    assert "does NOT beat" not in out
    assert (tmp_path / "accuracy-stop-seeds.png").stat().st_size > 0
    saved = json.loads((tmp_path / "accuracy-stop-seeds.json").read_text())
    assert saved["summary"]["target"][f"{PLAIN} + stop 0.625"]["learned_beats_random_on_auc"] is True


def test_a_sweep_without_stopping_is_summarised_as_before():
    rows = [unit_row(s, arm, acc, 400.0 + s) for s in SEEDS for arm, acc in (("grpo", 0.4), ("cppo-pooled", 0.38))]
    summary = seeds_report.summarise(rows)
    assert summary["cppo"] == "CPPO P=0.75" and "stop" not in summary
    assert "head AUC" not in seeds_report.format_summary(summary, seeds_report.by_seed(rows))
    assert seeds_stop.stop_pairs(seeds_report.by_seed(rows)) == {}


def test_stop_rows_beside_a_pooled_cppo_keep_the_usual_summary_and_add_the_pairs():
    rows = rows_of(GOOD) + [unit_row(s, arm, 0.4, 400.0) for s in SEEDS for arm in ("grpo", "cppo-pooled")]
    with pytest.raises(ValueError, match="two GRPO rows"):  # grpo and grpo-epochs are both named GRPO on a seed
        seeds_report.summarise(rows)
    rows = [r for r in rows if r["arm"] != "grpo-epochs"]
    summary = seeds_report.summarise(rows)
    assert summary["cppo"] == "CPPO P=0.75" and f"{PLAIN} + stop 0.625" in summary["stop"]
    text = seeds_report.format_summary(summary, seeds_report.by_seed(rows))
    assert "head AUC after warm-up" in text and "target (CPPO P=0.75)" in text


def test_the_committed_benchmark_combines_as_the_docs_say(tmp_path):
    """Issue 38's committed sweep (benchmarks/results/accuracy-stop), combined again from its units on a copy: the
    same paired differences as the committed JSON, and the numbers docs/results.md quotes from it."""
    committed = REPO / "benchmarks" / "results" / "accuracy-stop"
    shutil.copytree(committed / "units", tmp_path / "units")
    shutil.copy(committed / "sweep.json", tmp_path / "sweep.json")
    seeds, protocol = [str(s) for s in range(42, 48)], ["--questions", "32", "--eval", "300", "--eval-points", "1"]
    data = accuracy_seeds.main(["--seeds", *seeds, "--arms", *ARMS, "--name", "accuracy-stop", "--out", str(tmp_path),
                                "--combine", "--", *protocol])  # fmt: skip
    saved = json.loads((committed / "accuracy-stop-seeds.json").read_text())
    assert data["meta"]["sweep"]["missing"] == [] and len(data["rows"]) == len(saved["rows"]) == 24
    found = json.loads(json.dumps(data["summary"]["accuracy_differences"]))
    assert found == saved["summary"]["accuracy_differences"]
    group = data["summary"]["stop"][f"{PLAIN} + stop 0.625"]
    pair = group["pairs"][f"{LEARNED} vs {PLAIN}"]
    docs = (REPO / "docs" / "results.md").read_text(encoding="utf-8")
    d = pair["accuracy_difference"]
    assert f"{100 * d['mean']:+.1f} [{100 * d['ci95'][0]:+.1f}, {100 * d['ci95'][1]:+.1f}]" in docs  # -8.9 [...]
    assert f"{pair['tokens_ratio']['mean']:.3f}x" in docs and f"{pair['cpu_ratio']['mean']:.3f}x" in docs
    auc = group["learned_vs_random"]["auc_difference"]
    assert f"{auc['mean']:+.3f} [{auc['ci95'][0]:+.3f}, {auc['ci95'][1]:+.3f}]" in docs
    assert group["target"] == saved["summary"]["stop"][f"{PLAIN} + stop 0.625"]["target"]
