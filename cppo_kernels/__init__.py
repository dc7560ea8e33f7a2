"""cppo-kernels: fused Triton kernels for CPPO / GRPO training.

Public API::

    from cppo_kernels import group_advantages, select_completions, cppo_select
    from cppo_kernels import fused_cppo_loss, fused_logprobs, cppo_loss_from_logits, LossConfig
"""

from ._dispatch import use_backend
from .advantages import cppo_select, group_advantages, select_completions
from .config import LossConfig
from .loss import cppo_loss_from_logits, fused_cppo_loss, fused_logprobs

__version__ = "0.1.0"

__all__ = [
    "group_advantages",
    "select_completions",
    "cppo_select",
    "fused_cppo_loss",
    "fused_logprobs",
    "cppo_loss_from_logits",
    "LossConfig",
    "use_backend",
    "__version__",
]
