"""The quality head, its metrics and the stop rule of pruning while generating (cppo.step.quality, issue 38)."""

from __future__ import annotations

import pytest
import torch

from cppo.step.quality import QualityHead, auc, brier, choose_stops, stops_per_group


def test_auc_is_the_mann_whitney_statistic_with_half_ties():
    labels = torch.tensor([1, 0, 1, 0, 1])
    assert auc(torch.tensor([0.9, 0.1, 0.8, 0.2, 0.7]), labels) == 1.0
    assert auc(torch.tensor([0.1, 0.9, 0.2, 0.8, 0.3]), labels) == 0.0
    # pairs (pos, neg): 3 x 2 = 6; scores pos {0.5, 0.7, 0.2}, neg {0.5, 0.3}: 0.5 vs 0.5 tie (0.5), 0.5 > 0.3,
    # 0.7 > both, 0.2 below both -> (0.5 + 1 + 2) / 6
    assert auc(torch.tensor([0.5, 0.5, 0.7, 0.3, 0.2]), labels) == pytest.approx(3.5 / 6)
    assert auc(torch.tensor([0.5, 0.6]), torch.tensor([1, 1])) is None


def test_brier_score():
    assert brier(torch.full((4,), 0.5), torch.tensor([0, 1, 0, 1])) == pytest.approx(0.25)
    assert brier(torch.tensor([1.0, 0.0]), torch.tensor([1, 0])) == 0.0
    assert brier(torch.zeros(0), torch.zeros(0)) is None


def test_the_head_learns_a_separable_signal_online():
    torch.manual_seed(0)
    head = QualityHead(16)
    direction = torch.randn(16)
    assert torch.equal(head.predict(torch.randn(3, 16)), torch.full((3,), 0.5))  # untrained: no opinion
    for _ in range(5):  # five steps of 64 completions whose correctness is the sign along one direction
        h = torch.randn(64, 16) * 3 + 10  # off-centre and scaled: the running standardisation handles it
        head.update(h, ((h - 10) @ direction > 0).float())
    test = torch.randn(256, 16) * 3 + 10
    label = (test - 10) @ direction > 0
    assert auc(head.predict(test), label) > 0.95
    assert brier(head.predict(test), label) < 0.1


def test_the_head_state_round_trips_exactly():
    torch.manual_seed(1)
    head, copy = QualityHead(8), QualityHead(8)
    h, y = torch.randn(32, 8), (torch.rand(32) > 0.5).float()
    head.update(h, y)
    copy.load_state_dict(head.state_dict())
    h2, y2 = torch.randn(32, 8), (torch.rand(32) > 0.5).float()
    head.update(h2, y2)
    copy.update(h2, y2)  # the optimizer's moments travelled too: the same next update
    x = torch.randn(5, 8)
    assert torch.equal(head.predict(x), copy.predict(x))


def test_the_stop_rule_is_cppos_on_predicted_advantages():
    # one group of 6: rows 0 and 3 ended (true rewards 1 and 0); the open rows' predictions
    predicted = torch.tensor([0.0, 0.9, 0.52, 0.0, 0.1, 0.48])
    finished = [True, False, False, True, False, False]
    known = torch.tensor([1.0, 0, 0, 0.0, 0, 0])
    # group values: 1, 0.9, 0.52, 0, 0.1, 0.48 -> mean 0.5; the open rows nearest the mean stop first
    stops = choose_stops(predicted, finished, group_size=6, stop=2, known=known)
    assert stops == [False, False, True, False, False, True]
    # fewer open rows than the count: all of them, never a finished row
    assert choose_stops(predicted, finished, group_size=6, stop=5, known=known) == [not f for f in finished]
    # ties stop the later row; groups are independent
    tied = choose_stops(torch.tensor([0.5, 0.5, 0.5, 0.5]), [False] * 4, group_size=2, stop=1)
    assert tied == [False, True, False, True]


def test_the_stop_count_and_bad_input():
    assert stops_per_group(0.5, 8) == 4 and stops_per_group(0.3, 8) == 2 and stops_per_group(0.0, 8) == 0
    with pytest.raises(ValueError, match="groups of 4"):
        choose_stops(torch.zeros(6), [False] * 6, group_size=4, stop=1)
    with pytest.raises(ValueError, match="finite"):
        choose_stops(torch.tensor([0.1, float("nan")]), [False] * 2, group_size=2, stop=1)


