"""Every command line in the bash blocks of README.md and docs/*.md runs as written in a fresh shell (issue 11,
finding 8; issue 29): an edit of a page cannot silently break one.

The cheap lines (the tiny CPU model, one process or two) run for real, in the page's order within their block, in a
fresh folder. The long and GPU-sized ones are validated without training: ``benchmarks/speedup.py --dry-run``,
``cppo train --dry-run`` (every setting, the schedule, local model and data paths, the output folder), ``cppo
eval``'s argument checks, and ``--help`` for the scripts that have no dry run (it proves they start with the venv's
python). Skipped, with the reason: ``make test`` (this suite is what it runs) and lines reading ``../shared`` where it
is absent. A line no rule covers fails, so a new command gets a rule.

A fresh shell has no venv on its PATH: a block calls the programs the set-up's venv provides as ``.venv/bin/NAME``
(:data:`VENV_PROGRAMS`). ``python3`` is the GPU kit's alone, by design: the kit runs on a GPU machine's own python3
with the torch already there (``make gpu-check`` = ``python3 benchmarks/gpu_check.py``), so ``python3`` may only run
``benchmarks/gpu_check.py`` or fill its wheel folder (``python3 -m pip download ... -d .gpu-wheels``).
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
#: The pages whose bash blocks this test runs: the README and every page of docs/.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: The pages' placeholder for where the user keeps data (``dataset_path=PATH/gsm8k``).
PLACEHOLDER = "PATH/"
#: Programs the set-up's venv provides: a page calls them as ``.venv/bin/NAME`` (a fresh shell has no venv).
VENV_PROGRAMS = ("python", "cppo", "torchrun", "pip", "pytest", "ruff", "accelerate")
#: What ``python3`` (a GPU machine's own, by design) may run: the GPU kit and the download of its wheels.
PYTHON3_LINES = (("benchmarks/gpu_check.py",), ("-m", "pip", "download"))
#: Scripts without a dry run whose long lines are checked by starting them with ``--help``.
HELP_CHECKED = (
    "benchmarks/bench_loss.py",
    "benchmarks/bench_select.py",
    "benchmarks/bench_trl.py",
    "benchmarks/bench_generate.py",
    "examples/trl_cppo.py",
)
ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=.*", flags=re.S)


def _expand(token: str, variables: dict[str, str]) -> str:
    """``$NAME`` / ``${NAME}`` of a shell variable the block assigned earlier, replaced by its value."""
    return re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: variables.get(m.group(1), m.group(0)), token)


def page_blocks(page: pathlib.Path) -> list[list[list[str]]]:
    """The command lines of each ```bash block of ``page``, continuation lines joined, comments dropped, and the
    block's own variables (a line ``NAME=value`` alone) expanded in the lines after them."""
    text = page.read_text(encoding="utf-8")
    blocks = []
    for raw in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        variables: dict[str, str] = {}
        lines = []
        for line in raw.replace("\\\n", " ").splitlines():
            argv = [_expand(a, variables) for a in shlex.split(line, comments=True)]
            if len(argv) == 1 and ASSIGNMENT.fullmatch(argv[0]):
                name, value = argv[0].split("=", 1)
                variables[name] = value
            elif argv:
                lines.append(argv)
        blocks.append(lines)
    return blocks


#: ``(page, block number, its lines)`` of every page.
BLOCKS = [(page.relative_to(REPO).as_posix(), b, lines) for page in PAGES for b, lines in enumerate(page_blocks(page))]
LINES = [(page, b, argv) for page, b, lines in BLOCKS for argv in lines]
ENV = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CPPO_KERNELS_BACKEND")}
ENV.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


def programs(argv: list[str]) -> list[list[str]]:
    """The commands of a line (split at ``;``, ``&&`` and ``|``), each without its leading ``NAME=value``."""
    commands, current = [], []
    for token in argv:
        if token in ("&&", "|", "||"):
            commands.append(current)
            current = []
        elif token.endswith(";"):
            commands.append([*current, token[:-1]])
            current = []
        else:
            current.append(token)
    commands.append(current)
    out = []
    for command in commands:
        while command and ASSIGNMENT.fullmatch(command[0]):
            command = command[1:]
        if command:
            out.append(command)
    return out


def bare_program(argv: list[str]) -> str | None:
    """Why a line cannot run as written in a fresh shell, or None: a program of the venv called without
    ``.venv/bin/``, or ``python3`` running anything but the GPU kit."""
    for command in programs(argv):
        name = command[0]
        if name == "python3":
            if not any(tuple(command[1 : 1 + len(allowed)]) == allowed for allowed in PYTHON3_LINES):
                return f"python3 runs only the GPU kit ({PYTHON3_LINES}); use .venv/bin/python: {shlex.join(argv)}"
        elif name in VENV_PROGRAMS or re.fullmatch(r"python[\d.]*", name):
            return f"{name} is the venv's: call it as .venv/bin/{name}: {shlex.join(argv)}"
    return None


def cppo_args(argv: list[str]) -> list[str]:
    """The arguments of ``cppo``: after ``cppo`` itself, or after ``torchrun ... -m cppo`` / ``python -m cppo``."""
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
    one_node = argv[0] != "torchrun" or (
        flag(argv, "--nnodes", "1") == "1" and int(flag(argv, "--nproc-per-node", "1")) <= 2
    )
    return config.model.startswith("tiny-") and not config.device.startswith("cuda") and one_node


def eval_check(args: list[str]) -> list[str]:
    """``cppo eval``'s argument checks (model, data, flags) without loading the model: prints a dry-run plan."""
    code = (
        "import json, sys; from cppo.cli import _parser, _check_eval_args;"
        " _check_eval_args(_parser().parse_args(sys.argv[1:])); print(json.dumps({'dry_run': 'ok'}))"
    )
    return [sys.executable, "-c", code, *args]


def plan(argv: list[str], data: pathlib.Path) -> tuple[str, list[str], str]:
    """``(kind, command, reason)``: kind ``run`` (for real), ``check`` (a dry run of the same), ``help`` (the script
    starts: ``--help``) or ``skip``."""
    if argv[:3] == ["set", "-o", "pipefail;"]:  # the device tool's line: the command after it
        argv = argv[3:]
    while argv and ASSIGNMENT.fullmatch(argv[0]):  # ``OMP_NUM_THREADS=1 .venv/bin/python ...``: the command
        argv = argv[1:]
    if argv and argv[0].startswith(".venv/bin/"):  # the set-up's venv, as a fresh shell runs it (``make`` made it)
        assert (REPO / argv[0]).exists() or not (REPO / ".venv").exists(), f"{argv[0]} is not in the venv"
        argv = [argv[0].removeprefix(".venv/bin/"), *argv[1:]]
    line = shlex.join(argv)
    if argv == ["make", "test"] or argv[:3] == ["python", "-m", "pytest"] or argv[:2] == ["ruff", "check"]:
        return "skip", [], "make test runs ruff and this test suite: CI itself"
    if argv == ["make", "bench"]:
        assert "benchmarks/speedup.py" in (REPO / "Makefile").read_text().split("bench: setup", 1)[1].splitlines()[1]
        argv = ["python", "benchmarks/speedup.py"]  # what the Makefile runs
    if argv[:4] == ["python3", "-m", "pip", "download"]:
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
    if argv[0] == "python" and len(argv) > 1 and argv[1] in HELP_CHECKED:
        return "help", [sys.executable, str(REPO / argv[1]), "--help"], "measures for minutes (no dry run)"
    if argv[0] in ("cppo", "torchrun") or argv[:3] == ["python", "-m", "cppo"]:
        args = [a.replace(PLACEHOLDER, f"{data}/") for a in cppo_args(argv)]
        if cheap(argv):
            if argv[0] == "torchrun":
                return "run", [sys.executable, "-m", "torch.distributed.run", *argv[1:]], ""
            return "run", [sys.executable, "-m", "cppo", *args], ""
        if args[0] == "train":  # GPU-sized or several nodes: the config, data and output folder, not the training
            check = [a for a in args if a != "--resume"]  # the run to resume does not exist here
            # a fresh output folder: a run the page's line left in the checkout must not decide the test
            check += ["--set", f"output_dir={data}/readme-run", "--dry-run"]
            return "check", [sys.executable, "-m", "cppo", *check], "needs GPUs or several nodes"
        if args[0] == "eval" and flag(args, "--model", "").startswith("runs/"):
            return "skip", [], "evaluates what the (checked, not run) train line above it writes"
        if args[0] == "eval":  # a real model: its arguments, model and data are checked, nothing is generated
            return "check", eval_check(args), "evaluates a real model for minutes"
    raise AssertionError(f"command with no rule in {__file__}: {line}")


def commands(kind: str) -> list[tuple[str, int, list[str]]]:
    return [(page, b, argv) for page, b, argv in LINES if plan(argv, pathlib.Path("data"))[0] == kind]


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


def test_the_pages_have_the_commands_this_test_knows():
    """Every line has a rule (plan raises otherwise), and a train, a resume, an eval and a 2-process run are among
    the lines that run for real; the README itself shows the first train and eval."""
    assert len(LINES) >= 15
    real = [shlex.join(argv) for _, _, argv in commands("run")]
    for start in ("cppo train --config tiny-cpu", "cppo train --config tiny-cpu --resume", "cppo eval --model runs/"):
        assert any(line.startswith(".venv/bin/" + start) for line in real), (start, real)
    torchrun = ".venv/bin/torchrun --nproc-per-node 2 -m cppo train --config tiny-cpu"
    assert any(line.startswith(torchrun) for line in real), real
    readme = [shlex.join(argv) for page, _, argv in commands("run") if page == "README.md"]
    for start in (".venv/bin/cppo train --config tiny-cpu", ".venv/bin/cppo eval --model runs/"):
        assert any(line.startswith(start) for line in readme), (start, readme)


def line_id(item) -> str:
    page, b, argv = item
    return f"{page}:{b}:{shlex.join(argv)[:80]}"


@pytest.mark.parametrize("item", LINES, ids=line_id)
def test_no_line_calls_a_bare_python(item):
    """A fresh shell has no venv on its PATH: the venv's programs are called as .venv/bin/NAME (python3: the kit)."""
    assert bare_program(item[2]) is None, bare_program(item[2])


def test_the_bare_python_rule_refuses_what_fails_in_a_fresh_shell():
    refused = [
        "python benchmarks/bench_loss.py", "python examples/trl_cppo.py --tiny", "cppo train --config tiny-cpu",
        "OMP_NUM_THREADS=1 python -m cppo eval --model x", "python3 benchmarks/speedup.py", "pip install -e .",
        "set -o pipefail; X=1 python benchmarks/gpu_check.py 2>&1 | tee log", "torchrun -m cppo train",
    ]  # fmt: skip
    allowed = [
        ".venv/bin/python benchmarks/bench_loss.py", "python3 benchmarks/gpu_check.py --dry-run", "make test",
        "set -o pipefail; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out x 2>&1 | tee log",
        "python3 -m pip download --no-deps -d .gpu-wheels liger-kernel==0.8.5", "OMP_NUM_THREADS=1 .venv/bin/cppo eval",
    ]  # fmt: skip
    assert all(bare_program(shlex.split(line)) for line in refused)
    assert not any(bare_program(shlex.split(line)) for line in allowed)


def block_id(block) -> str:
    return f"{block[0]}:{block[1]}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "block", sorted({(page, b) for page, b, _ in commands("run")}), ids=block_id
)  # fmt: skip
def test_the_cheap_lines_of_a_block_run_as_written(block, tmp_path):
    """In a fresh folder, in the page's order (a resume and an eval use what the line before wrote)."""
    (lines,) = [lines for page, b, lines in BLOCKS if (page, b) == block]
    for argv in lines:
        kind, command, _ = plan(argv, tmp_path)
        if kind == "run":
            run(command, tmp_path)


@pytest.mark.parametrize("item", commands("check"), ids=line_id)
def test_the_long_lines_are_valid_plans(item, tmp_path):
    kind, command, _ = plan(item[2], gsm8k_stand_in(tmp_path))
    done = run(command, REPO)
    out = done.stdout.strip()
    plan_json = json.loads(out[out.index("{") :])
    assert plan_json["dry_run"] == "ok"
    if command[1:2] == [str(REPO / "benchmarks" / "speedup.py")] and "--out" not in command:
        # a user trying the line writes to a new folder of the run's own, never over the committed results
        assert pathlib.Path(plan_json["out"]).parent == REPO / "benchmarks" / "runs", plan_json["out"]
    argv = item[2]
    if argv[0] == ".venv/bin/torchrun":  # the dry run is one process: the step's questions must split over the ranks
        world = int(flag(argv, "--nnodes", "1")) * int(flag(argv, "--nproc-per-node", "1"))
        assert plan_json["questions_per_step"] % world == 0, (shlex.join(argv), plan_json["questions_per_step"], world)


@pytest.mark.parametrize("item", commands("help"), ids=line_id)
def test_the_scripts_without_a_dry_run_start_with_the_venv(item):
    """``--help`` imports everything the script imports at its top: a missing module or a bare python shows here."""
    kind, command, _ = plan(item[2], pathlib.Path("data"))
    assert run(command, REPO).stdout.startswith("usage:")


@pytest.mark.parametrize("item", commands("skip"), ids=line_id)
def test_the_skipped_lines_say_why(item):
    pytest.skip(plan(item[2], pathlib.Path("data"))[2])


def trl_snippet() -> str:
    """The Python block of README's "Using CPPO from TRL" section."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Using CPPO from TRL", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    return code


def section_code(title: str) -> str:
    """The Python block of the README's section ``title``."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    return code


def test_the_kernels_snippet_runs_as_written(tmp_path):
    """The README's Kernels snippet selects, computes the fused loss and its backward on the toy tensors it builds."""
    done = run([sys.executable, "-c", section_code("Kernels")], tmp_path)
    assert re.fullmatch(r"loss -?\d+\.\d{4}: 8 of 32 completions kept, kl \S+\n", done.stdout), done.stdout


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


def inline_spans(page: pathlib.Path) -> list[str]:
    """The inline code spans of ``page`` outside its fenced blocks."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_inline_command_calls_a_bare_python(page):
    """A command quoted in the prose (a heading's ``python benchmarks/bench_loss.py``) is copied as it stands too."""
    bare = [span for span in inline_spans(page) if re.match(r"python[\d.]* ", span) and bare_program(span.split())]
    assert not bare, bare


#: Paths the pages name that a run creates (results of the GPU kit, a benchmark's own output folder).
CREATED = ("benchmarks/runs/", "benchmarks/results/gpu/")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_a_page_names_exists(page):
    """A file or folder of the repository named in the prose (``cppo/...``, ``tests/...``) exists: a moved module
    cannot leave a page pointing at its old place."""
    roots = ("cppo/", "cppo_kernels/", "tests/", "benchmarks/", "docs/", "examples/")
    # a file (with its suffix) or a folder (ending in /); NAME ... are placeholders, cppo/kept_fraction a metric
    paths = [s for s in inline_spans(page) if re.fullmatch(r"[\w./*-]+(\.\w+|/)", s) and not re.search(r"[A-Z]{2}", s)]
    named = {s for s in paths if s.startswith(roots)}
    missing = [s for s in sorted(named) if not s.startswith(CREATED) and not list(REPO.glob(s.rstrip("/")))]
    assert not missing, missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    """``[text](path)`` and ``![image](path)`` point at files that exist (from the page's own folder)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8"))
    local = [t.split("#", 1)[0] for t in targets if not re.match(r"[a-z]+://|#|mailto:", t)]
    missing = [t for t in local if t and not (page.parent / t).exists()]
    assert not missing, missing
