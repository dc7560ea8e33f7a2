"""Issue 39: ``cppo --help``, each command's ``--help`` and a mistyped flag answer without importing torch or
transformers (seconds of imports before a line of help); ``cppo train --help``'s settings, read from the source of
cppo/config/settings.py for that, are the :class:`TrainConfig`'s own."""

import pathlib
import subprocess
import sys

import pytest

from cppo import cli
from cppo.cli import _settings_from_source
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


def test_the_settings_read_from_the_source_are_the_config_s_own():
    defaults = TrainConfig().to_dict()
    assert _settings_from_source() == {name: (defaults[name], meaning) for name, meaning in setting_help().items()}
    assert list(_settings_from_source()) == list(setting_help())  # in declaration order


def _fails(error: BaseException):
    def read():
        raise error

    return read


@pytest.mark.parametrize("error", [NameError("name 'SOME_TUPLE' is not defined"), OSError("no settings.py")])
def test_the_epilog_falls_back_to_the_config_itself(monkeypatch, error):
    """A default the source alone cannot give (a name that is no literal constant), or no source to read: the help
    is still right, from TrainConfig."""
    want = cli.settings_epilog()
    monkeypatch.setattr(cli, "_settings_from_source", _fails(error))
    assert cli.settings_epilog() == want


def test_the_epilog_does_not_hide_a_bug(monkeypatch):
    """Only what a source that cannot give the defaults raises falls back; another error is not swallowed."""
    monkeypatch.setattr(cli, "_settings_from_source", _fails(ZeroDivisionError("a bug")))
    with pytest.raises(ZeroDivisionError):
        cli.settings_epilog()
