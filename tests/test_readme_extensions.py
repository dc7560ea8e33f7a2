"""The README's "Where to change what" table, checked where a source scan can: the names an extension adds are
dispatched on (compared with ``==``, ``!=`` or ``in (...)``) only in the files the table names for it, so adding one
touches those files and no other."""

from __future__ import annotations

import pathlib
import re

import pytest

from cppo.engines import available_engines
from cppo.tasks import KINDS
from cppo_kernels.config import KL_ESTIMATORS, LOSS_AGG_UNITS, SURROGATES

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNEL = ("cppo_kernels/_policy.py", "cppo_kernels/config.py", "cppo_kernels/reference.py")

#: extension -> (its names, the files the README's table lets dispatch on them)
OWNERS = {
    "a KL estimator": (KL_ESTIMATORS, KERNEL),
    "a loss type": (SURROGATES, (*KERNEL, "cppo/trl/loss.py")),  # TRL's metrics of a TRL loss type
    "a loss aggregation": (tuple(LOSS_AGG_UNITS), (*KERNEL, "cppo/trl/loss.py")),  # dr_grpo's length: TRL's
    "a task kind": (tuple(KINDS), ("cppo/tasks/kinds.py", "cppo/tasks/registry.py")),
    "a rollout engine": (available_engines(), ("cppo/engines/base.py",)),  # `auto`'s choice among them
}


def _dispatches(name: str, text: str) -> bool:
    literal = rf"[\"']{re.escape(name)}[\"']"
    return bool(re.search(rf"(==|!=)\s*{literal}|{literal}\s*(==|!=)|\bin\s+[(\[{{][^)\]}}\n]*{literal}", text))


def _sources() -> dict[str, str]:
    files = sorted((ROOT / "cppo").rglob("*.py")) + sorted((ROOT / "cppo_kernels").rglob("*.py"))
    return {str(f.relative_to(ROOT)): f.read_text() for f in files}


@pytest.mark.parametrize("extension", list(OWNERS))
def test_only_the_owning_files_dispatch_on_an_extension_s_names(extension):
    names, owners = OWNERS[extension]
    found = sorted({(path, n) for path, text in _sources().items() for n in names if _dispatches(n, text)})
    strays = [(path, n) for path, n in found if path not in owners]
    assert not strays, f"{extension}: dispatched on outside {owners}: {strays}"


def test_the_scan_sees_a_dispatch():
    assert _dispatches("vespo", 'if cfg.surrogate == "vespo":')
    assert _dispatches("k3", "if est in ('k1', 'k3'):")
    assert not _dispatches("k3", 'kl_estimator: str = "k3"')  # a default is no dispatch
    assert _sources()["cppo_kernels/_policy.py"] and any(_dispatches("vespo", t) for t in _sources().values())
