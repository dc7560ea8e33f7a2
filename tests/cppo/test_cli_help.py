"""Issue 39: ``cppo --help``, each command's ``--help`` and a mistyped flag answer without importing torch or
transformers (seconds of imports before a line of help); ``cppo train --help``'s settings are read from
:class:`TrainConfig` itself, which is plain data (issue 50: importing ``cppo.config`` imports no torch)."""

import pathlib
import subprocess
import sys

import pytest

from cppo import cli
from cppo.config import TrainConfig, setting_help

REPO = pathlib.Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")


def imported(argv: list[str]) -> tuple[int, set[str]]:
    """``python -X importtime -m cppo ARGV`` (the console script's ``main`` behind the package's import): its exit
    code and the top-level packages it imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cppo", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    return done.returncode, {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in lines}


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--help"], 0),
        (["train", "--help"], 0),
        (["eval", "--help"], 0),
        (["merge", "--help"], 0),
        (["train"], 2),  # --config missing
        (["evaluate", "--model", "m"], 2),  # no such command
        (["eval", "--model", "m", "--limit", "ten"], 2),
    ],
)
def test_help_and_bad_flags_import_no_torch(argv, code):
    returncode, modules = imported(argv)
    assert returncode == code
    assert "argparse" in modules  # the import log was read
    assert modules.isdisjoint(HEAVY), sorted(modules & set(HEAVY))


def test_the_settings_import_no_torch():
    code = "import sys, cppo.config, cppo.cli; assert not {'torch', 'transformers'} & set(sys.modules), sys.modules"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_epilog_is_the_config_s_own_settings_in_declaration_order():
    defaults = TrainConfig().to_dict()
    lines = cli.settings_epilog().splitlines()[1:]
    names = [line.split(" = ", 1)[0].strip() for line in lines[::2]]
    assert names == list(setting_help()) == list(defaults)  # every setting, in declaration order
    assert [line.strip() for line in lines[1::2]] == list(setting_help().values())
