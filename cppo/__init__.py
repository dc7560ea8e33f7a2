"""cppo: a thin CPPO trainer on top of cppo_kernels.

``cppo train --config tiny-cpu`` / ``python -m cppo train ...``; from Python::

    from cppo import Trainer, load_config
    Trainer(load_config("tiny-cpu", ["num_steps=2"])).train()
"""

from .config import TrainConfig, load_config
from .trainer import Trainer

__all__ = ["TrainConfig", "load_config", "Trainer"]
