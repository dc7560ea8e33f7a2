"""Pruning while generating in the trainer (issue 38: the ``rollout_stop`` section): the settings refused where they
cannot run, a stopped completion never trained, the run equal to today's when nothing is stopped, the head trained and
resumed exactly."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_run import tiny_config

from cppo import TrainConfig
from cppo.step import Pruning, survivor_selection
from cppo.trainer import Trainer


def stop_config(tmp_path, **overrides) -> TrainConfig:
    """A tiny run that stops completions: G = 8, 4 of each group stopped at the 3rd token, P = 0.75 after."""
    options = dict(group_size=8, pruning_rate=0.75, selection_scope="group", max_completion_length=8,
                   micro_batch_tokens=128, num_steps=3, questions_per_step=1, allocation=True)  # fmt: skip
    stop = {"rate": 0.5, "at": 3, "warmup": 1, **overrides.pop("rollout_stop", {})}  # the section's options
    options.update(overrides, rollout_stop=stop)
    return tiny_config(tmp_path, **options)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(rollout_stop=dict(rate=0.8)), "must be <= pruning_rate"),
        (dict(rollout_stop=dict(rate=-0.1)), "rollout_stop.rate"),
        (dict(rollout_stop=dict(scorer="oracle")), "rollout_stop.scorer"),
        (dict(rollout_stop=dict(at=8)), "not before max_completion_length"),
        (dict(rollout_stop=dict(at=0)), "rollout_stop.at"),
        (dict(rollout_stop=dict(warmup=-1)), "rollout_stop.warmup"),
        (dict(selection_metric="random"), r"this config sets \['selection_metric'\]"),
        (dict(selection_scope="global"), r"this config sets \['selection_scope'\]"),
    ],
)
def test_settings_it_cannot_run_with_are_one_line_naming_them(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        stop_config(tmp_path, **overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(max_completion_length=1),  # the default checkpoint (0.25) would be its only token
        dict(rollout_stop=dict(at=16)),  # past the tiny run's 8 tokens
        dict(rollout_stop=dict(at=8)),  # at them
    ],
)
def test_with_the_feature_off_its_checkpoint_refuses_nothing(tmp_path, overrides):
    """Pruning while generating off (``rollout_stop.rate`` 0): where its checkpoint falls is no reason to refuse a
    run (issue 49, defect 8); on, the same settings are refused naming rollout_stop.at."""
    assert tiny_config(tmp_path, **overrides).rollout_stop["rate"] == 0.0
    with pytest.raises(ValueError, match="rollout_stop.at=.* not before max_completion_length"):
        stop_config(tmp_path, **overrides)


def test_cppo_train_with_one_new_token_loads(tmp_path):
    """``cppo train --set max_completion_length=1`` (issue 49's command) passes the config's checks."""
    from cppo.config import load_config

    config = load_config("tiny-cpu", ["max_completion_length=1", f"output_dir={tmp_path}"])
    assert config.max_completion_length == 1 and config.rollout_stop["rate"] == 0.0


def test_an_engine_that_cannot_stop_is_refused_naming_it(tmp_path):
    from cppo.engines import HFEngine, register_engine
    from cppo.engines.base import _ENGINES

    class NoStop(HFEngine):
        supports_stopping = False

    register_engine("nostop", NoStop)
    try:
        with pytest.raises(ValueError, match="rollout_backend='nostop' cannot stop completions mid-generation"):
            stop_config(tmp_path, rollout_backend="nostop")
        assert stop_config(tmp_path, rollout_backend="vllm").rollout_backend == "vllm"  # vllm can
    finally:
        _ENGINES.pop("nostop")


def test_stopping_nothing_trains_today_s_run_bit_for_bit(tmp_path):
    """rollout_stop.rate > 0 with a warm-up longer than the run: every step only trains the head, nothing stops, and
    the losses and weights are those of the run without the feature."""
    runs = {}
    for name, rate in (("plain", 0.0), ("warmup", 0.5)):
        trainer = Trainer(stop_config(tmp_path / name, rollout_stop=dict(rate=rate, warmup=99)))
        history = [trainer.train_step() for _ in range(3)]
        runs[name] = history, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    (plain, plain_w), (warm, warm_w) = runs["plain"], runs["warmup"]
    assert [h["loss"] for h in warm] == [h["loss"] for h in plain]
    assert [h["tokens/generate_completion"] for h in warm] == [h["tokens/generate_completion"] for h in plain]
    assert all(torch.equal(plain_w[k], warm_w[k]) for k in plain_w)
    assert all(h["rollout_stop/stopped"] == 0 for h in warm) and "rollout_stop/auc" in warm[-1]


@pytest.mark.parametrize("scorer", ["learned", "random", "length"])
def test_stopped_completions_are_never_decoded_further_nor_trained(tmp_path, scorer, monkeypatch):
    trainer = Trainer(stop_config(tmp_path, rollout_stop=dict(scorer=scorer)))
    seen = []
    select = trainer._select_and_pack

    def spy(rewards, rollout, filled=None):
        seen.append((rollout, rewards))
        return select(rewards, rollout, filled)

    monkeypatch.setattr(trainer, "_select_and_pack", spy)
    history = [trainer.train_step() for _ in range(3)]
    assert history[0]["rollout_stop/stopped"] == 0  # the warm-up step
    for (rollout, rewards), h in zip(seen[1:], history[1:]):
        stopped = rollout.stopped
        ran = [r for r, x in zip(rewards.tolist(), stopped) if not x]
        assert h["reward_mean"] == pytest.approx(sum(ran) / len(ran))  # over the completions that ran to the end
        n = len(stopped)
        assert h["rollout_stop/stopped"] == sum(stopped) > 0
        assert h["rollout_stop/tokens_saved_max"] == sum(stopped) * (8 - 3)  # max_completion_length - checkpoint
        for g in range(n // 8):  # at most int(8 * 0.5) = 4 of each group, and only unfinished ones
            assert sum(stopped[g * 8 : (g + 1) * 8]) <= 4
        assert all(len(rollout.completion_ids[i]) == 3 for i in range(n) if stopped[i])  # cut at the checkpoint
        assert h["tokens/generate_completion"] == sum(len(c) for c in rollout.completion_ids)
        assert h["completions_kept"] == 2 * (n // 8)  # P = 0.75 of each group after generation, as without it
    area = history[-1]["rollout_stop/auc"]  # nan when the rows that ran on were all right or all wrong
    assert math.isnan(area) or 0.0 <= area <= 1.0
    score = history[-1]["rollout_stop/brier"]  # nan for the length scorer, whose scores are no probabilities
    assert math.isnan(score) if scorer == "length" else 0.0 <= score <= 1.0


def test_the_selection_over_survivors_never_keeps_a_stopped_row():
    pruning = Pruning(group_size=4, pruning_rate=0.5, scope="group")
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    stopped = [True, False, False, True, False, True, False, False]
    adv, kept = survivor_selection(rewards, stopped, pruning)
    # group 1: survivors 0.0, 1.0 -> A = -/+ 0.7071 / (0.7071 + eps); group 2: survivors 0, 0, 1
    assert adv[0] == 0 and adv[3] == 0 and adv[5] == 0
    assert adv[1] == pytest.approx(-0.7071, abs=1e-3) and adv[2] == pytest.approx(0.7071, abs=1e-3)
    assert kept.tolist() == [1, 2, 4, 7]  # group 2: |A| of row 7 (2/3) first, then rows 4 and 6 tie: the lower
    assert not any(stopped[i] for i in kept.tolist())
    pooled = Pruning(group_size=4, pruning_rate=0.5, scope="batch")
    _, kept = survivor_selection(rewards, stopped, pooled)
    assert len(kept) == 4 and not any(stopped[i] for i in kept.tolist())


def test_the_head_resumes_exactly(tmp_path):
    full = Trainer(stop_config(tmp_path / "full", num_steps=3))
    for _ in range(2):
        full.train_step()
    path = full.save_checkpoint(str(tmp_path / "full" / "checkpoint-2"))
    last = full.train_step()
    resumed = Trainer(stop_config(tmp_path / "resumed", num_steps=3))
    resumed.load_checkpoint(path)
    again = resumed.train_step()
    assert again["loss"] == last["loss"] and again["rollout_stop/stopped"] == last["rollout_stop/stopped"]
    x = torch.randn(4, full.model.config.hidden_size)
    assert torch.equal(full.stopping.head.predict(x), resumed.stopping.head.predict(x))


@pytest.mark.parametrize(
    "extra",
    [dict(use_peft=True, lr=1e-3), dict(prefix_sharing=False), dict(selection_scope="batch")],
    ids=["lora", "no-prefix-sharing", "pooled"],
)
def test_it_composes_with_lora_prefix_sharing_and_the_pooled_scope(tmp_path, extra):
    trainer = Trainer(stop_config(tmp_path, **extra))
    history = [trainer.train_step() for _ in range(3)]
    assert sum(h["rollout_stop/stopped"] for h in history[1:]) > 0
    assert all(h["completions_kept"] == h["completions"] - int(h["completions"] * 0.75) for h in history)
    assert all(math.isfinite(h["loss"]) for h in history)


DYNAMIC = [dict(filter_groups=True), dict(greso=True), dict(filter_groups=True, greso=True)]


@pytest.mark.parametrize("extra", DYNAMIC, ids=["filter_groups", "greso", "both"])
def test_stopping_nothing_with_dynamic_sampling_and_greso_is_today_s_run_bit_for_bit(tmp_path, extra):
    runs = {}
    for name, rate in (("plain", 0.0), ("warmup", 0.5)):
        trainer = Trainer(stop_config(tmp_path / name, rollout_stop=dict(rate=rate, warmup=99), **extra))
        history = [trainer.train_step() for _ in range(3)]
        runs[name] = history, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    (plain, plain_w), (warm, warm_w) = runs["plain"], runs["warmup"]
    for key in ("loss", "tokens/generate_completion", "completions", "completions_kept", "reward_mean"):
        assert [h[key] for h in warm] == [h[key] for h in plain], key
    assert all(torch.equal(plain_w[k], warm_w[k]) for k in plain_w)


@pytest.mark.parametrize("extra", DYNAMIC, ids=["filter_groups", "greso", "both"])
@pytest.mark.parametrize("scope", ["group", "batch"])
def test_it_composes_with_dynamic_sampling_and_greso(tmp_path, extra, scope, monkeypatch):
    """Every generation call of a step stops rows; the head sees every call's rows; the selection (dynamic
    sampling's, over the survivors) keeps the plain rule's count and never a stopped row; GRESO's history and the
    zero-variance drops are over the survivors."""
    trainer = Trainer(stop_config(tmp_path, selection_scope=scope, num_steps=4, max_num_gen_batches=3, **extra))
    seen, select, reward, firsts = [], trainer._select_and_pack, trainer._reward, set()

    def spy(rewards, rollout, filled=None):
        seen.append((rollout, filled))
        return select(rewards, rollout, filled)

    def flat_first_call(problems, prompts, rollout):  # a step's first call all-equal: dynamic sampling draws again
        rewards, scores, correct = reward(problems, prompts, rollout)
        first = trainer.step not in firsts
        firsts.add(trainer.step)
        return (torch.zeros_like(rewards) if first else rewards), scores, correct

    monkeypatch.setattr(trainer, "_select_and_pack", spy)
    monkeypatch.setattr(trainer, "_reward", flat_first_call)
    history = [trainer.train_step() for _ in range(4)]
    assert sum(h["rollout_stop/stopped"] for h in history[1:]) > 0
    for (rollout, filled), h in zip(seen, history):
        n = len(rollout.texts)
        assert len(rollout.stopped) == n == h["completions"]  # every call's flags, call after call
        if "filter_groups" in extra:
            assert h["generation_calls"] >= 2 and n == 32 * h["generation_calls"]
            assert h["step"] == 1 or sum(rollout.stopped[32:]) > 0  # the second call stopped rows too
        assert "rollout_stop/auc" in h  # the head saw every call's rows (nan: the tiny model is never right)
        assert h["completions_kept"] == 8  # 4 questions drawn x 8 at P = 0.75: 2 of each group, or 8 of the 32 pooled
        if filled is not None:
            kept = filled.rows(8).tolist()
            assert not any(rollout.stopped[i] for i in kept)
            zero = step_zero(filled.rewards, torch.tensor(rollout.stopped))
            assert filled.zero_variance.tolist() == zero
        assert math.isfinite(h["loss"])
    assert all(0.0 <= h["rollout_stop/fraction"] <= 0.5 for h in history)


def step_zero(rewards, stopped):
    """The zero-variance verdict over each group's survivors, by hand."""
    out = []
    for g in range(len(rewards) // 8):
        alive = [float(r) for r, s in zip(rewards[g * 8 : (g + 1) * 8], stopped[g * 8 : (g + 1) * 8]) if not s]
        out.append(len(alive) < 2 or len(set(alive)) == 1)
    return out


def test_dynamic_sampling_fills_its_budget_from_survivors_only():
    """fill_step with stopped rows: a group whose survivors agree is dropped (no gradient), the budget filled from
    the others, the selection over survivors; with nothing stopped, exactly the plain call."""
    from cppo.step import fill_step, zero_variance_groups

    pruning = Pruning(group_size=4, pruning_rate=0.5, scope="group", questions_per_step=1)  # draws 2 questions
    calls = iter([
        (torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]), torch.tensor([0, 1, 0, 0, 0, 0, 0, 0]).bool()),
        (torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 0, 0, 0, 0, 1]).bool()),
    ])  # fmt: skip
    filled = fill_step(pruning, lambda n: next(calls), max_calls=3)
    # call 1: group 0's survivors 1, 1, 1 agree (dropped), group 1 has spread: 1 useful of the 2 needed
    # call 2: group 2's survivors 0, 1, 0 spread, group 3's 1, 0, 1 spread -> full
    assert filled.zero_variance.tolist() == [True, False, False, False] and filled.calls == 2
    assert filled.pool == [1, 2]
    kept = filled.rows(4).tolist()
    stopped = [0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert len(kept) == 4 and not any(stopped[i] for i in kept)
    assert zero_variance_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), 4, torch.tensor([0, 0, 1, 0]).bool()).item()
    plain = iter([torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])] * 2)
    none = iter([(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]), torch.zeros(8, dtype=torch.bool))] * 2)
    a, b = fill_step(pruning, lambda n: next(plain), max_calls=2), fill_step(pruning, lambda n: next(none), max_calls=2)
    assert a.pool == b.pool and torch.equal(a.selection.kept, b.selection.kept)
    assert torch.equal(a.selection.advantages, b.selection.advantages)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("scope", ["group", "batch"])
