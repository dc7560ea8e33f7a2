"""GRESO's skip rule (cppo.tasks.greso.SelectiveRollout) and the sampler's draw with it: probabilities, the adaptive
exploration probability, the exploration floor (a skipped question comes back), the state a checkpoint holds."""

from __future__ import annotations

import pytest

from cppo import load_config
from cppo.tasks import INITIAL_EXPLORE, QuestionSampler, SelectiveRollout


def test_skip_probability_grows_with_the_streak_up_to_the_floor():
    greso = SelectiveRollout(3, min_explore=0.05)
    assert greso.explore == INITIAL_EXPLORE == 0.5
    greso.observe([0, 0, 1, 0], [True, True, True, True])
    assert greso.streaks == [3, 1, 0]
    assert greso.skip_probability(2) == 0.0  # never seen zero-variance: never skipped
    assert greso.skip_probability(1) == pytest.approx(0.5)
    assert greso.skip_probability(0) == pytest.approx(1 - 0.5**3)
    greso.observe([0] * 10, [True] * 10)
    assert greso.skip_probability(0) == pytest.approx(0.95)  # 1 - min_explore: the floor
    greso.observe([0], [False])  # one group that teaches resets the streak
    assert greso.streaks[0] == 0 and greso.skip_probability(0) == 0.0


def test_the_exploration_probability_adapts_to_the_target_skip_rate_within_its_bounds():
    greso = SelectiveRollout(4, target_skip_rate=0.25, min_explore=0.1, adjust_step=0.2)
    greso.adapt(skipped=2, considered=4)  # 0.5 > 0.25: skip less
    assert greso.explore == pytest.approx(0.7)
    greso.adapt(2, 4)
    greso.adapt(2, 4)
    assert greso.explore == 1.0
    for _ in range(10):
        greso.adapt(0, 4)  # 0 <= 0.25: skip more
    assert greso.explore == pytest.approx(0.1)
    greso.adapt(0, 0)  # nothing considered: unchanged
    assert greso.explore == pytest.approx(0.1)


def test_the_sampler_passes_over_skipped_questions_and_fills_the_draw():
    sampler, plain = QuestionSampler(10, seed=3), QuestionSampler(10, seed=3)
    order = plain.draw(10)
    skip = lambda q, epoch, position: q % 2 == 0  # noqa: E731
    drawn = sampler.draw(4, skip)
    assert drawn == [q for q in order if q % 2][:4]
    assert sampler.skipped == [q for q in order[: sampler.position] if q % 2 == 0]
    assert sampler.considered == 4 + len(sampler.skipped) == sampler.position


def test_a_draw_stops_skipping_after_a_whole_epoch_of_skips():
    sampler = QuestionSampler(5, seed=0)
    drawn = sampler.draw(3, lambda *a: True)
    assert len(drawn) == 3 and len(sampler.skipped) == 5 and sampler.considered == 8


def test_ranks_take_their_share_of_the_same_skipped_draw():
    skip = lambda q, epoch, position: q < 4  # noqa: E731
    shares = [QuestionSampler(12, seed=1, rank=r, world_size=2).draw(4, skip) for r in range(2)]
    whole = QuestionSampler(12, seed=1).draw(4, skip)
    assert shares[0] + shares[1] == whole and all(q >= 4 for q in whole)


def test_a_hopeless_question_comes_back_through_the_exploration_floor():
    greso = SelectiveRollout(1, seed=7, min_explore=0.05)
    greso.observe([0] * 50, [True] * 50)
    kept = [not greso.skips(0, epoch, 0) for epoch in range(400)]
    assert 0 < sum(kept) < 60  # about 5% of 400 come back; never all
    # the decisions are a function of (seed, epoch, position): the same again
    assert kept == [not greso.skips(0, epoch, 0) for epoch in range(400)]


def test_state_round_trip_and_a_history_of_another_size_is_refused():
    greso = SelectiveRollout(3, seed=1)
    greso.observe([1, 2, 1], [True, True, True])
    greso.adapt(0, 3)
    other = SelectiveRollout(3, seed=1)
    other.load_state_dict(greso.state_dict())
    assert other.streaks == [0, 2, 1] and other.explore == greso.explore
    with pytest.raises(ValueError, match="GRESO history covers 3 questions, this run has 4"):
        SelectiveRollout(4).load_state_dict(greso.state_dict())


@pytest.mark.parametrize(
    "setting, message",
    [
        ("greso_target_skip_rate=1.0", r"greso_target_skip_rate must be in \[0, 1\), got 1.0"),
        ("greso_target_skip_rate=-0.1", r"greso_target_skip_rate must be in \[0, 1\)"),
        ("greso_min_explore=0", r"greso_min_explore must be in \(0, 1\] \(a skipped question must be able to come"),
        ("greso_min_explore=1.5", r"greso_min_explore must be in \(0, 1\]"),
        ("greso_adjust_step=0", r"greso_adjust_step must be in \(0, 1\], got 0.0"),
        ("greso_target_skip_rate=.nan", "greso_target_skip_rate"),
        ("max_num_gen_batches=0", r"max_num_gen_batches must be >= 1 \(generation calls per step with filter_groups"),
        ("max_num_gen_batches=-3", "max_num_gen_batches must be >= 1"),
        ("filter_groups=sometimes", "filter_groups must be true or false"),
        ("greso=2", "greso must be true or false"),
    ],
)
def test_bad_settings_are_one_clear_error(setting, message):
    with pytest.raises(ValueError, match=message):
        load_config("tiny-cpu", [setting])


def test_the_presets_keep_both_off():
    for preset in ("gsm8k-qwen2.5-1.5b", "math-qwen2.5-7b", "tiny-cpu", "smollm2-arith-cpu"):
        cfg = load_config(preset, [])
        assert cfg.filter_groups is False and cfg.greso is False, preset
