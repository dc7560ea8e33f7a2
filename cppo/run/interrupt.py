"""Stopping a run at a safe point: the first SIGINT (Ctrl-C) or SIGTERM (a cluster's preemption) only raises a flag
that the training loop reads after each step, where it writes a checkpoint and raises :class:`Interrupted`; a second
signal stops at once (``KeyboardInterrupt``). Checkpoints are written to a temporary folder and renamed into place,
so an immediate stop never leaves a half-written one: the previous checkpoint stays whole. A signal before the handler
is set up (the imports, the model loading) is Python's own ``KeyboardInterrupt``, which ``cppo train`` reports as what
it is (:mod:`cppo.cli_report`)."""

from __future__ import annotations

import signal
import threading

#: Exit code of a run stopped by a signal: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """The run stopped at a safe point after ``signum``; ``checkpoint`` is the folder a resume continues from (or
    None when no step has been saved yet)."""

    def __init__(self, signum: int, *, step: int, checkpoint: str | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"checkpoint {checkpoint} holds step {step}" if checkpoint else "no checkpoint was written yet"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}: {where}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StoppedAtOnce(KeyboardInterrupt):
    """The second SIGINT / SIGTERM within :class:`StopSignals`: the run stops at once (told apart from Python's own
    ``KeyboardInterrupt`` of a signal outside the block)."""


class StopSignals:
    """Within the block, SIGINT and SIGTERM set :attr:`received` (the first) or raise :class:`StoppedAtOnce` (the
    second); the previous handlers come back at the end. A no-op outside the main thread (signals go there)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise StoppedAtOnce(f"second {signal.Signals(signum).name}: stopping at once")
        self.received = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
