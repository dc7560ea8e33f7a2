"""The process supervisor: each part in a child process of its own process group, under the smaller of its budget
and what the deadline leaves, ended whole (with whatever it started) when it returns or runs out of time; a part's
JSON report, which its process rewrites whenever it has a new result, so a kill leaves everything finished so far.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from cppo.fileio import run_metadata, write_json
from gpukit.plan import BENCH, BUDGET_S, ENTRY, MIN_PART_S, REPO, RESERVE_S, Plan
from gpukit.report import read_json, write_summary


class PartTimeout(Exception):
    """A part stopped before its end for want of time (its partial results stay)."""


def now() -> str:
    """The UTC time, to the second, as ISO 8601."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Report:
    """One part's ``<part>.json``: checks and results, rewritten (atomically) whenever something is added."""

    def __init__(self, path: pathlib.Path, part: str, plan: Plan) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "part": part,
            "status": "running",
            "checks": [],
            "results": {},
            "meta": {"plan": dataclasses.asdict(plan), "started": now()},
        }
        write_json(path, self.data, indent=1)

    def add(self, key: str, value: Any) -> None:
        """Records ``value`` as the result ``key``."""
        self.data["results"][key] = value
        write_json(self.path, self.data, indent=1)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Records a pass/fail check and prints it."""
        self.data["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        write_json(self.path, self.data, indent=1)
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def finish(self, status: str, error: str | None = None) -> None:
        """Sets the part's final status (``pass``, ``fail``, ``timeout`` or ``error``) and its error text."""
        self.data["status"] = status
        if error:
            self.data["error"] = error
        write_json(self.path, self.data, indent=1)

    @property
    def failed(self) -> bool:
        return any(not c["ok"] for c in self.data["checks"])


def child_env(extra_path: Sequence[str] = (), **variables: str) -> dict[str, str]:
    """This environment with the repository, benchmarks/ and ``extra_path`` first on PYTHONPATH, plus
    ``variables``."""
    paths = [str(REPO), str(BENCH), *extra_path]
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])), **variables}


def run_child(
    cmd: Sequence[str], *, timeout: float, log: pathlib.Path, env: dict[str, str] | None = None
) -> tuple[int | None, bool, float]:
    """Runs ``cmd`` in the repository with its output streamed to a new ``log`` (what a killed command printed
    stays there), in a process group of its own that is ended whole (the command and whatever it started) when it
    returns or after ``timeout`` seconds.

    Returns ``(exit status or None if timed out, timed_out, seconds)``.
    """
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            list(cmd), cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=os.setpgrp,
        )  # fmt: skip
        try:
            rc, timed_out = proc.wait(timeout=max(timeout, 0.1)), False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
        finally:
            _end_group(proc)
    return rc, timed_out, time.monotonic() - start


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group of ``proc``, SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def seconds_left(until: float, margin: float = 5.0) -> float:
    """Seconds to ``until`` (epoch seconds) less ``margin``; :class:`PartTimeout` when at most 1 s would be left."""
    left = until - time.time() - margin
    if left <= 1.0:
        raise PartTimeout("no time left in this part's budget")
    return left


def finish_part(
    out: pathlib.Path, part: str, *, rc: int | None, timed_out: bool, seconds: float, budget: float
) -> dict:
    """The part's JSON as its process left it, with the final status: ``error`` (crashed) before ``fail`` (a check
    failed) before ``timeout`` (killed at its budget, or stopped for want of time) before ``pass``."""
    path = out / f"{part}.json"
    data = read_json(path) or {"part": part, "status": "running", "checks": [], "results": {}}
    status = data.get("status", "running")
    if status == "running":  # the process ended before it could say how the part went
        status = "timeout" if timed_out else "error"
        if not timed_out:
            data.setdefault("error", f"the part's process ended with exit status {rc}; see {part}.log")
    if status != "error" and any(not c["ok"] for c in data.get("checks", [])):
        status = "fail"
    data.update(status=status, exit_status=rc, seconds=round(seconds, 1), budget_s=budget)
    write_json(path, data, indent=1)
    return data


