"""The execution modes of :func:`cppo_kernels.fused_cppo_loss` (two-pass, gradient-in-forward) and the rule that
picks one per call (:data:`MODE_RULES`, and :attr:`cppo_kernels.LossConfig.two_pass_rule` for the options whose
gradients need a whole sequence or the whole call)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import use_triton
from .config import LossConfig, check_choice

__all__ = ["MODES", "MODE_RULES", "resolve_mode", "check_mode", "call_mode", "wants_grad"]

# --------------------------------------------------------------------------------------------
# Execution modes
# --------------------------------------------------------------------------------------------

#: Execution modes of :func:`fused_cppo_loss`: same results within fp32 rounding, different work.
MODES = ("auto", "two-pass", "grad-in-forward")

#: The mode ``mode="auto"`` picks, per shape class ``(device type, backend, dtype name or None for any)``:
#: a rule, read at each call, never a timing at call time. A class is not keyed on the token count: the two modes
#: may round a logit differently on CUDA, and a token's log-prob must not depend on the batch it comes in.
#: CPU torch backend: gradient-in-forward (measured, benchmarks/results/loss.json). CUDA: the Triton two-pass
#: kernels, and gradient-in-forward (cuBLAS) for the torch backend, until the GPU kit's first run
#: (benchmarks/gpu_check.py) times both at its shapes and sets these CUDA rows to the faster mode per class.
#: The interpreter (Triton on CPU: the tests) runs the Triton two-pass kernels. Whatever the rule, the options of
#: :attr:`LossConfig.two_pass_rule` (sequence-level ratios, VESPO, the off-policy and entropy masks, the entropy
#: bonus) run two-pass: they need a whole sequence or the whole call before any token's gradient is known.
MODE_RULES: dict[tuple[str, str, str | None], str] = {
    ("cpu", "torch", None): "grad-in-forward",
    ("cpu", "triton", None): "two-pass",
    ("cuda", "torch", None): "grad-in-forward",
    ("cuda", "triton", None): "two-pass",
}


def resolve_mode(mode: str, hidden: Tensor) -> str:
    """``mode`` itself, or for ``"auto"`` the :data:`MODE_RULES` entry of ``hidden``'s shape class ("two-pass"
    when none matches)."""
    check_choice("mode", mode, MODES)
    if mode != "auto":
        return mode
    key = (hidden.device.type, "triton" if use_triton(hidden) else "torch")
    dtype = str(hidden.dtype).removeprefix("torch.")
    return MODE_RULES.get((*key, dtype), MODE_RULES.get((*key, None), "two-pass"))


def check_mode(mode: str, cfg: LossConfig) -> None:
    """``mode`` is one of :data:`MODES`, and gradient-in-forward comes with options whose gradient is known token by
    token (:attr:`LossConfig.two_pass_rule`: none of them needs a whole sequence or the whole call)."""
    check_choice("mode", mode, MODES)
    rule = cfg.two_pass_rule
    if mode == "grad-in-forward" and rule is not None:
        raise ValueError(
            f"mode='grad-in-forward' cannot run {rule}: it needs a whole sequence or the whole call before any "
            "token's gradient is known, so its gradients take the two-pass path (mode='auto' or 'two-pass')"
        )


def call_mode(mode: str, cfg: LossConfig, hidden: Tensor, head: tuple[Tensor, Tensor | None]) -> str:
    """The mode a call runs: gradient-in-forward when ``mode`` resolves to it, every token's gradient is its own
    (no :attr:`LossConfig.two_pass_rule`) and gradients are wanted (grad mode on, hidden, weight or bias requiring
    grad); two-pass otherwise."""
    token_level = cfg.two_pass_rule is None
    if token_level and resolve_mode(mode, hidden) == "grad-in-forward" and wants_grad(hidden, *head):
        return "grad-in-forward"
    return "two-pass"


def wants_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
