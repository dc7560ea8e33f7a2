"""Issue 30's benchmark arms in the accuracy sweep: ``cppo-epochs`` (CPPO pooled at P = 0.75 for 3 epochs of the
seed's questions, the run bounded by the data's epochs) and ``cppo-dyn`` (the same with ``filter_groups`` and
``greso``): their plans, how rows are named (never mistaken for ``cppo-pooled``), the combined report (completions
generated, whole-run seconds, trained rows with A = 0, the paired accuracy difference and time ratio against a hand
computation) and one real tiny ``cppo-dyn`` unit that ends where the trainer's epoch bound ends it."""

from __future__ import annotations

import json
import math
import pathlib
import statistics

import pytest
import torch
from sweep_cases import META, PRESET, unit_row
from sweeps import arm as accuracy_arm
from sweeps import report as seeds_report
from sweeps import seeds as accuracy_seeds

from cppo import fileio

PAIR = ["cppo-epochs", "cppo-dyn"]


def _args(out, *extra, seeds=(42, 43, 44), questions=32):
    argv = ["--seeds", *map(str, seeds), "--arms", *PAIR, "--out", str(out), *extra, "--", *PRESET]
    return accuracy_seeds.parse_args([*argv, "--questions", str(questions)])


def test_the_pair_plans_three_epochs_of_the_seeds_questions_bounded_by_epochs(capsys):
    plan = accuracy_seeds.sweep_dry_run(_args(pathlib.Path("unused"), "--dry-run"))
    assert plan["units"] == ["before-seed42", "before-seed43", "before-seed44"] + [
        f"seed{s}-{a}" for s in (42, 43, 44) for a in PAIR
    ]
    pooled = accuracy_arm.plan(_args("x").base, "cppo-pooled", 42)
    for seed in (42, 43, 44):
        plain, dyn = (plan["plans"][f"seed{seed}-{a}"] for a in PAIR)
        for p in (plain, dyn):  # 3 * 32 questions / 4 a step: 24 planned steps, the schedule's length
            assert (p["steps"], p["bounded_by"], p["questions"], p["questions_per_step"]) == (24, "3 epochs", 32, 4)
            assert (p["optimizer_steps"], p["warmup_steps"], p["kept_per_step"]) == (24, 3, 8)
        assert (plain["filter_groups"], plain["greso"], dyn["filter_groups"], dyn["greso"]) == (
            False,
            False,
            True,
            True,
        )
        assert plain["train_question_ids"] == dyn["train_question_ids"]
    assert plan["plans"]["seed42-cppo-dyn"]["train_question_ids"] == pooled["train_question_ids"]
    assert (pooled["steps"], pooled["bounded_by"]) == (8, "steps")  # a step-bounded arm is unchanged
    assert "| seed42-cppo-dyn | 24 | 3 epochs | 4 | 8 | 3 |" in capsys.readouterr().out


def test_arm_of_tells_the_pair_from_cppo_pooled():
    pooled = accuracy_arm.arm_settings("cppo-pooled")
    assert accuracy_arm.arm_of(pooled) == "cppo-pooled"  # a row written before the new columns
    assert accuracy_arm.arm_of({**pooled, "num_epochs": None, "filter_groups": False, "greso": False}) == "cppo-pooled"
    assert accuracy_arm.arm_of({**pooled, "num_epochs": 3, "filter_groups": False, "greso": False}) == "cppo-epochs"
    assert accuracy_arm.arm_of({**pooled, "num_epochs": 3, "filter_groups": True, "greso": True}) == "cppo-dyn"
    assert accuracy_arm.arm_of({**pooled, "num_epochs": 3, "filter_groups": True, "greso": False}) is None
    assert accuracy_arm.arm_of({**pooled, "num_epochs": None, "filter_groups": True, "greso": True}) is None
    assert seeds_report.method({**pooled, "num_epochs": 3}) == "CPPO P=0.75 3 epochs"
    assert seeds_report.method(accuracy_arm.arm_settings("cppo-dyn")) == "CPPO P=0.75 3 epochs + filter_groups + greso"


@pytest.mark.parametrize("setting", ["num_epochs=2", "greso=true", "filter_groups=true"])
def test_a_common_set_of_the_pairs_settings_is_refused(setting):
    with pytest.raises(ValueError, match="must not set"):
        accuracy_seeds.parse_args(["--arms", *PAIR, "--out", "o", "--", "--set", setting])


#: seed -> (plain, dyn) of (accuracy, whole-run seconds, completions, trained rows with A = 0, GRESO skips)
PAIRS = {
    42: ((0.40, 1000.0, 768, 24, None), (0.42, 600.0, 700, 0, 30)),
    43: ((0.35, 1100.0, 768, 16, None), (0.33, 800.0, 760, 2, 20)),
    44: ((0.45, 900.0, 768, 8, None), (0.45, 650.0, 690, 0, 40)),
}


