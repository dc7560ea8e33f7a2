"""Issue 30 parts 2 and 3 in the trainer: dynamic sampling's counts (filter_groups, max_num_gen_batches) and GRESO's
skips (greso), whose history a checkpoint holds so that a resumed run skips exactly what the uninterrupted one would.

The engine returns fixed texts (the same four per question, whose digit shares differ) and the reward gates them by
the question: 0 for every completion of a question with an even answer (a zero-variance group), the digit share
otherwise (a group of four different rewards)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json

import pytest
import torch
from tiny_run import tiny_config
from toy_engine import TEXTS, FixedEngine

from cppo.engines import base, register_engine
from cppo.tasks import register_reward
from cppo.tasks.rewards import REWARDS, digits_reward
from cppo.trainer import Trainer


class SameTextsEngine(FixedEngine):
    """:class:`FixedEngine` restarting its texts at every call: a question's G completions are always the first G."""

    def generate(self, prompts, num_per_prompt, *, greedy=False):
        texts = list(itertools.islice(itertools.cycle(TEXTS), num_per_prompt))
        self.texts = itertools.cycle(texts)
        return super().generate(prompts, num_per_prompt, greedy=greedy)


def gated(prompts, completions, answer, **_):
    digits = digits_reward(prompts, completions)
    return [0.0 if int(a) % 2 == 0 else d for a, d in zip(answer, digits)]


@pytest.fixture(autouse=True)
def _engine_and_reward(monkeypatch):
    monkeypatch.setattr(base, "_ENGINES", dict(base._ENGINES))
    monkeypatch.setitem(REWARDS, "gated", None)  # restored after the test
    monkeypatch.setitem(REWARDS, "zero", None)
    register_engine("same", SameTextsEngine)
    register_reward("gated", gated)
    register_reward("zero", lambda prompts, completions, **_: [0.0] * len(completions))


def config(tmp_path, **overrides):
    options = dict(rollout_backend="same", rewards=["gated"], group_size=4, mu=1, beta=0.0, kernel_backend="torch")
    return tiny_config(tmp_path, **{**options, **overrides})


def recorded(trainer):
    """Wraps ``trainer._generate`` to record the problems of every generation call."""
    calls, generate = [], trainer._generate

    def wrapped(*args):
        problems, prompts, rollout = generate(*args)
        calls.append(problems)
        return problems, prompts, rollout

    trainer._generate = wrapped
    return calls


def even(problem) -> bool:
    return int(problem["answer"]) % 2 == 0


def test_filter_groups_counts_in_the_trainer(tmp_path):
    cfg = config(tmp_path, pruning_rate=0.75, questions_per_step=1, filter_groups=True, max_num_gen_batches=4)
    trainer = Trainer(cfg)
    budget = cfg.pruning.kept_per_step
    assert budget == 4 and cfg.pruning.questions_drawn == 4
    extra_calls = 0
    for _ in range(4):
        calls, engine_calls = recorded(trainer), len(trainer.rollout.calls)
        m = trainer.train_step()
        problems = sum(calls, [])
        useful = sum(not even(p) for p in problems)
        assert m["generation_calls"] == len(calls) == len(trainer.rollout.calls) - engine_calls
        extra_calls += len(calls) - 1
        assert len(calls[0]) == 4 and all(1 <= len(c) <= 4 for c in calls)
        assert m["questions"] == len(problems) and m["completions"] == 4 * len(problems)
        assert m["filter_groups/zero_variance_dropped"] == len(problems) - useful
        assert m["completions_kept"] == budget
        # a useful question brings 4 completions of non-zero advantage: the calls stop once one is drawn
        assert m["filter_groups/bound_reached"] == (useful == 0)
        assert (m["kept_zero_advantage"] == 0) == (useful > 0)
        if useful:
            assert all(even(p) for c in calls[:-1] for p in c)
    assert extra_calls > 0  # the extra calls ran


def test_the_bound_trains_what_it_has(tmp_path):
    cfg = config(tmp_path, rewards=["zero"], pruning_rate=0.5, filter_groups=True, max_num_gen_batches=3)
    trainer = Trainer(cfg)
    calls = recorded(trainer)
    m = trainer.train_step()
    assert m["generation_calls"] == len(calls) == 3 and m["filter_groups/bound_reached"] == 1
    assert [len(c) for c in calls] == [4, 4, 4]  # no useful completion seen: a first call's size each time
    assert m["completions_kept"] == cfg.pruning.kept_per_step == m["kept_zero_advantage"] == 8
    assert m["filter_groups/zero_variance_dropped"] == 12 and m["completions"] == 48


def test_off_by_default_one_call_and_no_new_metrics_but_kept_zero_advantage(tmp_path):
    trainer = Trainer(config(tmp_path, pruning_rate=0.5))
    calls = recorded(trainer)
    m = trainer.train_step()
    assert len(calls) == 1 and "generation_calls" not in m and "greso/explore" not in m
    zero_rows = 4 * sum(even(p) for p in calls[0])  # the pruning keeps non-zero advantages first
    assert m["kept_zero_advantage"] == max(0, m["completions_kept"] - (16 - zero_rows))


