"""The two-process worker of tests/trl/test_trl_distributed.py, run by ``accelerate launch --multi_gpu
--num_processes 2`` on CPU (gloo: ``use_cpu=True``). Each check is recorded in ``OUT/rank<r>.json``
(:class:`torchrun_harness.RankRecorder`). Usage: ``trl_worker.py OUT CHECK...`` (names of :data:`CHECKS`)."""

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

import cppo.trl.loss as cppo_loss
import cppo.trl.packing
import cppo.trl.trainer
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


def trains_as_stock(model: str, out: pathlib.Path, **options) -> tuple[CPPOTrainer, GRPOTrainer]:
    """Stock GRPOTrainer and CPPOTrainer (P = 0, the fused loss) with ``options``: the same losses and weights."""
    stock = train(GRPOTrainer, GRPOConfig, model, out / "stock", **options)
    cppo = train(CPPOTrainer, CPPOConfig, model, out / "cppo", **options)
    assert cppo.fused_loss_refused is None, cppo.fused_loss_refused
    torch.testing.assert_close(losses(cppo), losses(stock), atol=1e-6, rtol=1e-5)
    for name, value in weights(stock).items():
        torch.testing.assert_close(weights(cppo)[name], value, atol=1e-4, rtol=1e-4)
    return cppo, stock


def p0_equals_stock(model: str, out: pathlib.Path) -> None:
    trains_as_stock(model, out)


def entropy_quantile_equals_stock(model: str, out: pathlib.Path) -> None:
    """``top_entropy_quantile`` on two processes, fused: the cut is the quantile of both processes' tokens, as TRL's
    ``get_high_entropy_mask`` takes it, so the run equals stock TRL; a cut over each process's own tokens (the
    gather switched off) trains differently, so the equality says the gather ran."""
    options = dict(top_entropy_quantile=0.5)
    _, stock = trains_as_stock(model, out / "quantile", **options)
    gathered = cppo_loss._gathered_cut
    cppo_loss._gathered_cut = lambda trainer: None
    try:
        own = train(CPPOTrainer, CPPOConfig, model, out / "quantile-own", **options)
    finally:
        cppo_loss._gathered_cut = gathered
    gap = max(abs(a - b) for a, b in zip(losses(own), losses(stock), strict=True))
    assert gap > 1e-4, (losses(own), losses(stock))


def adaptive_entropy_equals_stock(model: str, out: pathlib.Path) -> None:
    """``use_adaptive_entropy`` with the entropy mask on two processes, fused: the window's entropy is reduced over
    both processes, so the coefficient, its gate and the weights follow stock TRL's."""
    options = dict(
        use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=100.0, entropy_coef_delta=0.05,
        top_entropy_quantile=0.5, max_steps=3,
    )  # fmt: skip
    cppo, stock = trains_as_stock(model, out / "adaptive", **options)
    coefs = metric(cppo, "entropy_coef")
    assert coefs == metric(stock, "entropy_coef") and len(coefs) == 3 and coefs[0] < coefs[1] < coefs[2], coefs
    assert abs(cppo._last_world_entropy - stock._last_world_entropy) <= 1e-5 * abs(stock._last_world_entropy)
    same_on_every_rank(torch.tensor([cppo._last_world_entropy], dtype=torch.float64))


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


def uneven_packing(model: str, out: pathlib.Path) -> None:
    """Rank 0 holds long prompts, rank 1 short ones, so rank 0 packs its kept rows into more forwards (rows capped at
    64 tokens here: a 60-token prompt's group takes one forward per completion, the short groups fit in one). Rank 1
    runs weight-0 filler forwards up to rank 0's count in the old-policy and the policy passes, so the ranks stay in
    step (before, rank 0 waited in its second DDP forward and rank 1 in the metrics all-reduce: a hang), and the run
    trains as TRL's padded rows do (prefix_sharing=False)."""
    long = "9" * 60
    # shuffle_dataset=False: each generation's 4 prompts in order, the first two on rank 0, the last two on rank 1
    dataset = Dataset.from_dict({"prompt": [f"{long}{i} =" if i % 4 < 2 else f"{i} =" for i in range(16)]})
    counts, original, cap = [], cppo.trl.trainer.trainer_rows, cppo.trl.packing.MAX_ROW_TOKENS

    def trainer_rows(trainer, batch):
        rows = original(trainer, batch)
        counts.append(None if rows is None else (len(rows.batches), len(rows.fillers)))
        return rows

    settings = dict(dataset=dataset, per_device_train_batch_size=8, shuffle_dataset=False)
    cppo.trl.trainer.trainer_rows, cppo.trl.packing.MAX_ROW_TOKENS = trainer_rows, 64
    try:
        shared = train(CPPOTrainer, CPPOConfig, model, out / "uneven", **settings)
    finally:
        cppo.trl.trainer.trainer_rows, cppo.trl.packing.MAX_ROW_TOKENS = original, cap
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, counts)
    # one generation's rows (its old-policy pass) and the two policy passes, packed on both ranks
    assert [len(r) for r in ranks] == [3, 3] and None not in ranks[0] + ranks[1], ranks
    for (long_rows, no_fillers), (short_rows, fillers) in zip(*ranks):
        assert long_rows > short_rows and no_fillers == 0 and fillers == long_rows - short_rows, ranks
    for value in weights(shared).values():
        same_on_every_rank(value)
    padded = train(CPPOTrainer, CPPOConfig, model, out / "uneven-padded", prefix_sharing=False, **settings)
    for name, value in weights(padded).items():  # the fillers changed nothing (fp32 rounding of the two layouts)
        torch.testing.assert_close(weights(shared)[name], value, atol=1e-5, rtol=1e-4)


CHECKS = {
    "p0_equals_stock": p0_equals_stock,
    "batch": lambda model, out: prunes(model, out, "batch", 0.5, 4),
    "global": lambda model, out: prunes(model, out, "global", 0.75, 2),
    "straddle": straddling_groups_need_global,
    "placeholder": one_rank_keeps_nothing,
    "uneven_packing": uneven_packing,
    "entropy_quantile": entropy_quantile_equals_stock,
    "adaptive_entropy": adaptive_entropy_equals_stock,
}


def main(out: pathlib.Path, checks: list[str]) -> None:
    state = PartialState(cpu=True)
    rank = state.process_index
    recorder = RankRecorder(out, rank)
    model = str(out / "model")
    if state.is_main_process:  # transformers saves from the main process only
        save_tiny_model(out / "model")
    state.wait_for_everyone()
    for name in checks:
        recorder.record(name, lambda check=CHECKS[name]: check(model, out / f"rank{rank}"))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2:])
