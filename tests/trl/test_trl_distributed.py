"""``accelerate launch --num_processes 2`` on CPU (gloo): the drop-in under two processes (tests/support/trl_worker.py):
equal to stock TRL at P = 0, the 'batch' and 'global' scopes' counts, DDP keeping the ranks in step, half a group per
process, and a process left with no kept completion."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from torchrun_harness import REPO, assert_ranks_ok, torchrun_env

pytest.importorskip("trl")

WORKER = pathlib.Path(__file__).resolve().parents[1] / "support" / "trl_worker.py"
CHECKS = ("p0_equals_stock", "batch", "global", "straddle", "placeholder")


@pytest.mark.distributed
def test_two_processes_under_accelerate_launch(tmp_path):
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]
    env = torchrun_env(TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run(
        [*launch, str(WORKER), str(tmp_path)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert_ranks_ok(tmp_path, [(name, rank) for name in CHECKS for rank in (0, 1)], proc)
