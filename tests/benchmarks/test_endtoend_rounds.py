"""Issue 51, part 1: ``speedup.py --rounds N`` (each round its own file, resumed, refused with other settings), the
report combining rounds (means, t intervals of per-round totals and ratios), one warm-up step per arm on questions
outside the measured set, the batched GRPO arms' plan, the shared vLLM engine's reloads kept out of the timed steps,
and the threads recorded. No timing is asserted."""

from __future__ import annotations

import json
import math

import pytest
from endtoend import rounds as rounds_mod
from endtoend import runner
from scipy import stats
from tiny_model import TINY_ONE_LAYER

from cppo import TrainConfig, load_config
from cppo.engines.vllm import VLLMEngine


def _config(*overrides):
    return load_config("speedup-cpu", ["device=cpu", *overrides])


def _tiny_argv(out, *more):
    argv = ["--model-config", TINY_ONE_LAYER, "--group-size", "4", "--pruning-rates", "0", "0.5", "--questions", "4"]
    return [*argv, "--set", "max_completion_length=4", "--backend", "torch", "--out", str(out), "--no-progress", *more]


# --------------------------------------------------------------------------------------------
# The batched GRPO arms' plan
# --------------------------------------------------------------------------------------------


def test_batched_grpo_arms_generate_q_steps_questions_a_call_and_train_as_grpo(speedup):
    rates = [0, 0.5, 0.75, 0.875]
    plans = speedup.plan_schedule(_config("group_size=16"), rates, batched=[2, 4, 8], questions=32)
    assert [speedup.run_label(p) for p in plans] == [
        "P=0", "P=0.5", "P=0.75", "P=0.875", "P=0 batched 2", "P=0 batched 4", "P=0 batched 8"
    ]  # fmt: skip
    assert [p.num_steps for p in plans] == [32, 16, 8, 4, 32, 32, 32]
    assert {p.max_questions for p in plans} == {32}
    for plan, q in zip(plans[4:], (2, 4, 8)):
        assert (plan.pruning_rate, plan.steps_per_generation, plan.max_staleness) == (0.0, q, q - 1)
        assert plan.pruning.keep == plan.group_size and plan.pruning.questions_drawn == 1  # trains as GRPO
        # one call draws what one CPPO step of the matching rate draws
        assert plan.pruning.questions_drawn * q == plans[(2, 4, 8).index(q) + 1].pruning.questions_drawn
    for plan in plans[:4]:
        assert (plan.steps_per_generation, plan.max_staleness) == (1, 0)


def test_batched_questions_must_fill_every_call(speedup):
    with pytest.raises(ValueError, match=r"--questions must be a multiple of 8 .*'P=0 batched 8': 8"):
        speedup.plan_schedule(_config(), [0, 0.5], batched=[8], questions=4)
    assert speedup.plan_schedule(_config(), [0, 0.5], batched=[4])[-1].max_questions == 4  # the least count


@pytest.mark.parametrize("batched", [[1], [4, 4], [0]])
def test_batched_q_must_be_distinct_and_at_least_2(speedup, batched):
    with pytest.raises(ValueError, match="--batched-grpo takes distinct Q >= 2"):
        speedup.plan_schedule(_config(), [0, 0.5], batched=batched)


def test_the_dry_run_lists_the_batched_arms(speedup, tmp_path, capsys):
    argv = ["--device", "cpu", "--pruning-rates", "0", "0.75", "--batched-grpo", "4", "--out", str(tmp_path)]
    plan = speedup.main([*argv, "--dry-run", "--rounds", "2"])
    arms = [(r["arm"], r["steps_per_generation"], r["max_staleness"], r["steps"]) for r in plan["rates"]]
    assert arms == [("P=0", 1, 0, 8), ("P=0.75", 1, 0, 2), ("P=0 batched 4", 4, 3, 8)]
    with pytest.raises(ValueError, match="--compare .* no --selection-metric or --batched-grpo"):
        speedup.main([*argv, "--compare", "mu=1", "--dry-run"])
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        speedup.main([*argv, "--rounds", "0", "--dry-run"])


