"""cppo: a thin CPPO trainer on top of cppo_kernels.

``cppo train --config tiny-cpu`` / ``python -m cppo train ...``; from Python::

    from cppo import Trainer, load_config
    Trainer(load_config("tiny-cpu", ["num_steps=2"])).train()
"""

from .config import TrainConfig, load_config  # plain data: no torch

__all__ = ["TrainConfig", "load_config", "Trainer"]


def __getattr__(name: str):
    """``Trainer``, imported on first use: it imports torch, which ``cppo --help`` and the CLI's bad flags (this
    package's ``-m`` entry and console script import this module first) do not wait for."""
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
