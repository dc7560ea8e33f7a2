"""The accuracy sweep (``benchmarks/accuracy_seeds.py --arms``, ``accuracy_arm.py``): the arms' plans, resumability
(a finished unit is skipped, a torn one moved aside and rerun), the combination with a former seeds file and what
must agree, the refusals of ``--from-runs``, the summary over the seeds each pair shares against a hand computation,
and one real tiny unit whose row has the committed rows' schema. The runner's own tests use a fake worker (a few
lines of Python per unit) instead of training."""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch
from sweep_cases import (
    ARMS5,
    COMMITTED,
    FORMER,
    PRESET,
    SWEEP,
    argv_of,
    former_file,
    question_ids,
    seed_files,
    summary_inputs,
    sweep_args,
    write_unit,
)
from sweeps import arm as accuracy_arm
from sweeps import seeds as accuracy_seeds

from cppo import fileio

#: Row columns added after the committed rows (issue 30: the run's bound, its features and their counts).
ISSUE30_KEYS = {"planned_steps", "num_epochs", "filter_groups", "greso", "kept_zero_advantage", "generation_calls",
                "greso_questions_skipped"}  # fmt: skip
#: Issue 41's columns: tokens per phase and every evaluation's per-problem records.
ISSUE41_KEYS = {"tokens_generate_prompt", "tokens_generate_completion", "tokens_train_prompt",
                "tokens_train_completion", "eval_per_problem", "phase_cpu_seconds"}  # fmt: skip
#: Issue 38's columns: the pruning-while-generating settings of the row.
ISSUE38_KEYS = {"rollout_stop_rate", "rollout_stop_at", "rollout_stop_scorer", "rollout_stopped"}
#: Issue 51's columns: generation ahead of training's settings, every step's wall clock, the shared engine's reloads.
ISSUE51_KEYS = {"steps_per_generation", "max_staleness", "step_seconds", "reloads", "reload_seconds",
                "reload_cpu_seconds"}  # fmt: skip


def test_arms_plan_the_control_as_grpos_steps_and_every_arm_on_the_seeds_questions(capsys):
    args = sweep_args(pathlib.Path("unused"), "--dry-run", seeds=[45, 46])
    plan = accuracy_seeds.sweep_dry_run(args)
    assert plan["units"] == ["before-seed45", "before-seed46"] + [f"seed{s}-{a}" for s in (45, 46) for a in ARMS5]
    p = plan["plans"]
    for seed in (45, 46):
        grpo, control = p[f"seed{seed}-grpo"], p[f"seed{seed}-control"]
        assert (grpo["steps"], grpo["warmup_steps"], control["steps"], control["warmup_steps"]) == (64, 7, 64, 7)
        assert control["summed_lr"] == pytest.approx(grpo["summed_lr"]) and control["allocation"] is False
        assert (control["questions_per_step"], control["kept_per_step"]) == (1, 2)
        for arm in ("cppo-pooled", "cppo-group", "max-variance"):
            a = p[f"seed{seed}-{arm}"]
            assert (a["steps"], a["questions_per_step"], a["kept_per_step"], a["warmup_steps"]) == (16, 4, 8, 2)
            assert a["summed_lr"] == pytest.approx(grpo["summed_lr"] / 4, rel=0.02)
        assert {tuple(p[f"seed{seed}-{a}"]["train_question_ids"]) for a in ARMS5} == {tuple(grpo["train_question_ids"])}
    assert p["seed45-grpo"]["train_question_ids"] != p["seed46-grpo"]["train_question_ids"]
    assert "| seed45-control | 64 | steps | 1 | 2 | 7 |" in capsys.readouterr().out


def test_arm_settings_name_the_committed_rows():
    rows = json.loads(COMMITTED.read_text())["rows"]
    assert sorted({accuracy_arm.arm_of(r) for r in rows}) == ["cppo-pooled", "grpo", "max-variance", "random"]
    assert accuracy_arm.arm_of({"pruning_rate": 0.75, "selection_metric": "smallest", "selection_scope": "batch",
                                "allocation": False}) == "control"  # fmt: skip
    assert accuracy_arm.before_name(accuracy_arm.arm_config(sweep_args("x").base, None, 3)) == "before-seed3.json"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--arms", "grpo"], "--arms needs --out"),
        (["--arms", "grpo", "grpo", "--out", "o"], "repeats an arm"),
        (["--arms", "grpo", "--out", "o", "--", "--set", "pruning_rate=0.5"], "must not set \\['pruning_rate'\\]"),
        (["--arms", "grpo", "--out", "o", "--from-runs", "r"], "with --arms use --combine"),
        (["--with", "f.json"], "--combine and --with go with --arms"),
    ],
)
def test_bad_sweep_arguments(argv, match):
    with pytest.raises(ValueError, match=match):
        accuracy_seeds.parse_args(argv)


