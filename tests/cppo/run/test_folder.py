"""The output folder of a run, opened once (``open_run``) for ``cppo train`` and ``Trainer.train``: checked writable,
sinks built, locked, never mixed with the run already there, cleaned of a killed save's leftovers; the lock and the
look at the folder left for the start of training on the Python API; an old run deleted only on ``clear``."""

import subprocess
import sys

import pytest

from cppo.distributed import DistInfo
from cppo.run import JsonlSink, RunLock, RunLocked, existing_run, open_run, refuse_existing_run
from cppo.run.lock import LOCK_NAME

ALONE = DistInfo()


def old_run(folder):
    """What a run leaves (names only matter), a killed save's leftover and a file of the user's own."""
    (folder / "checkpoint-000002" / "model").mkdir(parents=True)
    (folder / ".tmp-checkpoint-000003").mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 2}\n')
    (folder / "notes.txt").write_text("mine")


def held(folder) -> bool:
    return RunLock.of(str(folder)).depth > 0


def test_a_new_run_is_refused_where_a_run_is_and_holds_nothing_after(tmp_path):
    old_run(tmp_path)
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoint-000002, metrics.jsonl\): pass --resume"):
        open_run(str(tmp_path), report_to=["jsonl"], info=ALONE)
    assert not held(tmp_path) and (tmp_path / ".tmp-checkpoint-000003").is_dir()  # nothing changed


def test_resume_keeps_the_run_and_cleans_a_killed_saves_leftovers(tmp_path, caplog):
    old_run(tmp_path)
    run = open_run(str(tmp_path), report_to=["jsonl"], info=ALONE, existing="resume")
    assert held(tmp_path) and [type(s) for s in run.sinks] == [JsonlSink]
    assert not (tmp_path / ".tmp-checkpoint-000003").exists() and "left by a save that was killed" in caplog.text
    assert existing_run(str(tmp_path)) == ["checkpoint-000002", "metrics.jsonl"]
    run.close()
    run.close()  # idempotent
    assert not held(tmp_path)


def test_overwrite_deletes_the_old_run_only_when_cleared(tmp_path):
    old_run(tmp_path)
    run = open_run(str(tmp_path), report_to=["none"], info=ALONE, existing="overwrite")
    assert existing_run(str(tmp_path)) == ["checkpoint-000002", "metrics.jsonl"] and run.sinks == []
    run.clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME, "notes.txt"]
    run.start({}, step=0)  # the folder was dealt with at open: no second look
    run.close()


def test_the_python_api_looks_at_the_folder_and_locks_it_when_training_starts(tmp_path):
    run = open_run(str(tmp_path / "new"), report_to=["jsonl"], info=ALONE, existing="later")
    assert (tmp_path / "new").is_dir() and not held(tmp_path / "new")  # writable, checked; not yet locked
    old_run(tmp_path / "new")
    with pytest.raises(ValueError, match="already holds a run"):
        run.start({}, step=0)
    run.finish()
    assert not held(tmp_path / "new")
    run.start({}, step=2)  # a resumed trainer (step 2) continues the run in the folder
    assert held(tmp_path / "new")
    run.log({"step": 3, "loss": 1.0}, 3)
    run.finish()
    assert not held(tmp_path / "new") and (tmp_path / "new" / "metrics.jsonl").read_text().count("\n") == 2


def test_a_folder_locked_by_another_process_is_refused_naming_it(tmp_path):
    lock = f"from cppo.run import RunLock; RunLock.of({str(tmp_path)!r}).acquire()"
    code = f"import time; {lock}; print(1, flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        with pytest.raises(RunLocked, match=rf"in use by another run \(PID {holder.pid} "):
            open_run(str(tmp_path), report_to=["jsonl"], info=ALONE, existing="resume")
    finally:
        holder.kill()
        holder.wait()


def test_bad_folders_and_modes_are_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"output_dir .*file' is a file, not a folder"):
        open_run(str(tmp_path / "file"), report_to=["jsonl"], info=ALONE)
    with pytest.raises(ValueError, match=r"existing must be one of \('refuse', 'resume', 'overwrite', 'later'\)"):
        open_run(str(tmp_path), report_to=["jsonl"], info=ALONE, existing="append")
    refuse_existing_run(str(tmp_path / "missing"))  # no folder: no run to mix with
