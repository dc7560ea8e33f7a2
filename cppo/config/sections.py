"""The ``rollout_stop:`` section of a config (pruning while generating), held as ``loss:`` is: one mapping setting of
:class:`~cppo.config.settings.TrainConfig`. Its four options are declared once, with their defaults, types and help
texts (:data:`ROLLOUT_STOP`); a section as a user gives it (a YAML mapping, ``--set rollout_stop.NAME=VALUE``, a
``dict`` in Python) is completed with the defaults and typed option by option (:func:`rollout_stop_section`); the flat
names ``rollout_stop_NAME`` that configs and checkpoints written before the section hold still read
(:func:`with_rollout_stop_section`)."""

from __future__ import annotations

import math
from typing import Any

from .values import check_type, coerce, did_you_mean

#: Each option of the ``rollout_stop:`` section: ``(default, type, help)``, in the order a config lists them.
ROLLOUT_STOP: dict[str, tuple[Any, Any, str]] = {
    "rate": (
        0.0,
        float,
        "fraction of each group's completions stopped at rollout_stop.at, those of smallest predicted |advantage| "
        "(0: off; at most pruning_rate)",
    ),
    "at": (0.25, float, "the checkpoint, in new tokens (>= 1) or as a fraction of max_completion_length"),
    "scorer": ("learned", str, "learned (a quality head on the policy's hidden state), random or length"),
    "warmup": (2, int, "first steps whose rollouts only train the head"),
}
#: The flat setting each option was before the section (``rollout_stop_rate``: ``rate``), still read with a pointer.
FLAT_ROLLOUT_STOP = {f"rollout_stop_{name}": name for name in ROLLOUT_STOP}


def rollout_stop_defaults() -> dict[str, Any]:
    """The section's default: every option at its default (``rate`` 0: pruning while generating off)."""
    return {name: default for name, (default, _, _) in ROLLOUT_STOP.items()}


def rollout_stop_help() -> str:
    """The section's one help text (``cppo train --help``): what it is and each option's meaning."""
    options = "; ".join(f"{name}: {meaning}" for name, (_, _, meaning) in ROLLOUT_STOP.items())
    return f"pruning while generating (--set rollout_stop.NAME=VALUE): {options}"


def rollout_stop_section(given: Any) -> dict[str, Any]:
    """``given`` (the options a user set) completed with the defaults, each option converted as a flat setting is
    (``at: 3`` is 3.0) and its type checked; ``ValueError`` naming the section or the option (``rollout_stop.NAME``)."""
    if not isinstance(given, dict):
        raise ValueError(f"rollout_stop must be a mapping of {list(ROLLOUT_STOP)}, got {given!r}")
    section = rollout_stop_defaults()
    for name, value in given.items():
        if name not in ROLLOUT_STOP:
            raise ValueError(
                f"rollout_stop.{name}: not an option of rollout_stop{did_you_mean(name, ROLLOUT_STOP)}; the options "
                f"are {list(ROLLOUT_STOP)}"
            )
        hint = ROLLOUT_STOP[name][1]
        value = coerce(f"rollout_stop.{name}", value, hint)
        check_type(f"rollout_stop.{name}", value, hint)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"rollout_stop.{name} must be finite, got {value}")
        section[name] = value
    return section


def with_rollout_stop_section(saved: dict) -> dict:
    """A saved config (a checkpoint's, a result's) with its flat ``rollout_stop_NAME`` settings, if it was written
    before the section, as the ``rollout_stop`` section they set (the others at their defaults); as it is otherwise."""
    flat = {name: saved[key] for key, name in FLAT_ROLLOUT_STOP.items() if key in saved}
    if not flat or "rollout_stop" in saved:
        return saved
    rest = {k: v for k, v in saved.items() if k not in FLAT_ROLLOUT_STOP}
    return {**rest, "rollout_stop": {**rollout_stop_defaults(), **flat}}
