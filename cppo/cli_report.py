"""What ``cppo`` prints when a command ends: ``cppo train``'s last line (where the run went and how to evaluate it), a
user error as one line, and a stop by a signal in words with the command to run next, as it runs from a fresh shell
(the program as it was called: ``.venv/bin/cppo``, never a bare ``cppo`` the shell may not have).

A first Ctrl-C (SIGINT) or SIGTERM during the training steps stops at the next step's end with that step saved
(:class:`cppo.run.Interrupted`); a second one stops at once (:class:`cppo.run.interrupt.StoppedAtOnce`). A Ctrl-C
outside the training steps (the imports, the model loading, the last save) arrives as Python's own
``KeyboardInterrupt``: it is reported as what it is, never as a second signal, with the command that continues the
run when this run saved a checkpoint, else the command to start it again. Nothing here imports torch: a Ctrl-C may
have stopped its import half-way.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
import sys
from dataclasses import dataclass

from .fileio import cppo_program

__all__ = ["Progress", "error", "eval_hint", "stop_report", "continue_hint", "one_line", "did_you_mean_path"]


@dataclass
class Progress:
    """How far ``cppo train`` got, filled in as it goes: ``resume`` (the command's ``--resume``), the step training
    started after (``start``; None before training starts), the step reached and the last checkpoint this run wrote
    (``step``, ``checkpoint``: set when it stops)."""

    resume: bool = False
    start: int | None = None
    step: int | None = None
    checkpoint: str | None = None


def eval_hint(checkpoint: str) -> str:
    """``cppo train: saved CHECKPOINT; evaluate it with: PROGRAM eval --model CHECKPOINT`` (the program as it was
    called; the path relative to here when it is below)."""
    here = os.path.relpath(checkpoint)
    shown = here if not here.startswith(os.pardir) else checkpoint
    return f"cppo train: saved {shown}; evaluate it with: {cppo_program()} eval --model {shlex.quote(shown)}"


def command(argv: list[str], *, drop: tuple[str, ...] = (), add: tuple[str, ...] = ()) -> str:
    """The command as it was typed (``argv``: its arguments), without the flags ``drop`` and with ``add`` at its end."""
    args = [a for a in argv if a not in drop] + list(add)
    return " ".join([cppo_program(distributed=True), *(shlex.quote(a) for a in args)])


def continue_hint(argv: list[str]) -> str:
    """``cppo train: to continue: PROGRAM ARGS --resume`` (without ``--overwrite``)."""
    return f"cppo train: to continue: {command(argv, drop=('--overwrite', '--resume'), add=('--resume',))}"


def stop_report(name: str, e: KeyboardInterrupt, progress: Progress, argv: list[str]) -> list[str]:
    """The lines saying how ``cppo NAME`` stopped at once on ``e`` and what to run next."""
    interrupt = sys.modules.get("cppo.run.interrupt")  # loaded if its handler raised e
    second = interrupt is not None and isinstance(e, interrupt.StoppedAtOnce)
    trained = progress.step is not None and progress.start is not None and progress.step > progress.start
    if second:
        what = f"stopped at once by a second signal after step {progress.step}: every checkpoint in output_dir is whole"
    elif name != "train":
        return [f"cppo {name}: stopped: interrupted (Ctrl-C): nothing was written", again(name, argv)]
    elif not trained:
        what = "interrupted (Ctrl-C) before the first training step: nothing was trained"
        return [f"cppo train: stopped: {what}", again(name, argv)]
    else:  # the last save or the plot: outside the steps, where a first Ctrl-C waits for the step's end
        what = f"interrupted (Ctrl-C) after step {progress.step}, outside the training steps"
    lines = [f"cppo train: stopped: {what}"]
    if progress.checkpoint or progress.resume:  # this run's checkpoint, or the one it resumed from
        return lines + [continue_hint(argv)]
    start = command(argv, drop=("--resume",), add=("--overwrite",))
    return lines + [f"cppo train: no checkpoint was written: to start again: {start}"]


def again(name: str, argv: list[str]) -> str:
    return f"cppo {name}: to run it again: {command(argv)}"


def error(name: str, e: BaseException | str, *, kind: str = "error") -> None:
    """Prints ``cppo NAME: error: ...`` as one line of its own (after closing a progress bar the error stopped)."""
    tqdm = sys.modules.get("tqdm")  # imported only if a bar was drawn (a Ctrl-C may have stopped its import)
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()
    print(f"cppo {name}: {kind}: {one_line(e) if isinstance(e, BaseException) else e}", file=sys.stderr)


def one_line(e: BaseException) -> str:
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def did_you_mean_path(path: str) -> str:
    """For a ``path`` that does not exist: ``" (did you mean 'runs/x/checkpoint-000008'?)"``, the checkpoint folder of
    the same step beside it (``checkpoint-00008``, a zero short), else its folder's closest name; ``""`` if none."""
    parent, name = os.path.split(os.path.normpath(path))
    if os.path.exists(path) or not os.path.isdir(parent or os.curdir):
        return ""
    names = os.listdir(parent or os.curdir)
    step = re.fullmatch(r"checkpoint-(\d+)", name)
    same = [n for n in names if step and re.fullmatch(r"checkpoint-\d+", n) and int(n[11:]) == int(step[1])]
    close = same or difflib.get_close_matches(name, names, n=1, cutoff=0.8)
    return f" (did you mean {os.path.join(parent, close[0])!r}?)" if close else ""
