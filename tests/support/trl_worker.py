"""The two-process worker of tests/trl/test_trl_distributed.py, run by ``accelerate launch --multi_gpu
--num_processes 2`` on CPU (gloo: ``use_cpu=True``). Each check is recorded in ``OUT/rank<r>.json``
(:class:`torchrun_harness.RankRecorder`). Usage: ``trl_worker.py OUT``."""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.distributed as dist
from accelerate import PartialState
from datasets import Dataset
from torchrun_harness import RankRecorder
from trl import GRPOConfig, GRPOTrainer
from trl_tiny import digit_reward, losses, make_config, save_tiny_model, tiny_dataset, weights

from cppo.trl import CPPOConfig, CPPOTrainer

#: One group of 4 per process: per_device_train_batch_size 4 and num_generations 4.
LAYOUT = dict(per_device_train_batch_size=4, num_generations=4, max_steps=2, beta=0.04, num_iterations=2)


def train(cls, config_cls, model: str, out: pathlib.Path, *, reward=digit_reward, dataset=None, **overrides):
    trainer = cls(
        model=model, reward_funcs=reward, args=make_config(config_cls, out, **{**LAYOUT, **overrides}),
        train_dataset=tiny_dataset(32) if dataset is None else dataset,
    )  # fmt: skip
    trainer.train()
    return trainer


def metric(trainer, name: str) -> list[float]:
    return [h[name] for h in trainer.state.log_history if name in h]


def same_on_every_rank(value: torch.Tensor) -> None:
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value.contiguous())
    for other in gathered[1:]:
        torch.testing.assert_close(other, gathered[0], atol=0, rtol=0)


def p0_equals_stock(model: str, out: pathlib.Path) -> None:
    stock = train(GRPOTrainer, GRPOConfig, model, out / "stock")
    cppo = train(CPPOTrainer, CPPOConfig, model, out / "cppo")
    torch.testing.assert_close(losses(cppo), losses(stock), atol=1e-6, rtol=1e-5)
    for name, value in weights(stock).items():
        torch.testing.assert_close(weights(cppo)[name], value, atol=1e-4, rtol=1e-4)


def prunes(model: str, out: pathlib.Path, scope: str, rate: float, kept: int) -> None:
    trainer = train(CPPOTrainer, CPPOConfig, model, out / scope, pruning_rate=rate, selection_scope=scope)
    assert metric(trainer, "cppo/kept_completions") == [kept], metric(trainer, "cppo/kept_completions")
    for value in weights(trainer).values():  # DDP kept the ranks' weights identical
        same_on_every_rank(value)


def straddling_groups_need_global(model: str, out: pathlib.Path) -> None:
    """Half a group per process: 'batch' is refused in one line; 'global' trains."""
    try:
        train(CPPOTrainer, CPPOConfig, model, out / "straddle", per_device_train_batch_size=2, pruning_rate=0.5)
    except ValueError as err:
        assert "must be whole groups" in str(err) and "use 'global'" in str(err), err
    else:
        raise AssertionError("selection_scope='batch' with half a group per process was not refused")
    trainer = train(
        CPPOTrainer, CPPOConfig, model, out / "straddle-global", per_device_train_batch_size=2, pruning_rate=0.5,
        selection_scope="global",
    )  # fmt: skip
    assert metric(trainer, "cppo/kept_completions") == [2]


def spread_on_prompt_zero(prompts, completions, **kwargs) -> list[float]:
    """The digit share for the prompt "0 ...", 0 for the other: that group's advantages are all 0."""
    return [r if p.startswith("0 ") else 0.0 for p, r in zip(prompts, digit_reward(completions), strict=True)]


def one_rank_keeps_nothing(model: str, out: pathlib.Path) -> None:
    """'global' over two prompts, one per process, one with every advantage 0: the kept completions all come from
    the other process; the empty one trains on a masked placeholder row (adds nothing) and the ranks stay in step."""
    dataset = Dataset.from_dict({"prompt": ["0 + 0 =", "1 + 7 ="]})
    original, placeholders = CPPOTrainer._kept_rows, []

    def kept_rows(self, advantages):
        kept, placeholder = original(self, advantages)
        placeholders.append(placeholder)
        return kept, placeholder

    CPPOTrainer._kept_rows = kept_rows
    try:
        trainer = train(
            CPPOTrainer, CPPOConfig, model, out / "placeholder", reward=spread_on_prompt_zero, dataset=dataset,
            pruning_rate=0.5, selection_scope="global",
        )  # fmt: skip
    finally:
        CPPOTrainer._kept_rows = original
    assert metric(trainer, "cppo/kept_completions") == [4]
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, placeholders)
    assert sorted(flags) == [[False], [True]], flags  # exactly one process kept nothing
    for value in weights(trainer).values():
        same_on_every_rank(value)


def main(out: pathlib.Path) -> None:
    state = PartialState(cpu=True)
    rank = state.process_index
    recorder = RankRecorder(out, rank)
    model = str(out / "model")
    if state.is_main_process:  # transformers saves from the main process only
        save_tiny_model(out / "model")
    state.wait_for_everyone()
    recorder.record("p0_equals_stock", lambda: p0_equals_stock(model, out / f"rank{rank}"))
    recorder.record("batch", lambda: prunes(model, out / f"rank{rank}", "batch", 0.5, 4))
    recorder.record("global", lambda: prunes(model, out / f"rank{rank}", "global", 0.75, 2))
    recorder.record("straddle", lambda: straddling_groups_need_global(model, out / f"rank{rank}"))
    recorder.record("placeholder", lambda: one_rank_keeps_nothing(model, out / f"rank{rank}"))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
