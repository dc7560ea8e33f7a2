"""The math-verify worker of :mod:`cppo.math_grading`, run as a script (``python _math_verify_worker.py IN_FD OUT_FD``)
so that it imports math-verify and the standard library only, never torch or the ``cppo`` package.

It warms math-verify up once, then serves batches: for each batch it forks a child that grades the items in order
and streams one verdict per item back; an item that overruns its deadline (or kills the child) gets ``None`` and a
fresh child (forked from the warm worker in milliseconds) carries on with the next item. math-verify's own timeouts
(``signal.alarm``, whole seconds, main thread only) are switched off: the deadline here is the only one.

The grading functions reproduce the official CPPO code (lzhxmu/CPPO, ``src/open_r1``) call for call:
``reward`` is ``rewards_math.accuracy_reward`` for one completion, ``eval`` the MATH-500 / AIME check of
``GRPOTrainer.evaluate`` in ``grpo_trainer_math.py`` (note the swapped ``verify`` arguments of the two).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import warnings


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


def _child(grader: Grader, items: list, out_fd: int) -> None:
    """Grades ``items`` in order, writing one JSON line per verdict; never returns."""
    try:
        with os.fdopen(out_fd, "w", buffering=1) as out:
            for mode, completion, solution in items:
                try:
                    score = grader.grade(mode, completion, solution)
                except BaseException:  # noqa: B036  a verdict for every item, whatever math-verify does
                    score = None
                out.write(json.dumps(score) + "\n")
    finally:
        os._exit(0)


def _read_line(fd: int, buffer: bytearray, deadline: float) -> bytes | None:
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


def grade_batch(grader: Grader, items: list, timeout: float) -> list:
    """Verdicts of ``items`` (``[mode, completion, solution]``), each graded within ``timeout`` seconds by a forked
    child; None for an item that overran or crashed its child."""
    scores: list = []
    while len(scores) < len(items):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _child(grader, items[len(scores) :], write_fd)
        os.close(write_fd)
        buffer = bytearray()
        try:
            while len(scores) < len(items):
                line = _read_line(read_fd, buffer, time.monotonic() + timeout)
                if line is None:  # overran or died: the item gets no verdict, a new child takes the next one
                    scores.append(None)
                    break
                scores.append(json.loads(line))
        finally:
            os.close(read_fd)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
    return scores


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
    with os.fdopen(in_fd, "r", encoding="utf-8") as requests, os.fdopen(out_fd, "w", buffering=1) as replies:
        replies.write(json.dumps("ready") + "\n")
        for line in requests:
            request = json.loads(line)
            replies.write(json.dumps(grade_batch(grader, request["items"], float(request["timeout"]))) + "\n")
    return 0


if __name__ == "__main__":
    # run as a script: drop this file's folder from the path so that cppo's modules never shadow a library's
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(main(sys.argv))
