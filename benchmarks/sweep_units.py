"""The units of the accuracy sweep (``accuracy_seeds.py --arms``) on disk: one (seed, arm), or the untrained model's
evaluation, per folder ``OUT/units/NAME/``; whether a unit finished, a fresh folder for a rerun (a torn attempt moved
aside, never appended to), and the sweep's settings recorded in ``OUT/sweep.json`` and checked on a continuation."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from typing import Any

import accuracy_arm
from seeds_files import read_result

from cppo import fileio
from cppo.run import RunLock, RunLocked


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit of the sweep: ``arm`` on ``seed``, or (``arm`` None) the untrained model's evaluation, named
    ``before`` (or ``before-seedS`` for a tiny model), made with ``seed``'s settings. ``before``: an arm's."""

    seed: int
    arm: str | None
    name: str
    before: str | None = None

    def folder(self, out: pathlib.Path) -> pathlib.Path:
        return out / "units" / self.name

    def result(self, out: pathlib.Path) -> pathlib.Path:
        return self.folder(out) / "result.json"


def finished(unit: Unit, out: pathlib.Path) -> bool:
    """Whether ``unit``'s result is complete and valid: an evaluation with its point, or one row of its arm and seed
    with :data:`ROW_KEYS` (written atomically, so a result file is whole or absent; a damaged one is not valid)."""
    path = unit.result(out)
    if not path.is_file():
        return False
    try:
        if unit.arm is None:
            data = json.loads(path.read_text())
            return isinstance(data, dict) and isinstance(data.get("point"), dict) and "config" in data
        _, rows = read_result(path, "a unit's result")
    except (OSError, ValueError):
        return False
    return len(rows) == 1 and rows[0].get("arm") == unit.arm and rows[0].get("seed") == unit.seed


def fresh_folder(unit: Unit, out: pathlib.Path) -> pathlib.Path:
    """An empty folder for ``unit``: a former, interrupted attempt's folder is moved aside to ``NAME.torn-N`` (kept,
    never appended to). ValueError when that attempt still runs (its child holds the folder's lock)."""
    folder = unit.folder(out)
    if folder.exists():
        lock = RunLock(str(folder))
        try:
            lock.acquire()
        except RunLocked as e:
            raise ValueError(f"unit {unit.name} is still running ({e}): stop it, or let it finish first") from None
        lock.release()
        n = 1
        while folder.with_name(f"{folder.name}.torn-{n}").exists():
            n += 1
        folder.rename(folder.with_name(f"{folder.name}.torn-{n}"))
        print(f"{unit.name}: an interrupted attempt moved to {folder.name}.torn-{n}; rerun from scratch", flush=True)
    folder.mkdir(parents=True)
    return folder


def sweep_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What every unit of the sweep shares (``OUT/sweep.json``): the settings after ``--`` and the arms' overrides."""
    return {"unit_args": vars(args.base), "arms": {a: list(accuracy_arm.ARMS[a]) for a in args.arms}}


def check_sweep_folder(args: argparse.Namespace, out: pathlib.Path) -> None:
    """Records the sweep's settings in ``OUT/sweep.json``, or checks them against the ones there: ValueError naming
    what differs (a continued sweep must run what it started with; new seeds and arms are fine)."""
    path, settings = out / "sweep.json", sweep_settings(args)
    if not path.is_file():
        fileio.write_json(path, settings)
        return
    former = json.loads(path.read_text())
    if former["unit_args"] != settings["unit_args"]:
        raise ValueError(
            f"{path}: this folder's sweep ran with the settings {former['unit_args']}, not {settings['unit_args']}: "
            "use another --out"
        )
    changed = sorted(a for a in settings["arms"] if a in former["arms"] and former["arms"][a] != settings["arms"][a])
    if changed:
        raise ValueError(
            f"{path}: the arms {changed} were defined otherwise when this sweep started: use another --out"
        )
    fileio.write_json(path, {**settings, "arms": {**former["arms"], **settings["arms"]}})
