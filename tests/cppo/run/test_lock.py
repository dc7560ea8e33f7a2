"""One run per output_dir: a second run or resume of a folder is refused naming the holder; a lock whose holder
was SIGKILLed is taken over; dry runs see it without writing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from tiny_run import train_cli

from cppo.run.lock import LOCK_NAME, RunLock, RunLocked, check_free

HOLD = """
import sys, time
from cppo.run.lock import RunLock
RunLock.of(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def _holder(folder) -> subprocess.Popen:
    """A process that takes the lock of ``folder`` and sleeps (it prints "locked" once it holds it)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_is_refused_naming_the_holder_and_a_killed_holder_is_taken_over(tmp_path, caplog):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunLocked, match=rf"in use by another run \(PID {proc.pid} on host \S+, started 20"):
            RunLock(str(tmp_path)).acquire()
        with pytest.raises(RunLocked, match=f"PID {proc.pid}"):
            check_free(str(tmp_path))  # a dry run sees it too
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with caplog.at_level("WARNING", logger="cppo.run.lock"):
        lock = RunLock(str(tmp_path)).acquire()  # the kernel dropped the dead holder's lock
    assert "took over the lock of a run that ended without releasing it" in caplog.text
    assert f"PID {os.getpid()}" not in caplog.text
    lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released on purpose: the next run warns of nothing
    check_free(str(tmp_path))


def test_the_lock_nests_within_a_process(tmp_path):
    lock = RunLock.of(str(tmp_path))
    with lock, RunLock.of(str(tmp_path)):
        assert lock.depth == 2
        check_free(str(tmp_path))  # this process holds it: free for its own dry-run checks
    assert lock.depth == 0 and lock.fd is None


def test_cppo_train_into_a_folder_in_use_is_one_line(tmp_path, capsys):
    """Two ``cppo train`` (or two ``--resume``) of one folder: the second is refused before it writes anything."""
    out = tmp_path / "run"
    out.mkdir()
    proc = _holder(out)
    try:
        for extra in ([], ["--resume"], ["--dry-run"]):
            assert train_cli(out, *extra) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert err[-1].startswith("cppo train: error: output_dir") and f"PID {proc.pid}" in err[-1], err
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("existed", [False, True])
def test_a_failed_resume_into_a_new_folder_leaves_no_lock(tmp_path, capsys, existed):
    """``cppo train --resume`` where no run is: one line, and the folder is as it was (issue 49): no
    ``.cppo-run.lock`` left behind, no folder made."""
    out = tmp_path / "new"
    if existed:
        out.mkdir()
    assert train_cli(out, "--resume") == 2
    assert "no checkpoint-* folder" in capsys.readouterr().err
    assert (sorted(p.name for p in out.iterdir()) == []) if existed else not out.exists()
    lock = RunLock.of(str(out)).acquire()  # free, and takeable again
    lock.release()


def test_a_lock_file_removed_under_a_waiting_opener_is_not_taken(tmp_path, monkeypatch):
    """A process that opened the lock file just before its holder removed it (an empty folder's lock goes with the
    run) must not lock the removed file: it takes the lock of the file now at the path."""
    first = RunLock(str(tmp_path)).acquire()
    stale = os.open(tmp_path / LOCK_NAME, os.O_RDWR)  # opened while the first holder still has it
    first.release(remove_file=True)
    assert not (tmp_path / LOCK_NAME).exists()
    real_open, opened = os.open, []

    def open_stale_first(path, flags, *args):
        if str(path).endswith(LOCK_NAME) and not opened:
            opened.append(path)
            return os.dup(stale)  # what the waiting process holds: the removed file
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_stale_first)
    second = RunLock(str(tmp_path)).acquire()
    monkeypatch.undo()
    os.close(stale)
    with pytest.raises(RunLocked):
        RunLock(str(tmp_path)).acquire()  # the file at the path is locked: a third run is refused
    second.release()
