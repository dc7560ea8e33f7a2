"""``accelerate launch --num_processes 2`` on CPU (gloo): the drop-in under two processes (tests/support/trl_worker.py):
equal to stock TRL at P = 0, the 'batch' and 'global' scopes' counts, DDP keeping the ranks in step, half a group per
process, a process left with no kept completion, processes packing their rows into different numbers of forwards,
and TRL's entropy settings whose statistics span the processes."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
from torchrun_harness import assert_ranks_ok, run_with_deadline, torchrun_env

pytest.importorskip("trl")

WORKER = pathlib.Path(__file__).resolve().parents[1] / "support" / "trl_worker.py"
CHECKS = ("p0_equals_stock", "batch", "global", "straddle", "placeholder")


def launch(out: pathlib.Path, checks: tuple[str, ...], *, timeout: int):
    """``accelerate launch`` of the worker's ``checks`` on 2 CPU processes, killed with its workers past
    ``timeout`` seconds."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]
    env = torchrun_env(TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    return run_with_deadline([*launch, str(WORKER), str(out), *checks], timeout=timeout, env=env)


@pytest.mark.distributed
def test_two_processes_under_accelerate_launch(tmp_path):
    proc = launch(tmp_path, CHECKS, timeout=300)
    assert_ranks_ok(tmp_path, [(name, rank) for name in CHECKS for rank in (0, 1)], proc)


@pytest.mark.distributed
def test_trls_entropy_settings_under_two_processes_equal_stock_trl(tmp_path):
    """The entropy mask's cut over both processes' tokens and the adaptive entropy controller's window reduced over
    both: fused, and equal to stock TRL under the same launch."""
    checks = ("entropy_quantile", "adaptive_entropy")
    proc = launch(tmp_path, checks, timeout=300)
    assert_ranks_ok(tmp_path, [(name, rank) for name in checks for rank in (0, 1)], proc)


@pytest.mark.distributed
def test_ranks_packing_their_rows_into_different_pass_counts_stay_in_step(tmp_path):
    """Long prompts on one process, short on the other (prefix sharing on, the default): they once deadlocked; now
    the shorter side runs weight-0 filler forwards. A hang fails this test within the deadline."""
    proc = launch(tmp_path, ("uneven_packing",), timeout=180)
    assert_ranks_ok(tmp_path, [("uneven_packing", rank) for rank in (0, 1)], proc)
