"""The parts by name, and a child process's whole job: run one part and finish its JSON with its status."""

from __future__ import annotations

import pathlib
import traceback
from collections.abc import Callable

from gpukit import part_e2e, part_loss, part_select, part_tests
from gpukit.plan import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_PASS, Plan
from gpukit.runner import PartTimeout, Report

#: ``run(plan, out, report, until)`` of each part, in the order the kit runs them (``until``: epoch seconds).
PART_FUNCTIONS: dict[str, Callable[[Plan, pathlib.Path, Report, float], None]] = {
    "tests": part_tests.run,
    "loss": part_loss.run,
    "select": part_select.run,
    "e2e": part_e2e.run,
}


def run_part(part: str, plan: Plan, out: pathlib.Path, until: float) -> int:
    """One part, its JSON finished with its status (pass, fail, timeout, error); returns the process's exit status
    (0 pass, 1 fail or error, 3 timeout)."""
    report = Report(out / f"{part}.json", part, plan)
    try:
        PART_FUNCTIONS[part](plan, out, report, until)
    except PartTimeout as e:
        report.finish("timeout", str(e))
        return EXIT_INCOMPLETE
    except Exception:  # noqa: BLE001 - recorded in the part's JSON, the other parts go on
        report.finish("error", traceback.format_exc()[-4000:])
        print(traceback.format_exc(), flush=True)
        return EXIT_FAIL
    report.finish("fail" if report.failed else "pass")
    return EXIT_FAIL if report.failed else EXIT_PASS
