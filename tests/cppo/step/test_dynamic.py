"""Dynamic sampling's counts in one process (cppo.step.dynamic.fill_step; two processes: tests/cppo/distributed/
test_multiproc.py): zero-variance groups leave the pool, extra generation calls until the kept budget is filled with
non-zero advantages, the bound on calls, and the budget kept exactly whatever happens."""

from __future__ import annotations

import pytest
import torch

from cppo.step import Pruning, fill_step, zero_variance_groups
from cppo_kernels import group_advantages, reference

G = 4
ZERO = [0.0, 0.0, 0.0, 0.0]
ONES = [1.0, 1.0, 1.0, 1.0]
MIXED = [0.0, 1.0, 0.0, 2.0]  # mean 0.75: every advantage non-zero
HALF = [0.0, 0.5, 0.5, 1.0]  # mean 0.5: two advantages exactly 0


class Draws:
    """A stand-in for the trainer's draw: hands out the groups of ``script`` in order, ``n`` at a time."""

    def __init__(self, script: list[list[float]]) -> None:
        self.script, self.sizes = list(script), []

    def __call__(self, n: int) -> torch.Tensor:
        self.sizes.append(n)
        groups = [self.script.pop(0) if self.script else ZERO for _ in range(n)]
        return torch.tensor(groups).reshape(-1)


def test_zero_variance_groups():
    rewards = torch.tensor([ZERO, ONES, MIXED, HALF, [2.0, 2.0, 2.0, 2.0]]).reshape(-1)
    assert zero_variance_groups(rewards, G).tolist() == [True, True, False, False, True]


def test_without_zero_variance_groups_one_call_selects_as_the_plain_rule():
    pruning = Pruning(group_size=G, pruning_rate=0.75, questions_per_step=1)  # 4 questions drawn, keep 4 of 16
    script = [MIXED, [3.0, 1.0, 0.0, 2.0], [0.0, 0.0, 1.0, 0.0], [5.0, 1.0, 1.0, 0.0]]
    draws = Draws(script)
    filled = fill_step(pruning, draws, max_calls=4)
    plain = pruning.select(torch.tensor(script).reshape(-1))
    assert draws.sizes == [4] and filled.calls == 1 and not filled.bound_reached
    assert filled.pool == [0, 1, 2, 3]
    assert torch.equal(filled.rows(G), plain.kept) and torch.equal(
        filled.selection.kept_advantages, plain.kept_advantages
    )
    assert filled.metrics() == {
        "generation_calls": 1,
        "filter_groups/zero_variance_dropped": 0,
        "filter_groups/bound_reached": 0,
        "kept_zero_advantage": 0,
    }


def test_dropped_groups_and_an_extra_call_fill_the_budget_with_non_zero_advantages():
    pruning = Pruning(group_size=G, pruning_rate=0.75, questions_per_step=1)  # budget 4 of a first call's 16
    # call 1: 2 useful completions (HALF) of 4 questions -> rate 0.5 per question; 2 missing -> a call of 4
    draws = Draws([ZERO, HALF, ONES, ZERO, ZERO, MIXED, ZERO, ZERO])
    filled = fill_step(pruning, draws, max_calls=4)
    assert draws.sizes == [4, 4] and filled.calls == 2 and not filled.bound_reached
    assert filled.pool == [1, 5]  # the non-zero-variance groups, in draw order
    kept = filled.rows(G)
    assert len(kept) == pruning.kept_budget() == 4
    assert (filled.selection.kept_advantages != 0).all()
    # the selection is the plain rule's over the pool, with the budget as its count
    pool_rewards = torch.tensor([HALF, MIXED]).reshape(-1)
    want = reference.select_completions(group_advantages(pool_rewards, G), G, num_kept=4, scope="batch")
    assert torch.equal(filled.selection.kept, want)
    assert filled.metrics()["filter_groups/zero_variance_dropped"] == 6
    assert filled.metrics()["kept_zero_advantage"] == 0