def _skip_part(out: pathlib.Path, part: str, left: float) -> dict:
    """The JSON of a part the deadline leaves no time for."""
    data = {"part": part, "status": "skipped", "checks": [], "results": {}, "seconds": 0.0}
    data.update(budget_s=BUDGET_S[part], error=f"only {left:.0f} s left of --deadline")
    write_json(out / f"{part}.json", data, indent=1)
    print(f"[{part}] skipped: only {left:.0f} s left of the deadline", flush=True)
    return data


def run_parts(args: argparse.Namespace, plan: Plan, out: pathlib.Path, env: dict, kit: dict, start: float) -> dict:
    """Each part in its own process, under min(its budget, what the deadline leaves); the summary after each."""
    parts: dict[str, dict] = {}
    for part in args.parts:
        left = args.deadline - (time.monotonic() - start) - RESERVE_S
        budget = min(BUDGET_S[part], left)
        if budget < MIN_PART_S:
            parts[part] = _skip_part(out, part, left)
            continue
        print(f"[{part}] start (budget {budget:.0f} s)", flush=True)
        cmd = [sys.executable, str(ENTRY), "--part", part, "--out", str(out)]
        cmd += ["--until", f"{time.time() + budget:.1f}"] + (["--dry-run"] if plan.dry else [])
        rc, timed_out, seconds = run_child(cmd, timeout=budget, log=out / f"{part}.log", env=env)
        parts[part] = finish_part(out, part, rc=rc, timed_out=timed_out, seconds=seconds, budget=budget)
        passed = sum(c["ok"] for c in parts[part]["checks"])
        print(f"[{part}] {parts[part]['status']} in {seconds:.0f} s: {passed}/{len(parts[part]['checks'])} checks",
              flush=True)  # fmt: skip
        for c in parts[part]["checks"]:
            if not c["ok"]:
                print(f"  FAIL {c['name']}: {c['detail']}", flush=True)
        kit["elapsed_s"] = round(time.monotonic() - start, 1)
        write_summary(out, kit, parts)
    return parts


def kit_checks(wheels: dict, imports: dict) -> list[dict]:
    """The kit's own checks: every required module imports; the carried wheels (if any) install and import."""
    missing = {n: e for n, e in imports["required"].items() if e != "ok"}
    checks = [{"name": "every module the parts import imports", "ok": not missing, "detail": str(missing or "")}]
    if wheels["wheels"]:
        bad = {n: e for n, e in wheels["imports"].items() if e != "ok"}
        checks.append({"name": "the carried wheels install and import", "ok": bool(wheels["installed"]) and not bad,
                       "detail": wheels.get("error", "") or str(bad or wheels["installed"])})  # fmt: skip
    return checks


def orchestrate(args: argparse.Namespace, plan: Plan, out: pathlib.Path, site: pathlib.Path) -> int:
    """Wheels, imports, environment, the parts, the summary (printed last); returns the exit status."""
    from gpukit.wheels import check_imports, install_wheels

    start = time.monotonic()
    print(f"gpu_check: parts {', '.join(args.parts)}; deadline {args.deadline:g} s; results in {out}", flush=True)
    wheels = install_wheels(args.wheels, site)
    print(f"wheels: {', '.join(wheels['installed']) or 'none'} (from {args.wheels})", flush=True)
    imports = check_imports()
    ok = sum(e == "ok" for e in imports["required"].values())
    print(f"imports: {ok}/{len(imports['required'])} required ok; optional installed: "
          f"{[n for n, found in imports['optional'].items() if found]}", flush=True)  # fmt: skip
    import torch

    environment = run_metadata(device="cuda" if torch.cuda.is_available() else "cpu", commit=args.commit, cuda=True)
    kit = {
        "dry_run": plan.dry, "deadline_s": args.deadline, "parts": args.parts, "out": str(out),
        "budgets_s": {p: BUDGET_S[p] for p in args.parts}, "environment": environment,
        "wheels": wheels, "imports": imports, "checks": kit_checks(wheels, imports),
        "elapsed_s": round(time.monotonic() - start, 1),
    }  # fmt: skip
    write_summary(out, kit, {})
    env = child_env([str(site)] if wheels["installed"] else [], TRITON_INTERPRET="1" if plan.dry else "0")
    parts = run_parts(args, plan, out, env, kit, start)
    kit["elapsed_s"] = round(time.monotonic() - start, 1)
    status = write_summary(out, kit, parts)
    print("\n" + (out / "summary.md").read_text(encoding="utf-8"), flush=True)
    return status
