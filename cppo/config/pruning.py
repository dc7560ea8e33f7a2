"""The pruning settings, declared once: their defaults and one help text each (:data:`PRUNING_SETTINGS`), which
``cppo train``'s :class:`~cppo.config.settings.TrainConfig` and TRL's :class:`cppo.trl.CPPOConfig` both declare their
fields from (:func:`pruning_setting`), and :class:`HoldsPruning`, what both configs share to hold their
:class:`cppo.step.Pruning` (built by :func:`build_pruning` when first read, lazily importing it: the policy checks its
own settings and their rules, naming each setting as the config names it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

#: Each pruning setting: ``(default, help)``, in the order a config lists them.
PRUNING_SETTINGS: dict[str, tuple[Any, str]] = {
    "pruning_rate": (
        0.0,
        "fraction P of completions pruned (smallest |advantage|) before the training passes, in [0, 1)",
    ),
    "selection_scope": (
        "batch",
        "batch: prune int(N * P) of the rank's step (official); group: per question; global: all ranks",
    ),
    "selection_metric": (
        "smallest",
        "smallest: prune the smallest |A| (CPPO); largest; random; max-variance: keep each question's subset of "
        "largest reward variance (PODS, selection_scope group)",
    ),
    "allocation": (True, "draw 1/(1-P) times more questions per step, so a step trains as many completions as GRPO"),
}


def pruning_setting(name: str, *, default: Any = dataclasses.MISSING, **metadata) -> Any:
    """The dataclass field of the pruning setting ``name`` (a key of :data:`PRUNING_SETTINGS`), with its one help text;
    ``default`` where a config's default differs (``CPPOConfig``: no allocation, as TRL), ``metadata`` added to the
    help (``choices`` for TRL's argument parser)."""
    known, meaning = PRUNING_SETTINGS[name]
    value = known if default is dataclasses.MISSING else default
    return dataclasses.field(default=value, metadata={"help": meaning, **metadata})


def build_pruning(fields: Mapping[str, Any], names: Mapping[str, str]):  # -> cppo.step.Pruning
    """The pruning policy of ``fields`` (:class:`cppo.step.Pruning`'s fields), validated, each setting named in its
    messages as ``names`` says (imported here: it imports torch)."""
    from ..step import Pruning

    return Pruning(**fields, names=dict(names))


class HoldsPruning:
    """A config with the pruning settings and its :class:`cppo.step.Pruning`: ``pruning`` is the policy of its
    current settings, built and validated when first read (the config's own check builds it on construction) and the
    same object on every later read, built anew only after one of its settings has been assigned. A subclass says
    which of its settings the policy's fields are (:meth:`pruning_fields`) and, where it names one otherwise than
    ``cppo train`` does, how (:attr:`pruning_names`).

    The policy is held in :attr:`_built_pruning`, an attribute declared here and not a dataclass field, so that a
    config's fields stay its settings alone (``asdict``, ``==``, ``repr``, ``cppo train --help`` and TRL's ``to_dict``
    never see it); ``dataclasses.replace`` makes a new config, which builds its own."""

    #: The policy's field -> this config's setting where it differs from ``cppo train``'s, for the messages.
    pruning_names: ClassVar[Mapping[str, str]] = {}
    #: ``(the settings it was built from, each with its type: 1 is not True; the policy)``, or None before the first
    #: read (a class default; an instance's own once built).
    _built_pruning = None

    def pruning_fields(self) -> dict[str, Any]:
        """The fields of :class:`cppo.step.Pruning` from this config's settings."""
        raise NotImplementedError

    @property
    def pruning(self):  # -> cppo.step.Pruning
        """The run's pruning policy (:class:`cppo.step.Pruning`): counts per step and the selection itself."""
        fields = self.pruning_fields()
        settings = tuple((name, type(value), value) for name, value in fields.items())
        if self._built_pruning is None or self._built_pruning[0] != settings:
            self._built_pruning = (settings, build_pruning(fields, self.pruning_names))
        return self._built_pruning[1]
