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
import hashlib
import json
import os
import subprocess
import sys
import threading

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_verify_worker.py")
#: ``mode`` of a verdict: the official training reward (2.0 / 0.0, 1.0 for an unparseable gold) or the official
#: evaluation check (1.0 / 0.0).
MODES = ("reward", "eval")
DEFAULT_TIMEOUT = 0.5
CACHE_SIZE = 65536
START_TIMEOUT = 120.0


class MathVerifier:
    """Grades ``(completion, solution)`` pairs with math-verify in a worker process (started on first use, restarted
    if it dies). ``timeout``: seconds one completion may take (> 0). Thread-safe; one worker per process."""

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = check_timeout(timeout)
        self.timeouts = 0  # completions that overran the deadline (or crashed math-verify) so far
        self._cache: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._requests = self._replies = None

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
        """The worker's verdicts of ``items``; a worker that died is restarted once for the request."""
        request = json.dumps({"items": items, "timeout": self.timeout}) + "\n"
        for attempt in range(2):
            try:
                self._ensure_started()
                self._requests.write(request)
                self._requests.flush()
                reply = self._replies.readline()
                if reply:
                    return json.loads(reply)
            except (BrokenPipeError, OSError, ValueError):
                if attempt:
                    raise
            self.close()
        raise RuntimeError(f"the math-verify worker ({WORKER}) exited while grading; is math-verify installed?")

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self.close()
        to_worker, from_parent = os.pipe()
        to_parent, from_worker = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, WORKER, str(to_worker), str(from_worker)],
            pass_fds=(to_worker, from_worker),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        os.close(to_worker)
        os.close(from_worker)
        self._requests = os.fdopen(from_parent, "w", encoding="utf-8")
        self._replies = os.fdopen(to_parent, "r", encoding="utf-8")
        if json.loads(self._replies.readline() or "null") != "ready":
            self.close()
            raise RuntimeError(
                f"the math-verify worker ({WORKER}) did not start: install math-verify (pip install math-verify)"
            )

    def close(self) -> None:
        """Stops the worker (the next :meth:`scores` starts a new one)."""
        for stream in (self._requests, self._replies):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        self._requests = self._replies = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def check_timeout(timeout: float) -> float:
    """``timeout`` as a float when it is a finite number > 0, else a ValueError naming it."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"reward_timeout must be a finite number of seconds > 0, got {timeout!r}")
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