def test_a_questions_count_a_step_does_not_divide_is_refused():
    args = sweep_args("x", "--dry-run").base
    args.questions = 62
    with pytest.raises(ValueError, match="--questions must be a multiple of 4"):
        accuracy_arm.plan(args, "cppo-pooled", 45)


FAKE_WORKER = textwrap.dedent(
    """
    import json, os, pathlib, sys
    argv = sys.argv[1:]
    result = pathlib.Path(argv[argv.index("--result") + 1])
    with open(os.environ["CALLS"], "a") as f:
        f.write(result.parent.name + "\\n")
    if result.parent.name in os.environ.get("FAIL", "").split():
        sys.exit(3)
    if "--before-only" in argv:
        json.dump({"config": {}, "point": {"correct": 60}}, result.open("w"))
    else:
        arm, seed = argv[argv.index("--arm") + 1], int(argv[argv.index("--seed") + 1])
        row = {"arm": arm, "seed": seed, "pruning_rate": 0.0, "selection_metric": "smallest", "accuracy_after": 0.5,
               "total_seconds": 1.0, "train_seconds": 1.0, "eval_problems": 3}
        json.dump({"meta": {}, "rows": [row]}, result.open("w"))
    """
)


@pytest.fixture()
def fake_worker(tmp_path, monkeypatch):
    """Units run a few lines of Python that record their name in CALLS and write a valid result (FAIL: exit 3)."""
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("CALLS", str(calls))
    real = accuracy_seeds.unit_command

    def command(args, unit, out):
        return [sys.executable, str(script), *real(args, unit, out)[2:]]

    monkeypatch.setattr(accuracy_seeds, "unit_command", command)
    return lambda: calls.read_text().split() if calls.exists() else []


def test_finished_units_are_skipped_and_torn_ones_rerun_in_a_fresh_folder(tmp_path, fake_worker, monkeypatch):
    out = tmp_path / "sweep"
    args = sweep_args(out, "--jobs", "1", seeds=[45, 46], arms=["grpo", "control"])
    units = accuracy_seeds.plan_units(args)
    names = ["before-seed45", "before-seed46", "seed45-grpo", "seed45-control", "seed46-grpo", "seed46-control"]
    assert [u.name for u in units] == names  # a tiny model is measured before training per seed
    assert accuracy_seeds.run_units(args, units, out, poll=0.05) == []
    assert fake_worker() == names
    assert all(accuracy_seeds.finished(u, out) for u in units)
    assert accuracy_seeds.run_units(args, units, out, poll=0.05) == []  # a second invocation: nothing runs
    assert len(fake_worker()) == 6
    torn = out / "units" / "seed45-control"
    (torn / "result.json").unlink()  # interrupted before its result: its log stays
    damaged = out / "units" / "seed46-grpo" / "result.json"
    damaged.write_text('{"meta": {}, "rows": [')
    assert accuracy_seeds.run_units(args, units, out, poll=0.05) == []
    assert fake_worker()[6:] == ["seed45-control", "seed46-grpo"]
    assert (out / "units" / "seed45-control.torn-1" / "log").is_file()
    assert (out / "units" / "seed46-grpo.torn-1" / "result.json").read_text() == '{"meta": {}, "rows": ['
    assert all(accuracy_seeds.finished(u, out) for u in units)
    (torn / "result.json").unlink()
    assert accuracy_seeds.run_units(args, units, out, poll=0.05) == []
    assert (out / "units" / "seed45-control.torn-2").is_dir()  # the first torn attempt is kept too


def test_a_failed_unit_is_reported_and_the_arms_of_a_failed_before_are_not_run(tmp_path, fake_worker, monkeypatch):
    out = tmp_path / "sweep"
    args = sweep_args(out, "--jobs", "1", seeds=[45], arms=["grpo", "control"])
    monkeypatch.setenv("FAIL", "seed45-grpo")
    assert accuracy_seeds.run_units(args, accuracy_seeds.plan_units(args), out, poll=0.05) == ["seed45-grpo"]
    assert fake_worker() == ["before-seed45", "seed45-grpo", "seed45-control"]
    monkeypatch.setenv("FAIL", "before-seed45")
    (out / "units" / "before-seed45" / "result.json").unlink()
    failed = accuracy_seeds.run_units(args, accuracy_seeds.plan_units(args), out, poll=0.05)
    assert failed == ["before-seed45", "seed45-grpo"] and fake_worker()[3:] == ["before-seed45"]


