"""bench_loss.py, bench_select.py and bench_generate.py refuse bad arguments in one usage line naming the flag (exit
2), before anything is measured or written."""

import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"

CASES = [
    ("bench_loss.py", ["--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    ("bench_loss.py", ["--warmup", "-5"], "argument --warmup: must be an integer >= 0, got -5"),
    ("bench_loss.py", ["--vocab", "0"], "argument --vocab: must be an integer >= 1, got 0"),
    ("bench_loss.py", ["--tokens", "100"], "--tokens must be a multiple of 512"),
    ("bench_loss.py", ["--out", "{tmp}"], "is a folder: name the file to write"),
    ("bench_loss.py", ["--out", "{tmp}/file/x.json"], "its folder '{tmp}/file' is a file"),
    ("bench_select.py", ["--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    ("bench_select.py", ["--interpreter-repeats", "x"], "argument --interpreter-repeats: must be an integer"),
    ("bench_select.py", ["--threads", "-2"], "argument --threads: must be an integer >= 1, got -2"),
    ("bench_select.py", ["--backend", "cuda"], "--backend must be a comma-separated subset of torch,triton"),
    ("bench_select.py", ["--out", "{tmp}"], "is a folder: name the file to write"),
    ("bench_generate.py", ["--rounds", "0"], "argument --rounds: must be an integer >= 1, got 0"),
    ("bench_generate.py", ["--threads", "1", "x"], "argument --threads: must be an integer"),
    ("bench_generate.py", ["--engines", "sglang"], "argument --engines: hf, hf-noprefill or vllm, got 'sglang'"),
    ("bench_generate.py", ["--out", "{tmp}"], "is a folder: name the file to write"),
    ("bench_generate.py", ["--dataset-path", "{tmp}/nope"], "dataset_path '{tmp}/nope' does not exist"),
    ("bench_generate.py", ["--previous", "{tmp}/file"], "argument --previous: not a result file of this benchmark"),
]


@pytest.mark.parametrize("script,argv,match", CASES, ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_a_bad_argument_is_one_usage_line(script, argv, match, tmp_path):
    (tmp_path / "file").write_text("")
    argv = [a.format(tmp=tmp_path) for a in argv]
    done = subprocess.run([sys.executable, str(BENCH / script), *argv], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"{script}: error: "), done.stderr
    assert match.format(tmp=tmp_path) in done.stderr.splitlines()[-1], done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written
