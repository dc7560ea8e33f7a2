"""The accuracy sweep's test cases (for tests/benchmarks/): the committed rows' shape, a unit's row and result file, a
former combined file, the sweep's arguments, the per-seed files of the per-seed runner. No test lives here."""

from __future__ import annotations

import pathlib

from sweeps import arm as accuracy_arm
from sweeps import seeds as accuracy_seeds

from cppo import fileio

REPO = pathlib.Path(__file__).resolve().parents[2]  # tests/support/ -> the repository
COMMITTED = REPO / "benchmarks" / "results" / "accuracy-smollm2-seeds.json"
#: The real preset's settings with the built-in tiny model (nothing loads for a plan).
PRESET = ["--config", "smollm2-accuracy-cpu", "--set", "model=tiny-qwen2", "model_config=null"]
ARMS5 = ["grpo", "cppo-pooled", "cppo-group", "max-variance", "control"]
META = {"model": "m.gguf", "lr": 2e-5, "group_size": 8, "max_completion_length": 32, "questions": 64,
        "eval": {"problems": 300, "points": 1}}  # fmt: skip


def question_ids(seed):
    return [f"q{seed}-{i}" for i in range(64)]


def unit_row(seed, arm, acc, seconds, **extra):
    return {
        "arm": arm, "seed": seed, **accuracy_arm.arm_settings(arm), "accuracy_after": acc, "accuracy_before": 0.2,
        "total_seconds": seconds, "train_seconds": seconds / 2, "cpu_seconds": seconds, "eval_problems": 300,
        "eval_problems_scored": 300, "questions": 64, "group_size": 8, "train_question_ids": question_ids(seed),
        "ideal_speedup_train": 1.0 / (1.0 - accuracy_arm.arm_settings(arm)["pruning_rate"]),
        "accuracy_after_ci95": [acc - 0.05, acc + 0.05], "accuracy_curve": [[0, 0, 0.2], [seconds, 16, acc]], **extra,
    }  # fmt: skip


#: seed -> accuracy per arm of ARMS5 (the sweep's seeds) and the former file's seeds (no cppo-group, no control).
SWEEP = {45: (0.40, 0.38, 0.41, 0.44, 0.39), 46: (0.35, 0.37, 0.30, 0.36, 0.33), 47: (0.42, 0.42, 0.40, 0.41, 0.45)}
FORMER = {42: (0.47, 0.31, 0.45), 43: (0.42, 0.41, 0.46), 44: (0.40, 0.40, 0.40)}  # grpo, cppo-pooled, max-variance


def former_file(tmp_path, **meta):
    rows = [
        {k: v for k, v in unit_row(seed, arm, acc, 1000.0 if arm == "grpo" else 400.0).items() if k != "arm"}
        for seed, accs in FORMER.items()
        for arm, acc in zip(["grpo", "cppo-pooled", "max-variance"], accs)
    ]
    path = tmp_path / "former-seeds.json"
    fileio.write_json(path, {"meta": {**META, **meta}, "rows": rows, "summary": {}})
    return path


def write_unit(out, seed, arm, acc, *, meta=None, row=None):
    folder = out / "units" / f"seed{seed}-{arm}"
    folder.mkdir(parents=True, exist_ok=True)
    seconds = 1000.0 if arm in ("grpo", "control") else 400.0 + seed
    data = {"meta": {**META, **(meta or {})}, "rows": [{**unit_row(seed, arm, acc, seconds), **(row or {})}]}
    fileio.write_json(folder / "result.json", data)


def sweep_args(out, *extra, seeds=SWEEP, arms=ARMS5):
    argv = ["--seeds", *map(str, seeds), "--arms", *arms, "--out", str(out), *extra, "--", *PRESET]
    return accuracy_seeds.parse_args(argv)


def summary_inputs(tmp_path):
    out = tmp_path / "sweep"
    for seed, accs in SWEEP.items():
        for arm, acc in zip(ARMS5, accs):
            write_unit(out, seed, arm, acc)
    accuracy_seeds.check_sweep_folder(sweep_args(out), out)  # its sweep.json, as the run wrote it
    return out, former_file(tmp_path)


def argv_of(args):
    """The command line of a parsed sweep (``--combine``, the ``--with`` files)."""
    argv = ["--seeds", *map(str, args.seeds), "--arms", *args.arms, "--out", str(args.out), "--combine"]
    return [*argv, *(a for f in args.with_files for a in ("--with", str(f))), "--", *args.unit_args]


def seed_files(runs, **per_seed):
    runs.mkdir(exist_ok=True)
    args = accuracy_seeds.parse_args(["--seeds", "42", "43", "44"])
    for seed in (42, 43, 44):
        meta, rows = dict(META, seed=seed), [unit_row(seed, a, 0.4, 100.0) for a in ("grpo", "cppo-pooled")]
        meta["argv"] = accuracy_seeds.seed_command(args, seed, runs)[2:]  # what speedup.py records of its command
        meta.update(per_seed.get(f"meta{seed}", {}))
        rows = [{**r, **per_seed.get(f"row{seed}", {})} for r in rows]
        fileio.write_json(runs / f"accuracy-smollm2-seed{seed}.json", {"meta": meta, "rows": rows})
