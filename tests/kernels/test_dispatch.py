"""Backend choice: the environment variable, the use_backend context, and their errors."""

import pytest
import torch

from cppo_kernels import use_backend
from cppo_kernels._dispatch import backend_module, requested_backend, use_triton


def test_env_then_context_then_argument(monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "triton")
    assert requested_backend() == "triton"
    with use_backend("torch"):
        assert requested_backend() == "torch"
        assert not use_triton(torch.zeros(1))
        with use_backend("triton"):  # nests
            assert requested_backend() == "triton"
        assert requested_backend() == "torch"
        assert requested_backend("auto") == "auto"  # an explicit argument wins
    assert requested_backend() == "triton"


def test_context_restores_on_error(monkeypatch):
    monkeypatch.delenv("CPPO_KERNELS_BACKEND", raising=False)
    with pytest.raises(RuntimeError), use_backend("torch"):
        raise RuntimeError("boom")
    assert requested_backend() == "auto"


def test_auto_runs_torch_on_cpu(monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "auto")
    assert not use_triton(torch.zeros(1))


@pytest.mark.parametrize("bad", ["cuda", "", 3])
def test_unknown_backend_is_rejected(monkeypatch, bad):
    with pytest.raises(ValueError, match="use_backend"), use_backend(bad):
        pass
    if isinstance(bad, str):
        monkeypatch.setenv("CPPO_KERNELS_BACKEND", bad)
        with pytest.raises(ValueError, match="CPPO_KERNELS_BACKEND"):
            use_triton(torch.zeros(1))


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        use_triton(torch.zeros(1))


def test_backend_module_follows_the_choice():
    x = torch.zeros(1)
    for op in ("advantages", "loss"):
        with use_backend("torch"):
            assert backend_module(op, x).__name__ == f"cppo_kernels._{op}_torch"
        with use_backend("triton"):  # the tests run with TRITON_INTERPRET=1
            assert backend_module(op, x).__name__ == f"cppo_kernels._{op}_triton"
