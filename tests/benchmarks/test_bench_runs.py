"""The benchmarks never dirty the checkout (issue 17): without ``--out``, ``bench_select.py``, ``bench_loss.py`` and
``speedup.py`` write to a new folder of the run's own under the ignored ``benchmarks/runs/`` and print it at the end;
the committed reference results in ``benchmarks/results/`` stay as they were; an explicit ``--out`` is replaced whole.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from benchkit.out import RUNS, new_run_folder, run_folder_name
from tiny_model import TINY_ONE_LAYER

REPO = pathlib.Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"
#: A run folder's name after the benchmark's: the UTC second it started, ``-N`` when another run took that one.
STAMP = r"\d{8}T\d{6}Z(-\d+)?"
#: A speedup.py run of a few seconds: a one-layer model, 2 questions, 4 completions of at most 4 tokens.
TINY_SPEEDUP = [
    "--model-config",
    TINY_ONE_LAYER,
    *("--group-size", "4", "--pruning-rates", "0", "0.5", "--questions", "2", "--set", "max_completion_length=4"),
    *("--backend", "torch", "--device", "cpu", "--no-progress", "--no-warmup"),
]


def results_state() -> tuple[str | None, dict[str, bytes]]:
    """``git status --porcelain benchmarks/results`` (None outside a git checkout) and the bytes of every file there."""
    status = ["git", "status", "--porcelain", "--", str(RESULTS)]
    done = subprocess.run(status, cwd=REPO, capture_output=True, text=True)
    files = {str(p.relative_to(RESULTS)): p.read_bytes() for p in sorted(RESULTS.rglob("*")) if p.is_file()}
    return (done.stdout if done.returncode == 0 else None), files


def assert_ignored(path: pathlib.Path) -> None:
    done = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=REPO, capture_output=True)
    if done.returncode == 128:  # not a git checkout: nothing to dirty
        return
    assert done.returncode == 0, f"{path} is not ignored by git"


def written(stdout: str) -> list[pathlib.Path]:
    """The files a benchmark's last line ``wrote A, B`` / ``wrote A and B`` names."""
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("wrote "), stdout[-2000:]
    return [pathlib.Path(p) for p in re.split(r", | and ", last.removeprefix("wrote "))]


@pytest.fixture
def own_folders():
    """Run folders a test made under benchmarks/runs/: removed afterwards (only those)."""
    folders: list[pathlib.Path] = []
    yield folders
    for folder in folders:
        assert folder.parent == RUNS, folder
        shutil.rmtree(folder, ignore_errors=True)


def run_script(script: str, *argv: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(BENCH / script), *argv], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_run_gets_a_new_folder_of_its_own(tmp_path):
    now = datetime.datetime(2025, 3, 4, 5, 6, 7, tzinfo=datetime.timezone.utc)
    assert RUNS == BENCH / "runs"
    assert run_folder_name("select", root=tmp_path, now=now) == tmp_path / "select-20250304T050607Z"
    plus_one = datetime.timezone(datetime.timedelta(hours=1))  # the same instant elsewhere: named in UTC
    assert run_folder_name("loss", root=tmp_path, now=now.astimezone(plus_one)).name == "loss-20250304T050607Z"
    assert not any(tmp_path.iterdir())  # naming creates nothing
    made = [new_run_folder("select", root=tmp_path / "runs", now=now) for _ in range(3)]
    assert [p.name for p in made] == [f"select-20250304T050607Z{n}" for n in ("", "-2", "-3")]
    assert all(p.is_dir() and not any(p.iterdir()) for p in made)


def test_runs_starting_together_never_share_a_folder(tmp_path):
    now = datetime.datetime(2025, 3, 4, 5, 6, 7, tzinfo=datetime.timezone.utc)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: new_run_folder("speedup", root=tmp_path, now=now), range(16)))
    assert len(set(made)) == 16 and sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in made)


