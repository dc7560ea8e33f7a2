"""What the accuracy runner (``benchmarks/accuracy_seeds.py``) refuses to pool (issue 40, defect 8): every trainer
setting outside the allow-list (:data:`seeds_files.MAY_DIFFER`) and the environment must agree across units,
``--with`` files and per-seed files; ``--combine`` checks ``OUT/sweep.json`` against the command line as a continued
run does; a missing, empty or malformed ``sweep.json`` is one line naming it; where and when a file ran is recorded,
not compared; a key a file predates counts as the setting's default; and the committed result files still combine
as docs/results.md says."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
from sweep_cases import ARMS5, COMMITTED, META, argv_of, seed_files, summary_inputs, sweep_args, unit_row, write_unit
from sweeps import arm as accuracy_arm
from sweeps import files as seeds_files
from sweeps import seeds as accuracy_seeds
from sweeps import units as sweep_units

from cppo import TrainConfig, fileio

RESULTS = COMMITTED.parent
#: What may differ between files combined: the pruning settings, the seeds, the run's length and folder, what an arm
#: or the sweep sets per unit (accuracy_arm's OWN_SETTINGS and ARMS), and the preset's name.
ALLOWED = {"pruning_rate", "selection_metric", "selection_scope", "allocation", "seed", "question_seed", "num_steps",
           "max_questions", "output_dir", "num_epochs", "filter_groups", "greso", "preset"}  # fmt: skip
ALLOWED |= set(accuracy_arm.OWN_SETTINGS) | {k for arm in accuracy_arm.ARMS for k in accuracy_arm.arm_settings(arm)}
SETTINGS = sorted({f.name for f in dataclasses.fields(TrainConfig)} - ALLOWED)
MUST_AGREE = [*SETTINGS, "python", *fileio.LIBRARIES, "torch_threads"]


def test_the_allow_list_is_the_arms_and_the_sweeps_settings_and_every_other_setting_must_agree():
    assert seeds_files.MAY_DIFFER == ALLOWED
    issue30 = {
        "max_num_gen_batches",
        "greso_target_skip_rate",
        "greso_min_explore",
        "greso_adjust_step",
        "prefill_once",
    }
    assert not issue30 & ALLOWED  # no arm sets them: they must agree
    assert set(seeds_files.AGREE_KEYS) == set(MUST_AGREE)
    assert {"max_num_gen_batches", "greso_target_skip_rate", "prefill_once", "reward_timeout"} <= set(
        seeds_files.AGREE_KEYS
    )
    assert {"transformers", "torch", "python", "torch_threads"} <= set(seeds_files.AGREE_KEYS)
    assert not set(seeds_files.RECORDED_KEYS) & set(seeds_files.AGREE_KEYS)


@pytest.mark.parametrize("key", MUST_AGREE)
def test_a_file_that_differs_in_any_setting_outside_the_allow_list_is_refused(tmp_path, key):
    rows = [unit_row(45, "grpo", 0.4, 100.0)]
    sources = [(tmp_path / "a.json", dict(META), rows), (tmp_path / "b.json", {**META, key: "changed"}, rows)]
    with pytest.raises(ValueError, match=rf"b.json: {key} is 'changed', but .* in .*a.json \(the runs would not"):
        seeds_files.check_agree(sources)


@pytest.mark.parametrize(
    "meta",
    [
        {"max_num_gen_batches": 8},
        {"greso_target_skip_rate": 0.3},
        {"prefill_once": False},
        {"greso_min_explore": 0.1},
        {"transformers": "5.19.0"},
        {"python": "3.12.1"},
    ],  # fmt: skip
)
def test_a_unit_of_other_issue_30_settings_or_another_environment_is_refused(tmp_path, meta):
    out, former = summary_inputs(tmp_path)
    write_unit(out, 46, "cppo-group", 0.3, meta=meta)
    ((key, value),) = meta.items()
    match = rf"seed46-cppo-group/result.json: {key} is {value!r}, but .* in .*seed45-grpo/result.json"
    with pytest.raises(ValueError, match=match):
        accuracy_seeds.main(argv_of(sweep_args(out, "--combine", "--with", str(former))))


def test_a_setting_a_file_predates_counts_as_its_default(tmp_path):
    out, former = summary_inputs(tmp_path)  # the former file records no prefill_once: it ran before the setting
    write_unit(out, 46, "cppo-group", 0.3, meta={"prefill_once": True, "max_num_gen_batches": 4})  # the defaults
    accuracy_seeds.main(argv_of(sweep_args(out, "--combine", "--with", str(former))))
    write_unit(out, 46, "cppo-group", 0.3, meta={"prefill_once": False})
    match = r"prefill_once is False, but True \(not recorded: the default\) in .*/result.json"
    with pytest.raises(ValueError, match=match):
        accuracy_seeds.main(argv_of(sweep_args(out, "--combine", "--with", str(former))))


def test_where_and_when_a_file_ran_is_recorded_not_compared(tmp_path):
    out, former = summary_inputs(tmp_path)
    ran = {"git_commit": "abc", "git_dirty": True, "device_name": "other", "date": "2027", "cpu_count": 64}
    write_unit(out, 46, "cppo-group", 0.3, meta=ran)
    data = accuracy_seeds.main(argv_of(sweep_args(out, "--combine", "--with", str(former))))
    source = next(s for s in data["meta"]["sources"] if s["file"].endswith("seed46-cppo-group/result.json"))
    assert {k: source[k] for k in ran} == ran
    # the combination records every setting agreed on, so that it can itself be combined later (--with)
    unit = json.loads((out / "units" / "seed45-grpo" / "result.json").read_text())["meta"]
    assert {k: data["meta"][k] for k in seeds_files.AGREE_KEYS} == seeds_files.agreed_meta(unit)


def test_combine_refuses_a_command_line_other_than_the_sweeps(tmp_path):
    out, former = summary_inputs(tmp_path)  # sweep.json: the preset, 64 questions, 300 problems, 1 point
    other = [*argv_of(sweep_args(out, "--combine")), "--eval", "100", "--questions", "32"]
    with pytest.raises(ValueError, match=r"sweep.json: this folder's sweep ran with eval 300 \(--eval\), this comm"):
        accuracy_seeds.main(other)
    data = json.loads((out / "sweep.json").read_text())
    fileio.write_json(out / "sweep.json", {**data, "arms": {**data["arms"], "control": ["pruning_rate=0.5"]}})
    with pytest.raises(ValueError, match=r"sweep.json: the arm control was \['pruning_rate=0.5'\] when this sweep"):
        accuracy_seeds.main(argv_of(sweep_args(out, "--combine")))
    del data["unit_args"]["eval_points"]  # a sweep.json written before the flag existed: its default (1)
    fileio.write_json(out / "sweep.json", data)
    assert (
        accuracy_seeds.main(argv_of(sweep_args(out, "--combine", "--with", str(former))))["meta"]["sweep"]["unit_args"][
            "eval_points"
        ]
        == 1
    )
    assert json.loads((out / "sweep.json").read_text()) == data  # --combine writes nothing there


BAD = "is not a sweep's settings file \\("


@pytest.mark.parametrize(
    ("text", "why"),
    [(None, "is missing"), ("", BAD + "JSONDecodeError"), ("[]", BAD + "TypeError: not an object with unit_args"),
     ('{"unit_args": 3}', BAD + "TypeError: not an object with unit_args"),
     ('{"unit_args": {}, "arms": ["grpo"]}', BAD + "TypeError: its arms are not an object"),
     ('{"unit_args": {}}', BAD + "TypeError: its arms")],
)  # fmt: skip
def test_a_missing_empty_or_malformed_sweep_json_is_refused_naming_it(tmp_path, text, why):
    out, _ = summary_inputs(tmp_path)
    (out / "sweep.json").unlink()
    if text is not None:
        (out / "sweep.json").write_text(text)
        with pytest.raises(ValueError, match=f"sweep.json {why}"):  # a run (continuing) reads it too
            accuracy_seeds.check_sweep_folder(sweep_args(out), out)
    with pytest.raises(ValueError, match=f"{out}/sweep.json {why}"):
        accuracy_seeds.main(argv_of(sweep_args(out, "--combine")))


def test_an_empty_sweep_json_is_one_line_and_a_failing_exit(tmp_path):
    out, _ = summary_inputs(tmp_path)
    (out / "sweep.json").write_text("")
    cmd = [sys.executable, str(accuracy_seeds.HERE / "accuracy_seeds.py"), *argv_of(sweep_args(out, "--combine"))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    line = done.stderr.strip()
    assert done.returncode != 0 and "\n" not in line and f"{out}/sweep.json is not a sweep's" in line, line


def _from_runs(tmp_path, *extra):
    return accuracy_seeds.main(["--seeds", "42", "43", "44", "--from-runs", str(tmp_path / "runs"), "--out",
                                str(tmp_path / "o"), *extra])  # fmt: skip


def test_from_runs_refuses_files_of_other_speedup_arguments_or_settings(tmp_path):
    runs = tmp_path / "runs"
    seed_files(runs)
    assert _from_runs(tmp_path)["meta"]["speedup_args"] == list(accuracy_seeds.DEFAULT_SPEEDUP_ARGS)
    with pytest.raises(ValueError, match=r"seed42.json: it ran speedup.py with eval 300, but this command passes 100"):
        _from_runs(tmp_path, "--", *accuracy_seeds.DEFAULT_SPEEDUP_ARGS, "--eval", "100")
    smaller = accuracy_seeds.parse_args(["--", *accuracy_seeds.DEFAULT_SPEEDUP_ARGS, "--questions", "32"])
    seed_files(runs, meta44={"argv": accuracy_seeds.seed_command(smaller, 44, runs)[2:]})
    with pytest.raises(ValueError, match=r"seed44.json: it ran speedup.py with questions 32, but this command passes"):
        _from_runs(tmp_path)
    seed_files(runs, meta43={"max_num_gen_batches": 2})
    with pytest.raises(ValueError, match=r"seed43.json: max_num_gen_batches is 2, but 4 \(not recorded: the def"):
        _from_runs(tmp_path)
    seed_files(runs, meta43={"argv": None})
    with pytest.raises(ValueError, match=r"seed43.json: its meta.argv is None, not the speedup.py command line"):
        _from_runs(tmp_path)


def test_the_committed_results_combine_as_the_docs_say(tmp_path):
    """docs/results.md's combination of the nine-seed sweep (its units and the three-seed file) and the
    dynamic-sampling pair, run on copies (a combination writes into its folder): the same accuracy differences as the
    committed combined files."""
    for name in ("sweep-seeds45-50", "accuracy-dynamic"):
        shutil.copytree(RESULTS / name, tmp_path / name)
    seeds = [str(s) for s in range(42, 51)]
    data = accuracy_seeds.main(["--seeds", *seeds, "--arms", *ARMS5, "--out", str(tmp_path / "sweep-seeds45-50"),
                                "--combine", "--with", str(COMMITTED)])  # fmt: skip
    committed = json.loads((RESULTS / "sweep-seeds45-50" / "accuracy-smollm2-seeds.json").read_text())
    assert data["meta"]["sweep"]["missing"] == [] and len(data["rows"]) == len(committed["rows"]) == 48
    assert (
        json.loads(json.dumps(data["summary"]["accuracy_differences"])) == committed["summary"]["accuracy_differences"]
    )
    data = accuracy_seeds.main(["--seeds", "42", "43", "44", "--arms", "cppo-epochs", "cppo-dyn", "--name",
                                "accuracy-dynamic", "--out", str(tmp_path / "accuracy-dynamic"), "--combine", "--",
                                "--questions", "32", "--eval", "300", "--eval-points", "4"])  # fmt: skip
    committed = json.loads((RESULTS / "accuracy-dynamic" / "accuracy-dynamic-seeds.json").read_text())
    assert data["summary"]["dynamic"].keys() == committed["summary"]["dynamic"].keys()
    for pair, found in data["summary"]["dynamic"].items():
        found = json.loads(json.dumps(found["accuracy_difference"]))
        assert found == committed["summary"]["dynamic"][pair]["accuracy_difference"]


def test_a_continued_sweep_refuses_finished_units_of_other_settings_or_environment(tmp_path):
    """Before it runs anything, a continued sweep checks its finished units against what it would run now (an
    edited preset, an upgraded library): such units would never combine with the new ones."""
    out = tmp_path / "sweep"
    args = sweep_args(out, seeds=[45], arms=["grpo"])
    unit = accuracy_seeds.plan_units(args)[1]
    unit.folder(out).mkdir(parents=True)
    env = fileio.run_metadata(argv=[])
    meta = {**accuracy_arm.arm_config(args.base, "grpo", 45).to_dict(), **env, "torch_threads": 1}
    for change, match in (({}, None), ({"max_num_gen_batches": 8}, "max_num_gen_batches is 8, but this command would"),
                          ({"transformers": "0.1"}, "transformers is '0.1', but this command would run")):  # fmt: skip
        fileio.write_json(unit.result(out), {"meta": {**meta, **change}, "rows": [unit_row(45, "grpo", 0.4, 100.0)]})
        assert accuracy_seeds.finished(unit, out)
        if match is None:
            sweep_units.check_finished_units(args, [unit], out)
        else:
            with pytest.raises(ValueError, match=f"seed45-grpo/result.json: {match}"):
                sweep_units.check_finished_units(args, [unit], out)
