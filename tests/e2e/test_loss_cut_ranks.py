"""A step's loss and gradients on two processes (gloo, DDP), each cutting its share into several micro-batches,
equal those of one process training the whole step in one micro-batch (issue 49, defect 2): for the loss types that
average over sequences (``loss.loss_type`` grpo, dr_grpo, luspo) and for the entropy mask and bonus, whose cut and
mean are the step's. One-process cuts of every loss type: tests/cppo/test_loss_cut.py.

The completions are fixed per prompt (:class:`LengthEngine`: their lengths differ from question to question, so a
rank's share of the tokens differs from its share of the sequences); every rank walks the same question order and
takes its contiguous share, so the ranks' questions in rank order are the one-process step's. Each process builds one
trainer and steps it once per case, recording the gradients and applying nothing.

This file is also the worker: the test runs it under ``torchrun --nproc-per-node 2`` (each rank writes
``rank<r>.json``: check name -> "ok" or the error).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import zlib

import pytest
import torch
from tiny_model import TINY
from torchrun_harness import RankRecorder, assert_ranks_ok, torchrun

WORLD = 2
CONFIG = {
    "model": "tiny-qwen2", "model_config": TINY, "device": "cpu", "dataset": "arith", "max_questions": 16,
    "system_prompt": "Answer.", "max_prompt_length": 48, "max_completion_length": 8, "group_size": 4,
    "questions_per_step": 4, "mu": 1, "beta": 0.04, "lr_schedule": "constant", "warmup_ratio": 0.0,
    "num_steps": 1, "rewards": ["digits"], "rollout_backend": "hf", "kernel_backend": "torch",
}  # fmt: skip
CASES = {
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "luspo": {"loss_type": "luspo"},
    "entropy": {"loss_type": "grpo", "top_entropy_quantile": 0.5, "entropy_coef": 0.5},
}
#: Micro-batch budgets: one question a micro-batch at most (2 processes), or the whole step in one (1 process).
CUT, WHOLE = 56, 1024


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def length_engine(trainer):
    from cppo.engines import Rollout, RolloutEngine, encode_prompts

    class LengthEngine(RolloutEngine):
        """Completion j of a prompt: ``a`` digits then ``b`` letters, both from the prompt's checksum and j."""

        def generate(self, prompts: list[str], num_per_prompt: int, *, greedy: bool = False) -> Rollout:
            encoded = encode_prompts(self.tokenizer, prompts, self.settings.max_prompt_length)
            texts = []
            for p in prompts:
                crc = zlib.crc32(p.encode())
                texts += ["7" * ((crc + j) % 3) + "x" * (1 + (crc // 7 + 2 * j) % 5) for j in range(num_per_prompt)]
            ids = [c[: self.settings.max_completion_length] for c in self.tokenizer(texts, add_special_tokens=False)[
                "input_ids"]]  # fmt: skip
            prompt_ids = [e for e in encoded for _ in range(num_per_prompt)]
            return Rollout(prompt_ids, ids, self.tokenizer.batch_decode(ids))

        def sync_weights(self) -> None:
            """Nothing to sync: the completions do not come from the model."""

    return LengthEngine(trainer.model, trainer.tokenizer, trainer.rollout.settings)


class GradientStep:
    """A trainer whose step records the gradients (synchronised over the ranks) and applies nothing."""

    def __init__(self, info, output_dir: str, micro_batch_tokens: int) -> None:
        from cppo import TrainConfig
        from cppo.trainer import Trainer

        config = TrainConfig(**CONFIG, output_dir=output_dir, micro_batch_tokens=micro_batch_tokens)
        self.trainer = Trainer(config, info=info)
        self.trainer.rollout = length_engine(self.trainer)
        self.trainer._optimizer_step = self._record
        self.base, self.sampler, self.grads = config, self.trainer.sampler.state_dict(), {}

    def _record(self) -> tuple[float, bool]:
        params = self.trainer.model.named_parameters()
        self.grads = {n: p.grad.clone() for n, p in params if p.grad is not None}
        self.trainer.optimizer.zero_grad(set_to_none=True)
        return 0.0, True

    def run(self, loss: dict) -> tuple[dict, dict[str, torch.Tensor]]:
        t = self.trainer
        t.config = dataclasses.replace(self.base, loss=loss)
        t.loss_config = t.config.loss_config
        t.sampler.load_state_dict(self.sampler)
        t.step = 0
        return t.train_step(), self.grads


def worker(out_dir: str) -> None:
    from cppo import distributed as D

    torch.set_num_threads(1)
    info = D.init_distributed(device="cpu", timeout_s=300)
    out = pathlib.Path(out_dir)
    record = RankRecorder(out, info.rank).record
    cut, results = GradientStep(info, str(out / "two"), CUT), {}

    def two_processes(name: str) -> None:
        metrics, grads = cut.run(CASES[name])
        assert metrics["micro_batches"] >= 2, metrics  # this rank cuts its share too
        results[name] = metrics, grads

    for name in CASES:
        record(f"{name}_two_processes", lambda name=name: two_processes(name))
    D.barrier(info)
    if info.rank == 0:  # one process, the whole step in one micro-batch
        whole = GradientStep(D.DistInfo(), str(out / "one"), WHOLE)

        def equal(name: str) -> None:
            metrics, grads = whole.run(CASES[name])
            got_metrics, got = results[name]
            assert metrics["micro_batches"] == 1 and metrics["completions"] == got_metrics["completions"] == 16
            assert max(float(g.abs().max()) for g in grads.values()) > 1e-4  # the step moves the policy
            assert got_metrics["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-7), name
            for key, want in grads.items():
                torch.testing.assert_close(got[key], want, rtol=1e-4, atol=1e-7, msg=f"{name}: {key}")

        for name in CASES:
            record(f"{name}_equals_one_process", lambda name=name: equal(name))
    D.barrier(info)
    D.close_distributed()


# --------------------------------------------------------------------------------------------
# pytest side
# --------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_two_processes_cut_the_step_and_equal_one_micro_batch(tmp_path):
    proc = torchrun([__file__, str(tmp_path)], timeout=300, world=WORLD)
    expected = [(f"{name}_two_processes", rank) for name in CASES for rank in range(WORLD)]
    expected += [(f"{name}_equals_one_process", 0) for name in CASES]
    assert_ranks_ok(tmp_path, expected, proc)


if __name__ == "__main__":
    worker(sys.argv[1])
