"""benchmarks/speedup.py's accuracy measurement and ablations: Wilson intervals, evaluation points, the accuracy
columns, time to reach GRPO's final accuracy, the --eval / --selection-metric checks, the evaluation wiring and a
seconds-long --eval run on a tiny model."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib

import pytest
from tiny_model import TINY_ONE_LAYER

from cppo import TrainConfig, load_config

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "speedup.py"
TINY = TINY_ONE_LAYER


def _config(*overrides):
    return load_config("speedup-cpu", ["device=cpu", *overrides])


# --------------------------------------------------------------------------------------------
# Wilson score interval
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("correct", "total"), [(0, 10), (5, 10), (10, 10), (74, 300), (1, 1), (150, 300)])
def test_wilson_bounds_solve_the_score_equation(report, correct, total):
    """Each Wilson bound b is a root of n (p_hat - b)^2 = z^2 b (1 - b): where the score test stops rejecting."""
    lo, hi = report.wilson_interval(correct, total)
    phat, z = correct / total, report.Z95
    assert 0.0 <= lo <= phat <= hi <= 1.0
    for b in (lo, hi):
        assert total * (phat - b) ** 2 == pytest.approx(z * z * b * (1 - b), abs=1e-12)
    assert (lo == 0.0) == (correct == 0) and (hi == 1.0) == (correct == total)


def test_wilson_textbook_values(report):
    assert report.wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert report.wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert report.Z95 == pytest.approx(1.959964, abs=1e-6)
    narrow, wide = report.wilson_interval(150, 300), report.wilson_interval(5, 10)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]


@pytest.mark.parametrize(("correct", "total"), [(0, 0), (3, 2), (-1, 5)])
def test_wilson_rejects_impossible_counts(report, correct, total):
    with pytest.raises(ValueError, match="0 <= correct <= total"):
        report.wilson_interval(correct, total)


# --------------------------------------------------------------------------------------------
# Evaluation points, time to reach, the accuracy columns
# --------------------------------------------------------------------------------------------


def test_eval_steps_are_evenly_spaced_and_end_the_run(speedup):
    assert speedup.eval_steps(8, 2) == [4, 8]
    assert speedup.eval_steps(8, 4) == [2, 4, 6, 8]
    assert speedup.eval_steps(32, 3) == [11, 22, 32]
    assert speedup.eval_steps(3, 2) == [2, 3] and speedup.eval_steps(5, 5) == [1, 2, 3, 4, 5]
    assert speedup.eval_steps(7, 1) == [7]
    for bad in (0, 9):
        with pytest.raises(ValueError, match=r"--eval-points must be in \[1, 8\]"):
            speedup.eval_steps(8, bad)


def test_eval_points_fall_on_the_same_questions_at_every_rate(speedup):
    plans = speedup.plan_schedule(_config("group_size=8"), [0, 0.5, 0.75, 0.875], questions=32)
    seen = {tuple(k * p.pruning.questions_drawn for k in speedup.eval_steps(p.num_steps, 4)) for p in plans}
    assert seen == {(8, 16, 24, 32)}


def _point(report, seconds, step, correct, total=100, **kw):
    return report.EvalPoint(train_seconds=seconds, step=step, correct=correct, total=total, **kw)


def test_time_to_reach_is_the_first_point_at_or_above_the_target(report):
    curve = [_point(report, 0.0, 0, 20), _point(report, 10.0, 2, 35), _point(report, 20.0, 4, 30)]
    assert report.time_to_reach(curve, 0.35) == 10.0  # reaching it exactly counts
    assert report.time_to_reach(curve, 0.3) == 10.0
    assert report.time_to_reach(curve, 0.2) == 0.0  # the start already there
    assert report.time_to_reach(curve, 0.36) is None
    assert report.time_to_reach([], 0.1) is None


def test_accuracy_fields(report):
    curve = [
        _point(report, 0.0, 0, 20, format_rate=0.0, eval_seconds=7.0),
        _point(report, 12.5, 2, 30, eval_seconds=3.0),
        _point(report, 30.0, 4, 45, format_rate=0.25, eval_seconds=4.0),
    ]
    f = report.accuracy_fields(curve, target=0.3, grpo_seconds=50.0)
    assert set(f) == set(report.ACCURACY_KEYS)
    assert (f["eval_problems"], f["eval_problems_scored"]) == (None, 100)  # distinct questions: not counted here
    assert (f["accuracy_before"], f["accuracy_after"]) == (0.2, 0.45)
    counted = [dataclasses.replace(p, distinct=97) for p in curve]
    assert report.accuracy_fields(counted, target=0.3, grpo_seconds=50.0)["eval_problems"] == 97
    assert f["accuracy_before_ci95"] == list(report.wilson_interval(20, 100))
    assert f["accuracy_after_ci95"] == list(report.wilson_interval(45, 100))
    assert f["accuracy_curve"] == [[0.0, 0, 0.2], [12.5, 2, 0.3], [30.0, 4, 0.45]]
    assert (f["format_rate_before"], f["format_rate_after"]) == (0.0, 0.25)
    assert f["eval_seconds"] == 7.0  # this run's own points; the shared one before training is in meta
    assert (f["time_to_grpo_accuracy"], f["time_to_grpo_accuracy_fraction"]) == (12.5, 0.25)
    never = report.accuracy_fields(curve, target=0.5, grpo_seconds=50.0)
    assert never["time_to_grpo_accuracy"] is None and never["time_to_grpo_accuracy_fraction"] is None
    assert report.accuracy_fields([], target=0.3, grpo_seconds=50.0) == dict.fromkeys(report.ACCURACY_KEYS)


def _run(report, p, *, total, curve, metric="smallest"):
    config = TrainConfig(group_size=8, pruning_rate=p, selection_metric=metric, questions_per_step=1)
    config = dataclasses.replace(config, num_steps=8 // config.pruning.questions_drawn, max_questions=8)
    phases = dict.fromkeys(report.PHASES, 0.0) | {"generation": total / 2, "policy_fwd_bwd": total / 2}
    sums = {"phase_seconds": phases, "total_seconds": total, "tokens_trained": 10, "tokens_forward": 30}
    sums |= {"completions": 64, "completions_kept": 8, "questions": 8, "reward_mean": 0.1, "accuracy": 0.1}
    return report.RateRun(config=config, sums=sums, curve=curve)


def test_build_rows_times_every_run_against_grpos_final_interval(report, speedup):
    before = _point(report, 0.0, 0, 100, total=300)
    grpo = [before, _point(report, 40.0, 4, 120, total=300), _point(report, 80.0, 8, 150, total=300)]
    lo = report.wilson_interval(150, 300)[0]  # 0.4436...: what a run must reach
    cppo_curve = [before, _point(report, 10.0, 1, 135, total=300), _point(report, 20.0, 2, 140, total=300)]
    random_curve = [before, _point(report, 10.0, 1, 110, total=300), _point(report, 20.0, 2, 120, total=300)]
    rows = report.build_rows([
        _run(report, 0.0, total=80.0, curve=grpo),
        _run(report, 0.75, total=20.0, curve=cppo_curve),
        _run(report, 0.75, total=20.0, curve=random_curve, metric="random"),
    ])  # fmt: skip
    assert 133 / 300 < lo < 135 / 300
    assert [r["selection_metric"] for r in rows] == ["smallest", "smallest", "random"]
    assert [r["time_to_grpo_accuracy"] for r in rows] == [80.0, 10.0, None]
    assert [r["time_to_grpo_accuracy_fraction"] for r in rows] == [1.0, 0.125, None]
    assert [r["paper_speedup_gsm8k"] for r in rows] == [1.0, 3.27, None]  # the paper has no random pruning
    assert {r["accuracy_before"] for r in rows} == {100 / 300}
    assert rows[2]["speedup_total"] == 4.0
    table = report.format_accuracy_table(rows).splitlines()
    assert table[0].startswith("| P | keep | steps | wall s | speedup |") and len(table) == 5
    assert "| 0.75 random | 2/8 |" in table[4] and table[4].split("|")[8].strip() == "-"
    assert "10 s (12%)" in table[3] and "46.7% [" in table[3]


def test_rows_without_eval_have_the_accuracy_columns_empty(report):
    rows = report.build_rows([_run(report, 0.0, total=8.0, curve=[]), _run(report, 0.5, total=4.0, curve=[])])
    assert all(r[k] is None for r in rows for k in report.ACCURACY_KEYS)
    assert [r["selection_metric"] for r in rows] == ["smallest", "smallest"]


# --------------------------------------------------------------------------------------------
# Ablations: --selection-metric METRIC@P
# --------------------------------------------------------------------------------------------


def test_parse_ablation(speedup):
    assert speedup.parse_ablation("random@0.75") == ("random", 0.75)
    assert speedup.parse_ablation("largest@0.5") == ("largest", 0.5)
    for bad in ("random", "random@", "random@x", "random@0", "random@1", "smallest@0.5", "best@0.5", "@0.5"):
        with pytest.raises(ValueError, match=r"--selection-metric .*expected METRIC@P"):
            speedup.parse_ablation(bad)


def test_schedule_adds_ablation_runs_on_the_same_questions(speedup):
    base = _config("group_size=8")
    plans = speedup.plan_schedule(base, [0, 0.75], ablations=[("random", 0.75), ("largest", 0.5)], questions=8)
    assert [(p.pruning_rate, p.selection_metric) for p in plans] == [
        (0.0, "smallest"), (0.75, "smallest"), (0.75, "random"), (0.5, "largest")
    ]  # fmt: skip
    assert [p.num_steps for p in plans] == [8, 2, 2, 4] and {p.max_questions for p in plans} == {8}
    assert plans[2] == dataclasses.replace(plans[1], selection_metric="random")
    assert [speedup.run_label(p) for p in plans] == ["P=0", "P=0.75", "P=0.75 random", "P=0.5 largest"]
    with pytest.raises(ValueError, match="repeats a run"):
        speedup.plan_schedule(base, [0, 0.75], ablations=[("random", 0.75)] * 2)
    with pytest.raises(ValueError, match=r"--questions must be a multiple of 4 .*'P=0.75 random': 4"):
        speedup.plan_schedule(base, [0, 0.5], ablations=[("random", 0.75)], questions=6)
    # the pooled scopes keep the official count at any rate (cppo_kernels' num_kept), global scope included
    glob = _config("group_size=8", "selection_scope=global")
    high = speedup.plan_schedule(glob, [0], ablations=[("random", 0.99)], questions=100)[1]
    assert (high.pruning.questions_drawn, high.pruning.kept_per_step, high.num_steps) == (100, 800 - int(800 * 0.99), 1)


# --------------------------------------------------------------------------------------------
# --eval checks (the dry run validates them, building no model)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--eval-points", "2"], "--eval-points needs --eval"),
        (["--eval", "0"], "--eval must be >= 1"),
        (["--eval", "5", "--eval-points", "3"], r"--eval-points must be in \[1, 2\] .*P=0.875"),
        (["--eval", "5", "--eval-points", "0"], r"--eval-points must be in \[1, 2\]"),
        (["--selection-metric", "random"], "expected METRIC@P"),
        (["--eval", "5", "--name", "a/b"], "--name must be a file name stem"),
    ],
)
def test_bad_eval_options_are_refused(speedup, tmp_path, argv, match):
    base = ["--pruning-rates", "0", "0.5", "0.875", "--questions", "16", "--device", "cpu", "--out", str(tmp_path)]
    for dry in ([], ["--dry-run"]):
        with pytest.raises(ValueError, match=match):
            speedup.main([*base, *argv, *dry])
    assert list(tmp_path.iterdir()) == []


def test_eval_needs_enough_local_test_problems(speedup, tmp_path):
    data = tmp_path / "gsm8k"
    data.mkdir()
    rows = [json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(3)]
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    argv = ["--dataset", "gsm8k", "--dataset-path", str(data), "--pruning-rates", "0", "--questions", "2"]
    argv += ["--device", "cpu", "--out", str(tmp_path / "out"), "--dry-run"]
    with pytest.raises(ValueError, match="--eval 5: the test split of 'gsm8k' has only 3 problems"):
        speedup.main([*argv, "--eval", "5"])
    plan = speedup.main([*argv, "--eval", "3"])
    assert plan["eval"] == {"problems": 3, "points": 2}  # the default 4, capped by the 2 steps of the run
    with pytest.raises(ValueError, match="is one file"):  # dataset_path a file: train and test are the same rows
        speedup.main([*argv[:3], str(data / "test.jsonl"), *argv[4:], "--eval", "3"])
    with pytest.raises(ValueError, match="needs held-out test problems"):  # a .jsonl dataset: the same
        speedup.main(["--dataset", str(data / "train.jsonl"), *argv[4:], "--eval", "3"])


def test_dry_run_plans_the_evaluations_and_the_files(speedup, tmp_path, monkeypatch):
    def no_trainer(*args, **kwargs):
        raise AssertionError("a dry run built a trainer")

    monkeypatch.setattr("cppo.trainer.Trainer", no_trainer)
    argv = ["--group-size", "8", "--pruning-rates", "0", "0.5", "0.75", "--selection-metric", "random@0.75"]
    argv += ["--questions", "16", "--eval", "300", "--eval-points", "2", "--name", "acc", "--dry-run"]
    plan = speedup.main([*argv, "--device", "cpu", "--out", str(tmp_path / "out")])
    assert plan["eval"] == {"problems": 300, "points": 2}
    assert [(r["selection_metric"], r["steps"], r["eval_steps"]) for r in plan["rates"]] == [
        ("smallest", 16, [8, 16]), ("smallest", 8, [4, 8]), ("smallest", 4, [2, 4]), ("random", 4, [2, 4])
    ]  # fmt: skip
    assert [pathlib.Path(f).name for f in plan["files"]] == ["acc.json", "acc.png", "acc-accuracy.png"]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# The wiring: evaluation points, their clock, one measurement before training
# --------------------------------------------------------------------------------------------


class _FakeTrainer:
    """Draws its planned questions; ``evaluate`` reports 10 + (steps taken) right of ``limit`` and counts calls."""

    calls: list[tuple[float, int]] = []

    def __init__(self, config):
        self.config, self.step = config, 0
        self.problems = [{"question": f"q{i}?", "answer": str(i)} for i in range(config.max_questions)]

    def train_step(self):
        self.step += 1
        q, g = self.config.pruning.questions_drawn, self.config.group_size
        m = {k: 0.0 for k in ("time/generate", "time/reward", "time/select", "time/logprobs", "time/update")}
        m |= {"time/optimizer": 0.0, "tokens_trained": 1, "tokens_forward": 1, "reward_mean": 0.0, "accuracy": 0.0}
        return m | {"completions": q * g, "completions_kept": q * self.config.pruning.keep, "questions": q}

    def evaluate(self, limit):
        _FakeTrainer.calls.append((self.config.pruning_rate, self.step))
        return {"correct": 10 + self.step, "total": limit, "format_rate": 0.0, "accuracy": (10 + self.step) / limit}


def test_run_plans_evaluates_before_and_at_the_points_on_the_training_clock(report, speedup, monkeypatch):
    import cppo.trainer

    monkeypatch.setattr(cppo.trainer, "Trainer", _FakeTrainer)
    from endtoend import runner  # where run_plans times its steps

    monkeypatch.setattr(runner, "timed_step", lambda trainer, device: (trainer.train_step(), 1.5, 1.0))
    _FakeTrainer.calls = []
    plans = speedup.plan_schedule(_config("group_size=8"), [0, 0.75], ablations=[("random", 0.75)], questions=8)
    seen = []
    runs = speedup.run_plans(
        plans,
        device="cpu",
        interleave=True,
        evaluation=speedup.EvalPlan(problems=50, points=2),
        on_eval=lambda plan, point: seen.append((speedup.run_label(plan), point.step)),
    )
    assert _FakeTrainer.calls[0] == (0.0, 0) and len(_FakeTrainer.calls) == 1 + 3 * 2  # one measurement before
    assert seen[0] == ("P=0", 0) and sorted(seen[1:]) == sorted(
        [("P=0", 4), ("P=0", 8), ("P=0.75", 1), ("P=0.75", 2), ("P=0.75 random", 1), ("P=0.75 random", 2)]
    )
    for run in runs:
        assert run.curve[0] is runs[0].curve[0] and run.curve[0].train_seconds == 0.0
        steps = speedup.eval_steps(run.config.num_steps, 2)
        assert [(p.step, p.train_seconds, p.correct) for p in run.curve[1:]] == [(k, 1.5 * k, 10 + k) for k in steps]
        assert run.sums["total_seconds"] == 1.5 * run.config.num_steps  # evaluation is not training time
        assert all(p.total == 50 and p.eval_seconds >= 0 for p in run.curve)
    plain = speedup.run_plans(plans, device="cpu", interleave=False)
    assert all(run.curve == [] for run in plain)


# --------------------------------------------------------------------------------------------
# Smoke test: the whole script with --eval, tiny
# --------------------------------------------------------------------------------------------


def test_main_with_eval_smoke(speedup, tmp_path, capsys):
    argv = ["--model-config", TINY, "--group-size", "4", "--pruning-rates", "0", "0.5", "--questions", "4"]
    argv += ["--set", "max_completion_length=4", "--backend", "torch", "--no-progress", "--no-warmup"]
    with_eval = [*argv, "--eval", "6", "--eval-points", "2", "--selection-metric", "random@0.5", "--name", "acc"]
    result = speedup.main([*with_eval, "--out", str(tmp_path)])
    for name in ("acc.png", "acc-accuracy.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "acc.json").read_text())
    assert data["rows"] == json.loads(json.dumps(result["rows"]))
    rows, meta = data["rows"], data["meta"]
    runs = [(r["pruning_rate"], r["selection_metric"]) for r in rows]
    assert runs == [(0, "smallest"), (0.5, "smallest"), (0.5, "random")]
    assert meta["eval"]["problems"] == 6 and meta["eval"]["points"] == 2 and "Wilson" in meta["eval"]["interval"]
    assert meta["ablations"] == ["random@0.5"] and meta["eval"]["before_seconds"] > 0
    for r in rows:
        assert (
            r["eval_problems"] == r["eval_problems_scored"] == 6 and r["accuracy_before"] == rows[0]["accuracy_before"]
        )
        curve = r["accuracy_curve"]
        assert [step for _, step, _ in curve] == [0, *speedup.eval_steps(r["steps"], 2)]
        assert curve[0][0] == 0.0 and curve[-1][0] == pytest.approx(r["total_seconds"])
        assert all(0 <= a <= 1 and math.isclose(a * 6, round(a * 6)) for _, _, a in curve)
        assert [s for s, _, _ in curve] == sorted(s for s, _, _ in curve)
        assert r["accuracy_after"] == curve[-1][2] and len(r["accuracy_after_ci95"]) == 2
        assert r["eval_seconds"] > 0
    assert rows[0]["time_to_grpo_accuracy"] is not None  # GRPO reaches its own final accuracy
    out = capsys.readouterr().out
    assert "| P | keep | steps | wall s | speedup | accuracy before (95% CI)" in out and "| 0.5 random |" in out
    plain = speedup.main([*argv, "--selection-metric", "random@0.5", "--no-plot", "--out", str(tmp_path / "plain")])
    for a, b in zip(plain["rows"], rows):  # evaluating between the steps leaves the training unchanged
        assert (a["tokens_trained"], a["reward_mean"]) == (b["tokens_trained"], b["reward_mean"])
        assert a["accuracy_curve"] is None and a["selection_metric"] == b["selection_metric"]
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["speedup.json"]


def test_write_json_replaces_the_file_whole(report, tmp_path):
    path = tmp_path / "acc.json"
    path.write_text("old")
    report.write_json(path, [{"x": float("nan")}], {"eval": None})
    assert json.loads(path.read_text()) == {"meta": {"eval": None}, "rows": [{"x": None}]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acc.json"]  # no partial file left behind


def test_the_reference_preset_plans_the_documented_run(speedup):
    """smollm2-accuracy-cpu and the command line in its header: five runs on the same 32 questions, 8 completions
    trained per step, two evaluation points each, the official prompt and rewards, pooled pruning."""
    import yaml

    from cppo.config import PRESET_DIR

    text = (PRESET_DIR / "smollm2-accuracy-cpu.yaml").read_text()
    raw = yaml.safe_load(text)
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "The reference run" in line) + 1
    command = itertools.takewhile(lambda line: line.startswith("#   "), lines[start:])
    argv = " ".join(line.lstrip("# ") for line in command).split("speedup.py ", 1)[1].split()
    args = speedup.parse_args(argv)
    assert (args.config, args.eval, args.eval_points, args.threads) == ("smollm2-accuracy-cpu", 300, 2, 1)
    base = TrainConfig(**{**raw, "model": "tiny-qwen2"})  # the GGUF may be absent here: the settings only
    assert base.system_prompt is None and base.rewards == ["format", "accuracy"] and base.selection_scope == "batch"
    plans = speedup.plan_schedule(
        base,
        args.pruning_rates,
        ablations=[speedup.parse_ablation(a) for a in args.ablations],
        questions=args.questions,
    )
    assert [speedup.run_label(p) for p in plans] == ["P=0", "P=0.5", "P=0.75", "P=0.875", "P=0.75 random"]
    assert [p.num_steps for p in plans] == [32, 16, 8, 4, 8] and {p.pruning.kept_per_step for p in plans} == {8}
    assert [speedup.eval_steps(p.num_steps, args.eval_points) for p in plans][0] == [16, 32]
    assert base.max_questions == args.questions and base.eval_limit == args.eval  # as a trainer preset: the GRPO row
