"""benchmarks/speedup.py: the trainer config it builds, the schedule, the result rows, the writers, a tiny run."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch
from endtoend import args as speedup_args
from tiny_model import TINY_ONE_LAYER

from cppo import TrainConfig, fileio, load_config

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "speedup.py"


def _config(*overrides):
    return load_config("speedup-cpu", ["device=cpu", *overrides])


# --------------------------------------------------------------------------------------------
# The trainer config: --config / --set exactly as `cppo train`, flags as one --set each
# --------------------------------------------------------------------------------------------


def test_config_and_set_build_what_cppo_train_builds(speedup):
    argv = ["--config", "tiny-cpu", "--set", "mu=1", "lr=1e-4", "--set", "rewards=format,accuracy"]
    args = speedup.parse_args(argv)
    assert (args.config, args.overrides, args.preset) == (
        "tiny-cpu",
        ["mu=1", "lr=1e-4", "rewards=format,accuracy"],
        None,
    )
    assert speedup.base_config(args) == load_config("tiny-cpu", ["mu=1", "lr=1e-4", "rewards=format,accuracy"])
    yaml = REPO / "cppo" / "presets" / "tiny-cpu.yaml"
    args = speedup.parse_args(["--config", str(yaml), "--set", "group_size=4"])
    assert speedup.base_config(args) == load_config(str(yaml), ["group_size=4"])


def test_presets_are_trainer_presets(speedup):
    args = speedup.parse_args([])
    assert (args.preset, args.config, args.overrides) == ("cpu", "speedup-cpu", [])
    config = speedup.base_config(speedup.parse_args(["--device", "cpu"]))
    assert config == load_config("speedup-cpu", ["device=cpu"])
    assert config.model == "tiny-qwen2" and config.model_config["vocab_size"] == 4096
    assert (config.max_prompt_length, config.max_completion_length, config.micro_batch_tokens) == (64, 48, 512)
    assert (config.group_size, config.questions_per_step, config.mu, config.allocation) == (16, 1, 2, True)
    args = speedup.parse_args(["--preset", "gsm8k"])
    assert args.config == "gsm8k-qwen2.5-1.5b"
    gsm8k = load_config(args.config, args.overrides)
    assert (gsm8k.model, gsm8k.dtype, gsm8k.group_size, gsm8k.questions_per_step) == (
        "Qwen/Qwen2.5-1.5B-Instruct", "bfloat16", 16, 1
    )  # fmt: skip
    assert speedup.plan_schedule(gsm8k, speedup_args.DEFAULT_RATES)[0].max_questions == 16


TINY = TINY_ONE_LAYER

#: flag, value on the command line, setting, value in the TrainConfig
FLAGS = [
    ("--model", "tiny-qwen2", "model", "tiny-qwen2"),
    ("--model-config", TINY, "model_config", json.loads(TINY)),
    ("--dataset", "gsm8k", "dataset", "gsm8k"),
    ("--dataset-path", str(REPO), "dataset_path", str(REPO)),
    ("--device", "cpu", "device", "cpu"),
    ("--dtype", "bfloat16", "dtype", "bfloat16"),
    ("--group-size", "8", "group_size", 8),
    ("--questions-per-step", "3", "questions_per_step", 3),
    ("--max-new-tokens", "64", "max_completion_length", 64),
    ("--max-prompt-length", "32", "max_prompt_length", 32),
    ("--micro-batch-tokens", "1024", "micro_batch_tokens", 1024),
    ("--mu", "1", "mu", 1),
    ("--backend", "torch", "kernel_backend", "torch"),
    ("--rollout-backend", "hf", "rollout_backend", "hf"),
    ("--seed", "7", "seed", 7),
]


@pytest.mark.parametrize(("flag", "raw", "setting", "value"), FLAGS)
def test_each_flag_is_a_set_of_one_setting(speedup, flag, raw, setting, value):
    args = speedup.parse_args([flag, raw])
    config = load_config(args.config, args.overrides)
    assert getattr(config, setting) == value
    assert config == dataclasses.replace(load_config("speedup-cpu"), **{setting: value})


def test_flags_cover_every_shortcut_and_allocation(speedup):
    assert {f for f, *_ in FLAGS} | {"--allocation"} == {f for f, *_ in speedup_args.SHORTCUTS}
    assert speedup.parse_args(["--no-allocation"]).overrides == ["allocation=false"]
    assert speedup.parse_args(["--no-allocation", "--allocation"]).overrides == ["allocation=true"]
    # strings stay strings (YAML would read 123 as a number), and a flag comes after --set
    args = speedup.parse_args(["--dataset", "123", "--set", "dataset=arith"])
    assert args.overrides == ["dataset=arith", 'dataset="123"']


def test_a_non_tiny_model_drops_the_presets_model_config(speedup):
    args = speedup.parse_args(["--model", "Qwen/Qwen2.5-0.5B-Instruct"])
    config = load_config(args.config, args.overrides)
    assert (config.model, config.model_config) == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert config.max_prompt_length == 64  # everything else stays the preset's


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--max-new-tokens", "0"], "max_completion_length must be >= 1"),
        (["--backend", "cuda"], "kernel_backend"),
        (["--set", "bogus=1"], "unknown setting 'bogus'"),
        (["--set", "group_size"], "must look like key=value"),
        # settings each run's plan sets: the plan replaced them silently
        (
            ["--set", "num_steps=3"],
            r"^--set num_steps=3: speedup.py sets num_steps for every run itself: choose it "
            "with --questions$",
        ),
        (["--set", "mu=1", "pruning_rate=0.5"], "--set pruning_rate=0.5: .* choose it with --pruning-rates$"),
        (["--set", "max_questions=8"], "--set max_questions=8: .* with --questions$"),
        (["--set", "output_dir=x"], "--set output_dir=x: .* with --out$"),
        (["--config", "no-such-preset"], "unknown preset 'no-such-preset'"),
        (["--questions", "24"], r"--questions must be a multiple of 16 .* use 32"),
        (["--questions", "0"], "--questions must be >= 1"),
        (["--pruning-rates", "0", "1"], r"--pruning-rates 1: pruning_rate must be in \[0, 1\)"),
        (["--pruning-rates", "0.5", "0.75"], "start with 0"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--preset", "gsm8k", "--device", "cpu"], "needs a CUDA device"),
    ],
)
def test_bad_values_are_refused_naming_the_flag_or_setting(speedup, tmp_path, argv, match):
    with pytest.raises(ValueError, match=match):
        speedup.main([*argv, "--out", str(tmp_path)])
    assert not (tmp_path / "speedup.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused(speedup):
    with pytest.raises(ValueError, match="CUDA is not available"):
        speedup.base_config(speedup.parse_args(["--device", "cuda"]))


def test_argparse_errors_name_the_flag(speedup, capsys):
    for argv, flag in ((["--group-size", "x"], "--group-size"), (["--preset", "cpu", "--config", "x"], "--config")):
        with pytest.raises(SystemExit):
            speedup.parse_args(argv)
        assert flag in capsys.readouterr().err


def test_the_script_reports_a_bad_value_in_one_line(tmp_path):
    argv = ["--pruning-rates", "0", "1", "--device", "cpu", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == ["speedup.py: error: --pruning-rates 1: pruning_rate must be in [0, 1), got 1.0"]


def test_the_readme_smollm2_plan_keeps_the_official_count(speedup):
    """The README's SmolLM2 line (G = 8, 32 questions): P = 0.9375 prunes int(128 * 0.9375) = 120 of a step's 128
    completions and keeps 8 (the old round(G * (1 - P)) rule kept 0 per question and refused it)."""
    base = speedup.base_config(speedup.parse_args(["--group-size", "8", "--device", "cpu"]))
    plans = speedup.plan_schedule(base, speedup_args.DEFAULT_RATES, questions=32)
    assert [p.pruning.kept_per_step for p in plans] == [8] * 5
    assert [p.pruning.questions_drawn for p in plans] == [1, 2, 4, 8, 16]


# --------------------------------------------------------------------------------------------
# Schedule: the trainer's keep and questions per step
# --------------------------------------------------------------------------------------------


def test_schedule_with_allocation_processes_the_same_questions(speedup):
    base = _config()
    plans = speedup.plan_schedule(base, speedup_args.DEFAULT_RATES, questions=32)
    assert [p.pruning.keep for p in plans] == [16, 8, 4, 2, 1]
    assert [p.pruning.questions_drawn for p in plans] == [1, 2, 4, 8, 16]
    assert [p.num_steps for p in plans] == [32, 16, 8, 4, 2]
    assert all(p.num_steps * p.pruning.questions_drawn == 32 == p.max_questions for p in plans)
    for p, rate in zip(plans, speedup_args.DEFAULT_RATES):
        assert p == dataclasses.replace(base, pruning_rate=rate, num_steps=p.num_steps, max_questions=32)


def test_schedule_without_allocation_runs_the_same_steps(speedup):
    base = _config("allocation=false", "group_size=8", "questions_per_step=2")
    plans = speedup.plan_schedule(base, [0, 0.5, 0.75], questions=6)
    assert [p.pruning.keep for p in plans] == [8, 4, 2]
    assert [(p.pruning.questions_drawn, p.num_steps) for p in plans] == [(2, 3)] * 3


def test_schedule_uses_the_trainers_rounding(speedup):
    """ceil(2 / (1 - 0.3)) = 3 questions a step, as the trainer draws (the old script refused P = 0.3 here)."""
    base = _config("group_size=10", "questions_per_step=2")
    plans = speedup.plan_schedule(base, [0, 0.3], questions=6)
    assert [(p.pruning.keep, p.pruning.questions_drawn, p.num_steps) for p in plans] == [(10, 2, 3), (7, 3, 2)]
    trainer_rule = TrainConfig(group_size=10, questions_per_step=2, pruning_rate=0.3)
    assert (plans[1].pruning.keep, plans[1].pruning.questions_drawn) == (
        trainer_rule.pruning.keep,
        trainer_rule.pruning.questions_drawn,
    )


def test_default_question_count(speedup):
    base = _config()
    assert speedup.plan_schedule(base, speedup_args.DEFAULT_RATES)[0].max_questions == 16
    assert speedup.plan_schedule(base, speedup_args.DEFAULT_RATES, least_times=2)[0].max_questions == 32
    assert speedup.plan_schedule(_config("questions_per_step=3"), [0, 0.5, 0.75])[0].max_questions == 12
    no_alloc = _config("questions_per_step=3", "allocation=false")
    assert speedup.plan_schedule(no_alloc, [0, 0.5, 0.75])[0].max_questions == 3


@pytest.mark.parametrize(
    ("rates", "match"),
    [([], "start with 0"), ([0, 0.5, 0.5], "distinct"), ([0, -0.5], r"--pruning-rates -0.5: pruning_rate must be")],
)
def test_schedule_rejects_bad_rates(speedup, rates, match):
    with pytest.raises(ValueError, match=match):
        speedup.plan_schedule(_config(), rates)


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


def _metrics(**seconds):
    m = {key: 0.0 for key in ("time/generate", "time/reward", "time/select", "time/logprobs")}
    m |= {"time/update": 0.0, "time/optimizer": 0.0, "tokens_trained": 10, "tokens_forward": 30}
    m |= {"completions": 16, "completions_kept": 8, "questions": 1, "reward_mean": 0.5, "accuracy": 0.25}
    return m | seconds


def test_accumulate_sums_phases_and_other(report):
    steps = [
        _metrics(**{"time/generate": 1.0, "time/logprobs": 0.5, "time/update": 1.0, "time/optimizer": 0.25}),
        _metrics(**{"time/generate": 2.0, "time/reward": 0.5, "time/select": 0.25}),
    ]
    acc = report.accumulate(steps, [3.0, 2.5])
    ph = acc["phase_seconds"]
    assert ph["generation"] == 3.0 and ph["reward"] == 0.5 and ph["selection"] == 0.25
    assert ph["old_ref_logprobs"] == 0.5 and ph["policy_fwd_bwd"] == 1.0 and ph["optimizer"] == 0.25
    assert ph["other"] == pytest.approx(0.25 + 0.0)  # step 1: 3.0 - 2.75; step 2: max(0, 2.5 - 2.75)
    assert acc["total_seconds"] == 5.5
    assert acc["tokens_trained"] == 20 and acc["questions"] == 2 and acc["completions_kept"] == 16
    assert acc["reward_mean"] == 0.5 and acc["accuracy"] == 0.25


def test_accumulate_rejects_missing_metric(report):
    m = _metrics()
    del m["time/logprobs"]
    with pytest.raises(ValueError, match="time/logprobs"):
        report.accumulate([m], [1.0])
    with pytest.raises(ValueError):
        report.accumulate([_metrics()], [1.0, 2.0])


def _run(report, p, *, gen, train, steps=1, allocation=False):
    config = TrainConfig(group_size=16, pruning_rate=p, allocation=False, questions_per_step=16 // steps)
    if allocation:  # the same questions per step, drawn by the paper's allocation
        config = TrainConfig(group_size=16, pruning_rate=p, allocation=True, questions_per_step=1)
    config = dataclasses.replace(config, num_steps=steps, max_questions=16)
    phases = dict.fromkeys(report.PHASES, 0.0)
    phases |= {"generation": gen, "old_ref_logprobs": train / 4, "policy_fwd_bwd": train / 2, "optimizer": train / 4}
    sums = {"phase_seconds": phases, "total_seconds": gen + train, "tokens_trained": 100 * config.pruning.keep}
    sums |= {"tokens_forward": 0, "completions": 256, "completions_kept": 16 * config.pruning.keep, "questions": 16}
    return report.RateRun(config=config, sums=sums | {"reward_mean": 0.5, "accuracy": float("nan")})


def test_build_rows_speedups(report):
    runs = [
        _run(report, 0.0, gen=10.0, train=16.0, steps=16),
        _run(report, 0.75, gen=8.0, train=5.0, steps=4, allocation=True),
        _run(report, 0.8, gen=10.0, train=4.0, steps=4),
    ]
    rows = report.build_rows(runs)
    no_allocation = report.build_rows([runs[0], _run(report, 0.75, gen=8.0, train=5.0, steps=4)])[1]
    assert no_allocation["paper_speedup_gsm8k"] is None  # the paper's CPPO always allocates
    base, cppo, other = rows
    assert base["speedup_train"] == 1.0 and base["speedup_total"] == 1.0 and base["ideal_speedup_train"] == 1.0
    assert base["amdahl_speedup_total"] == 1.0 and base["paper_speedup_gsm8k"] == 1.0
    assert cppo["train_seconds"] == pytest.approx(5.0)
    assert cppo["speedup_train"] == pytest.approx(16.0 / 5.0)
    assert cppo["speedup_total"] == pytest.approx(26.0 / 13.0)
    assert cppo["ideal_speedup_train"] == pytest.approx(4.0)
    assert cppo["fraction_of_ideal"] == pytest.approx(0.8)
    assert cppo["amdahl_speedup_total"] == pytest.approx(26.0 / (10.0 + 4.0))
    assert cppo["generation_share"] == pytest.approx(8.0 / 13.0)
    assert cppo["paper_speedup_gsm8k"] == 3.27
    assert other["paper_speedup_gsm8k"] is None and other["ideal_speedup_train"] == pytest.approx(5.0)
    assert [r["keep"] for r in rows] == [16, 4, 4] and [r["steps"] for r in rows] == [16, 4, 4]
    assert [r["kept_per_step"] for r in rows] == [16, 16, 13]  # 64 - int(64 * 0.8) = 13: pooled over the step
    assert [r["questions_per_step"] for r in rows] == [1, 4, 4] and {r["questions"] for r in rows} == {16}
    assert [r["completions_kept"] for r in rows] == [256, 64, 64] and rows[2]["questions_seen"] == 16


def test_build_rows_needs_the_baseline_first(report):
    with pytest.raises(ValueError, match="P = 0"):
        report.build_rows([_run(report, 0.5, gen=1.0, train=1.0)])
    with pytest.raises(ValueError, match="empty"):
        report.build_rows([])


def test_build_rows_zero_time_gives_none_not_inf(report):
    rows = report.build_rows([_run(report, 0.0, gen=1.0, train=2.0), _run(report, 0.5, gen=1.0, train=0.0)])
    assert rows[1]["speedup_train"] is None and rows[1]["fraction_of_ideal"] is None
    assert "| 0.5 |" in report.format_table(rows)


def test_writers(report, speedup, tmp_path):
    runs = [_run(report, 0.0, gen=3.0, train=4.0), _run(report, 0.5, gen=3.0, train=2.0, allocation=True)]
    rows = report.build_rows(runs)
    rows[1]["reward_mean"] = float("nan")
    table = report.format_table(rows).split("\n\n")[0].splitlines()  # the notes follow a blank line
    assert len(table) == 4 and table[0].startswith("| P | keep |")
    assert table[3].split("|")[6].strip() == "2.00x"  # speedup train
    assert "1.81x" in table[3]
    report.write_json(tmp_path / "speedup.json", rows, {"device": "cpu", "x": float("inf")})
    data = json.loads((tmp_path / "speedup.json").read_text())
    assert data["meta"] == {"device": "cpu", "x": None} and data["rows"][1]["reward_mean"] is None
    assert data["rows"][0]["cpu_seconds"] is None and data["rows"][0]["pruning_rate"] == 0.0
    report.plot(tmp_path / "speedup.png", rows, {"device": "cpu", "model": "m"})
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_git_commit_outside_a_repo(tmp_path):
    """The meta's commit (cppo.fileio.git_commit, which collect_meta's run_metadata calls)."""
    assert fileio.git_commit(tmp_path) == ("unknown", None)
    commit, _ = fileio.git_commit()
    assert commit == "unknown" or len(commit) == 40


def test_ideal_is_one_over_one_minus_p(report, speedup):
    for p in speedup_args.DEFAULT_RATES[1:]:
        rows = report.build_rows([_run(report, 0.0, gen=1.0, train=1.0), _run(report, p, gen=1.0, train=1.0)])
        assert math.isclose(rows[1]["ideal_speedup_train"], 1.0 / (1.0 - p))


# --------------------------------------------------------------------------------------------
# The trainer wiring
# --------------------------------------------------------------------------------------------


class _FakeTrainer:
    """Draws ``questions_drawn + extra`` questions per step and reports fixed phase times."""

    extra = 0

    def __init__(self, config):
        self.config = config
        self.problems = [{"question": f"q{i}?", "answer": str(i)} for i in range(config.max_questions or 1)]

    def train_step(self):
        q = self.config.pruning.questions_drawn + self.extra
        return _metrics(
            questions=q, completions=q * self.config.group_size, completions_kept=q * self.config.pruning.keep
        )


def test_step_order(speedup):
    plans = speedup.plan_schedule(_config("group_size=8"), [0, 0.5, 0.75], questions=4)
    assert speedup.step_order(plans, interleave=False) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0)]
    inter = speedup.step_order(plans, interleave=True)
    assert inter == [(0, 0), (1, 0), (0, 1), (2, 0), (0, 2), (1, 1), (0, 3)]
    assert sorted(inter) == speedup.step_order(plans, interleave=False)


def test_run_plans_checks_the_trainer_draws_the_planned_questions(speedup, monkeypatch):
    import cppo.trainer

    monkeypatch.setattr(cppo.trainer, "Trainer", _FakeTrainer)
    plans = speedup.plan_schedule(_config("group_size=8", "questions_per_step=2"), [0, 0.75], questions=8)
    seen = []
    runs = speedup.run_plans(plans, device="cpu", interleave=True, on_step=lambda p, m: seen.append(p.pruning_rate))
    assert seen == [0, 0, 0.75, 0, 0]
    assert [r.sums["questions"] for r in runs] == [8, 8] and [r.sums["completions"] for r in runs] == [64, 64]
    assert [r.sums["completions_kept"] for r in runs] == [64, 16] and [r.sums["tokens_trained"] for r in runs] == [
        40,
        10,
    ]
    assert all(r.cpu_seconds >= 0 and r.setup_seconds >= 0 for r in runs)
    monkeypatch.setattr(_FakeTrainer, "extra", 1)
    with pytest.raises(RuntimeError, match="drew 9 questions"):
        speedup.run_plans(plans[1:], device="cpu", interleave=False)


# --------------------------------------------------------------------------------------------
# Smoke test: the whole script, tiny
# --------------------------------------------------------------------------------------------


def test_main_smoke(report, speedup, tmp_path, capsys):
    argv = ["--model-config", TINY, "--group-size", "4", "--pruning-rates", "0", "0.5", "--questions", "2"]
    argv += ["--set", "max_completion_length=4", "--backend", "torch", "--out", str(tmp_path), "--no-progress"]
    result = speedup.main(argv)
    data = json.loads((tmp_path / "speedup.json").read_text())
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["rows"] == json.loads(json.dumps(result["rows"]))
    settings = ["max_completion_length=4", f"model_config={TINY}", "group_size=4", "kernel_backend=torch", "device=cpu"]
    expected = load_config("speedup-cpu", settings).to_dict() | {"preset": "cpu"}  # meta's preset: the --preset
    assert {k: data["meta"][k] for k in expected} == expected  # meta records every setting of the trainer config
    run_keys = ("python", "python_executable", "cpu_count", "git_dirty")  # cppo.fileio.run_metadata's, added
    for key in ("device_name", "torch", "triton", "git_commit", "date", "argv", "warmup_seconds", "timing", *run_keys):
        assert key in data["meta"], key
    meta = data["meta"]
    assert (meta["device"], meta["argv"], meta["preset"], meta["config"]) == ("cpu", argv, "cpu", "speedup-cpu")
    assert (meta["schedule"], meta["questions"], meta["torch_threads"]) == ("interleaved", 2, 1)
    assert meta["warmup_seconds"] > 0
    rows = data["rows"]
    assert [r["pruning_rate"] for r in rows] == [0.0, 0.5]
    assert [r["keep"] for r in rows] == [4, 2] and [r["steps"] for r in rows] == [2, 1]
    for r in rows:
        assert r["questions"] == r["questions_seen"] == 2 and r["group_size"] == 4
        assert r["completions"] == 8 and r["completions_kept"] == 2 * r["keep"]
        assert 2 * r["completions_kept"] <= r["tokens_trained"] <= 2 * r["completions_kept"] * 4  # mu = 2, 1..4 tokens
        assert set(r["phase_seconds"]) == set(report.PHASES) and all(v >= 0 for v in r["phase_seconds"].values())
        assert r["train_seconds"] == pytest.approx(sum(r["phase_seconds"][k] for k in report.TRAIN_PHASES))
        assert r["total_seconds"] == pytest.approx(sum(r["phase_seconds"].values()), rel=1e-6)
        assert r["train_seconds"] > 0 and r["phase_seconds"]["generation"] > 0 and r["cpu_seconds"] > 0
    assert rows[0]["speedup_train"] == rows[0]["speedup_total"] == rows[0]["ideal_speedup_train"] == 1.0
    assert rows[1]["ideal_speedup_train"] == 2.0
    assert rows[1]["speedup_train"] == pytest.approx(rows[0]["train_seconds"] / rows[1]["train_seconds"])
    assert rows[1]["speedup_total"] == pytest.approx(rows[0]["total_seconds"] / rows[1]["total_seconds"])
    assert [r["paper_speedup_gsm8k"] for r in rows] == [1.0, 1.81]
    out = capsys.readouterr().out
    assert "| P | keep |" in out and "1.81x" in out


def test_compare_runs_each_rate_with_the_setting_changed(speedup, tmp_path):
    """--compare prefix_sharing=false: every rate twice, the changed rows marked and measured against their own
    P = 0; meta.compare pairs them: the same questions and rollouts (equal rewards), more tokens without sharing."""
    argv = ["--model-config", TINY, "--group-size", "4", "--pruning-rates", "0", "0.5", "--questions", "2"]
    argv += ["--set", "max_completion_length=4", "--backend", "torch", "--out", str(tmp_path), "--no-progress"]
    data = speedup.main([*argv, "--compare", "prefix_sharing=false", "--no-plot"])
    rows = data["rows"]
    assert [(r["pruning_rate"], r["variant"]) for r in rows] == [
        (0.0, None), (0.5, None), (0.0, "prefix_sharing=false"), (0.5, "prefix_sharing=false")
    ]  # fmt: skip
    assert rows[2]["speedup_train"] == 1.0 and rows[0]["tokens_trained"] == rows[2]["tokens_trained"]
    pairs = data["meta"]["compare"]["pairs"]
    assert [p["pruning_rate"] for p in pairs] == [0.0, 0.5]
    for p, base, off in zip(pairs, rows[:2], rows[2:]):
        assert p["tokens_forward"] == [base["tokens_forward"], off["tokens_forward"]]
        assert p["ratio_tokens_forward"] == off["tokens_forward"] / base["tokens_forward"] > 1.0  # prompts once
        assert p["reward_mean"][0] == p["reward_mean"][1]  # the same rollouts
        assert p["ratio_train_seconds"] == off["train_seconds"] / base["train_seconds"]
        generation = [base["phase_seconds"]["generation"], off["phase_seconds"]["generation"]]
        assert p["generation_seconds"] == generation and p["ratio_generation_seconds"] == generation[1] / generation[0]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("prefix_sharing", "expected KEY=VALUE"),
        ("prefix_sharing=true", "already has that value"),
        ("no_such_setting=1", "--compare no_such_setting=1: "),
        # a setting each run's plan sets: the dry run passed and the two runs of a rate were the same run
        ("pruning_rate=0.5", r"^--compare pruning_rate=0.5: speedup.py sets pruning_rate for every run itself \(choose "
         r"it with --pruning-rates\), so the two runs of a rate would be the same: compare another setting$"),
        ("num_steps=3", r"sets num_steps for every run itself \(choose it with --questions\)"),
        ("max_questions=8", r"sets max_questions for every run itself \(choose it with --questions\)"),
        ("output_dir=/tmp/x", r"sets output_dir for every run itself \(choose it with --out\)"),
        # a second --compare was dropped silently
        (["prefix_sharing=false", "mu=1"], r"^--compare given 2 times \(prefix_sharing=false, mu=1\): a run compares "
         "one setting; run speedup.py once per setting$"),
    ],
)  # fmt: skip
def test_bad_compare(speedup, tmp_path, value, match):
    argv = ["--pruning-rates", "0", "0.5", "--device", "cpu", "--out", str(tmp_path), "--dry-run"]
    compares = [a for v in ([value] if isinstance(value, str) else value) for a in ("--compare", v)]
    with pytest.raises(ValueError, match=match):
        speedup.main([*argv, *compares])
