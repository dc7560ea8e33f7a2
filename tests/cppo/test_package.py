"""The package ``cppo`` holds the torch-free settings alone; a name that moved to its own module says where."""

import subprocess
import sys

import pytest


def test_from_cppo_import_trainer_points_to_its_module_without_importing_torch():
    code = (
        "import sys\n"
        "try:\n    from cppo import Trainer\nexcept ImportError as e:\n    print(e)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.splitlines()
    assert out == [
        "cppo.Trainer is imported from its own module: from cppo.trainer import Trainer (the package cppo holds the "
        "torch-free settings alone)",
        "False",
    ]


def test_other_missing_names_are_plain_attribute_errors():
    import cppo

    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        cppo.nothing  # noqa: B018
