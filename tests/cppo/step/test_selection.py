"""cppo.step.selection: the whole pruning step (counts, scopes, the random generator across ranks) against the float64
oracle, and the rule that no other module of cppo calls the selection kernels."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cppo import TrainConfig
from cppo.distributed import DistInfo
from cppo.step.selection import SCOPES, Pruning, kept_count
from cppo_kernels import reference
from cppo_kernels.config import SCOPES as KERNEL_SCOPES

CPPO = pathlib.Path(__file__).resolve().parents[3] / "cppo"


def test_one_vocabulary_with_the_kernels():
    assert SCOPES == (*KERNEL_SCOPES, "global")
    assert TrainConfig(selection_scope="global", max_prompt_length=8, max_completion_length=8).pruning.scope == "global"


@pytest.mark.parametrize(
    ("rate", "allocation", "questions", "drawn", "keep", "kept_batch"),
    [
        (0.0, True, 1, 1, 16, 16),
        (0.5, True, 1, 2, 8, 16),
        (0.75, True, 1, 4, 4, 16),
        (0.875, True, 2, 16, 2, 32),
        (0.3, True, 2, 3, 12, 48 - int(48 * 0.3)),  # ceil(2.857) questions; 34 of 48, no multiple of 16
        (0.75, False, 3, 3, 4, 12),
    ],
)
def test_official_counts(rate, allocation, questions, drawn, keep, kept_batch):
    rule = Pruning(group_size=16, pruning_rate=rate, allocation=allocation, questions_per_step=questions)
    assert (rule.questions_drawn, rule.keep, rule.kept_per_step) == (drawn, keep, kept_batch)
    assert rule.completions_per_step == drawn * 16
    assert Pruning(group_size=16, pruning_rate=rate, scope="group", allocation=allocation,
                   questions_per_step=questions).kept_per_step == keep * drawn  # fmt: skip
    assert kept_count(drawn * 16, rate) == kept_batch


@given(
    groups=st.integers(1, 5),
    group_size=st.integers(2, 9),
    rate=st.sampled_from([0.0, 0.25, 0.3, 0.5, 0.75, 0.875]),
    scope=st.sampled_from(SCOPES),
    metric=st.sampled_from(["smallest", "largest", "random"]),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_select_matches_the_oracle_in_one_process(groups, group_size, rate, scope, metric, levels, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, levels, (groups * group_size,), generator=g).float() / 2  # [N], many ties
    rule = Pruning(group_size=group_size, pruning_rate=rate, scope=scope, metric=metric)
    got = rule.select(rewards, seed=seed)
    want_adv = reference.group_advantages(rewards.double(), group_size)
    torch.testing.assert_close(got.advantages.double(), want_adv.double(), rtol=1e-5, atol=2e-5)
    count = {"keep": rule.keep} if scope == "group" else {"num_kept": kept_count(rewards.numel(), rate)}
    gen = torch.Generator().manual_seed(seed) if metric == "random" else None  # one process: rank 0
    want = reference.select_completions(
        got.advantages, group_size, scope="group" if scope == "group" else "batch", metric=metric, generator=gen,
        **count,
    )  # fmt: skip
    assert torch.equal(got.kept, want)
    assert torch.equal(rule.prune(got.advantages, seed=seed), want)  # the same from given advantages (TRL's)
    assert torch.equal(got.kept_advantages, got.advantages[want])


@given(groups=st.integers(1, 4), rate=st.sampled_from([0.0, 0.25, 0.5, 0.75]), seed=st.integers(0, 2**16))
def test_max_variance_per_question_matches_the_oracle(groups, rate, seed):
    rewards = torch.randint(0, 3, (groups * 8,), generator=torch.Generator().manual_seed(seed)).float()  # [N]
    rule = Pruning(group_size=8, pruning_rate=rate, scope="group", metric="max-variance")
    got = rule.select(rewards, seed=seed)
    want = reference.select_completions(got.advantages, 8, rule.keep, metric="max-variance")
    assert torch.equal(got.kept, want) and torch.equal(rule.prune(got.advantages, seed=seed), want)


def test_random_draws_differ_per_rank_for_local_scopes_only():
    """The local scopes seed their draws with seed + rank (the ranks' batches differ); with one process ``global``
    is ``batch`` on rank 0's seed."""
    adv = torch.randn(32, generator=torch.Generator().manual_seed(0))
    rule = Pruning(group_size=8, pruning_rate=0.5, scope="batch", metric="random")
    as_rank = [rule._generator(5, DistInfo(rank=r, world_size=2)).initial_seed() for r in (0, 1)]
    assert as_rank == [5, 6]
    glob = Pruning(group_size=8, pruning_rate=0.5, scope="global", metric="random")
    assert [glob._generator(5, DistInfo(rank=r, world_size=2)).initial_seed() for r in (0, 1)] == [5, 5]
    assert rule._generator(5, DistInfo()) is not None and Pruning(group_size=8)._generator(5, DistInfo()) is None
    assert torch.equal(glob.prune(adv, seed=3), rule.prune(adv, seed=3))  # one process


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pruning_rate": 1.0}, r"pruning_rate must be in \[0, 1\)"),
        ({"pruning_rate": -0.1}, "pruning_rate must be >= 0"),
        ({"scope": "world"}, "selection_scope must be one of"),
        ({"metric": "max"}, "selection_metric must be one of"),
        (  # the rule stated once (issue 50), in the words CPPOConfig's message had
            {"metric": "max-variance"},
            "selection_metric='max-variance' keeps each question's subset of largest variance, which needs "
            "selection_scope='group', got 'batch'",
        ),
        ({"metric": "max-variance", "scope": "global"}, "needs selection_scope='group', got 'global'"),
        ({"questions_per_step": 0}, "questions_per_step must be >= 1"),
        ({"allocation": "yes"}, "allocation must be true or false"),
    ],
)
def test_bad_options_name_the_setting(options, message):
    with pytest.raises(ValueError, match=message):
        Pruning(group_size=4, **options)


def test_no_other_module_of_cppo_calls_the_selection_kernels():
    kernels = re.compile(r"\b(cppo_select|select_completions|group_advantages)\b")
    callers = sorted(p.name for p in CPPO.rglob("*.py") if p.name != "selection.py" and kernels.search(p.read_text()))
    assert callers == []
