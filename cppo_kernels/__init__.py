"""cppo-kernels: fused Triton kernels for CPPO / GRPO training; this module is the public API.

Public API::

    from cppo_kernels import group_advantages, select_completions, cppo_select
    from cppo_kernels import fused_cppo_loss, fused_logprobs, cppo_loss_from_logits, FusedCPPOLoss, LossConfig

Layout: ``advantages.py`` / ``loss.py`` (public functions: validation once, then dispatch; the loss's validation
and packing in ``_loss_inputs.py``, its autograd Functions in ``_loss_autograd.py``), their backends
``_{op}_triton.py`` (kernels + launchers) and ``_{op}_torch.py`` (PyTorch), ``_policy.py`` (the per-token policy
math of the loss), ``_dispatch.py`` (backend choice, per execution mode), ``config.py`` (options and checks),
``reference.py`` (naive oracles for the tests, apart from all of the above), ``_ops.py`` (the public ops as
``torch.library`` custom ops, which the public functions call under ``torch.compile``). :func:`fused_cppo_loss`
runs two-pass or with its gradients computed in the forward (``mode=``; ``cppo_kernels.loss.MODE_RULES`` holds the
per-shape-class default).
"""

from . import _ops  # noqa: E402, F401  (registers the torch.library ops: torch.ops.cppo_kernels.*)
from ._dispatch import use_backend
from .advantages import cppo_select, group_advantages, select_completions
from .config import LossConfig
from .loss import FusedCPPOLoss, cppo_loss_from_logits, fused_cppo_loss, fused_logprobs

__version__ = "0.1.0"

__all__ = [
    "group_advantages",
    "select_completions",
    "cppo_select",
    "fused_cppo_loss",
    "fused_logprobs",
    "cppo_loss_from_logits",
    "FusedCPPOLoss",
    "LossConfig",
    "use_backend",
    "__version__",
]
