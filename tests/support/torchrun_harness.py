"""The torchrun harness of the multi-process tests: launch a worker file under ``torch.distributed.run`` on CPU,
let each rank record named checks in ``OUT/rank<r>.json`` (check name -> "ok" or the traceback), and assert them.

The worker side is :class:`RankRecorder`; the pytest side is :func:`torchrun` and :func:`assert_ranks_ok`.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable

#: The repository: the workers import cppo from this checkout.
REPO = pathlib.Path(__file__).resolve().parents[2]
WORLD = 2


def torchrun_env(**extra: str) -> dict:
    """The environment of a worker: one thread, this checkout and tests/support first on ``PYTHONPATH`` (a worker
    file imports this harness), plus ``extra``."""
    paths = [str(REPO), str(pathlib.Path(__file__).resolve().parent)]
    path = os.pathsep.join(paths + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def run_with_deadline(cmd: list[str], *, timeout: int, env: dict) -> subprocess.CompletedProcess:
    """Runs ``cmd`` from the repository; past ``timeout`` seconds the launcher and every process under it are killed
    (torch's launcher starts each worker in a session of its own, so a process group would miss them) and an
    ``AssertionError`` says so, with the output's tail: a hang fails the test in bounded time, leaving no worker."""
    import psutil  # accelerate's dependency (the test extra installs it)

    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher = psutil.Process(proc.pid)
        for p in [*launcher.children(recursive=True), launcher]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        out, err = proc.communicate()  # the pipes close once every writer is gone
        raise AssertionError(f"{cmd[2]} did not finish within {timeout} s (a hang?): killed\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(args: list[str], *, timeout: int, world: int = WORLD, **env: str) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node WORLD ARGS`` from the repository, killed with
    its workers past ``timeout`` seconds (:func:`run_with_deadline`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *args]
    return run_with_deadline(cmd, timeout=timeout, env=torchrun_env(**env))


class RankRecorder:
    """Runs named checks on one rank and writes ``rank<r>.json`` after each (so a failure that leaves the ranks out
    of step still reports the checks done so far)."""

    def __init__(self, out_dir: str | os.PathLike, rank: int) -> None:
        self.path = pathlib.Path(out_dir) / f"rank{rank}.json"
        self.results: dict[str, str] = {}

    def record(self, name: str, fn: Callable[[], object]) -> None:
        try:
            fn()
            self.results[name] = "ok"
        except Exception:
            self.results[name] = traceback.format_exc()
        self.path.write_text(json.dumps(self.results))


def rank_failures(out_dir: pathlib.Path, expected: Iterable[tuple[str, int]], proc) -> list[str]:
    """Each expected (check, rank) that did not report "ok", and a non-zero torchrun exit."""
    found = {p.name: json.loads(p.read_text()) for p in pathlib.Path(out_dir).glob("rank*.json")}
    failures = []
    for name, rank in expected:
        result = found.get(f"rank{rank}.json", {}).get(name, f"not reported; torchrun exited {proc.returncode}")
        if result != "ok":
            failures.append(f"{name} on rank {rank}:\n{result}")
    if proc.returncode != 0:  # every check passed but a rank failed afterwards (e.g. tearing down the group)
        failures.append(f"torchrun exited {proc.returncode}")
    return failures


def assert_ranks_ok(out_dir: pathlib.Path, expected: Iterable[tuple[str, int]], proc) -> None:
    failures = rank_failures(out_dir, expected, proc)
    assert not failures, "\n\n".join(failures) + f"\n{proc.stderr[-3000:]}"