def test_a_changed_sweep_is_refused_and_new_arms_are_added(tmp_path):
    out = tmp_path / "sweep"
    out.mkdir()
    accuracy_seeds.check_sweep_folder(sweep_args(out, arms=["grpo"]), out)
    accuracy_seeds.check_sweep_folder(sweep_args(out, arms=["grpo", "control"]), out)
    assert set(json.loads((out / "sweep.json").read_text())["arms"]) == {"grpo", "control"}
    other = accuracy_seeds.parse_args(["--arms", "grpo", "--out", str(out), "--", *PRESET, "--eval", "100"])
    with pytest.raises(
        ValueError, match="sweep.json: this folder's sweep ran with eval 300 \\(--eval\\), this command 100"
    ):
        accuracy_seeds.check_sweep_folder(other, out)


def test_the_sweep_combines_with_the_former_seeds_over_the_seeds_each_pair_shares(tmp_path):
    out, former = summary_inputs(tmp_path)
    args = sweep_args(out, "--combine", "--with", str(former))
    data = accuracy_seeds.main([*map(str, argv_of(args))])
    s = data["summary"]
    assert s["seeds"] == [42, 43, 44, 45, 46, 47] and s["cppo"] == "CPPO P=0.75"
    d = s["accuracy_differences"]
    pooled_grpo = [c - g for g, c, _ in FORMER.values()] + [v[1] - v[0] for v in SWEEP.values()]
    half = 2.570582 * statistics.stdev(pooled_grpo) / math.sqrt(6)  # t(0.975, df=5)
    assert d["CPPO P=0.75 - GRPO"]["n"] == 6 and d["CPPO P=0.75 - GRPO"]["mean"] == pytest.approx(sum(pooled_grpo) / 6)
    assert d["CPPO P=0.75 - GRPO"]["ci95"] == pytest.approx([sum(pooled_grpo) / 6 - half, sum(pooled_grpo) / 6 + half])
    # hand count: -16, -1, 0 (former), -2, +2, 0 (sweep)
    assert d["CPPO P=0.75 - GRPO"]["signs"] == {"positive": 1, "negative": 3, "zero": 2}
    group = [v[1] - v[2] for v in SWEEP.values()]  # the sweep's three seeds only
    assert d["CPPO P=0.75 - CPPO group P=0.75"]["per_seed"] == pytest.approx(dict(zip(SWEEP, group)))
    assert d["CPPO P=0.75 - CPPO group P=0.75"]["ci95"][1] == pytest.approx(
        sum(group) / 3 + 4.302653 * statistics.stdev(group) / math.sqrt(3)
    )
    assert d["CPPO P=0.75 - max-variance P=0.75"]["n"] == 6
    control = d["CPPO P=0.75 no allocation - GRPO"]
    assert control["n"] == 3 and control["mean"] == pytest.approx((-0.01 - 0.02 + 0.03) / 3)
    assert d["CPPO P=0.75 - CPPO P=0.75 no allocation"]["signs"] == {"positive": 1, "negative": 2, "zero": 0}
    t = s["time_ratios"]["CPPO P=0.75"]["total"]
    assert t["n"] == 6 and t["per_seed"][45] == pytest.approx(445.0 / 1000.0) and t["per_seed"][42] == 0.4
    assert s["time_ratios"]["CPPO P=0.75 no allocation"]["total"]["of_sums"] == pytest.approx(1.0)
    rows = {(r["seed"], r["arm"]): r for r in data["rows"]}
    assert rows[(42, "grpo")]["arm"] == "grpo" and len(rows) == 9 + 15
    assert rows[(45, "cppo-pooled")]["speedup_total"] == pytest.approx(1000.0 / 445.0)  # against seed 45's GRPO
    assert data["meta"]["sweep"]["missing"] == [] and {s["file"] for s in data["meta"]["sources"]} >= {str(former)}
    assert (out / "accuracy-smollm2-seeds.png").stat().st_size > 0


