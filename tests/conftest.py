"""Test set-up: the Triton interpreter must be on before any @triton.jit runs."""

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pathlib
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import cppo_kernels  # noqa: E402, F401  (imported after TRITON_INTERPRET is set)

# triton decorates its own @jit helpers (tl.sum, tl.max, ...) at its first import, under the TRITON_INTERPRET of that
# moment, and cppo_kernels imports it lazily: import it now, so that a test setting TRITON_INTERPRET=0 before anything
# imported triton cannot break every interpreted kernel after it (tests/kernels/test_dispatch.py)
if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: E402, F401

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / "shared"
SUPPORT = pathlib.Path(__file__).resolve().parent / "support"
# shared fixtures, harnesses and reference transcriptions live in tests/support/: imported by module name, so that no
# test module imports another one
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))


def pytest_collection_modifyitems(config, items):
    """The real-vLLM tests (marker ``vllm``) run in a pytest process of their own (``pytest -m vllm``, as ``make
    test`` runs them): an in-process vLLM engine initialises torch.distributed's default group for the whole process,
    which the distributed tests sharing a worker with it would then find taken."""
    expression = config.getoption("markexpr") or ""
    if "vllm" in expression and "not vllm" not in expression:
        return
    skip = pytest.mark.skip(reason="the real-vLLM tests run on their own: pytest -m vllm (make test runs them)")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


FAILURE_LOG = os.environ.get("CPPO_TEST_FAILURE_LOG")


def pytest_runtest_logreport(report):
    """With ``CPPO_TEST_FAILURE_LOG`` set (the GPU kit's tests part), each failure is appended to that file as a JSON
    line the moment it happens (under xdist: in the controller), so a run stopped at its time budget keeps the
    messages of the failures it saw."""
    if not FAILURE_LOG or not report.failed:
        return
    import json

    line = {"test": report.nodeid, "when": report.when, "message": report.longreprtext[-2000:]}
    with open(FAILURE_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Runs a test once per backend by setting CPPO_KERNELS_BACKEND."""
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", request.param)
    return request.param


@pytest.fixture
def shared_dir():
    if not SHARED.is_dir():
        pytest.skip(f"../shared is absent ({SHARED}): data and model tests need it")
    return SHARED


BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
# every test sees benchmarks/ on the path, as its scripts do when they run: whether a benchmark module imports its
# siblings never depends on which test ran first
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


@pytest.fixture(scope="session")
def speedup():
    """The end-to-end benchmark behind ``benchmarks/speedup.py``: ``benchmarks/endtoend/speedup.py``."""
    from endtoend import speedup

    return speedup


@pytest.fixture(scope="session")
def report():
    """``benchmarks/endtoend/report.py``: the rows and the report of the speedup benchmark."""
    from endtoend import report

    return report
