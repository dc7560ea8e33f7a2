"""A run's :class:`Pruning` is built once (issue 39): ``TrainConfig.pruning`` is the policy its construction built
and validated, the same object for every reader (the trainer, ``cppo train --dry-run``'s counts, ``steps_for``),
and a new one only after a pruning setting is assigned."""

from __future__ import annotations

import dataclasses

import pytest

from cppo.config import TrainConfig
from cppo.step import Pruning

SMALL = dict(max_prompt_length=8, max_completion_length=8)


def test_the_config_builds_it_once_and_every_reader_shares_it(constructions):
    config = TrainConfig(pruning_rate=0.75, questions_per_step=2, **SMALL)
    assert len(constructions) == 1
    first = config.pruning
    config.validate()
    steps = config.steps_for(100)  # the dry run's plan and the trainer's counts read the same policy
    assert (steps, config.pruning.kept_per_step, config.pruning.questions_drawn) == (12, 32, 8)
    assert all(config.pruning is first for _ in range(3))
    assert constructions == [first] and first == Pruning.from_config(config)
    assert "_cppo_pruning" not in config.to_dict() and config == TrainConfig(
        pruning_rate=0.75, questions_per_step=2, **SMALL
    )


def test_a_setting_assigned_afterwards_builds_it_anew(constructions):
    config = TrainConfig(**SMALL)
    first = config.pruning
    config.validate()
    assert len(constructions) == 1
    config.pruning_rate = 0.5  # e.g. a benchmark sweeping the rate on one config
    assert config.pruning is not first and config.pruning.pruning_rate == 0.5 and len(constructions) == 2
    config.selection_scope = "everywhere"
    with pytest.raises(ValueError, match="selection_scope"):
        config.validate()
    config.selection_scope = "batch"
    config.allocation = 1  # validated anew, though 1 == True
    with pytest.raises(ValueError, match="allocation must be true or false"):
        config.pruning  # noqa: B018


def test_a_replaced_config_has_its_own():
    config = TrainConfig(**SMALL)
    other = dataclasses.replace(config, pruning_rate=0.5)
    assert other.pruning.pruning_rate == 0.5 and config.pruning.pruning_rate == 0.0
    assert dataclasses.replace(config).pruning == config.pruning


def test_kept_of_local_is_the_rule_of_one_ranks_pool():
    """The count one rank's own selection keeps of a pool of whole groups; ``kept_budget`` is it of a rank's share
    (or, for ``global`` on several ranks, the whole step's)."""
    from cppo.distributed import DistInfo

    group = Pruning(group_size=4, pruning_rate=0.6, scope="group", questions_per_step=6, allocation=False)
    batch = Pruning(group_size=4, pruning_rate=0.6, scope="batch", questions_per_step=6, allocation=False)
    glob = Pruning(group_size=4, pruning_rate=0.6, scope="global", questions_per_step=6, allocation=False)
    assert (group.kept_of_local(12), batch.kept_of_local(12), glob.kept_of_local(12)) == (6, 5, 5)
    two = DistInfo(rank=1, world_size=2)
    assert (group.kept_budget(two), batch.kept_budget(two), glob.kept_budget(two)) == (6, 5, 10)
    assert (glob.pools_ranks(two), glob.pools_ranks(DistInfo()), batch.pools_ranks(two)) == (True, False, False)
    assert glob.completions_per_rank(two) == 12 and glob.completions_per_rank() == 24