def _write_pair(out):
    for seed, arms in PAIRS.items():
        for arm, (acc, seconds, completions, zero, skipped) in zip(PAIR, arms):
            row = {**unit_row(seed, "cppo-pooled", acc, seconds), **accuracy_arm.arm_settings(arm), "arm": arm}
            ids, steps = [f"q{seed}-{i}" for i in range(32)], 24 if arm == PAIR[0] else 20
            row.update(questions=32, train_question_ids=ids, completions=completions, kept_zero_advantage=zero,
                       greso_questions_skipped=skipped, steps=steps)  # fmt: skip
            folder = out / "units" / f"seed{seed}-{arm}"
            folder.mkdir(parents=True)
            fileio.write_json(folder / "result.json", {"meta": {**META, "questions": 32}, "rows": [row]})
    accuracy_seeds.check_sweep_folder(_args(out), out)  # its sweep.json, as the run wrote it


def test_the_combined_report_gives_the_pairs_counts_difference_and_time_ratio(tmp_path, capsys):
    _write_pair(tmp_path)
    args = _args(tmp_path, "--combine")
    data = accuracy_seeds.main(["--seeds", "42", "43", "44", "--arms", *PAIR, "--out", str(tmp_path), "--combine",
                                "--", *args.unit_args])  # fmt: skip
    assert {(r["seed"], r["arm"]) for r in data["rows"]} == {(s, a) for s in PAIRS for a in PAIR}
    plain, dyn = "CPPO P=0.75 3 epochs", "CPPO P=0.75 3 epochs + filter_groups + greso"
    d = data["summary"]["dynamic"][f"{dyn} vs {plain}"]
    diffs = [b[0] - a[0] for a, b in PAIRS.values()]  # +0.02, -0.02, 0
    half = 4.302653 * statistics.stdev(diffs) / math.sqrt(3)
    assert d["accuracy_difference"]["per_seed"] == pytest.approx(dict(zip(PAIRS, diffs)))
    assert d["accuracy_difference"]["ci95"] == pytest.approx([sum(diffs) / 3 - half, sum(diffs) / 3 + half])
    ratios = [b[1] / a[1] for a, b in PAIRS.values()]
    assert d["time_ratio"]["mean"] == pytest.approx(sum(ratios) / 3)
    assert d["time_ratio"]["of_sums"] == pytest.approx(2050.0 / 3000.0)
    assert d["methods"][plain]["completions"]["mean"] == 768 and d["methods"][dyn]["completions"]["mean"] == 2150 / 3
    assert d["methods"][plain]["kept_zero_advantage"]["mean"] == 16 and d["methods"][dyn]["kept_zero_advantage"][
        "mean"
    ] == pytest.approx(2 / 3)
    assert (
        "greso_questions_skipped" not in d["methods"][plain]
        and d["methods"][dyn]["greso_questions_skipped"]["mean"] == 30
    )
    assert d["target"] == {"same_accuracy": True, "at_most_0.7x_time": sum(ratios) / 3 <= 0.7}
    out = capsys.readouterr().out
    assert f"| {plain} | 3 | 24 | 768 | 1000 | 16 | - |" in out and f"| {dyn} | 3 | 20 | 717 | 683 | 1 | 30 |" in out
    assert f"| {dyn} vs {plain} | 3 | +0.0 " in out
    assert (tmp_path / "accuracy-smollm2-seeds.png").stat().st_size > 0


def test_a_real_tiny_dyn_unit_ends_where_the_epochs_are_used_up(tmp_path):
    """``accuracy_arm.py --arm cppo-dyn`` for real on the tiny model, 4 questions, 3 epochs (3 planned steps): with
    the accuracy reward alone the untrained tiny model's groups are all wrong (zero-variance), so dynamic sampling's
    extra calls pass the 12 questions early; the run ends there, is evaluated at its end, and its row counts what it
    generated."""
    tiny = ["--config", "tiny-cpu", "--questions", "4", "--eval", "3", "--no-warmup", "--set",
            "max_completion_length=4", "group_size=4", "mu=1", "questions_per_step=1", "rewards=accuracy"]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        accuracy_arm.main(["--before-only", "--seed", "3", "--result", str(tmp_path / "b.json"), *tiny])
        accuracy_arm.main(["--arm", "cppo-dyn", "--seed", "3", "--before", str(tmp_path / "b.json"),
                           "--result", str(tmp_path / "r.json"), *tiny])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert (row["arm"], row["planned_steps"], row["num_epochs"], row["filter_groups"], row["greso"]) == (
        "cppo-dyn", 3, 3, True, True)  # fmt: skip
    assert 1 <= row["steps"] < 3 and row["generation_calls"] > row["steps"]
    assert row["questions_seen"] >= 12 and row["completions"] == 4 * row["questions_seen"]
    assert row["accuracy_curve"][-1][1] == row["steps"]  # evaluated where it ended
    assert accuracy_arm.arm_of(row) == "cppo-dyn"
