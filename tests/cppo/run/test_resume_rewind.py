"""A resumed run's folder holds only what the resumed run did (issue 49, defect 5): what the killed run wrote after the
checkpoint a resume continues from (evaluations, checkpoints that could not be read) is moved aside, named, into
``stale/after-step-N/`` and the log says so, as ``metrics.jsonl`` is rewound past its records; what a killed atomic
write left (a half-written evaluation or plot) is removed."""

from __future__ import annotations

import json
import logging

from tiny_run import train_cli

from cppo.distributed import DistInfo
from cppo.run import existing_run, metrics, open_run
from cppo.run.rewind import STALE_FOLDER

ALONE = DistInfo()


def killed_run(folder) -> None:
    """What a run killed after step 4 leaves when its last readable checkpoint is step 2's."""
    (folder / "eval").mkdir(parents=True)
    for step in (1, 2, 3, 4):
        (folder / "eval" / f"step-{step}.json").write_text(json.dumps({"step": step}))
        metrics.append_jsonl(str(folder / "metrics.jsonl"), {"step": step})
    (folder / "checkpoint-000002" / "model").mkdir(parents=True)
    (folder / "checkpoint-000004").mkdir()  # unreadable: the resume fell back to step 2
    (folder / "eval" / ".step-5.json.k2x9q1.tmp").write_text("{")  # a write killed mid-way
    (folder / ".metrics.png.a8b7c6.tmp").write_bytes(b"\x89PNG")
    (folder / "eval" / "notes.txt").write_text("the user's")


def test_a_resume_moves_aside_what_the_killed_run_wrote_after_its_checkpoint(tmp_path, caplog):
    killed_run(tmp_path)
    run = open_run(str(tmp_path), report_to=["jsonl"], info=ALONE, existing="resume")
    with caplog.at_level(logging.WARNING, logger="cppo"):
        run.start({}, step=2)
    run.close()
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["notes.txt", "step-1.json", "step-2.json"]
    stale = tmp_path / STALE_FOLDER / "after-step-2"
    assert sorted(p.name for p in (stale / "eval").iterdir()) == ["step-3.json", "step-4.json"]
    assert (stale / "checkpoint-000004").is_dir() and (tmp_path / "checkpoint-000002").is_dir()
    assert not (tmp_path / "checkpoint-000004").exists() and not (tmp_path / ".metrics.png.a8b7c6.tmp").exists()
    assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2]
    said = [r.getMessage() for r in caplog.records if "after-step-2" in r.getMessage()]
    assert len(said) == 1 and all(n in said[0] for n in ("eval/step-3.json", "eval/step-4.json", "checkpoint-000004"))
    assert STALE_FOLDER in existing_run(str(tmp_path))  # --overwrite clears it too


def test_a_second_resume_to_the_same_step_keeps_both_sets_apart(tmp_path):
    killed_run(tmp_path)
    for _ in range(2):
        (tmp_path / "eval" / "step-3.json").write_text("{}")
        run = open_run(str(tmp_path), report_to=["none"], info=ALONE, existing="resume")
        run.start({}, step=2)
        run.close()
    assert (tmp_path / STALE_FOLDER / "after-step-2" / "eval" / "step-4.json").is_file()
    assert (tmp_path / STALE_FOLDER / "after-step-2-2" / "eval" / "step-3.json").is_file()


def test_the_log_is_rewound_whatever_report_to_says_now(tmp_path):
    """A resume that no longer logs to metrics.jsonl (``report_to`` may change) still drops the killed run's records
    after its checkpoint: they are no part of the resumed run."""
    killed_run(tmp_path)
    run = open_run(str(tmp_path), report_to=["none"], info=ALONE, existing="resume")
    run.start({}, step=2)
    run.close()
    assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2]


def test_a_new_run_and_a_resume_with_nothing_after_move_nothing(tmp_path):
    killed_run(tmp_path)
    run = open_run(str(tmp_path), report_to=["none"], info=ALONE, existing="resume")
    run.start({}, step=4)
    run.close()
    assert not (tmp_path / STALE_FOLDER).exists() and (tmp_path / "eval" / "step-4.json").is_file()


def test_cppo_train_resumed_with_another_eval_every_holds_only_its_evaluations(tmp_path, monkeypatch, capsys):
    """The issue's run: evaluated every step, killed after step 3 (its last checkpoint step 2's), resumed evaluating
    every 4 steps: the folder's evaluations are steps 1, 2 and 4, step 3's aside."""
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")
    run = tmp_path / "run"
    common = ("eval_limit=2", "save_every=2")
    assert train_cli(run, settings=("num_steps=3", "eval_every=1", *common)) == 0
    (run / "checkpoint-000003").rename(tmp_path / "killed-before-saving")  # the kill came before step 3's save
    assert train_cli(run, "--resume", settings=("num_steps=4", "eval_every=4", *common)) == 0
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["step-1.json", "step-2.json", "step-4.json"]
    assert (run / STALE_FOLDER / "after-step-2" / "eval" / "step-3.json").is_file()
    assert [r["step"] for r in metrics.read_jsonl(str(run / "metrics.jsonl"))] == [1, 2, 3, 4]
    assert "moved aside" in capsys.readouterr().err
