"""Part ``tests``: the suite's CUDA tests, those marked ``cuda`` (``pytest -m cuda``:
tests/kernels/test_cuda_kernels.py, the CUDA tests of tests/kernels/test_loss_triton.py and
tests/kernels/test_loss_grad_in_forward.py, tests/cppo/step/test_cuda_models.py) with ``TRITON_INTERPRET=0``; in the
dry run, that the marker selects them (collection only)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import sys
import xml.etree.ElementTree as ElementTree
from typing import Any

from gpukit.plan import TESTS, Plan
from gpukit.runner import PartTimeout, Report, child_env, run_child, seconds_left


def tests_command(plan: Plan, out: pathlib.Path) -> list[str]:
    """pytest over tests/ keeping the ``cuda``-marked tests: a real run on the GPU, collection only in the dry run."""
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-rfEs", str(TESTS)]
    if plan.dry:
        return cmd + ["--collect-only", "-q"]
    cmd += ["-v", f"--junitxml={out / 'tests-junit.xml'}"]
    if plan.pytest_workers and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(plan.pytest_workers)]
    return cmd


def junit_results(path: pathlib.Path) -> dict | None:
    """Outcomes from pytest's JUnit XML: passed count, failed / errors / skipped with their messages."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    out: dict[str, Any] = {"source": "junit", "passed": 0, "failed": [], "errors": [], "skipped": []}
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        for tag, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                out[key].append({"test": test, "message": (node.get("message") or node.text or "")[:500]})
                break
        else:
            out["passed"] += 1
    return out


_OUTCOME = r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
_LOG_LINE = re.compile(rf"(tests/\S+::\S+)\s+{_OUTCOME}|{_OUTCOME}\s+(tests/\S+::\S+)")


def log_results(text: str) -> dict:
    """Outcomes read off pytest's ``-v`` lines (with or without xdist): what is left when pytest was stopped."""
    seen: dict[str, str] = {}
    for m in _LOG_LINE.finditer(text):
        test, outcome = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        seen[test] = outcome
    by = {o: [{"test": t, "message": ""} for t, x in seen.items() if x == o] for o in ("FAILED", "ERROR", "SKIPPED")}
    passed = sum(o in ("PASSED", "XFAIL") for o in seen.values())
    return {"source": "log", "passed": passed, "failed": by["FAILED"], "errors": by["ERROR"], "skipped": by["SKIPPED"]}


def with_failure_messages(results: dict, path: pathlib.Path) -> dict:
    """``results`` with each failure's message filled in from the JSON lines tests/conftest.py writes to ``path`` as
    failures happen (what a stopped run's log lacks: pytest prints tracebacks only at its end)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return results
    messages: dict[str, str] = {}
    for line in lines:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        messages.setdefault(item.get("test", ""), str(item.get("message", ""))[:500])
    for key in ("failed", "errors"):
        for row in results[key]:
            row["message"] = row["message"] or messages.get(row["test"], "")
        seen = {row["test"] for row in results["failed"] + results["errors"]}
        if key == "failed":  # a failure the log has not shown yet (xdist prints outcomes in batches)
            results[key] += [{"test": t, "message": m} for t, m in messages.items() if t not in seen]
    return results


def run(plan: Plan, out: pathlib.Path, report: Report, until: float) -> None:
    """The suite's CUDA tests on the GPU; in the dry run, that pytest selects them (collection only)."""
    log = out / "tests.pytest.log"
    failures = out / "tests-failures.jsonl"
    failures.unlink(missing_ok=True)
    env = child_env(TRITON_INTERPRET="1" if plan.dry else "0", CPPO_TEST_FAILURE_LOG=str(failures))
    cmd = tests_command(plan, out)
    report.add("command", cmd[1:])
    rc, timed_out, seconds = run_child(cmd, timeout=seconds_left(until), log=log, env=env)
    text = log.read_text(encoding="utf-8", errors="replace")
    report.add("seconds", round(seconds, 1))
    if plan.dry:
        ids = re.findall(r"^(tests/\S+::\S+)$", text, re.M)
        report.add("selected", ids)
        detail = f"{len(ids)} tests selected, pytest exit status {rc}"
        report.check("pytest -m cuda selects the suite's CUDA tests", rc == 0 and bool(ids), detail)
        return
    results = junit_results(out / "tests-junit.xml") if not timed_out else None
    results = results or with_failure_messages(log_results(text), failures)
    report.add("outcomes", results)
    if timed_out:
        raise PartTimeout(f"pytest stopped after {seconds:.0f} s; outcomes so far read from its log")
    bad = len(results["failed"]) + len(results["errors"])
    detail = (
        f"{results['passed']} passed, {len(results['failed'])} failed, {len(results['errors'])} errors, "
        f"{len(results['skipped'])} skipped; pytest exit status {rc}"
    )
    report.check("the suite's CUDA tests pass", rc == 0 and bad == 0 and results["passed"] > 0, detail)
