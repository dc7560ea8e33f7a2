"""A resumed run's folder holds only what the resumed run did: what the run there wrote after the checkpoint a resume
continues from (``eval/step-N.json`` of later steps, later ``checkpoint-N`` folders, which the resume could not read)
is moved aside, named, into ``stale/after-step-S/`` (:func:`move_aside`; ``metrics.jsonl`` is rewound by its sink,
TensorBoard's events purged by its writer), and what a killed atomic write left (a half-written evaluation or plot,
:func:`cppo.fileio.atomic_path`'s ``.NAME.XXXX.tmp``) is removed (:func:`remove_torn_writes`)."""

from __future__ import annotations

import os
import re

__all__ = ["EVAL_FOLDER", "STALE_FOLDER", "move_aside", "remove_torn_writes"]

#: Where each evaluation's result, with its per-problem records, is written (``eval/step-N.json``).
EVAL_FOLDER = "eval"
#: Where a resume moves what the run there wrote after its checkpoint (``stale/after-step-S/``).
STALE_FOLDER = "stale"
EVAL_RE = re.compile(r"^step-(\d+)\.json$")
#: What :func:`cppo.fileio.atomic_path` leaves when killed: ``.NAME.RANDOM.tmp`` (NAME one of the run's files).
TORN_RE = re.compile(r"^\.(metrics\.png|step-\d+\.json)\.\w+\.tmp$")


def move_aside(output_dir: str, step: int, *, checkpoints: re.Pattern) -> tuple[str | None, list[str]]:
    """Moves the evaluations and checkpoints (the folders ``checkpoints`` matches, the step its first group) of steps
    after ``step`` into a new ``stale/after-step-STEP[-K]/`` (keeping their paths below it); returns that folder
    (None when nothing was moved) and the paths moved, relative to ``output_dir``."""
    found = [os.path.join(EVAL_FOLDER, name) for name in _listed(os.path.join(output_dir, EVAL_FOLDER))
             if (m := EVAL_RE.match(name)) and int(m.group(1)) > step]  # fmt: skip
    found += [name for name in _listed(output_dir) if (m := checkpoints.match(name)) and int(m[1]) > step]
    if not found:
        return None, []
    target = _new_folder(os.path.join(output_dir, STALE_FOLDER), f"after-step-{step}")
    for path in sorted(found):
        os.makedirs(os.path.dirname(os.path.join(target, path)), exist_ok=True)
        os.replace(os.path.join(output_dir, path), os.path.join(target, path))  # a symlink moves as the link
    return target, sorted(found)


def remove_torn_writes(output_dir: str) -> list[str]:
    """Removes what killed atomic writes of the run's plot and evaluations left; returns the paths removed, relative
    to ``output_dir``."""
    removed = []
    for folder in ("", EVAL_FOLDER):
        for name in _listed(os.path.join(output_dir, folder)):
            if TORN_RE.match(name) and os.path.isfile(os.path.join(output_dir, folder, name)):
                os.remove(os.path.join(output_dir, folder, name))
                removed.append(os.path.join(folder, name))
    return removed


def _listed(folder: str) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _new_folder(parent: str, name: str) -> str:
    """``parent/name``, or ``parent/name-2``, ``-3``, ... when taken: created, empty."""
    os.makedirs(parent, exist_ok=True)
    for k in range(1, 10_000):
        path = os.path.join(parent, name if k == 1 else f"{name}-{k}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise OSError(f"{parent}: no free name for {name}")