def test_a_batched_row_is_labelled_and_has_no_paper_figure(report):
    config = TrainConfig(group_size=4, pruning_rate=0.0, steps_per_generation=2, max_staleness=1)
    config = config.__class__(**{**config.to_dict(), "num_steps": 2, "max_questions": 2})
    phases = dict.fromkeys(report.PHASES, 1.0)
    sums = {"phase_seconds": phases, "total_seconds": 7.0, "tokens_trained": 8, "tokens_forward": 8,
            "completions": 8, "completions_kept": 8, "questions": 2, "reward_mean": 0.0, "accuracy": 0.0}  # fmt: skip
    row = report.run_row(report.RateRun(config=config, sums=sums))
    assert (row["steps_per_generation"], row["max_staleness"], row["paper_speedup_gsm8k"]) == (2, 1, None)
    assert "| 0 batched 2 |" in report.format_table(report.build_rows([report.RateRun(config=config, sums=sums)]))
    assert rounds_mod.arm_label(row) == "GRPO batched 2"


def test_a_phase_a_step_did_not_run_counts_zero(report):
    base = {"time/generate": 2.0, "time/reward": 0.1, "time/select": 0.1, "time/logprobs": 1.0, "time/update": 1.0,
            "time/optimizer": 0.1, "tokens_trained": 1, "tokens_forward": 1, "completions": 4, "completions_kept": 4,
            "questions": 1, "generation_calls": 1}  # fmt: skip
    trained_only = {k: v for k, v in base.items() if k not in ("time/generate", "time/reward", "generation_calls")}
    acc = report.accumulate([base, trained_only], [5.0, 3.0])
    assert acc["phase_seconds"]["generation"] == 2.0 and acc["generation_calls"] == 1
    with pytest.raises(ValueError, match="time/generate"):
        report.accumulate([trained_only], [3.0])


# --------------------------------------------------------------------------------------------
# Warm-up: one step per arm, on questions outside the measured set
# --------------------------------------------------------------------------------------------


def test_each_arm_warms_up_on_questions_outside_the_measured_set(speedup):
    config = _config("dataset=arith", "group_size=4")
    plans = speedup.plan_schedule(config, [0, 0.5, 0.75], batched=[4], questions=8)
    warm = runner.warmup_plans(plans)
    assert len(warm) == len(plans)
    measured = runner.measured_ids(plans)
    assert len(measured) == 8
    for plan, w in zip(plans, warm):
        assert runner.measured_ids([w]).isdisjoint(measured)
        assert w.seed == plan.seed + 1 and w.question_seed != plan.training_question_seed
        assert (w.pruning_rate, w.steps_per_generation, w.max_staleness) == (
            plan.pruning_rate, plan.steps_per_generation, plan.max_staleness
        )  # fmt: skip
        assert w.max_questions == plan.pruning.questions_drawn * plan.steps_per_generation  # one call's questions
        assert w.num_steps == plan.steps_per_generation


# --------------------------------------------------------------------------------------------
# The shared vLLM engine's reload, outside the timed step
# --------------------------------------------------------------------------------------------


class _Engine(VLLMEngine):
    def __init__(self, log, name):  # no vLLM: records its syncs
        self.log, self.name = log, name

    def sync_weights(self):
        self.log.append(self.name)


class _Trainer:
    def __init__(self, log, name):
        self.rollout = _Engine(log, name)


def test_an_arm_reloads_the_shared_engine_untimed_only_after_another_arms_step():
    log, engine = [], runner.EngineReloads()
    a, b = _Trainer(log, "a"), _Trainer(log, "b")
    grpo, batched = TrainConfig(), TrainConfig(steps_per_generation=2, max_staleness=1)
    engine.touched(0, a, grpo)  # a built (its engine synced) or stepped
    assert engine.before_step(0, a, grpo) is None and log == []  # a single arm never reloads
    wall, cpu = engine.before_step(1, b, grpo)
    assert log == ["b"] and wall >= 0 and cpu >= 0
    engine.touched(1, b, grpo)
    assert engine.before_step(1, b, grpo) is None and log == ["b"]
    # an arm with a queue of generation calls syncs before each call itself (its own cost, timed): left alone
    assert engine.before_step(2, _Trainer(log, "c"), batched) is None and log == ["b"]
    engine.touched(2, _Trainer(log, "c"), batched)
    assert engine.holder is None  # which weights it left is not known: the next arm reloads
    assert engine.before_step(1, b, grpo) is not None and log == ["b", "b"]
    hf = type("T", (), {"rollout": object()})()  # an engine of its own (hf): nothing shared
    assert engine.before_step(3, hf, grpo) is None


