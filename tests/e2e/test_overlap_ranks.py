"""Generation ahead of training under torchrun (issue 51): ``torchrun -m cppo train`` with ``max_staleness: 1`` on 2
CPU processes (gloo, DDP, the hf engine generating from a copy of the policy on every rank): the ranks run the same
steps, each after the first trains rollouts one update old, the run ends with the planned steps and a checkpoint, and
``--resume`` from its step-2 checkpoint (which holds the draws generated ahead) gives the uninterrupted run's weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_model import TINY
from torchrun_harness import torchrun

CONFIG = {
    "model": "tiny-qwen2", "model_config": TINY, "device": "cpu", "dataset": "arith", "max_questions": 64,
    "system_prompt": "Answer.", "max_prompt_length": 48, "max_completion_length": 8, "micro_batch_tokens": 96,
    "group_size": 4, "pruning_rate": 0.5, "questions_per_step": 2, "mu": 1, "lr": 1e-2, "lr_schedule": "constant",
    "warmup_ratio": 0.0, "num_steps": 4, "rewards": ["digits"], "rollout_backend": "hf", "kernel_backend": "torch",
    "max_staleness": 1, "save_every": 2,
}  # fmt: skip


@pytest.mark.distributed
def test_two_processes_generate_ahead_and_resume_exactly(tmp_path):
    import yaml
    from safetensors.torch import load_file

    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "run")}))
    train = ["-m", "cppo", "train", "--config", str(tmp_path / "cfg.yaml")]
    proc = torchrun(train, timeout=600, world=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["staleness"] for r in records] == [0, 1, 1, 1]
    assert all(r["completions"] == 16 for r in records)  # both ranks' rollouts, every step
    final = run / "checkpoint-000004" / "model" / "model.safetensors"
    want = load_file(final)
    (run / "checkpoint-000004").rename(tmp_path / "uninterrupted")
    proc = torchrun(train + ["--resume"], timeout=600, world=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint-000002" in proc.stderr
    got = load_file(final)
    for name in want:
        assert torch.equal(got[name], want[name]), name
