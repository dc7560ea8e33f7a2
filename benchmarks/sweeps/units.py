"""The units of the accuracy sweep (``accuracy_seeds.py --arms``) on disk: one (seed, arm), or the untrained model's
evaluation, per folder ``OUT/units/NAME/``; whether a unit finished, a fresh folder for a rerun (a torn attempt moved
aside, never appended to), and the sweep's settings recorded in ``OUT/sweep.json`` and checked on a continuation."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from cppo import fileio
from cppo.run import RunLock, RunLocked
from sweeps import arm as accuracy_arm
from sweeps.files import AGREE_KEYS, ENVIRONMENT_KEYS, meta_value, read_result


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


def read_sweep_file(path: pathlib.Path) -> dict[str, Any]:
    """``OUT/sweep.json`` as :func:`sweep_settings` wrote it; ValueError naming the file when it is absent, empty or
    not such an object."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("unit_args"), dict):
            raise TypeError("not an object with unit_args (the settings after --)")
        arms = data.get("arms")
        if not isinstance(arms, dict) or not all(isinstance(v, list) for v in arms.values()):
            raise TypeError("its arms are not an object of arm -> its --set overrides")
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path} is not a sweep's settings file ({type(e).__name__}: {e})") from None
    return data


def _flags() -> tuple[dict[str, Any], dict[str, str]]:
    """The settings after ``--`` (:func:`accuracy_arm.add_base_args`): their defaults and their flags by name."""
    ap = argparse.ArgumentParser()
    accuracy_arm.add_base_args(ap)
    flags = {a.dest: a.option_strings[0] for a in ap._actions if a.option_strings and a.dest != "help"}
    return vars(ap.parse_args([])), flags


def check_sweep_folder(args: argparse.Namespace, out: pathlib.Path, *, record: bool = True) -> None:
    """Checks the command's sweep settings (:func:`sweep_settings`) against the ones in ``OUT/sweep.json``: ValueError
    in one line naming the file, the setting and both values (a continued sweep must run, and ``--combine`` combine,
    what it started with; new seeds and arms are fine; a setting the file predates counts as its default). With
    ``record`` (a run) the file is written (first run) or updated with new arms; without (``--combine``), a folder
    without one is refused."""
    path, settings = out / "sweep.json", sweep_settings(args)
    if not path.is_file():
        if not record:
            raise ValueError(f"{path} is missing: --combine combines the units of a sweep's folder (its --out)")
        fileio.write_json(path, settings)
        return
    former, (defaults, flags) = read_sweep_file(path), _flags()
    advice = "use another --out" if record else "combine with the settings it ran with"
    for key in sorted(settings["unit_args"].keys() | former["unit_args"].keys()):
        was, now = former["unit_args"].get(key, defaults.get(key)), settings["unit_args"].get(key)
        if was != now:
            flag = flags.get(key, "no longer a flag")
            raise ValueError(
                f"{path}: this folder's sweep ran with {key} {was!r} ({flag}), this command {now!r}: {advice}"
            )
    for arm in sorted(settings["arms"].keys() & former["arms"].keys()):
        if former["arms"][arm] != settings["arms"][arm]:
            raise ValueError(
                f"{path}: the arm {arm} was {former['arms'][arm]} when this sweep started, it is "
                f"{settings['arms'][arm]} now: {advice}"
            )
    if record:
        fileio.write_json(path, {**settings, "arms": {**former["arms"], **settings["arms"]}})


def check_finished_units(args: argparse.Namespace, units: Sequence[Unit], out: pathlib.Path) -> None:
    """Before a continued sweep runs anything: every finished arm agrees with what this command would run now on
    every setting that must agree (:data:`sweeps.files.AGREE_KEYS`: the settings its ``--config`` and ``--set``
    resolve to, which an edited preset changes, and this environment's Python and library versions, one torch thread
    a unit), else the new units could never be combined with it; ValueError naming its result, the setting and both
    values."""
    env = fileio.run_metadata(argv=[])
    env = {**{k: env.get(k) for k in ENVIRONMENT_KEYS}, "torch_threads": 1}  # each unit runs --threads 1
    for unit in units:
        if unit.arm is None or not finished(unit, out):
            continue
        meta, _ = read_result(unit.result(out), "a unit's result")
        now = {**accuracy_arm.arm_config(args.base, unit.arm, unit.seed).to_dict(), **env}
        wrong = next((k for k in AGREE_KEYS if meta_value(meta, k) != now[k]), None)
        if wrong is not None:
            raise ValueError(
                f"{unit.result(out)}: {wrong} is {meta_value(meta, wrong)!r}, but this command would run "
                f"{now[wrong]!r}: new units would not combine with it (use another --out, or the settings and "
                "environment the sweep ran with)"
            )
