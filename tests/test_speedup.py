"""benchmarks/speedup.py: the schedule, the result rows, the writers, and a tiny end-to-end run."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "speedup.py"


@pytest.fixture(scope="module")
def speedup():
    spec = importlib.util.spec_from_file_location("benchmarks_speedup", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


# --------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------


def test_schedule_with_allocation_processes_the_same_questions(speedup):
    plans = speedup.plan_schedule(
        speedup.DEFAULT_RATES, group_size=16, questions=32, questions_per_step=1, allocation=True
    )
    assert [p.keep for p in plans] == [16, 8, 4, 2, 1]
    assert [p.step_questions for p in plans] == [1, 2, 4, 8, 16]
    assert [p.steps for p in plans] == [32, 16, 8, 4, 2]
    assert all(p.steps * p.step_questions == 32 == p.questions for p in plans)


def test_schedule_without_allocation_runs_the_same_steps(speedup):
    plans = speedup.plan_schedule([0, 0.5, 0.75], group_size=8, questions=6, questions_per_step=2, allocation=False)
    assert [p.keep for p in plans] == [8, 4, 2]
    assert [(p.step_questions, p.steps) for p in plans] == [(2, 3)] * 3


def test_smallest_questions(speedup):
    assert speedup.smallest_questions(speedup.DEFAULT_RATES, questions_per_step=1, allocation=True) == 16
    assert speedup.smallest_questions([0, 0.5, 0.75], questions_per_step=3, allocation=True) == 12
    assert speedup.smallest_questions([0, 0.5, 0.75], questions_per_step=3, allocation=False) == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"questions": 24}, r"questions must be a multiple of 16.*use 32"),
        ({"questions": 0}, "questions must be an int >= 1"),
        ({"pruning_rates": [0.5, 0.75]}, "must start with 0"),
        ({"pruning_rates": [0, 1.0]}, r"must lie in \[0, 1\)"),
        ({"pruning_rates": [0, -0.5]}, r"must lie in \[0, 1\)"),
        ({"pruning_rates": [0, 0.5, 0.5]}, "distinct"),
        ({"pruning_rates": []}, "must not be empty"),
        ({"pruning_rates": [0, 0.3]}, "whole number"),
        ({"group_size": 4, "pruning_rates": [0, 0.9375]}, "at least 1"),
        ({"group_size": 1}, "group_size must be an int >= 2"),
        ({"questions_per_step": 0}, "questions_per_step must be an int >= 1"),
    ],
)
def test_schedule_rejects_bad_input(speedup, kwargs, match):
    args = {
        "pruning_rates": speedup.DEFAULT_RATES,
        "group_size": 16,
        "questions": 16,
        "questions_per_step": 1,
        "allocation": True,
    } | kwargs
    pruning_rates = args.pop("pruning_rates")
    with pytest.raises(ValueError, match=match):
        speedup.plan_schedule(pruning_rates, **args)


def test_rate_without_whole_allocation_is_fine_without_allocation(speedup):
    plans = speedup.plan_schedule([0, 0.3], group_size=10, questions=4, questions_per_step=2, allocation=False)
    assert [p.keep for p in plans] == [10, 7]


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


def _metrics(**seconds):
    m = {key: 0.0 for key in ("time/generate", "time/reward", "time/select", "time/logprobs")}
    m |= {"time/update": 0.0, "time/optimizer": 0.0, "tokens_trained": 10, "tokens_forward": 30}
    m |= {"completions": 16, "completions_kept": 8, "questions": 1, "reward_mean": 0.5, "accuracy": 0.25}
    return m | seconds


def test_accumulate_sums_phases_and_other(speedup):
    steps = [
        _metrics(**{"time/generate": 1.0, "time/logprobs": 0.5, "time/update": 1.0, "time/optimizer": 0.25}),
        _metrics(**{"time/generate": 2.0, "time/reward": 0.5, "time/select": 0.25}),
    ]
    acc = speedup.accumulate(steps, [3.0, 2.5])
    ph = acc["phase_seconds"]
    assert ph["generation"] == 3.0 and ph["reward"] == 0.5 and ph["selection"] == 0.25
    assert ph["old_ref_logprobs"] == 0.5 and ph["policy_fwd_bwd"] == 1.0 and ph["optimizer"] == 0.25
    assert ph["other"] == pytest.approx(0.25 + 0.0)  # step 1: 3.0 - 2.75; step 2: max(0, 2.5 - 2.75)
    assert acc["total_seconds"] == 5.5
    assert acc["tokens_trained"] == 20 and acc["questions"] == 2 and acc["completions_kept"] == 16
    assert acc["reward_mean"] == 0.5


def test_accumulate_rejects_missing_metric(speedup):
    m = _metrics()
    del m["time/logprobs"]
    with pytest.raises(ValueError, match="time/logprobs"):
        speedup.accumulate([m], [1.0])
    with pytest.raises(ValueError):
        speedup.accumulate([_metrics()], [1.0, 2.0])


def _run(speedup, p, keep, *, gen, train, steps=1):
    q = 16 // steps
    plan = speedup.RatePlan(pruning_rate=p, keep=keep, group_size=16, questions=16, step_questions=q, steps=steps)
    phases = dict.fromkeys(speedup.PHASES, 0.0)
    phases |= {"generation": gen, "old_ref_logprobs": train / 4, "policy_fwd_bwd": train / 2, "optimizer": train / 4}
    return speedup.RateRun(plan=plan, phase_seconds=phases, total_seconds=gen + train, tokens_trained=100 * keep)


def test_build_rows_speedups(speedup):
    runs = [
        _run(speedup, 0.0, 16, gen=10.0, train=16.0, steps=16),
        _run(speedup, 0.75, 4, gen=8.0, train=5.0, steps=4),
        _run(speedup, 0.8, 3, gen=10.0, train=4.0, steps=4),
    ]
    rows = speedup.build_rows(runs)
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
    assert [r["keep"] for r in rows] == [16, 4, 3] and [r["steps"] for r in rows] == [16, 4, 4]


def test_build_rows_needs_the_baseline_first(speedup):
    with pytest.raises(ValueError, match="P = 0"):
        speedup.build_rows([_run(speedup, 0.5, 8, gen=1.0, train=1.0)])
    with pytest.raises(ValueError, match="empty"):
        speedup.build_rows([])


def test_build_rows_zero_time_gives_none_not_inf(speedup):
    rows = speedup.build_rows([_run(speedup, 0.0, 16, gen=1.0, train=2.0), _run(speedup, 0.5, 8, gen=1.0, train=0.0)])
    assert rows[1]["speedup_train"] is None and rows[1]["fraction_of_ideal"] is None
    assert "| 0.5 |" in speedup.format_table(rows)


def test_writers(speedup, tmp_path):
    rows = speedup.build_rows([_run(speedup, 0.0, 16, gen=3.0, train=4.0), _run(speedup, 0.5, 8, gen=3.0, train=2.0)])
    rows[1]["reward_mean"] = float("nan")
    table = speedup.format_table(rows).splitlines()
    assert len(table) == 4 and table[0].startswith("| P | keep |")
    assert table[3].split("|")[15].strip() == "2.00x"  # speedup train
    assert "1.81x" in table[3]
    speedup.write_json(tmp_path / "speedup.json", rows, {"device": "cpu"})
    data = json.loads((tmp_path / "speedup.json").read_text())
    assert data["meta"] == {"device": "cpu"} and data["rows"][1]["reward_mean"] is None
    speedup.plot(tmp_path / "speedup.png", rows, {"device": "cpu", "model": "m"})
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_git_commit_outside_a_repo(speedup, tmp_path):
    assert speedup.git_commit(tmp_path) == ("unknown", None)
    commit, _ = speedup.git_commit()
    assert commit == "unknown" or len(commit) == 40


def test_ideal_is_one_over_one_minus_p(speedup):
    for p in speedup.DEFAULT_RATES[1:]:
        rows = speedup.build_rows([_run(speedup, 0.0, 16, gen=1.0, train=1.0), _run(speedup, p, 1, gen=1.0, train=1.0)])
        assert math.isclose(rows[1]["ideal_speedup_train"], 1.0 / (1.0 - p))


# --------------------------------------------------------------------------------------------
# The trainer wiring
# --------------------------------------------------------------------------------------------


class _FakeTrainer:
    """Draws ``questions_drawn + extra`` questions per step and reports fixed phase times."""

    extra = 0

    def __init__(self, config):
        self.config = config

    def train_step(self):
        q = self.config.questions_drawn + self.extra
        return _metrics(questions=q, completions=q * self.config.group_size, completions_kept=q * self.config.keep)


def test_step_order(speedup):
    plans = speedup.plan_schedule([0, 0.5, 0.75], group_size=8, questions=4, questions_per_step=1, allocation=True)
    assert speedup.step_order(plans, interleave=False) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (2, 0)]
    inter = speedup.step_order(plans, interleave=True)
    assert inter == [(0, 0), (1, 0), (0, 1), (2, 0), (0, 2), (1, 1), (0, 3)]
    assert sorted(inter) == speedup.step_order(plans, interleave=False)


def test_run_plans_checks_the_trainer_draws_the_planned_questions(speedup, monkeypatch):
    import cppo

    monkeypatch.setattr(cppo, "Trainer", _FakeTrainer)
    plans = speedup.plan_schedule([0, 0.75], group_size=8, questions=8, questions_per_step=2, allocation=True)
    config = cppo.TrainConfig(group_size=8, questions_per_step=2, max_completion_length=8)
    seen = []
    runs = speedup.run_plans(plans, config, device="cpu", interleave=True, on_step=lambda p, m: seen.append(p))
    assert [p.pruning_rate for p in seen] == [0, 0, 0.75, 0, 0]
    assert [r.questions_seen for r in runs] == [8, 8] and [r.completions for r in runs] == [64, 64]
    assert [r.completions_kept for r in runs] == [64, 16] and [r.tokens_trained for r in runs] == [40, 10]
    monkeypatch.setattr(_FakeTrainer, "extra", 1)
    with pytest.raises(RuntimeError, match="drew 9 questions"):
        speedup.run_plans(plans[1:], config, device="cpu", interleave=False)


# --------------------------------------------------------------------------------------------
# Smoke test: the whole script, tiny
# --------------------------------------------------------------------------------------------

TINY = (
    '{"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, '
    '"num_attention_heads": 2, "num_key_value_heads": 1}'
)


def test_main_smoke(speedup, tmp_path, capsys):
    argv = ["--model-config", TINY, "--group-size", "4", "--pruning-rates", "0", "0.5", "--questions", "2"]
    argv += ["--max-new-tokens", "4", "--backend", "torch", "--out", str(tmp_path), "--no-progress", "--no-warmup"]
    result = speedup.main(argv)
    data = json.loads((tmp_path / "speedup.json").read_text())
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["rows"] == json.loads(json.dumps(speedup._json_safe(result["rows"])))
    for key in ("device", "model", "torch", "triton", "git_commit", "date", "argv"):
        assert key in data["meta"], key
    assert data["meta"]["device"] == "cpu" and data["meta"]["argv"] == argv
    rows = data["rows"]
    assert [r["pruning_rate"] for r in rows] == [0.0, 0.5]
    assert [r["keep"] for r in rows] == [4, 2] == [round(4 * (1 - r["pruning_rate"])) for r in rows]
    assert [r["steps"] for r in rows] == [2, 1]
    for r in rows:
        assert r["questions"] == r["questions_seen"] == 2 and r["group_size"] == 4
        assert r["completions"] == 8 and r["completions_kept"] == 2 * r["keep"]
        assert 2 * r["completions_kept"] <= r["tokens_trained"] <= 2 * r["completions_kept"] * 4  # mu = 2, 1..4 tokens
        assert set(r["phase_seconds"]) == set(speedup.PHASES) and all(v >= 0 for v in r["phase_seconds"].values())
        assert r["train_seconds"] == pytest.approx(sum(r["phase_seconds"][k] for k in speedup.TRAIN_PHASES))
        assert r["total_seconds"] == pytest.approx(sum(r["phase_seconds"].values()), rel=1e-6)
        assert r["train_seconds"] > 0 and r["phase_seconds"]["generation"] > 0 and r["cpu_seconds"] > 0
    assert rows[0]["speedup_train"] == rows[0]["speedup_total"] == rows[0]["ideal_speedup_train"] == 1.0
    assert rows[1]["ideal_speedup_train"] == 2.0
    assert rows[1]["speedup_train"] == pytest.approx(rows[0]["train_seconds"] / rows[1]["train_seconds"])
    assert rows[1]["speedup_total"] == pytest.approx(rows[0]["total_seconds"] / rows[1]["total_seconds"])
    assert [r["paper_speedup_gsm8k"] for r in rows] == [1.0, 1.81]
    out = capsys.readouterr().out
    assert "| P | keep |" in out and "1.81x" in out


def test_main_smoke_without_allocation_sequential(speedup, tmp_path):
    argv = ["--model-config", TINY, "--group-size", "4", "--pruning-rates", "0", "0.75", "--questions", "2"]
    argv += ["--max-new-tokens", "3", "--no-allocation", "--schedule", "sequential", "--questions-per-step", "2"]
    argv += ["--out", str(tmp_path), "--no-progress", "--no-warmup", "--no-plot"]
    rows = speedup.main(argv)["rows"]
    assert not (tmp_path / "speedup.png").exists()
    assert [(r["steps"], r["questions_per_step"], r["questions_seen"]) for r in rows] == [(1, 2, 2)] * 2
    assert [r["completions"] for r in rows] == [8, 8] and [r["completions_kept"] for r in rows] == [8, 2]
    assert [r["ideal_speedup_train"] for r in rows] == [1.0, 4.0]


def test_main_rejects_a_question_count_that_breaks_the_schedule(speedup, tmp_path):
    with pytest.raises(ValueError, match="questions must be a multiple of 16"):
        speedup.main(["--questions", "24", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"pruning_rates must lie in \[0, 1\)"):
        speedup.main(["--pruning-rates", "0", "1", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--max-new-tokens must be >= 1"):
        speedup.main(["--max-new-tokens", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="needs a CUDA device"):
        speedup.main(["--preset", "gsm8k", "--device", "cpu", "--out", str(tmp_path)])
    assert not (tmp_path / "speedup.json").exists()


def test_presets_fill_the_trainer_config(speedup):
    args = speedup.apply_preset(speedup.parse_args(["--preset", "gsm8k"]))
    config = speedup.base_config(args, device="cuda")
    assert (config.model, config.dataset, config.dtype) == ("Qwen/Qwen2.5-1.5B-Instruct", "gsm8k", "bfloat16")
    assert (config.group_size, config.questions_per_step, config.max_completion_length) == (16, 8, 1024)
    assert args.questions == 128 and args.schedule == "sequential" and args.threads is None
    args = speedup.apply_preset(speedup.parse_args(["--model", "some/model", "--max-new-tokens", "64"]))
    config = speedup.base_config(args, device="cpu")
    assert config.model_config is None and config.max_prompt_length == 512 and config.micro_batch_tokens == 576
    args = speedup.apply_preset(speedup.parse_args([]))
    config = speedup.base_config(args, device="cpu")
    assert config.model_config == speedup.TINY_MODEL_CONFIG and config.max_prompt_length == 64
    assert (args.questions, args.threads, config.mu, config.allocation) == (32, 1, 2, True)
