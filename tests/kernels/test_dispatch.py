"""Backend choice: the environment variable, the use_backend context, and their errors; the execution modes each
backend implements, and where a mode a backend lacks runs."""

import importlib

import pytest
import torch

from cppo_kernels import use_backend
from cppo_kernels._dispatch import BACKEND_MODES, MODE_MODULES, backend_module, requested_backend, use_triton


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


def test_triton_helpers_stay_interpreted_after_a_test_sets_interpret_off():
    """Runs right after the test above, which sets TRITON_INTERPRET=0 and reaches ``import triton``: triton decorates
    its own @jit helpers (``tl.sum``, ``tl.max``, ``tl.cdiv``, ...) when first imported, under the TRITON_INTERPRET of
    that moment, so had that been triton's first import, every interpreted kernel launched afterwards would fail
    ("Cannot call @triton.jit'd outside of the scope of a kernel"). tests/conftest.py imports triton up front."""
    standard = pytest.importorskip("triton.language.standard")
    from triton.runtime.interpreter import InterpretedFunction

    assert all(isinstance(f, InterpretedFunction) for f in (standard.sum, standard.max, standard.cdiv))


def test_backend_module_follows_the_choice():
    x = torch.zeros(1)
    for op in ("advantages", "loss"):
        with use_backend("torch"):
            assert backend_module(op, x).__name__ == f"cppo_kernels._{op}_torch"
        with use_backend("triton"):  # the tests run with TRITON_INTERPRET=1
            assert backend_module(op, x).__name__ == f"cppo_kernels._{op}_triton"


#: The functions a loss backend needs for each execution mode of fused_cppo_loss.
_MODE_FUNCTIONS = {
    "two-pass": ("logprobs_fwd", "logprobs_bwd"),
    "grad-in-forward": ("logprobs_fwd_grads", "logprobs_bwd"),
}


def test_backend_modes_are_what_the_modules_implement():
    """BACKEND_MODES lists exactly the modes whose functions a backend's module for that mode has (MODE_MODULES, else
    ``_loss_{backend}``); the torch twin has every mode."""
    modes = BACKEND_MODES["loss"]
    assert set(modes["torch"]) == set(_MODE_FUNCTIONS) and set(modes["triton"]) <= set(modes["torch"])
    for backend, listed in modes.items():
        implemented = []
        for mode, fns in _MODE_FUNCTIONS.items():
            module = importlib.import_module(
                f"cppo_kernels.{MODE_MODULES.get(('loss', backend, mode), f'_loss_{backend}')}"
            )
            if all(callable(getattr(module, f, None)) for f in fns):
                implemented.append(mode)
        assert sorted(implemented) == sorted(listed), backend


def test_each_mode_runs_its_backends_module(monkeypatch):
    """Gradient-in-forward on the Triton backend is the GEMM path (cppo_kernels._loss_gemm), on the torch backend
    the torch twin; two-pass follows the backend choice; a forced Triton backend that cannot run here raises in
    both modes."""
    x = torch.zeros(1)
    with use_backend("triton"):
        assert backend_module("loss", x, mode="grad-in-forward").__name__ == "cppo_kernels._loss_gemm"
        assert backend_module("loss", x, mode="two-pass").__name__ == "cppo_kernels._loss_triton"
    for backend in ("auto", "torch"):  # auto on a CPU tensor: torch
        with use_backend(backend):
            assert backend_module("loss", x, mode="grad-in-forward").__name__ == "cppo_kernels._loss_torch"
            assert backend_module("loss", x, mode="two-pass").__name__ == "cppo_kernels._loss_torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("triton"):
        for mode in ("grad-in-forward", "two-pass"):
            with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
                backend_module("loss", x, mode=mode)


def test_bad_mode_is_a_clear_error():
    x = torch.zeros(1)
    with pytest.raises(ValueError, match=r"mode must be one of \('two-pass', 'grad-in-forward'\) for op 'loss'"):
        backend_module("loss", x, mode="fast")
    with pytest.raises(ValueError, match="op 'advantages' has no execution modes"):
        backend_module("advantages", x, mode="two-pass")
