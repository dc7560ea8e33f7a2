"""Ctrl-C and SIGTERM stop ``cppo train`` at a safe point with the step saved, one line saying so and how to resume,
exit code 130 / 143; a second Ctrl-C stops at once and leaves every checkpoint whole; a Ctrl-C before the training
steps (the imports, the model loading) is said as what it is, with the command to run (issue 49). Every printed
command starts with the program as it was called (``.venv/bin/cppo``, ``PYTHON -m cppo``), never a bare ``cppo``."""

from __future__ import annotations

import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

import pytest
from tiny_run import CLI_SETTINGS, train_cli

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
    program = shlex.quote(os.path.relpath(sys.executable, REPO))  # python -m cppo, from the repository
    assert lines[-1].startswith(f"cppo train: to continue: {program} -m cppo train --config tiny-cpu"), lines[-1]
    assert lines[-1].endswith(" --resume")
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


def stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("cppo train: ")]


@pytest.fixture
def python_sigint():
    """SIGINT as a fresh ``cppo`` process has it: Python's own handler, the signal not blocked. The in-process tests
    share a pytest worker with others, and a library an earlier test ran may have left SIGINT ignored or blocked
    (then the raised signal below would do nothing and the run would train to its end)."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    signal.signal(signal.SIGINT, handler)


def test_a_ctrl_c_before_the_first_step_says_so_and_what_to_run(tmp_path, monkeypatch, capsys, python_sigint):
    """The first Ctrl-C arrives while the model loads, before the safe stop's handler is set: not "a second
    signal", no ``--resume`` hint that would fail, but the command to run again, as the user called cppo
    (``.venv/bin/cppo``); the new folder is left as it was."""
    import cppo.trainer

    real = cppo.trainer.Trainer.__init__

    def ctrl_c_while_loading(self, *args, **kwargs):
        real(self, *args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # Python's own handler: KeyboardInterrupt here

    monkeypatch.setattr(cppo.trainer.Trainer, "__init__", ctrl_c_while_loading)
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [str(REPO / ".venv" / "bin" / "cppo")])  # as a fresh shell runs it
    out = tmp_path / "run"
    assert train_cli(out) == 130
    lines = stderr_lines(capsys)
    assert lines[0] == "cppo train: stopped: interrupted (Ctrl-C) before the first training step: nothing was trained"
    assert lines[1].startswith("cppo train: to run it again: .venv/bin/cppo train --config tiny-cpu --set "), lines
    assert "--resume" not in lines[1] and len(lines) == 2
    assert not out.exists()  # no lock, no folder: the command runs again as printed


def test_a_ctrl_c_while_torch_imports_is_one_line_not_a_traceback(tmp_path):
    """A Ctrl-C during ``cppo train``'s imports (torch's takes seconds): one line and exit code 130."""
    code = (
        "import sys\n"
        "class CtrlC:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'cppo.run': raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, CtrlC())\n"
        "from cppo.cli import main\n"
        f"raise SystemExit(main(['train', '--config', 'tiny-cpu', '--set', 'output_dir={tmp_path / 'run'}']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr
    assert "cppo train: stopped: interrupted (Ctrl-C) before the first training step" in proc.stderr


@pytest.mark.parametrize("save_every", [1, 0])
def test_a_second_signal_says_what_to_run_whether_or_not_a_step_was_saved(
    tmp_path, monkeypatch, capsys, save_every, python_sigint
):
    """Two Ctrl-C in step 2: stopped at once after step 1; with step 1 saved, the command that continues it, else
    (nothing saved, the folder holding this run's log) the command that starts again over it."""
    import cppo.trainer

    real, calls = cppo.trainer.Trainer.train_step, []

    def two_ctrl_c_in_step_two(self):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(signal.SIGINT)  # the safe stop's handler: stop after this step
            signal.raise_signal(signal.SIGINT)  # the second: at once
        return real(self)

    monkeypatch.setattr(cppo.trainer.Trainer, "train_step", two_ctrl_c_in_step_two)
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")
    out = tmp_path / "run"
    assert train_cli(out, settings=("num_steps=4", f"save_every={save_every}")) == 130
    lines = stderr_lines(capsys)
    assert lines[-2].startswith("cppo train: stopped: stopped at once by a second signal after step 1"), lines
    if save_every:
        assert lines[-1].startswith("cppo train: to continue: ") and lines[-1].endswith(" --resume"), lines
        assert checkpoint.latest(str(out)).endswith("checkpoint-000001")
    else:
        assert lines[-1].startswith("cppo train: no checkpoint was written: to start again: "), lines
        assert lines[-1].endswith(" --overwrite") and checkpoint.latest(str(out)) is None
