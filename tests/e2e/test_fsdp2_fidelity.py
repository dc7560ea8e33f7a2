"""FSDP2 with a bf16 compute dtype (2 processes, gloo on CPU): the shards and AdamW state stay fp32, the parameters
are gathered in bf16 and the gradients reduced in fp32, and a step at the paper's lr 1e-6 moves the fp32 masters."""

import json
import pathlib
import sys

import pytest
import torch
from tiny_model import TINY
from torchrun_harness import torchrun

CONFIG = {
    "model": "tiny-qwen2",
    "model_config": TINY,
    "device": "cpu",
    "dtype": "bfloat16",
    "parallelism": "fsdp2",
    "dataset": "arith",
    "max_questions": 16,
    "system_prompt": "Answer.",
    "max_prompt_length": 48,
    "max_completion_length": 8,
    "micro_batch_tokens": 96,
    "group_size": 4,
    "pruning_rate": 0.5,
    "questions_per_step": 2,
    "mu": 1,
    "lr": 1e-6,
    "lr_schedule": "constant",
    "warmup_ratio": 0.0,
    "num_steps": 1,
    "rewards": ["digits"],
    "rollout_backend": "hf",
    "kernel_backend": "torch",
}


def worker(out_dir: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from cppo import TrainConfig
    from cppo import distributed as D
    from cppo.trainer import Trainer

    torch.set_num_threads(1)
    info = D.init_distributed(device="cpu", timeout_s=300)
    trainer = Trainer(TrainConfig(**CONFIG, output_dir=out_dir), info=info)
    policy = trainer.policy._get_fsdp_state()._mp_policy
    before = [p.to_local().detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train_step()
    after = [p.to_local().detach() for p in trainer.model.parameters()]
    changed = sum(int((a != b).sum()) for a, b in zip(after, before))
    result = {
        "policy": policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "masters": sorted({str(p.to_local().dtype) for p in trainer.model.parameters()}),
        "adam": sorted({str(s["exp_avg"].to_local().dtype) for s in trainer.optimizer.state.values()}),
        "changed": changed / sum(a.numel() for a in after),
        "loss_finite": bool(torch.isfinite(torch.tensor(metrics["loss"]))),
    }
    (pathlib.Path(out_dir) / f"rank{info.rank}.json").write_text(json.dumps(result))
    D.barrier(info)  # no rank tears the group down while the other still talks to it
    D.close_distributed()


@pytest.mark.distributed
def test_fsdp2_bf16_keeps_fp32_shards_and_updates_them(tmp_path):
    proc = torchrun([__file__, str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["policy"] and result["loss_finite"], result
        assert result["masters"] == result["adam"] == ["torch.float32"], result
        assert result["changed"] > 0.9, result  # the update reached nearly every element of the fp32 shards


if __name__ == "__main__":
    worker(sys.argv[1])