def test_the_survivor_selection_keeps_the_largest_survivors_ties_to_the_lower_index(seed, scope):
    """Against the rule written row by row: per group (or pooled) the largest |A| over the survivors first, ties to
    the lower index, never a stopped row."""
    g = torch.Generator().manual_seed(seed)
    G = [4, 8][seed % 2]
    n = G * (1 + seed % 4)
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    stopped = [bool(x) for x in (torch.rand(n, generator=g) < 0.4).tolist()]
    for q in range(n // G):  # at most G * P of a group stopped, as the settings allow
        for i in [i for i in range(q * G, (q + 1) * G) if stopped[i]][G // 2 :]:
            stopped[i] = False
    pruning = Pruning(group_size=G, pruning_rate=0.5, scope=scope)
    adv, kept = survivor_selection(rewards, stopped, pruning)
    score = [-1.0 if s else abs(float(a)) for s, a in zip(stopped, adv.double())]
    if scope == "group":
        want = [i for q in range(n // G)
                for i in sorted(range(q * G, (q + 1) * G), key=lambda i: (-score[i], i))[: pruning.keep]]  # fmt: skip
    else:
        want = sorted(range(n), key=lambda i: (-score[i], i))[: pruning.kept_count(n)]
    assert kept.tolist() == sorted(want)