def _choose_stops_by_hand(predicted, finished, *, group_size, stop, known=None, eps=1e-4):
    """The rule as the first version wrote it, one row at a time (the oracle of the vectorised one)."""
    n = len(finished)
    values = predicted.double().clone()
    done = torch.tensor(finished, dtype=torch.bool)
    values[done] = float("nan") if known is None else known.double()[done]
    out = [False] * n
    for g in range(n // group_size):
        rows = range(g * group_size, (g + 1) * group_size)
        v = values[g * group_size : (g + 1) * group_size]
        seen = v[~v.isnan()]
        mean = float(seen.mean()) if len(seen) else 0.0
        std = float(seen.std()) if len(seen) > 1 else 0.0
        open_rows = [i for i in rows if not finished[i]]
        score = {i: abs(float(values[i]) - mean) / (std + eps) for i in open_rows}
        for i in sorted(open_rows, key=lambda i: (score[i], -i))[: min(stop, len(open_rows))]:
            out[i] = True
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_vectorised_rule_stops_what_the_row_by_row_one_did(seed):
    g = torch.Generator().manual_seed(seed)
    group_size = [2, 4, 8][seed % 3]
    n = group_size * (1 + seed % 5)
    predicted = torch.randint(0, 4, (n,), generator=g).double() / 4  # few values: ties everywhere
    finished = (torch.rand(n, generator=g) < 0.3).tolist()
    known = None if seed % 2 else torch.randint(0, 2, (n,), generator=g).double()
    for stop in range(group_size + 1):
        got = choose_stops(predicted, finished, group_size=group_size, stop=stop, known=known)
        assert got == _choose_stops_by_hand(predicted, finished, group_size=group_size, stop=stop, known=known)


def test_the_rule_keeps_both_predicted_extremes_as_a_balance_rule_would():
    """Why ARRoL's balance rule was not built (docs/training.md): CPPO's rule stops the rows nearest the group's
    predicted mean, so with 5 of 8 stopped it keeps the highest and the lowest prediction in nearly every group
    (98.5% of these 5,000, predictions uniform or Beta(0.7, 3)); a balance rule keeps both always, so the two differ
    at most in the third survivor. A row of largest |deviation| is an extreme, so one extreme is always kept."""
    torch.manual_seed(0)  # Beta draws from the global generator
    groups = 2500
    p = torch.cat([torch.rand(groups, 8), torch.distributions.Beta(0.7, 3.0).sample((groups, 8))])  # [5000, 8]
    stopped = torch.tensor(choose_stops(p.reshape(-1), [False] * p.numel(), group_size=8, stop=5)).reshape(-1, 8)
    rows = torch.arange(len(p))
    top, bottom = ~stopped[rows, p.argmax(1)], ~stopped[rows, p.argmin(1)]  # kept?
    assert bool((top | bottom).all())
    assert float((top & bottom).float().mean()) > 0.98, float((top & bottom).float().mean())


def test_stoppers_that_saw_other_rows_than_the_rollout_holds_are_an_error():
    """Every generation call asks its stopper once, for all its rows: a step whose records cover fewer (or more)
    rows than its rollout is an engine's bug, named, not a silently skipped AUC and head update."""
    from types import SimpleNamespace

    from cppo.step import RolloutStopping

    config = SimpleNamespace(rollout_stop=dict(rate=0.5, scorer="random", warmup=0, at=2),
                             max_completion_length=8, group_size=4)  # fmt: skip
    stopping = RolloutStopping(config, hidden_size=8, tokenizer=None)
    stopper = stopping.stopper(step=0, seed=0)
    assert sum(stopper.choose(SimpleNamespace(finished=[False] * 4, hidden=None))) == 2  # one group of the two
    rollout = SimpleNamespace(stopped=[False] * 8)
    with pytest.raises(RuntimeError, match="stoppers saw 4 rows, its rollout has 8"):
        stopping.observe(rollout, [True, False] * 4, torch.arange(8.0))