def comparable(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def test_greso_skips_and_a_resumed_run_skips_what_the_uninterrupted_one_would(tmp_path):
    # 8 questions, 4 drawn per step: an epoch is 2 steps, so questions come back and their history counts
    cfg = config(tmp_path, greso=True, pruning_rate=0.5, max_questions=8, num_steps=8, greso_target_skip_rate=0.9)
    straight = Trainer(cfg)
    skipped, history = [], []
    for k in range(8):
        history.append(straight.train_step())
        skipped.append(list(straight.sampler.skipped))
        if k == 3:
            ckpt = straight.save_checkpoint(str(tmp_path / "checkpoint-000004"))
            saved_greso = straight.greso.state_dict()
    assert sum(map(len, skipped)) > 0 and all(len(s) == m["greso/questions_skipped"] for s, m in zip(skipped, history))
    assert all(int(straight.problems[q]["answer"]) % 2 == 0 for s in skipped for q in s)  # only hopeless ones
    assert saved_greso != straight.greso.state_dict()

    resumed = Trainer(cfg)
    torch.manual_seed(99)
    resumed.load_checkpoint(ckpt)
    assert resumed.greso.state_dict() == saved_greso
    tail, tail_skipped = [], []
    for _ in range(4):
        tail.append(resumed.train_step())
        tail_skipped.append(list(resumed.sampler.skipped))
    assert tail_skipped == skipped[4:]
    assert [comparable(m) for m in tail] == [comparable(m) for m in history[4:]]
    assert resumed.greso.state_dict() == straight.greso.state_dict()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_both_together_count_what_was_generated(tmp_path):
    cfg = config(tmp_path, greso=True, filter_groups=True, pruning_rate=0.5, max_questions=8, num_steps=6)
    trainer = Trainer(cfg)
    for _ in range(6):
        calls = recorded(trainer)
        m = trainer.train_step()
        assert m["completions"] == 4 * sum(map(len, calls)) and m["completions_kept"] == 8
        assert m["generation_calls"] == len(calls)


def test_greso_alone_selects_by_the_plain_rule(tmp_path):
    """With no history yet nothing is skipped: GRESO's first step is the plain step, bit for bit."""
    plain = Trainer(config(tmp_path / "plain", pruning_rate=0.5, selection_metric="random"))
    greso = Trainer(config(tmp_path / "greso", pruning_rate=0.5, selection_metric="random", greso=True))
    a, b = plain.train_step(), greso.train_step()
    assert b["greso/questions_skipped"] == 0
    assert comparable(a) == {k: v for k, v in comparable(b).items() if not k.startswith("greso/")}
    for (name, p), q in zip(plain.model.named_parameters(), greso.model.parameters()):
        assert torch.equal(p, q), name


def test_num_epochs_bounds_the_run_by_the_questions_passed_and_a_resumed_run_stops_at_the_same_step(tmp_path, capsys):
    # 8 questions, 4 drawn per call: 3 epochs plan 6 steps; extra calls and skips pass more questions, so the data's
    # 3 epochs are used up earlier, and the run ends there (verl's epochs), its last step logged and saved as usual
    options = dict(greso=True, filter_groups=True, greso_target_skip_rate=0.9, pruning_rate=0.5, max_questions=8)
    cfg = config(tmp_path / "straight", **options, num_steps=None, num_epochs=3, save_every=2, log_every=100)
    straight = Trainer(cfg)
    assert straight.num_steps == 6 and straight.stop_reason() is None
    passed = []
    straight.train_step = functools.partial(passed_after, straight, straight.train_step, passed)
    history = straight.train()
    steps = len(history)
    assert steps < straight.num_steps == 6 and straight.step == steps
    assert passed[-1] >= 3 * 8 > passed[-2]  # it stopped at the first step that used the epochs up, not later
    assert "num_epochs=3 epochs of the 8 questions used up after step" in capsys.readouterr().out
    assert (tmp_path / "straight" / f"checkpoint-{steps:06d}").is_dir()  # saved as at a normal end
    logged = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "loss" in r][-1] == steps  # the last step logged (log_every=100)

    # resumed from step 2 in a fresh folder: the same stop point, the same weights
    resumed = Trainer(dataclasses.replace(cfg, output_dir=str(tmp_path / "resumed")))
    resumed.load_checkpoint(str(tmp_path / "straight" / "checkpoint-000002"))
    resumed.train()
    assert resumed.step == steps and resumed.sampler.state_dict() == straight.sampler.state_dict()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def passed_after(trainer, train_step, passed):
    record = train_step()
    passed.append(trainer.sampler.passed)
    return record


def test_a_plain_run_of_num_epochs_ends_at_its_planned_steps(tmp_path):
    trainer = Trainer(config(tmp_path, pruning_rate=0.5, max_questions=8, num_steps=None, num_epochs=2))
    assert len(trainer.train()) == trainer.num_steps == 4 and trainer.sampler.passed == 16
    assert trainer.stop_reason() == "4 of 4 planned steps done"
