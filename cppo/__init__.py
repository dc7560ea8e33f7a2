"""cppo: a thin CPPO trainer on top of cppo_kernels.

``cppo train --config tiny-cpu`` / ``python -m cppo train ...``; from Python::

    from cppo import load_config
    from cppo.trainer import Trainer
    Trainer(load_config("tiny-cpu", ["num_steps=2"])).train()

This package's namespace holds the settings alone (plain data: no torch). ``import cppo.config``, ``cppo --help``
and the CLI's bad flags run this module first, and a Python package cannot export a name of a torch-importing
submodule here without importing torch for all of them (or loading it lazily, which it does not do): the trainer is
imported from its own module, :mod:`cppo.trainer`.
"""

from .config import TrainConfig, load_config  # plain data: no torch

__all__ = ["TrainConfig", "load_config"]

#: Names that live in a submodule of their own (they import torch), and where.
MOVED = {"Trainer": "cppo.trainer"}


def __getattr__(name: str):
    """A pointer, not a lazy import: ``from cppo import Trainer`` says where the trainer lives."""
    if name in MOVED:
        raise ImportError(
            f"cppo.{name} is imported from its own module: from {MOVED[name]} import {name} (the package cppo "
            "holds the torch-free settings alone)"
        )
    raise AttributeError(f"module 'cppo' has no attribute {name!r}")