def test_the_combination_names_the_units_it_left_out_but_not_those_a_former_file_holds(tmp_path, capsys):
    out, former = summary_inputs(tmp_path)
    (out / "units" / "seed46-control" / "result.json").unlink()  # an unfinished unit
    write_unit(out, 42, "cppo-group", 0.44)  # a new arm on a former seed: its grpo row comes from the former file
    data = accuracy_seeds.main(argv_of(sweep_args(out, "--combine", "--with", str(former), seeds=[42, *SWEEP])))
    assert data["meta"]["sweep"]["missing"] == ["seed42-control", "seed46-control"]
    assert "left out (not finished, and in no --with file): seed42-control, seed46-control" in capsys.readouterr().out
    d = data["summary"]["accuracy_differences"]
    assert d["CPPO group P=0.75 - GRPO"]["per_seed"][42] == pytest.approx(0.44 - FORMER[42][0])
    assert d["CPPO P=0.75 no allocation - GRPO"]["n"] == 2  # seeds 45 and 47
    rows = {(r["seed"], r["arm"]): r for r in data["rows"]}
    assert rows[(42, "cppo-group")]["speedup_total"] == pytest.approx(1000.0 / 442.0)  # against the former GRPO row


def test_arms_combined_without_grpo_or_pooled_cppo_are_refused_naming_what_is_missing(tmp_path):
    out = tmp_path / "sweep"
    for seed in (42, 43):
        write_unit(out, seed, "cppo-group", 0.4)
    accuracy_seeds.check_sweep_folder(sweep_args(out, arms=["cppo-group"]), out)
    with pytest.raises(ValueError, match=r"need GRPO and a pooled CPPO row with allocation .*--with file"):
        accuracy_seeds.main(argv_of(sweep_args(out, "--combine", seeds=[42, 43], arms=["cppo-group"])))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"meta": {"lr": 1e-5}}, "lr is 1e-05, but 2e-05 in"),
        ({"meta": {"model": "other.gguf"}}, "model is 'other.gguf'"),
        ({"meta": {"eval": {"problems": 100, "points": 1}}}, "eval problems is 100"),
        ({"meta": {"questions": 32}}, "questions \\(per seed\\) is 32"),
        ({"row": {"accuracy_before": 0.25}}, "rows' accuracy_before is 0.25"),
        ({"row": {"train_question_ids": question_ids(99)}}, "seed 46's CPPO group P=0.75 trained other questions"),
        ({"row": {"selection_scope": "batch"}}, "says arm 'cppo-group', but its settings are those of 'cppo-pooled'"),
    ],
)
def test_a_unit_that_does_not_agree_is_refused_naming_its_file(tmp_path, change, match):
    out, former = summary_inputs(tmp_path)
    write_unit(out, 46, "cppo-group", 0.3, **change)
    with pytest.raises(ValueError, match=f"seed46-cppo-group/result.json: .*{match}"):
        accuracy_seeds.main(argv_of(sweep_args(out, "--combine", "--with", str(former))))


def test_a_former_file_that_does_not_agree_is_refused(tmp_path):
    out, _ = summary_inputs(tmp_path)
    for meta, match in (({"max_completion_length": 64}, "max_completion_length is 64"), ({"group_size": 16}, "")):
        former = former_file(tmp_path, **meta)
        with pytest.raises(ValueError, match=f"former-seeds.json: .*{match}"):
            accuracy_seeds.main(argv_of(sweep_args(out, "--combine", "--with", str(former))))


def test_a_seed_and_method_in_both_is_refused(tmp_path):
    out, former = summary_inputs(tmp_path)
    write_unit(out, 42, "grpo", 0.47)
    with pytest.raises(ValueError, match="seed 42 has two GRPO rows"):
        accuracy_seeds.main(argv_of(sweep_args(out, "--combine", "--with", str(former), seeds=[42, *SWEEP])))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"meta43": {"model": "other.gguf"}}, "seed43.json: model is 'other.gguf', but 'm.gguf' in .*seed42.json"),
        ({"row44": {"eval_problems": 100}}, "seed44.json: rows' eval_problems is 100, but 300"),
        ({"meta44": {"questions": 32}}, "seed44.json: questions \\(per seed\\) is 32, but 64"),
        (
            {"row44": {"seed": 99, "train_question_ids": question_ids(99)}},
            "seed44.json: its rows or meta are of seed\\(s\\) ",
        ),
        ({"meta44": {"seed": 99}}, "seed44.json: .*seed\\(s\\) \\[44, 99\\], but the file is named for seed 44"),
    ],
)
def test_from_runs_refuses_files_of_other_settings_or_seeds(tmp_path, change, match):
    runs = tmp_path / "runs"
    seed_files(runs, **change)
    with pytest.raises(ValueError, match=match):
        accuracy_seeds.main(["--seeds", "42", "43", "44", "--from-runs", str(runs), "--out", str(tmp_path / "o")])


