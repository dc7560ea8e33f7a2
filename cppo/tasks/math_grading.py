"""MATH scoring with math-verify, in a worker process with a hard deadline per completion.

math-verify can take seconds (or forever) on adversarial LaTeX such as ``\\boxed{9^{9^{9^{9}}}}``, and its own
timeouts are whole seconds of ``signal.alarm`` that only work on the main thread. So every MATH completion is
graded by a child of a warm worker process (``cppo/_math_verify_worker.py``) that is killed when it overruns
``timeout`` seconds; that completion then scores 0, as the official code scores a math-verify time-out. Verdicts
are memoised (a bounded cache keyed by a digest of the text), so the accuracy metric reuses the reward's verdict
and math-verify runs once per completion.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

from ._math_verify_worker import read_line, write_all

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_verify_worker.py")
#: ``mode`` of a verdict: the official training reward (2.0 / 0.0, 1.0 for an unparseable gold) or the official
#: evaluation check (1.0 / 0.0).
MODES = ("reward", "eval")
DEFAULT_TIMEOUT = 0.5
CACHE_SIZE = 65536
START_TIMEOUT = 120.0
#: ``reward_timeout`` is at most an hour per completion (the official code waits 5 s; ``select`` overflows past 9e9).
MAX_TIMEOUT = 3600.0
#: The caller's own deadline for a batch of n items: n * (timeout + FORK_SLACK) + REPLY_SLACK seconds, past which
#: the worker is deemed hung and killed with its children (the worker enforces the per-item deadline itself).
FORK_SLACK = 1.0
REPLY_SLACK = 30.0


class MathVerifier:
    """Grades ``(completion, solution)`` pairs with math-verify in a worker process (started on first use, restarted
    if it dies). ``timeout``: seconds one completion may take (> 0). Thread-safe; one worker per process."""

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = check_timeout(timeout)
        self.timeouts = 0  # completions that overran the deadline (or crashed math-verify) so far
        self._cache: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._requests: int | None = None  # the raw pipe descriptors to and from the worker
        self._replies: int | None = None
        self._buffer = bytearray()

    def scores(self, mode: str, completions: list[str], solutions: list[str]) -> list[float]:
        """One verdict per pair (see :data:`MODES`): math-verify runs only on pairs not graded before."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if len(completions) != len(solutions):
            raise ValueError(f"{len(completions)} completions but {len(solutions)} solutions")
        keys = [_key(mode, c, s) for c, s in zip(completions, solutions)]
        with self._lock:
            todo = {k: (mode, c, s) for k, c, s in zip(keys, completions, solutions) if k not in self._cache}
            if todo:
                verdicts = self._ask(list(todo.values()))
                self.timeouts += sum(v is None for v in verdicts)
                for key, verdict in zip(todo, verdicts):
                    self._remember(key, 0.0 if verdict is None else float(verdict))
            return [self._cache[k] for k in keys]

    def _remember(self, key: bytes, value: float) -> None:
        self._cache[key] = value
        self._cache.move_to_end(key)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)

    def _ask(self, items: list[tuple[str, str, str]]) -> list:
        """The worker's verdicts of ``items`` (``None``: over the deadline). A worker that died is restarted once for
        the request; one that overruns the caller's own deadline for the whole batch is killed with its children
        (every verdict ``None``) and restarted on the next request."""
        request = (json.dumps({"items": items, "timeout": self.timeout}) + "\n").encode()
        deadline = len(items) * (self.timeout + FORK_SLACK) + REPLY_SLACK
        for _ in range(2):
            self._ensure_started()
            try:
                write_all(self._requests, request)
                reply = read_line(self._replies, self._buffer, time.monotonic() + deadline)
            except OSError:  # the worker is gone (a broken pipe)
                reply = None
            if reply is not None:
                return _verdicts(json.loads(reply), len(items))
            overran = self._proc.poll() is None  # alive but silent past the deadline: it hangs
            self.close()
            if overran:
                return [None] * len(items)
        raise WorkerError(f"the math-verify worker ({WORKER}) died twice while grading (see its exit status)")

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self.close()
        to_worker, from_parent = os.pipe()
        to_parent, from_worker = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, WORKER, str(to_worker), str(from_worker)],
                pass_fds=(to_worker, from_worker),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,  # its own process group: close() kills the grading children with it
            )
        except OSError as e:
            for fd in (to_worker, from_parent, to_parent, from_worker):
                os.close(fd)
            raise WorkerError(f"cannot start the math-verify worker ({e.strerror or e}): a process limit?") from None
        finally:
            if self._proc is not None:
                os.close(to_worker)
                os.close(from_worker)
        self._requests, self._replies, self._buffer = from_parent, to_parent, bytearray()
        ready = read_line(self._replies, self._buffer, time.monotonic() + START_TIMEOUT)
        if ready is None or json.loads(ready) != "ready":
            self.close()
            raise WorkerError(
                f"the math-verify worker ({WORKER}) did not start: install math-verify (pip install math-verify)"
            )

    def close(self) -> None:
        """Stops the worker and its grading children (the next :meth:`scores` starts a new one)."""
        for fd in (self._requests, self._replies):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._requests = self._replies = None
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)  # the worker's group: its children too
            self._proc.kill()
            self._proc.wait()
            self._proc = None


class WorkerError(OSError):
    """The math-verify worker cannot grade: it did not start, could not fork, or died twice on one request."""


def _verdicts(reply, count: int) -> list:
    """The verdicts of a worker's reply, or ``WorkerError`` for the worker's ``{"error": ...}``."""
    if isinstance(reply, dict):
        raise WorkerError(f"math-verify worker: {reply.get('error', reply)}")
    if not isinstance(reply, list) or len(reply) != count:
        raise WorkerError(f"math-verify worker: a reply of {count} verdicts was expected")
    return reply


def check_timeout(timeout: float) -> float:
    """``timeout`` as a float when it is a number of seconds in (0, :data:`MAX_TIMEOUT`], else a ValueError naming
    ``reward_timeout``."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"reward_timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {timeout!r}")
    return float(timeout)


def _key(mode: str, completion: str, solution: str) -> bytes:
    digest = hashlib.blake2b(digest_size=20)
    for part in (mode, solution, completion):
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.digest()


_VERIFIER: MathVerifier | None = None


def verifier(*, timeout: float | None = None) -> MathVerifier:
    """This process's :class:`MathVerifier`; ``timeout`` (when given) sets its deadline from now on."""
    global _VERIFIER
    if _VERIFIER is None:
        _VERIFIER = MathVerifier(timeout=DEFAULT_TIMEOUT if timeout is None else timeout)
        atexit.register(_VERIFIER.close)
    elif timeout is not None:
        _VERIFIER.timeout = check_timeout(timeout)
    return _VERIFIER