def test_extra_calls_draw_what_is_missing_at_the_rate_seen():
    pruning = Pruning(group_size=G, pruning_rate=0.875, questions_per_step=1)  # 8 questions, budget 32 - 28 = 4
    # call 1: one MIXED group (4 useful) of 8 questions... already full: one call
    assert fill_step(pruning, Draws([MIXED] + [ZERO] * 7), max_calls=3).calls == 1
    # call 1: one HALF group (2 useful of 8 questions: 0.25 per question); 2 missing -> 8 questions (capped at 8)
    draws = Draws([HALF] + [ZERO] * 7 + [HALF, HALF])
    filled = fill_step(pruning, draws, max_calls=3)
    assert draws.sizes == [8, 8] and filled.calls == 2 and len(filled.rows(G)) == 4
    # [0, 1, 2, 5]: mean 2, so 3 useful of 8 questions; 1 missing -> a call of ceil(1 / (3 / 8)) = 3 questions
    draws = Draws([[0.0, 1.0, 2.0, 5.0]] + [ZERO] * 7 + [MIXED] * 3)
    filled = fill_step(pruning, draws, max_calls=3)
    assert draws.sizes == [8, 3] and filled.pool == [0, 8, 9, 10] and len(filled.rows(G)) == 4
    pruning = Pruning(group_size=G, pruning_rate=0.5, questions_per_step=4)  # 8 questions, budget 16
    draws = Draws([MIXED] * 3 + [ZERO] * 5 + [MIXED] * 8)  # 12 useful of 8 questions: 1.5 each; 4 missing -> 3
    filled = fill_step(pruning, draws, max_calls=3)
    assert draws.sizes == [8, 3] and filled.calls == 2 and len(filled.rows(G)) == 16


@pytest.mark.parametrize("scope", ["batch", "global", "group"])
def test_the_bound_trains_what_it_has_and_keeps_the_budget(scope):
    pruning = Pruning(group_size=G, pruning_rate=0.5, questions_per_step=2, scope=scope)  # 4 questions, budget 8
    draws = Draws([ZERO, HALF, ONES])  # then zeros for ever
    filled = fill_step(pruning, draws, max_calls=3)
    assert filled.calls == 3 and filled.bound_reached and draws.sizes == [4, 4, 4]
    assert len(filled.rows(G)) == pruning.kept_budget() == 8
    assert filled.pool[0] == 1  # the useful group first, then the dropped ones as the tail
    m = filled.metrics()
    assert m["filter_groups/bound_reached"] == 1 and m["generation_calls"] == 3
    assert m["filter_groups/zero_variance_dropped"] == 11
    if scope == "group":  # the first 4 groups of the pool, 2 kept each: HALF keeps its two non-zero advantages
        assert filled.pool == [1, 0, 2, 3] and m["kept_zero_advantage"] == 6
    else:  # HALF's two non-zero advantages, then 6 rows of A = 0
        assert m["kept_zero_advantage"] == 6


def test_group_scope_fills_questions_with_non_zero_variance_groups():
    pruning = Pruning(group_size=G, pruning_rate=0.5, questions_per_step=2, scope="group")  # 4 questions, keep 2 each
    draws = Draws([ZERO, MIXED, HALF, ZERO, MIXED, ZERO, MIXED, MIXED])
    filled = fill_step(pruning, draws, max_calls=4)
    # 2 useful groups of 4 (0.5 per question), 2 missing -> 4 questions: 5 useful, the first 4 form the pool
    assert draws.sizes == [4, 4] and filled.pool == [1, 2, 4, 6] and not filled.bound_reached
    assert len(filled.rows(G)) == 8 and filled.metrics()["kept_zero_advantage"] == 0


def test_max_calls_one_is_the_plain_step_with_zero_variance_groups_last():
    pruning = Pruning(group_size=G, pruning_rate=0.5, questions_per_step=2)
    filled = fill_step(pruning, Draws([ZERO, MIXED, ONES, HALF]), max_calls=1)
    assert filled.calls == 1 and filled.bound_reached and filled.pool == [1, 3, 0, 2]
    assert len(filled.rows(G)) == 8 and filled.metrics()["kept_zero_advantage"] == 2


def test_num_kept_is_refused_for_the_group_scope():
    pruning = Pruning(group_size=G, pruning_rate=0.5, scope="group")
    with pytest.raises(ValueError, match="num_kept applies to the pooled scopes"):
        pruning.select(torch.tensor(MIXED), num_kept=2)


@pytest.mark.parametrize("seed", range(20))
def test_random_scripts_keep_the_budget_and_the_bound(seed):
    """Whatever the rewards: at most max_calls calls, every call a multiple of nothing more than a first call's,
    exactly the budget kept, and kept rows with A = 0 only when the bound was reached."""
    g = torch.Generator().manual_seed(seed)
    scope = ("batch", "global", "group")[seed % 3]
    pruning = Pruning(
        group_size=G, pruning_rate=[0.5, 0.75, 0.3][seed % 3], questions_per_step=1 + seed % 3, scope=scope
    )
    script = torch.randint(0, 2, (60, G), generator=g).float().tolist()
    draws = Draws(script)
    filled = fill_step(pruning, draws, max_calls=1 + seed % 4)
    assert filled.calls == len(draws.sizes) <= 1 + seed % 4
    assert all(1 <= n <= pruning.questions_drawn for n in draws.sizes)
    assert len(filled.rows(G)) == pruning.kept_budget()
    if not filled.bound_reached:
        assert filled.metrics()["kept_zero_advantage"] == 0 or scope == "group"
        assert all(not filled.zero_variance[q] for q in filled.pool)
