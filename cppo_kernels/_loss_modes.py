"""The execution modes of :func:`cppo_kernels.fused_cppo_loss` (two-pass, gradient-in-forward) and the rule that
picks one per call (:data:`MODE_RULES`; :attr:`cppo_kernels.LossConfig.call_rule` and ``sequence_rule`` for the
options whose gradients need the whole call or a whole sequence)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._dispatch import use_triton
from .config import LossConfig, check_choice

__all__ = ["MODES", "MODE_RULES", "resolve_mode", "check_mode", "call_mode", "whole_sequence_tokens", "wants_grad"]

# --------------------------------------------------------------------------------------------
# Execution modes
# --------------------------------------------------------------------------------------------

#: Execution modes of :func:`fused_cppo_loss`: same results within fp32 rounding, different work.
MODES = ("auto", "two-pass", "grad-in-forward")

#: The mode ``mode="auto"`` picks, per shape class ``(device type, backend, dtype name or None for any)``:
#: a rule, read at each call, never a timing at call time. A class is not keyed on the token count: the two modes
#: may round a logit differently on CUDA, and a token's log-prob must not depend on the batch it comes in.
#: CPU torch backend: gradient-in-forward (measured, benchmarks/results/loss.json). CUDA: gradient-in-forward for
#: both backends: the GPU kit's H200 run (2026-12-04, T = 16,384, H = 1,536, V = 151,936 bf16) timed the torch
#: backend's cuBLAS gradient-in-forward at 69.7 ms against 140.9 ms for the Triton two-pass kernels; the Triton
#: backend's gradient-in-forward is now cuBLAS GEMMs around one Triton row pass (cppo_kernels._loss_gemm, predicted
#: ~1.1x the 3-GEMM floor by the kit's roofline, to be measured), and the two-pass kernels stay the memory-minimal
#: mode (mode="two-pass": no [C, V] buffer). The interpreter (Triton on CPU: the tests) runs the two-pass kernels
#: unless a test asks for gradient-in-forward. Whatever the rule, the options of
#: :attr:`LossConfig.call_rule` (the entropy mask and bonus) run two-pass: they need the whole call before any
#: token's gradient is known; those of :attr:`LossConfig.sequence_rule` (sequence-level ratios, VESPO, the
#: off-policy mask) run gradient-in-forward in chunks of whole sequences on the CPU when every sequence fits one
#: chunk (:func:`cppo_kernels._loss_torch.chunk_tokens`), two-pass otherwise.
MODE_RULES: dict[tuple[str, str, str | None], str] = {
    ("cpu", "torch", None): "grad-in-forward",
    ("cpu", "triton", None): "two-pass",
    ("cuda", "torch", None): "grad-in-forward",
    ("cuda", "triton", None): "grad-in-forward",
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
    """``mode`` is one of :data:`MODES`, and gradient-in-forward comes without options that need the whole call
    (:attr:`LossConfig.call_rule`); whether its sequences fit a chunk is :func:`call_mode`'s to check."""
    check_choice("mode", mode, MODES)
    rule = cfg.call_rule
    if mode == "grad-in-forward" and rule is not None:
        raise ValueError(
            f"mode='grad-in-forward' cannot run {rule}: it needs the whole call before any token's gradient is "
            "known, so its gradients take the two-pass path (mode='auto' or 'two-pass')"
        )


def call_mode(
    mode: str, cfg: LossConfig, hidden: Tensor, head: tuple[Tensor, Tensor | None], lengths: Tensor | None = None
) -> str:
    """The mode a call runs: gradient-in-forward when ``mode`` resolves to it, gradients are wanted (grad mode on,
    hidden, weight or bias requiring grad), no option needs the whole call and, with an option of
    :attr:`LossConfig.sequence_rule`, the call is on the CPU and each sequence (``lengths [S]``) fits one chunk;
    two-pass otherwise (an explicit ``mode="grad-in-forward"`` whose sequences do not fit: a ValueError)."""
    if resolve_mode(mode, hidden) != "grad-in-forward" or not wants_grad(hidden, *head) or cfg.call_rule:
        return "two-pass"
    if cfg.sequence_rule is None:
        return "grad-in-forward"
    chunk = whole_sequence_tokens(hidden.device)
    cpu = hidden.device.type == "cpu"  # (the lengths are read back only there: no device sync on an accelerator)
    longest = int(lengths.max()) if cpu and lengths is not None and lengths.numel() else 0
    if cpu and longest <= chunk:
        return "grad-in-forward"
    if mode == "grad-in-forward":
        got = f"a sequence of {longest} tokens" if cpu else f"a {hidden.device.type} call"
        raise ValueError(
            f"mode='grad-in-forward' runs {cfg.sequence_rule} in chunks of whole sequences, on the CPU only, each "
            f"sequence at most {whole_sequence_tokens(torch.device('cpu'))} tokens: got {got} (mode='auto' or "
            "'two-pass')"
        )
    return "two-pass"


def whole_sequence_tokens(device: torch.device) -> int:
    """The longest sequence gradient-in-forward takes whole on ``device``, for the options of
    :attr:`LossConfig.sequence_rule`: on the CPU the forward's chunk (:func:`cppo_kernels._loss_torch.chunk_tokens`);
    0 elsewhere (there those options run two-pass). A benchmark sizes its sequences with it."""
    if torch.device(device).type != "cpu":
        return 0
    from ._loss_torch import chunk_tokens

    return chunk_tokens(torch.device(device))


def wants_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
