"""cppo: a thin CPPO trainer on top of cppo_kernels.

``cppo train --config tiny-cpu`` / ``python -m cppo train ...``; from Python::

    from cppo import Trainer, load_config
    Trainer(load_config("tiny-cpu", ["num_steps=2"])).train()
"""

import importlib
import importlib.util

__all__ = ["TrainConfig", "load_config", "Trainer"]


def __getattr__(name: str):
    """The names above, and the subpackages (``cppo.step``, ...), imported on first use (they import torch): ``cppo
    --help`` and the CLI's bad flags do not wait for it."""
    if name in ("TrainConfig", "load_config"):
        from .config import TrainConfig, load_config

        return TrainConfig if name == "TrainConfig" else load_config
    if name == "Trainer":
        from .trainer import Trainer

        return Trainer
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