def test_from_runs_refusal_is_one_line_and_a_failing_exit(tmp_path):
    runs = tmp_path / "runs"
    seed_files(runs, row44={"seed": 99})
    cmd = [sys.executable, str(accuracy_seeds.HERE / "accuracy_seeds.py"), "--from-runs", str(runs), "--out",
           str(tmp_path / "o")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and done.stdout == ""
    line = done.stderr.strip()
    assert "\n" not in line and "accuracy-smollm2-seed44.json" in line and "[44, 99]" in line, line


def test_before_of_another_model_or_size_is_refused(tmp_path):
    args = sweep_args("x").base
    config = accuracy_arm.arm_config(args, "grpo", 45)
    before = tmp_path / "before.json"
    point = {"train_seconds": 0.0, "step": 0, "correct": 60, "total": 300}
    fileio.write_json(before, {"config": config.to_dict(), "point": point})
    assert accuracy_arm.read_before(before, config, 300).correct == 60
    with pytest.raises(ValueError, match="eval problems"):
        accuracy_arm.read_before(before, config, 100)
    fileio.write_json(before, {"config": {**config.to_dict(), "max_completion_length": 64}, "point": point})
    with pytest.raises(ValueError, match="max_completion_length"):
        accuracy_arm.read_before(before, config, 300)
    fileio.write_json(before, {"config": {**config.to_dict(), "seed": 46}, "point": point})  # a tiny model's seed
    with pytest.raises(ValueError, match="'seed': \\(46, 45\\)"):
        accuracy_arm.read_before(before, config, 300)


def test_a_real_tiny_unit_writes_a_row_with_the_committed_schema(tmp_path):
    """``accuracy_arm.py`` for real on the tiny model (one step, three problems): its row has every column of the
    committed rows, plus ``arm``; the curve starts at the before measurement."""
    tiny = ["--config", "tiny-cpu", "--questions", "4", "--eval", "3", "--no-warmup", "--set",
            "max_completion_length=4", "group_size=4", "mu=1", "questions_per_step=1"]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        before = accuracy_arm.main(["--before-only", "--seed", "3", "--result", str(tmp_path / "b.json"), *tiny])
        result = accuracy_arm.main(["--arm", "cppo-pooled", "--seed", "3", "--before", str(tmp_path / "b.json"),
                                    "--result", str(tmp_path / "r.json"), *tiny])  # fmt: skip
    finally:
        torch.set_num_threads(threads)  # the unit runs one thread; the test process keeps its own
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    committed = json.loads(COMMITTED.read_text())["rows"][0]
    assert set(row) == set(committed) | {"arm"} | ISSUE30_KEYS | ISSUE41_KEYS | ISSUE38_KEYS | ISSUE51_KEYS
    assert row == json.loads(json.dumps(result["rows"][0]))
    # per-problem records of both evaluations (before: the --before-only unit's, carried; after), in problem order
    (first, last) = row["eval_per_problem"]
    assert first["step"] == 0 and first["records"] == before["point"]["per_problem"] and last["step"] == 1
    assert [r["index"] for r in last["records"]] == [0, 1, 2] and sum(r["correct"] for r in last["records"]) == round(
        3 * row["accuracy_after"]
    )
    assert all(1 <= r["completion_tokens"] <= 4 and len(r["id"]) == 12 for r in last["records"])
    # tokens per phase: the training passes' split adds up to tokens_forward; generation decoded what it kept
    assert row["tokens_train_prompt"] + row["tokens_train_completion"] == row["tokens_forward"]
    assert 0 < row["tokens_generate_completion"] <= 4 * row["completions"] and row["tokens_generate_prompt"] > 0
    assert row["cpu_seconds"] > 0 and row["phase_cpu_seconds"]["generation"] > 0
    assert set(row["phase_cpu_seconds"]) == set(row["phase_seconds"]) - {"other"}
    assert (row["arm"], row["seed"], row["steps"], row["questions"]) == ("cppo-pooled", 3, 1, 4)
    assert row["accuracy_curve"][0] == [0.0, 0, before["point"]["correct"] / 3] and row["accuracy_curve"][1][1] == 1
    assert row["speedup_total"] is None  # filled against the seed's GRPO row when the sweep is combined