def test_thread_record_says_what_the_process_runs_with():
    record = runner.thread_record(1)
    assert record["torch_threads"] == 1 and record["set_num_threads_takes"] is True
    assert set(record) >= {"affinity", "os_threads", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"}
    assert all(isinstance(c, int) for c in record["affinity"])


# --------------------------------------------------------------------------------------------
# Combining rounds
# --------------------------------------------------------------------------------------------


def _row(p, total, *, spg=1, per_step=1, steps=4, cpu=None):
    phases = dict.fromkeys(rounds_mod.PHASES, 0.0) | {"generation": total / 2, "policy_fwd_bwd": total / 2}
    return {"pruning_rate": p, "selection_metric": "smallest", "steps_per_generation": spg, "max_staleness": spg - 1,
            "keep": 16 if p == 0 else 4, "group_size": 16, "questions": 8, "questions_per_step": per_step,
            "steps": steps, "total_seconds": total, "train_seconds": total / 2, "cpu_seconds": cpu or total,
            "reload_seconds": 1.0, "reload_cpu_seconds": 1.0, "setup_seconds": 2.0, "phase_seconds": phases,
            "step_seconds": [total / steps] * steps, "ideal_speedup_train": 1 / (1 - p)}  # fmt: skip


def test_combine_gives_means_and_t_intervals_over_rounds_and_per_round_ratios():
    totals = [(100.0, 25.0, 50.0), (120.0, 40.0, 60.0)]  # GRPO, CPPO P=0.75, GRPO batched 4: per round
    rounds = [{"rows": [_row(0.0, g), _row(0.75, c, per_step=4, steps=2), _row(0.0, b, spg=4)]} for g, c, b in totals]
    grpo, cppo, batched = rounds_mod.combine(rounds)
    assert [r["label"] for r in (grpo, cppo, batched)] == ["GRPO", "CPPO P=0.75", "GRPO batched 4"]
    half = stats.t.ppf(0.975, 1) * math.sqrt(((100 - 110) ** 2 + (120 - 110) ** 2) / 1) / math.sqrt(2)
    assert grpo["total_seconds"]["mean"] == 110.0 and grpo["total_seconds"]["values"] == [100.0, 120.0]
    assert grpo["total_seconds"]["ci95"] == pytest.approx([110 - half, 110 + half])
    ratios = [100 / 25, 120 / 40]  # the mean of per-round ratios, not the ratio of the means
    assert cppo["speedup_total"]["values"] == pytest.approx(ratios)
    assert cppo["speedup_total"]["mean"] == pytest.approx(3.5) and cppo["speedup_total"]["ci95"] is not None
    assert cppo["batched_partner"] == "GRPO batched 4"
    assert cppo["speedup_total_over_batched"]["values"] == pytest.approx([50 / 25, 60 / 40])
    assert batched["speedup_total"]["values"] == pytest.approx([2.0, 2.0]) and batched["batched_partner"] is None
    assert cppo["step_seconds"]["n"] == 4  # every step of every round, pooled
    assert [r["generation_calls"] for r in (grpo, cppo, batched)] == [4, 2, 1]  # a batched call serves Q steps
    assert grpo["phase_seconds"]["generation"]["mean"] == 55.0
    one = rounds_mod.combine(rounds[:1])[1]
    assert one["speedup_total"]["ci95"] is None and one["speedup_total"]["mean"] == 4.0  # one round: no interval
    table = rounds_mod.format_rounds_table([grpo, cppo, batched])
    assert "| CPPO P=0.75 | 4/16 | 2 |" in table and "3.50x [" in table


# --------------------------------------------------------------------------------------------
# Round files: written as each round ends, resumed, refused with other settings
# --------------------------------------------------------------------------------------------


def test_finished_rounds_refuse_other_settings(tmp_path):
    plans = [TrainConfig(), TrainConfig(pruning_rate=0.5)]
    settings = rounds_mod.round_settings(plans, schedule="interleaved", threads=1, warmup=True, env={})
    rounds_mod.write_round(tmp_path, "x", 1, settings=settings, rows=[{"a": 1}], meta={})
    assert [r["rows"] for r in rounds_mod.finished_rounds(tmp_path, "x", settings)] == [[{"a": 1}]]
    rounds_mod.write_round(tmp_path, "x", 3, settings=settings, rows=[], meta={})  # after a gap: not read
    assert len(rounds_mod.finished_rounds(tmp_path, "x", settings)) == 1
    other = rounds_mod.round_settings(plans, schedule="interleaved", threads=1, warmup=True,
                                      env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    with pytest.raises(ValueError, match=r"x-round1.json was measured with other settings \(env\)"):
        rounds_mod.finished_rounds(tmp_path, "x", other)
    other = rounds_mod.round_settings([TrainConfig(), TrainConfig(pruning_rate=0.75)], schedule="interleaved",
                                      threads=1, warmup=True, env={})  # fmt: skip
    with pytest.raises(ValueError, match=r"arm 1 pruning_rate"):
        rounds_mod.finished_rounds(tmp_path, "x", other)
    newer = json.loads(json.dumps(settings))  # a trainer setting added to TrainConfig since: not a difference
    for arm in newer["arms"]:
        arm["a_new_setting"] = 0
    assert len(rounds_mod.finished_rounds(tmp_path, "x", newer)) == 1


def test_rounds_are_written_resumed_and_refused(speedup, tmp_path, capsys):
    first = speedup.main(_tiny_argv(tmp_path, "--rounds", "1", "--batched-grpo", "2", "--no-plot"))
    round1 = (tmp_path / "speedup-round1.json").read_text()
    assert first["meta"]["rounds_done"] == 1 and [r["label"] for r in first["rows"]] == [
        "GRPO", "CPPO P=0.5", "GRPO batched 2"
    ]  # fmt: skip
    warm = first["meta"]["rounds"][0]["warmup"]
    assert [w["arm"] for w in warm] == ["P=0", "P=0.5", "P=0 batched 2"]  # one untimed step per arm
    assert first["meta"]["rounds"][0]["threads_after_engine_start"]["torch_threads"] == 1
    assert first["meta"]["rounds"][0]["peak_rss_gib"]["self"] > 0
    assert first["meta"]["rounds"][0]["round_children_cpu_seconds"] >= 0
    second = speedup.main(_tiny_argv(tmp_path, "--rounds", "2", "--batched-grpo", "2", "--no-plot"))
    assert "1 of 2 round(s) already in" in capsys.readouterr().out
    assert (tmp_path / "speedup-round1.json").read_text() == round1  # the finished round is kept, not rerun
    assert second["meta"]["rounds_done"] == 2 and second["rows"][1]["total_seconds"]["n"] == 2
    assert second["meta"]["rounds"][1]["warmup"] is not None  # a new process (here: call) warms up again
    round2 = json.loads((tmp_path / "speedup-round2.json").read_text())
    assert round2["round"] == 2 and round2["rows"][0]["pruning_rate"] == 0.0
    assert json.loads((tmp_path / "speedup.json").read_text())["rows"] == json.loads(json.dumps(second["rows"]))
    again = speedup.main(_tiny_argv(tmp_path, "--rounds", "2", "--batched-grpo", "2", "--no-plot"))
    assert "nothing to run" in capsys.readouterr().out and again["meta"]["rounds_done"] == 2
    with pytest.raises(ValueError, match=r"speedup-round1.json was measured with other settings \(arms "):
        speedup.main(_tiny_argv(tmp_path, "--rounds", "3", "--no-plot"))  # without the batched arm


def test_collect_joins_invocations_each_against_its_own_grpo(speedup, tmp_path, capsys):
    meta = {"model": "m", "dataset": "gsm8k", "group_size": 16, "max_completion_length": 128, "questions": 8}
    for folder, (g, c, b) in {"p0.75": (100.0, 25.0, 50.0), "p0.5": (90.0, 45.0, 60.0)}.items():
        p = 0.75 if folder == "p0.75" else 0.5
        per_step, q = (4, 4) if p == 0.75 else (2, 2)
        rows = rounds_mod.combine([{"rows": [_row(0.0, g), _row(p, c, per_step=per_step), _row(0.0, b, spg=q)]}])
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "wholerun.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    folders = [str(tmp_path / "p0.75"), str(tmp_path / "p0.5")]
    out = speedup.main(["--collect", *folders, "--name", "wholerun", "--out", str(tmp_path)])
    labels = [r["label"] for r in out["rows"]]
    assert labels == ["GRPO (p0.75)", "CPPO P=0.75", "GRPO batched 4", "GRPO (p0.5)", "CPPO P=0.5", "GRPO batched 2"]
    assert out["rows"][4]["speedup_total"]["mean"] == 2.0  # against the GRPO of its own invocation
    assert json.loads((tmp_path / "wholerun.json").read_text())["meta"]["collected"] == folders
    assert "| GRPO (p0.5) |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no wholerun.json there"):
        speedup.main(["--collect", str(tmp_path / "nowhere"), "--name", "wholerun", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--collect needs --out"):
        speedup.main(["--collect", *folders])
