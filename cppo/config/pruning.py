"""The pruning settings, declared once: their defaults and one help text each (:data:`PRUNING_SETTINGS`), which
``cppo train``'s :class:`~cppo.config.settings.TrainConfig` and TRL's :class:`cppo.trl.CPPOConfig` both declare their
fields from (:func:`pruning_setting`), and :class:`HoldsPruning`, what both configs share to hold their
:class:`cppo.step.Pruning` (built when first read, lazily importing it: the policy checks its own settings and their
rules, naming each setting as the config names it)."""

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


class HoldsPruning:
    """A config with the pruning settings and its :class:`cppo.step.Pruning`: ``pruning`` is the policy of its
    current settings, built and validated when first read (the config's own check builds it on construction) and the
    same object on every later read, built anew only after one of its settings has been assigned. A subclass says
    which of its settings the policy's fields are (:meth:`pruning_fields`) and, where it names one otherwise than
    ``cppo train`` does, how (:attr:`pruning_names`)."""

    #: The policy's field -> this config's setting where it differs from ``cppo train``'s, for the messages.
    pruning_names: ClassVar[Mapping[str, str]] = {}

    def pruning_fields(self) -> dict[str, Any]:
        """The fields of :class:`cppo.step.Pruning` from this config's settings."""
        raise NotImplementedError

    @property
    def pruning(self):  # -> cppo.step.Pruning (imported when first built: it imports torch)
        """The run's pruning policy (:class:`cppo.step.Pruning`): counts per step and the selection itself."""
        fields = self.pruning_fields()
        key = tuple((name, type(value), value) for name, value in fields.items())  # 1 is not True
        held = vars(self).get("_held_pruning")
        if held is None or held[0] != key:
            from ..step import Pruning

            held = (key, Pruning(**fields, names=dict(self.pruning_names)))
            vars(self)["_held_pruning"] = held  # not a field: dataclasses' asdict, eq and repr never see it
        return held[1]
