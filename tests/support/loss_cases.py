"""Shared cases of the loss tests (tests/kernels/): tolerances per dtype, random packed problems, the comparison
helper and the small-block fixture. Imported by the loss test modules (``tests/support`` is on ``sys.path``)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, settings

from cppo_kernels import _loss_gemm, _loss_rows_triton, _loss_torch

#: Tolerances per input dtype: (loss and metrics, gradients of the torch backend and of
#: cppo_loss_from_logits, gradients of the Triton backend). Gradients are compared as
#: max|got - want| <= tol * max|want|; they come back in the input dtype. The torch backend accumulates
#: in fp32 and rounds once to nearest: half an ulp (bf16 2^-8, fp16 2^-11) plus fp32 slack. The Triton
#: backend also feeds bf16/fp16 dz operands to its backward dots and, under the interpreter, truncates
#: fp32 -> bf16/fp16 stores (1 ulp); the dz rounding error is relative to sum_v |dz_v| |w_v|, not to the
#: (cancelling) result, so no ulp bound holds there and its tolerance is empirical (bf16 worst seen
#: 1.3e-2 over 270 random problems; tests/test_loss_triton.py checks the kernels against the proper
#: error bound). Last column: absolute gradient slack. fp16 gradients here reach the subnormal range
#: (< 6.1e-5, spacing 2^-24 = 6e-8) where errors are absolute: the truncated output and each dz operand
#: flushed to a subnormal before the dot (seen: 3.3 spacings on a 7e-6 dweight), hence 4 spacings more.
#: Losses are fp32 whatever the input dtype.
TOL = {
    torch.float32: (2e-5, 1e-4, 1e-4, 1e-7),
    torch.bfloat16: (1e-4, 5e-3, 2e-2, 1e-7),
    torch.float16: (1e-4, 1e-3, 2e-3, 1e-7 + 4 * 2**-24),
}
DTYPES = list(TOL)
METRIC_KEYS = (
    "kl", "clip_fraction_low", "clip_fraction_high", "ratio_mean", "ratio_min", "ratio_max", "num_tokens",
    "policy_loss",
)  # fmt: skip


def hypothesis_settings(**kwargs) -> settings:
    """The loaded profile, plus: the ``backend`` / ``path`` fixtures are safely shared by all examples of a test."""
    checks = [*settings().suppress_health_check, HealthCheck.function_scoped_fixture]
    return settings(suppress_health_check=checks, **kwargs)


@pytest.fixture
def small_chunks(monkeypatch):
    """Small blocks, so the small test shapes cross the torch backend's token and vocab block boundaries."""
    monkeypatch.setattr(_loss_torch, "FWD_TOKENS", 8)
    monkeypatch.setattr(_loss_torch, "BWD_TOKENS", 16)
    monkeypatch.setattr(_loss_torch, "BWD_VOCAB", 64)
    # the GEMM path (Triton gradient-in-forward): chunks of 16 tokens, rows of 32-column tiles under the interpreter
    monkeypatch.setattr(_loss_gemm, "CHUNK_MAX", 16)
    monkeypatch.setitem(_loss_rows_triton.ROW_BLOCK_V, "interpreter", 32)


#: Every path of fused_cppo_loss on the CPU: (backend, mode).
LOSS_PATHS = {
    "torch-two-pass": ("torch", "two-pass"),
    "torch-grad-in-forward": ("torch", "grad-in-forward"),
    "triton-two-pass": ("triton", "two-pass"),
    "triton-grad-in-forward": ("triton", "grad-in-forward"),
}


@pytest.fixture(params=list(LOSS_PATHS))
def loss_path(request, monkeypatch) -> tuple[str, str]:
    """Runs a test once per loss path: the backend by CPPO_KERNELS_BACKEND, the mode as that backend's CPU rule (so
    that options needing the whole sequence still take the two-pass path). Registered in tests/kernels/conftest.py."""
    from cppo_kernels import loss as loss_module

    backend, mode = LOSS_PATHS[request.param]
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", backend)
    monkeypatch.setitem(loss_module.MODE_RULES, ("cpu", backend, None), mode)
    return backend, mode


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, atol: float = 1e-7) -> None:
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1e-6)
    assert err <= tol * scale + atol, f"{name}: max error {err:.3g} > {tol} x {scale:.3g}"


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return cu


def problem(seed: int, lengths: list[int], H: int, V: int, dtype: torch.dtype, *, logit_scale: float, bias: bool):
    """Random hidden [T, H], weight [V, H], bias [V], targets [T], advantages [S] (hidden's dtype)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * logit_scale / H**0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    targets = torch.randint(0, V, (T,), generator=g)
    advantages = torch.randn(len(lengths), generator=g)
    if len(lengths) > 1:
        advantages[0] = 0.0  # a zero-variance group
    return hidden, weight, b, targets, advantages, g


def grads(loss: torch.Tensor, inputs: list[torch.Tensor], upstream: float) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss * upstream, inputs))


#: The Triton forward's logit error bound per unit of Z (tests/kernels/test_loss_triton.py states the bound).
FWD_ATOL = 2e-6


def logit_error(Z: float, hidden_size: int) -> float:
    """Bound on the absolute fp32 error of a logit: ``FWD_ATOL * Z * max(1, sqrt(H) / 8)``."""
    return FWD_ATOL * Z * max(1.0, math.sqrt(hidden_size) / 8)
