"""CPPO for TRL users: a drop-in for TRL 1.16's ``GRPOTrainer`` (the only part of :mod:`cppo` that imports trl).

::

    from cppo.trl import CPPOConfig, CPPOTrainer

    args = CPPOConfig(output_dir="out", pruning_rate=0.875, num_generations=16, per_device_train_batch_size=16)
    CPPOTrainer(model="Qwen/Qwen2.5-1.5B-Instruct", reward_funcs=rewards, args=args, train_dataset=ds).train()

Modules: ``config`` (:class:`CPPOConfig`), ``trainer`` (:class:`CPPOTrainer`, the step order), ``rows`` (the kept
rows of TRL's batch), ``loss`` (TRL's loss settings read through one table, ``loss_settings``, and the policy loss
through ``cppo_kernels.fused_cppo_loss``), ``sampling`` (vLLM's importance-sampling correction on the kept rows),
``packing`` (the passes on rows holding each prompt once).
"""

try:
    import trl  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("cppo.trl needs TRL 1.16: pip install 'cppo-kernels[trl]'") from err

from .config import CPPOConfig
from .sampling import eager_colocated_vllm, reload_colocated_weights
from .trainer import CPPOTrainer

__all__ = ["CPPOConfig", "CPPOTrainer", "eager_colocated_vllm", "reload_colocated_weights"]