def test_an_unwritable_runs_folder_is_one_error_naming_out(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"cannot create this run's folder under '.*file' \(.*\): name one with --out"):
        new_run_folder("select", root=tmp_path / "file")


@pytest.mark.slow
def test_bench_select_without_out_writes_to_its_own_ignored_folder(tmp_path, own_folders):
    before = results_state()
    done = run_script("bench_select.py", "--backend", "torch", "--repeats", "1", "--warmup", "0", cwd=tmp_path)
    (path,) = written(done.stdout)
    own_folders.append(path.parent)
    assert path.parent.parent == RUNS and re.fullmatch(f"select-{STAMP}", path.parent.name), path
    assert sorted(p.name for p in path.parent.iterdir()) == ["select.json"]  # no temporary file left
    assert_ignored(path)
    assert results_state() == before and not any(tmp_path.iterdir())
    meta = json.loads(path.read_text())["meta"]
    assert {"device", "torch", "triton", "date", "torch_threads", "note"} <= set(meta)  # what it recorded before
    assert {"device_name", "git_commit", "git_dirty", "argv", "python", "cpu_count"} <= set(meta)  # run_metadata's


@pytest.mark.slow
def test_bench_loss_without_out_writes_to_its_own_ignored_folder(tmp_path, own_folders):
    before = results_state()
    tiny = ("--tokens", "512", "--hidden", "16", "--vocab", "64", "--repeats", "1")
    json_path, png = written(run_script("bench_loss.py", *tiny, cwd=tmp_path).stdout)
    own_folders.append(json_path.parent)
    assert json_path.parent.parent == RUNS and re.fullmatch(f"loss-{STAMP}", json_path.parent.name), json_path
    assert (json_path.name, png) == ("loss.json", json_path.with_suffix(".png"))
    assert sorted(p.name for p in json_path.parent.iterdir()) == ["loss.json", "loss.png"]  # no temporary file left
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_ignored(json_path)
    assert results_state() == before and not any(tmp_path.iterdir())
    meta = json.loads(json_path.read_text())["meta"]
    assert {"torch", "threads", "machine", "gpu", "repeats", "warmup", "options"} <= set(meta)  # what it recorded
    assert {"device_name", "git_commit", "git_dirty", "argv", "date", "python", "triton"} <= set(meta)  # run_metadata


def test_speedup_without_out_writes_to_its_own_ignored_folder(speedup, own_folders, capsys):
    before = results_state()
    plan = speedup.main([*TINY_SPEEDUP, "--dry-run"])
    planned = pathlib.Path(plan["out"])
    assert planned.parent == RUNS and re.fullmatch(f"speedup-{STAMP}", planned.name), planned
    assert [pathlib.Path(f) for f in plan["files"]] == [planned / "speedup.json", planned / "speedup.png"]
    assert not planned.exists()  # a dry run writes nothing
    capsys.readouterr()
    result = speedup.main(TINY_SPEEDUP)
    files = written(capsys.readouterr().out)
    folder = files[0].parent
    own_folders.append(folder)
    assert folder.parent == RUNS and re.fullmatch(f"speedup-{STAMP}", folder.name), folder
    assert files == [folder / "speedup.json", folder / "speedup.png"]
    assert sorted(p.name for p in folder.iterdir()) == ["speedup.json", "speedup.png"]  # no temporary file left
    assert json.loads(files[0].read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    assert_ignored(files[0])
    assert results_state() == before


def test_speedup_replaces_an_explicit_out_whole(speedup, tmp_path, capsys):
    """``--out`` is the user's choice: the files there are replaced (atomically: no temporary file is left)."""
    for name in ("speedup.json", "speedup.png", "keep.txt"):
        (tmp_path / name).write_text("old")
    result = speedup.main([*TINY_SPEEDUP, "--out", str(tmp_path)])
    assert written(capsys.readouterr().out) == [tmp_path / "speedup.json", tmp_path / "speedup.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "speedup.json", "speedup.png"]
    assert json.loads((tmp_path / "speedup.json").read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "keep.txt").read_text() == "old"
