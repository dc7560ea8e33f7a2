"""``Pruning`` is built once per run and handed down (issue 39): ``CPPOConfig.pruning`` is the one policy of the
config, and CPPOTrainer's per-process counts are Pruning's (``completions_per_rank``, ``kept_budget``,
``pools_ranks``), equal to the rule the trainer restated before, for a grid of processes, scopes, rates, groups and
batches (on a stand-in holding the members the layout reads: no model)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from trl_tiny import make_config

from cppo.distributed import DistInfo
from cppo.step import SCOPES, Pruning
from cppo.trl import CPPOConfig, CPPOTrainer


class Layout:
    """CPPOTrainer's layout members on a stand-in: ``world`` processes (this one ``rank``), ``per_device`` completions
    per micro-batch, ``spg`` micro-batches per generation, groups of ``group``."""

    dist_info = CPPOTrainer.dist_info
    local_generation_size = CPPOTrainer.local_generation_size
    kept_per_process = CPPOTrainer.kept_per_process
    _check_layout = CPPOTrainer._check_layout

    def __init__(self, pruning: Pruning, *, world: int, rank: int, per_device: int, spg: int, group: int):
        self.pruning, self.num_generations = pruning, group
        self.accelerator = SimpleNamespace(num_processes=world, process_index=rank)
        self.args = SimpleNamespace(steps_per_generation=spg, generation_batch_size=per_device * spg * world)


def before(pruning: Pruning, *, world: int, generation: int, spg: int, group: int) -> tuple[int, int | None, bool]:
    """``(local completions, kept per process or None, refused)`` as CPPOTrainer computed them before issue 39."""
    local = pruning.completions_per_step // world if pruning.allocation else generation // world
    if pruning.allocation and pruning.completions_per_step % world:
        return local, None, True
    if pruning.scope == "global" and world > 1:
        return local, None, spg > 1
    if local % group:
        return local, None, True
    kept = (local // group) * pruning.keep if pruning.scope == "group" else pruning.kept_count(local)
    return local, kept, kept % spg != 0


GRID = list(
    itertools.product(
        (1, 2, 3, 4), SCOPES, (0.0, 0.25, 0.3, 0.5, 0.75, 0.875), (2, 3, 4, 8), (2, 3, 4, 6, 8, 12, 16), (1, 2, 4)
    )
)


@pytest.mark.parametrize("allocation", [False, True])
def test_the_per_process_budget_is_prunings(allocation):
    checked, kept_seen = 0, set()
    for world, scope, rate, group, per_device, spg in GRID:
        generation = per_device * spg * world
        if generation % group:  # TRL's GRPOConfig refuses it
            continue
        pruning = Pruning(
            group_size=group, pruning_rate=rate, scope=scope, allocation=allocation,
            questions_per_step=generation // group,
        )  # fmt: skip
        local, kept, refused = before(pruning, world=world, generation=generation, spg=spg, group=group)
        for rank in range(world):
            layout = Layout(pruning, world=world, rank=rank, per_device=per_device, spg=spg, group=group)
            info = DistInfo(rank=rank, world_size=world)
            assert layout.local_generation_size == local == pruning.completions_per_rank(info)
            assert pruning.pools_ranks(info) == (scope == "global" and world > 1)
            if kept is not None:
                assert layout.kept_per_process == kept == pruning.kept_budget(info), (world, scope, rate, group)
            if refused:
                with pytest.raises(ValueError):
                    layout._check_layout()
            else:
                layout._check_layout()
        if kept is not None and not refused:
            checked += 1
            kept_seen.add(kept)
            advantages = torch.randn(local, generator=torch.Generator().manual_seed(checked))
            info = DistInfo(rank=world - 1, world_size=world)
            assert len(pruning.prune(advantages, info=info)) == kept  # the selection keeps the budget
    assert checked > 300 and len(kept_seen) > 10


def test_the_pool_over_processes_is_prunings():
    """``global`` on several processes: the pool gathered, one selection alike on every process, each keeping its
    own survivors (``Pruning.prune_pooled``), as one process prunes ``batch`` over the concatenated pools."""
    pruning = Pruning(group_size=4, pruning_rate=0.625, scope="global", metric="smallest")
    advantages = torch.randn(3 * 8, generator=torch.Generator().manual_seed(0))
    whole = Pruning(group_size=4, pruning_rate=0.625, scope="batch").prune(advantages)
    mine = [pruning.prune_pooled(advantages, [8, 8, 8], rank) for rank in range(3)]
    assert torch.cat([m + 8 * rank for rank, m in enumerate(mine)]).tolist() == whole.tolist()
    random = Pruning(group_size=4, pruning_rate=0.5, scope="global", metric="random")
    picks = [random.prune_pooled(advantages, [8, 8, 8], rank, seed=3) for rank in range(3)]
    alone = Pruning(group_size=4, pruning_rate=0.5, scope="batch", metric="random").prune(advantages, seed=3)
    assert torch.cat([m + 8 * rank for rank, m in enumerate(picks)]).tolist() == alone.tolist()


def test_the_config_builds_its_pruning_once(tmp_path, constructions):
    args = make_config(CPPOConfig, tmp_path, pruning_rate=0.5, allocation=True)
    assert len(constructions) == 1
    first = args.pruning
    assert all(args.pruning is first for _ in range(3)) and len(constructions) == 1
    assert first == Pruning(group_size=4, pruning_rate=0.5, allocation=True, questions_per_step=2)
    constructions.clear()
    assert "_cppo_pruning" not in args.to_dict() and "pruning" not in args.to_dict()


def test_a_setting_assigned_afterwards_builds_it_anew(tmp_path):
    args = make_config(CPPOConfig, tmp_path, pruning_rate=0.5)
    first = args.pruning
    args.pruning_rate = 0.75
    assert args.pruning is not first and args.pruning.pruning_rate == 0.75 and args.pruning is args.pruning
    args.selection_scope = "nowhere"
    with pytest.raises(ValueError, match="selection_scope"):
        args.pruning  # noqa: B018
    args.selection_scope = "group"
    assert args.pruning.scope == "group"
    args.allocation = 1  # validated anew, though 1 == True
    with pytest.raises(ValueError, match="allocation must be true or false"):
        args.pruning  # noqa: B018


def test_the_trainer_holds_the_configs_pruning(tiny_model, tmp_path):
    from trl_tiny import digit_reward, tiny_dataset

    args = make_config(CPPOConfig, tmp_path, pruning_rate=0.5)
    trainer = CPPOTrainer(model=tiny_model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset())
    assert trainer.pruning is args.pruning
    assert trainer.kept_per_process == args.pruning.kept_budget(trainer.dist_info) == 4
