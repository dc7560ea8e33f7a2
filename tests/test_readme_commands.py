"""Every command line in README.md's bash blocks runs as written (issue 11, finding 8): a README edit cannot
silently break one.

The cheap lines (the tiny CPU model, one process or two) run for real, in README order within their block, in a
fresh folder. The long and GPU-sized ones are validated without training: ``benchmarks/speedup.py --dry-run`` and
``cppo train --dry-run`` (every setting, the schedule, local model and data paths, the output folder). Skipped, with
the reason: ``make test`` (this suite is what it runs) and lines reading ``../shared`` where it is absent. A line no
rule covers fails, so a new command gets a rule.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from cppo.cli import _parser
from cppo.config import TrainConfig, load_config

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
#: The README's placeholder for where the user keeps data (``dataset_path=PATH/gsm8k``).
PLACEHOLDER = "PATH/"


def readme_blocks() -> list[list[list[str]]]:
    """The command lines of each ```bash block of README.md, continuation lines joined, comments dropped."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    lines = [[shlex.split(line, comments=True) for line in b.replace("\\\n", " ").splitlines()] for b in blocks]
    return [[argv for argv in block if argv] for block in lines]


BLOCKS = readme_blocks()
ENV = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CPPO_KERNELS_BACKEND")}
ENV.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def cppo_args(argv: list[str]) -> list[str]:
    """The arguments of ``cppo``: after ``cppo`` itself, or after ``torchrun ... -m cppo``."""
    if argv[0] == "cppo":
        return argv[1:]
    start = next(i for i in range(len(argv) - 1) if argv[i : i + 2] == ["-m", "cppo"])
    return argv[start + 2 :]


def flag(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def train_config(args: list[str]) -> TrainConfig:
    parsed = _parser().parse_args(args)
    return load_config(parsed.config, [a for a in parsed.overrides if PLACEHOLDER not in a])


def cheap(argv: list[str]) -> bool:
    """Runs for real: the tiny model on the CPU, in one process or two on one node."""
    args = cppo_args(argv)
    if args[0] == "eval":
        return "tiny" in flag(args, "--model", "")
    config = train_config(args)
    one_node = argv[0] == "cppo" or (
        flag(argv, "--nnodes", "1") == "1" and int(flag(argv, "--nproc-per-node", "1")) <= 2
    )
    return config.model.startswith("tiny-") and not config.device.startswith("cuda") and one_node


def plan(argv: list[str], data: pathlib.Path) -> tuple[str, list[str], str]:
    """``(kind, command, reason)``: kind ``run`` (for real), ``check`` (a dry run of the same) or ``skip``."""
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # ``OMP_NUM_THREADS=1 python ...``: the command
        argv = argv[1:]
    if argv and argv[0].startswith(".venv/bin/"):  # the set-up's venv, as a fresh shell runs it (``make`` made it)
        assert (REPO / argv[0]).exists() or not (REPO / ".venv").exists(), f"{argv[0]} is not in the venv"
        argv = [argv[0].removeprefix(".venv/bin/"), *argv[1:]]
    line = shlex.join(argv)
    if argv == ["make", "test"]:
        return "skip", [], "make test runs ruff and this test suite: CI itself"
    if argv == ["make", "bench"]:
        assert "benchmarks/speedup.py" in (REPO / "Makefile").read_text().split("bench: setup", 1)[1].splitlines()[1]
        argv = ["python", "benchmarks/speedup.py"]  # what the Makefile runs
    if argv[:2] == ["pip", "download"]:
        return "skip", [], "fills the GPU kit's wheel folder from PyPI: needs the network"
    if argv == ["make", "gpu-check"]:
        target = (REPO / "Makefile").read_text().split("gpu-check:", 1)[1].splitlines()[1]
        assert "benchmarks/gpu_check.py" in target, target
        argv = ["python3", "benchmarks/gpu_check.py"]  # what the Makefile runs
    if "benchmarks/gpu_check.py" in argv:  # needs a GPU (the dry run is tests/test_gpu_check.py): its arguments parse
        start = argv.index("benchmarks/gpu_check.py") + 1
        stop = next((i for i in range(start, len(argv)) if argv[i] in ("2>&1", "|")), len(argv))
        code = (
            "import json, sys; sys.path.insert(0, 'benchmarks'); import gpu_check; gpu_check.parse_args(sys.argv[1:]);"
            " print(json.dumps({'dry_run': 'ok'}))"
        )
        return "check", [sys.executable, "-c", code, *argv[start:stop]], "needs a GPU"
    if "../shared" in line and not SHARED.is_dir():
        return "skip", [], f"{SHARED} is absent (a fresh clone has no ../shared)"
    if argv[:2] == ["python", "benchmarks/accuracy_seeds.py"]:  # each seed's speedup.py plan, checked
        rest = argv[2:]
        at = rest.index("--") if "--" in rest else len(rest)
        return "check", [sys.executable, str(REPO / argv[1]), *rest[:at], "--dry-run", *rest[at:]], "trains for 1.5 h"
    if argv[:2] == ["python", "benchmarks/speedup.py"]:
        return "check", [sys.executable, str(REPO / argv[1]), *argv[2:], "--dry-run"], "trains for minutes"
    if argv[0] in ("cppo", "torchrun"):
        args = [a.replace(PLACEHOLDER, f"{data}/") for a in cppo_args(argv)]
        if cheap(argv):
            if argv[0] == "cppo":
                return "run", [sys.executable, "-m", "cppo", *args], ""
            return "run", [sys.executable, "-m", "torch.distributed.run", *argv[1:]], ""
        if args[0] == "train":  # GPU-sized or several nodes: the config, data and output folder, not the training
            check = [a for a in args if a != "--resume"]  # the run to resume does not exist here
            # a fresh output folder: a run the README's line left in the checkout must not decide the test
            check += ["--set", f"output_dir={data}/readme-run", "--dry-run"]
            return "check", [sys.executable, "-m", "cppo", *check], "needs GPUs or several nodes"
    raise AssertionError(f"README command with no rule in {__file__}: {line}")


def commands(kind: str) -> list[tuple[int, list[str]]]:
    return [
        (b, argv) for b, block in enumerate(BLOCKS) for argv in block if plan(argv, pathlib.Path("data"))[0] == kind
    ]


def gsm8k_stand_in(folder: pathlib.Path) -> pathlib.Path:
    """What ``PATH`` stands for: a folder with ``gsm8k/train.jsonl`` (../shared's when present)."""
    (folder / "gsm8k").mkdir(parents=True)
    rows = SHARED / "data" / "gsm8k" / "train.jsonl"
    text = rows.read_text() if rows.is_file() else '{"question": "1 + 1?", "answer": "so #### 2"}\n'
    (folder / "gsm8k" / "train.jsonl").write_text(text)
    return folder


def run(command: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (shlex.join(command), done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done


def test_the_readme_has_the_commands_this_test_knows():
    """Every line has a rule (plan raises otherwise), and a train, a resume, an eval and a 2-process run are among
    the lines that run for real."""
    assert sum(len(block) for block in BLOCKS) >= 15
    real = [shlex.join(argv) for _, argv in commands("run")]
    for start in ("cppo train --config tiny-cpu", "cppo train --config tiny-cpu --resume", "cppo eval --model runs/"):
        assert any(line.startswith(".venv/bin/" + start) for line in real), (start, real)
    torchrun = ".venv/bin/torchrun --nproc-per-node 2 -m cppo train --config tiny-cpu"
    assert any(line.startswith(torchrun) for line in real), real


@pytest.mark.slow
@pytest.mark.parametrize("block", sorted({b for b, _ in commands("run")}))
def test_the_cheap_lines_of_a_block_run_as_written(block, tmp_path):
    """In a fresh folder, in README order (a resume and an eval use what the line before wrote)."""
    for argv in BLOCKS[block]:
        kind, command, _ = plan(argv, tmp_path)
        if kind == "run":
            run(command, tmp_path)


def command_id(item) -> str:
    return shlex.join(item[1])[:90]


@pytest.mark.parametrize("item", commands("check"), ids=command_id)
def test_the_long_lines_are_valid_plans(item, tmp_path):
    kind, command, _ = plan(item[1], gsm8k_stand_in(tmp_path))
    done = run(command, REPO)
    out = done.stdout.strip()
    plan_json = json.loads(out[out.index("{") :])
    assert plan_json["dry_run"] == "ok"
    if command[1:2] == [str(REPO / "benchmarks" / "speedup.py")] and "--out" not in command:
        # a user trying the line writes to a new folder of the run's own, never over the committed results
        assert pathlib.Path(plan_json["out"]).parent == REPO / "benchmarks" / "runs", plan_json["out"]
    argv = item[1]
    if argv[0] == "torchrun":  # the dry run is one process: the step's questions must split over the real world size
        world = int(flag(argv, "--nnodes", "1")) * int(flag(argv, "--nproc-per-node", "1"))
        assert plan_json["questions_per_step"] % world == 0, (shlex.join(argv), plan_json["questions_per_step"], world)


@pytest.mark.parametrize("item", commands("skip"), ids=command_id)
def test_the_skipped_lines_say_why(item):
    pytest.skip(plan(item[1], pathlib.Path("data"))[2])


def trl_snippet() -> str:
    """The Python block of README's "Using CPPO from TRL" section."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Using CPPO from TRL", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    return code


@pytest.mark.slow
def test_the_trl_snippet_runs_as_written(tmp_path):
    """The README's TRL snippet (about ten lines) trains as written, on the tiny model it builds (issue 18)."""
    pytest.importorskip("trl")
    code = trl_snippet()
    assert 6 <= len(code.strip().splitlines()) <= 14, code
    report = "\nimport json\nprint(json.dumps(trainer.state.log_history[0]))\n"  # what the snippet trained
    done = run([sys.executable, "-c", code + report], tmp_path)
    logged = json.loads(done.stdout.strip().splitlines()[-1])
    assert logged["cppo/kept_fraction"] == 0.25 and "loss" in logged, logged  # pruning_rate=0.75
