"""Ctrl-C and SIGTERM stop ``cppo train`` at a safe point with the step saved, one line saying so and how to resume,
exit code 130 / 143; a second Ctrl-C stops at once and leaves every checkpoint whole."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from tiny_run import CLI_SETTINGS

from cppo.run import checkpoint, metrics

REPO = pathlib.Path(__file__).resolve().parents[3]


def _start(out: pathlib.Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "cppo", "train", "--config", "tiny-cpu", *extra, "--set", *CLI_SETTINGS]
    cmd += [f"output_dir={out}", "num_steps=200", "save_every=0"]
    env = {**os.environ, "CPPO_KERNELS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)


def _wait_for_steps(out: pathlib.Path, proc: subprocess.Popen, steps: int) -> None:
    log, deadline = out / "metrics.jsonl", time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not log {steps} steps (exit {proc.poll()})")


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_at_a_safe_point_with_the_step_saved(tmp_path, sig, code):
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for_steps(out, proc, 1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    lines = [line for line in err.splitlines() if line.startswith("cppo train: ")]
    stopped = [line for line in lines if line.startswith(f"cppo train: stopped: stopped by {sig.name} after step")]
    assert len(stopped) == 1 and "Traceback" not in err, err
    saved = checkpoint.latest(str(out))
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert saved is not None and saved.endswith(f"checkpoint-{step:06d}") and f"checkpoint {saved} holds" in stopped[0]
    assert lines[-1].startswith("cppo train: to continue: cppo train --config tiny-cpu") and "--resume" in lines[-1]
    assert [r["step"] for r in metrics.read_jsonl(str(out / "metrics.jsonl"))] == list(range(1, step + 1))
    resumed = _start(out, "--resume")  # the hint's command continues the run from the saved step
    _wait_for_steps(out, resumed, step + 1)
    resumed.send_signal(signal.SIGINT)
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 130 and f"resumed from {saved}" in err, err


def test_a_second_ctrl_c_stops_at_once_and_leaves_checkpoints_whole(tmp_path):
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for_steps(out, proc, 1)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "to continue:" in err, err
    for path in checkpoint.checkpoints(str(out)):
        checkpoint.verify(path, required=checkpoint.TRAINER_KEYS)  # every checkpoint there reads whole
