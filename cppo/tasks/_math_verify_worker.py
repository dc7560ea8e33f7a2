"""The math-verify worker of :mod:`cppo.tasks.math_grading`, run as a script (``python _math_verify_worker.py IN_FD
OUT_FD``) so that it imports math-verify and the standard library only, never torch or the ``cppo`` package.

It warms math-verify up once, then serves batches through a forked child that grades one item at a time and
stays alive (its caches warm) from batch to batch; an item that overruns its deadline (or kills the child) gets
``None``, the child is killed, and a fresh fork of the warm worker (milliseconds) carries on with the next item.
math-verify's own timeouts (``signal.alarm``, whole seconds, main thread only) are switched off: the deadline here
is the only one. A grading child dies with the worker (``PR_SET_PDEATHSIG`` on Linux) and holds no descriptor but
its own two pipes, so a killed worker never leaves a child grading on or holding the caller's reply pipe; the
caller (:mod:`cppo.tasks.math_grading`) also runs the worker in a process group of its own, kills the group on a
deadline of its own, and restarts it. A fork that fails (a process limit) is answered ``{"error": ...}``, not a crash.

The grading functions reproduce the official CPPO code (lzhxmu/CPPO, ``src/open_r1``) call for call:
``reward`` is ``rewards_math.accuracy_reward`` for one completion, ``eval`` the MATH-500 / AIME check of
``GRPOTrainer.evaluate`` in ``grpo_trainer_math.py`` (note the swapped ``verify`` arguments of the two).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
import warnings

GOLD_CACHE = 4096  # parsed golds a grading child keeps


def _official_configs():
    """(gold extraction config, answer extraction config) of the official reward and evaluation."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    gold = [LatexExtractionConfig()]
    answer = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(
                nits=False, malformed_operators=False, basic_latex=True, equations=True, boxed="all", units=True
            ),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    return gold, answer


class Grader:
    """The official math-verify calls, without math-verify's own (signal-based) timeouts; golds parsed once each."""

    def __init__(self) -> None:
        from math_verify import parse, verify

        self.parse, self.verify = parse, verify
        self.gold_config, self.answer_config = _official_configs()
        self.golds: dict[str, list] = {}

    def _gold(self, solution: str) -> list:
        if solution not in self.golds:
            if len(self.golds) >= GOLD_CACHE:
                self.golds.clear()
            self.golds[solution] = self.parse(
                solution, extraction_mode="first_match", extraction_config=self.gold_config, parsing_timeout=None
            )
        return self.golds[solution]

    def _answer(self, completion: str) -> list:
        return self.parse(
            completion, extraction_config=self.answer_config, extraction_mode="first_match", parsing_timeout=None
        )

    def grade(self, mode: str, completion: str, solution: str) -> float:
        """``reward``: 2.0 when math-verify accepts the completion, 0.0 when not, 1.0 when the gold does not parse
        (the official "skip this example"). ``eval``: 1.0 when correct, else 0.0 (an unparseable gold is wrong)."""
        gold = self._gold(solution)
        if mode == "reward":
            if not gold:
                return 1.0
            try:
                return float(self.verify(self._answer(completion), gold, timeout_seconds=None)) * 2
            except Exception:
                return 0.0
        try:
            return float(bool(self.verify(gold, self._answer(completion), timeout_seconds=None)))
        except Exception:
            return 0.0


PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Asks Linux to SIGKILL this process when its parent dies (and exits at once if it already has)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def _close_other_fds(keep: set[int]) -> None:
    """Closes every inherited descriptor above stderr but ``keep`` (the worker's request and reply pipes above all:
    a child holding the reply pipe would keep the caller waiting after the worker died)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _child(grader: Grader, in_fd: int, out_fd: int, parent: int) -> None:
    """Grades the items read from ``in_fd`` (one JSON line each), writing one JSON verdict line per item to
    ``out_fd``, until the input closes; never returns."""
    try:
        _die_with_parent(parent)
        _close_other_fds({in_fd, out_fd})
        with os.fdopen(in_fd, "r", encoding="utf-8") as items, os.fdopen(out_fd, "w", buffering=1) as out:
            for line in items:
                try:
                    score = grader.grade(*json.loads(line))
                except BaseException:  # noqa: B036  a verdict for every item, whatever math-verify does
                    score = None
                out.write(json.dumps(score) + "\n")
    finally:
        os._exit(0)


class ForkFailed(OSError):
    """The system refused to fork a grading child (e.g. a pids limit)."""


class Children:
    """One forked child at a time that grades items while it keeps within the deadline (its caches stay warm across
    batches); a child that overruns an item, or dies on it, is killed and the next item goes to a fresh fork of the
    (warm) worker."""

    def __init__(self, grader: Grader) -> None:
        self.grader = grader
        self.pid: int | None = None
        self.to_child = self.from_child = -1
        self.buffer = bytearray()

    def _start(self) -> None:
        """Forks a grading child; ``ForkFailed`` (naming the cause) when the system refuses the fork."""
        item_read, item_write = os.pipe()
        verdict_read, verdict_write = os.pipe()
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError as e:
            for fd in (item_read, item_write, verdict_read, verdict_write):
                os.close(fd)
            raise ForkFailed(f"cannot fork a grading process ({e.strerror or e}): a process limit is reached") from None
        if pid == 0:
            os.close(item_write)
            os.close(verdict_read)
            _child(self.grader, item_read, verdict_write, parent)
        os.close(item_read)
        os.close(verdict_write)
        self.pid, self.to_child, self.from_child, self.buffer = pid, item_write, verdict_read, bytearray()

    def stop(self) -> None:
        """Kills the child (if any)."""
        if self.pid is None:
            return
        os.close(self.to_child)
        os.close(self.from_child)
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        self.pid = None

    def grade(self, item: list, timeout: float):
        """The verdict of one ``[mode, completion, solution]`` item, or None when it took longer than ``timeout``
        seconds or killed the child."""
        if self.pid is None:
            self._start()
        try:
            write_all(self.to_child, (json.dumps(item) + "\n").encode())
            line = read_line(self.from_child, self.buffer, time.monotonic() + timeout)
        except OSError:  # the child is gone (a broken pipe)
            line = None
        if line is None:
            self.stop()
            return None
        return json.loads(line)

    def batch(self, items: list, timeout: float) -> list:
        """Verdicts of ``items`` in order (see :meth:`grade`)."""
        return [self.grade(item, timeout) for item in items]


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_line(fd: int, buffer: bytearray, deadline: float) -> bytes | None:
    """The next line from ``fd`` before ``deadline`` (``time.monotonic``), or None (timeout or end of file)."""
    import select

    while b"\n" not in buffer:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        buffer.extend(chunk)
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line


def main(argv: list[str]) -> int:
    """Serves batches from the parent until it closes the pipe: each request is one JSON line
    ``{"items": [[mode, completion, solution], ...], "timeout": seconds}``, each reply one JSON list of verdicts.
    The first line written is ``"ready"``, once math-verify is imported and warm."""
    in_fd, out_fd = int(argv[1]), int(argv[2])
    logging.disable(logging.CRITICAL)  # math-verify logs every time-out and failed parse
    warnings.filterwarnings("ignore")
    grader = Grader()
    grader.grade("reward", "$\\boxed{\\frac{1}{2}}$", "$\\frac{1}{2}$")  # loads the LaTeX grammar
    grader.golds.clear()
    children = Children(grader)
    with os.fdopen(in_fd, "r", encoding="utf-8") as requests, os.fdopen(out_fd, "w", buffering=1) as replies:
        replies.write(json.dumps("ready") + "\n")
        for line in requests:
            request = json.loads(line)
            try:
                reply = children.batch(request["items"], float(request["timeout"]))
            except ForkFailed as e:
                reply = {"error": str(e)}
            replies.write(json.dumps(reply) + "\n")
    children.stop()
    return 0


if __name__ == "__main__":
    # run as a script: drop this file's folder from the path so that cppo's modules never shadow a library's
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(main(sys.argv))
