"""Resuming CPPOTrainer continues exactly as the uninterrupted run: from a checkpoint at a generation boundary (the
``random`` metric's draws are seeded from TRL's micro-step counter, which a resume used to restart at 0) and from one
inside a generation (``steps_per_generation=4`` micro-batches span two optimizer steps of
``gradient_accumulation_steps=2``: the buffered generation is saved with the checkpoint; stock TRL generates anew)."""

from __future__ import annotations

import shutil

import pytest
import torch
from trl_tiny import digit_reward, make_config, tiny_dataset, weights

from cppo.trl import CPPOConfig, CPPOTrainer
from cppo.trl.trainer import GENERATION_STATE

#: Two generations of 4 prompts x 4 completions, each trained as 4 micro-batches over 2 optimizer steps; a checkpoint
#: after every step (checkpoint-1 and -3 inside a generation, -2 at the boundary).
OPTIONS = dict(
    per_device_train_batch_size=4, steps_per_generation=4, gradient_accumulation_steps=2, max_steps=4,
    save_strategy="steps", save_steps=1, pruning_rate=0.5, beta=0.04,
)  # fmt: skip


def run(model: str, out, *, resume: str | None = None, **options) -> tuple[dict, list[list[int]]]:
    """The final weights and each generation's kept indices of a run (resumed from ``resume``)."""
    args = make_config(CPPOConfig, out, **{**OPTIONS, **options})
    trainer = CPPOTrainer(model=model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset())
    kept, original = [], trainer._kept_rows

    def kept_rows(advantages):
        rows, placeholder = original(advantages)
        kept.append(rows.tolist())
        return rows, placeholder

    trainer._kept_rows = kept_rows
    trainer.train(resume_from_checkpoint=resume)
    return weights(trainer), kept


@pytest.mark.parametrize("metric", ["random", "smallest"])
def test_a_resumed_run_continues_exactly(tiny_model, tmp_path, metric):
    full, full_kept = run(tiny_model, tmp_path / "full", pruning_metric=metric)
    assert len(full_kept) == 2
    for step, generations in ((2, 1), (1, 1), (3, 0)):  # generations the resumed run still draws
        resumed, kept = run(tiny_model, tmp_path / f"from-{step}", resume=str(tmp_path / "full" / f"checkpoint-{step}"),
                            pruning_metric=metric)  # fmt: skip
        assert kept == full_kept[len(full_kept) - generations :], (step, kept, full_kept)
        for name, value in full.items():
            torch.testing.assert_close(resumed[name], value, atol=0, rtol=0, msg=f"resumed from checkpoint-{step}")


def test_a_checkpoint_without_the_generation_state_resumes_as_trl_with_a_warning(tiny_model, tmp_path):
    run(tiny_model, tmp_path / "full", max_steps=2)
    checkpoint = tmp_path / "old-checkpoint"
    shutil.copytree(tmp_path / "full" / "checkpoint-1", checkpoint)
    (checkpoint / GENERATION_STATE.format(rank=0)).unlink()
    with pytest.warns(UserWarning, match=r"holds no generation state of 1 processes \(cppo_generation_0.pt\)"):
        _, kept = run(tiny_model, tmp_path / "resumed", resume=str(checkpoint), max_steps=2)
    assert len(kept) == 1  # a new generation for the second step, as stock TRL
