"""The torchrun worker of tests/cppo/step/test_lora.py: LoRA under DDP and FSDP2 on gloo, 2 processes.

Each rank records in ``OUT/rank<r>.json``: the ranks hold equal adapters after 2 steps (DDP, FSDP2), no reference
copy exists, a 2-process run equals a 1-process run over the same global batch (selection ``global``; each question's
completions sampled with a seed of (step, prompt) alone), and a DDP resume from a LoRA checkpoint equals the
uninterrupted run. ``python -m torch.distributed.run --nproc-per-node 2 lora_worker.py OUT``.
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch
from per_question import PerQuestionRollout
from tiny_model import TINY
from torchrun_harness import RankRecorder

CONFIG = {
    "model": "tiny-qwen2",
    "model_config": TINY,
    "device": "cpu",
    "dataset": "arith",
    "max_questions": 64,
    "system_prompt": "Answer.",
    "max_prompt_length": 48,
    "max_completion_length": 8,
    "micro_batch_tokens": 400,
    "group_size": 4,
    "pruning_rate": 0.5,
    "selection_scope": "global",
    "questions_per_step": 2,  # 4 questions drawn with allocation: 2 per rank
    "mu": 2,
    "beta": 0.04,
    "lr": 1e-2,  # Adam moves each entry by ~lr a step: at 5e-2 a few near-zero-gradient entries of one question set
    # differed by 3e-5 between DDP and one process (sign of a rounding-level gradient); at 1e-2 by less than 1e-5
    "lr_schedule": "constant",
    "warmup_ratio": 0.0,
    "num_steps": 2,
    "rewards": ["digits", "tag_count"],
    "rollout_backend": "hf",
    "kernel_backend": "torch",
    "use_peft": True,
    "lora_r": 4,
    "lora_alpha": 8,
    "lora_dropout": 0.0,
}
CHECKS = ("ddp_ranks_agree", "fsdp2_ranks_agree", "ddp_resume_matches_uninterrupted")
#: rank 0 compares both 2-process runs with one process
REFERENCE_CHECKS = ("ddp_matches_one_process", "fsdp2_matches_one_process")


def make_trainer(info, output_dir: str, **overrides):
    from cppo import TrainConfig
    from cppo.trainer import Trainer

    trainer = Trainer(TrainConfig(**{**CONFIG, "output_dir": output_dir, **overrides}), info=info)
    trainer.rollout = PerQuestionRollout(trainer)
    return trainer


def adapters(model) -> dict[str, torch.Tensor]:
    """The LoRA parameters, whole (FSDP2's shards gathered)."""
    named = {n: p for n, p in model.named_parameters() if "lora_" in n}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in named.items()}


def compare(got: dict, want: dict, *, atol: float) -> None:
    assert got.keys() == want.keys() and got
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst <= atol, f"largest adapter difference {worst:.3g} > {atol}"


def main(out_dir: str) -> None:
    from cppo import distributed as D

    torch.set_num_threads(1)
    info = D.init_distributed(device="cpu", timeout_s=300)
    out = pathlib.Path(out_dir)
    record = RankRecorder(out, info.rank).record
    runs = {}

    def two_process(parallelism: str) -> None:
        trainer = make_trainer(info, str(out / parallelism), parallelism=parallelism)
        assert trainer.ref_model is None
        for _ in range(2):
            trainer.train_step()
        runs[parallelism] = adapters(trainer.model)
        flat = torch.cat([p.reshape(-1) for p in runs[parallelism].values()])
        gathered, _ = D.all_gather_varlen(flat, info=info)
        assert torch.equal(gathered[: flat.numel()], gathered[flat.numel() :]), "the ranks' adapters differ"

    def resume() -> None:
        path = str(out / "resume")
        first = make_trainer(info, path, parallelism="ddp")
        first.train_step()
        ckpt = first.save_checkpoint(os.path.join(path, "checkpoint-000001"))
        assert os.path.isfile(os.path.join(ckpt, "model", "adapter_model.safetensors"))
        second = make_trainer(info, path, parallelism="ddp")
        second.load_checkpoint(ckpt)
        second.train_step()
        compare(adapters(second.model), runs["ddp"], atol=1e-7)

    record("ddp_ranks_agree", lambda: two_process("ddp"))
    record("fsdp2_ranks_agree", lambda: two_process("fsdp2"))
    record("ddp_resume_matches_uninterrupted", resume)
    D.barrier(info)
    if info.rank == 0:  # no communication: the 1-process reference ("batch" pools the one process's step)
        single = make_trainer(D.DistInfo(), str(out / "single"), selection_scope="batch")
        for _ in range(2):
            single.train_step()
        want = adapters(single.model)
        for parallelism in ("ddp", "fsdp2"):
            record(f"{parallelism}_matches_one_process", lambda p=parallelism: compare(runs[p], want, atol=1e-5))
    D.barrier(info)
    D.close_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
