"""CPPOTrainer on an FSDP2-sharded policy, 2 CPU processes (gloo; tests/support/trl_fsdp_worker.py): the fused loss
reads the LM head where FSDP2 keeps it gathered after the forward and FSDP2 reduces its gradient. At pruning_rate=0
it trains as stock GRPOTrainer on the same sharding (losses, whole weights); at P = 0.5 it trains. Accelerate does not
shard CPU processes itself: the worker applies accelerate's own ``fsdp2_prepare_model`` to the trainers' models."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
from torchrun_harness import assert_ranks_ok, run_with_deadline, torchrun_env

pytest.importorskip("trl")

WORKER = pathlib.Path(__file__).resolve().parents[1] / "support" / "trl_fsdp_worker.py"
CHECKS = ("p0_equals_stock", "pruned_trains")


@pytest.mark.distributed
def test_fsdp2_sharded_policy_under_two_processes(tmp_path):
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]
    env = torchrun_env(TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = run_with_deadline([*launch, str(WORKER), str(tmp_path), *CHECKS], timeout=300, env=env)
    assert_ranks_ok(tmp_path, [(name, rank) for name in CHECKS for rank in (0, 1)], proc)
