"""benchmarks/gpu_check.py, the GPU validation kit: its dry run end to end (what CI can run of it) and its pieces."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def kit():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _demo_wheel(folder: pathlib.Path) -> pathlib.Path:
    """A minimal pure-Python wheel (one module) such as the kit carries in its wheel folder."""
    folder.mkdir()
    path = folder / "gpu_kit_demo-0.1-py3-none-any.whl"
    info = "gpu_kit_demo-0.1.dist-info"
    files = {
        "gpu_kit_demo/__init__.py": "VALUE = 42\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpu-kit-demo\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


# --------------------------------------------------------------------------------------------
# The dry run, end to end
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dry_run(tmp_path):
    """Every part's code path on tiny CPU shapes, a carried wheel, the JSON per part and the summary."""
    out = tmp_path / "out"
    _demo_wheel(tmp_path / "wheels")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)  # the kit sets it for its parts itself
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--wheels", str(tmp_path / "wheels")]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = done.stdout.splitlines()[0]
    assert first.startswith("gpu_check: ") and "dry run" in first, first

    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_status"] == 0 and summary["kit"]["dry_run"] is True
    assert all(c["ok"] for c in summary["kit"]["checks"]), summary["kit"]["checks"]
    assert summary["kit"]["wheels"]["installed"] == ["gpu_kit_demo-0.1"]
    assert summary["kit"]["wheels"]["imports"] == {"gpu_kit_demo": "ok"}
    assert set(summary["kit"]["environment"]) >= {"torch", "triton", "python", "git_commit", "cuda_available"}
    parts = {p: json.loads((out / f"{p}.json").read_text()) for p in ("tests", "loss", "select", "e2e")}
    assert list(summary["parts"]) == list(parts)
    for name, part in parts.items():
        assert part["status"] == "pass" and part["checks"], name
        assert all(c["ok"] for c in part["checks"]), part["checks"]
        assert summary["parts"][name]["status"] == "pass" and part["budget_s"] > 0

    selected = parts["tests"]["results"]["selected"]  # collection only: the CUDA tests, nothing else
    assert "tests/test_loss_triton.py::test_new_token_count_or_temperature_does_not_recompile" in selected
    assert any(t.startswith("tests/test_cuda_kernels.py::test_loss_matches_reference") for t in selected)
    assert {t.split("::")[0] for t in selected} == {
        "tests/test_cuda_kernels.py",
        "tests/test_loss_triton.py",
        "tests/test_loss_grad_in_forward.py",
    }
    shapes = {k: v for k, v in parts["loss"]["results"].items() if isinstance(v, dict) and "methods" in v}
    assert list(shapes) == ["T=512 H=32 V=1000 float32", "T=512 H=48 V=700 bfloat16"]
    for shape in shapes.values():
        fused = {"fused-grad-in-forward-torch", "fused-two-pass-torch"}
        assert fused | {"naive"} <= set(shape["methods"]) and shape["gemm"]["ms"] > 0
        assert all(shape["methods"][m]["library"] for m in fused) and not shape["methods"]["naive"]["library"]
    rows = parts["select"]["results"]["rows"]
    assert {(r["backend"], r["mode"]) for r in rows} == {("torch", "eager"), ("triton", "interpreter")}
    assert len(rows) == 10 and all(r["matches_reference"] and "launches_per_call" in r for r in rows)
    e2e = parts["e2e"]["results"]
    assert e2e["packed float32"]["control_error"] > 10 * e2e["packed float32"]["error"]
    assert [r["pruning_rate"] for r in e2e["speedup hf"]["rows"]] == [0.0, 0.5]
    assert (out / "speedup-hf" / "speedup.json").is_file()
    assert (
        e2e["speedup vllm"].startswith("dry run: arguments checked") and "--rollout-backend vllm" in e2e["speedup vllm"]
    )

    md = (out / "summary.md").read_text()
    assert md.startswith("# GPU validation kit: results") and "**Dry run**" in md
    for part in parts:
        assert f"| {part} | pass |" in md and f"## {part}" in md
    assert "gpu_kit_demo-0.1" in md and md in done.stdout  # the summary is printed last


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------


class _Item:
    """A collected test as the selection sees it: its markers."""

    def __init__(self, *marks) -> None:
        self.marks = [m.mark for m in marks]

    def iter_markers(self, name: str):
        return (m for m in self.marks if m.name == name)


def test_the_cuda_tests_are_those_skipped_without_cuda(kit):
    needs = pytest.mark.skipif
    for cuda in (False, True):
        assert kit.needs_cuda(_Item(needs(not cuda, reason="needs a CUDA device")), cuda=cuda)
        assert kit.needs_cuda(_Item(needs(not cuda, reason="bit-exactness needs GPU MMA")), cuda=cuda)
        assert kit.needs_cuda(_Item(pytest.mark.slow, needs(not cuda, reason="needs a GPU")), cuda=cuda)
        assert not kit.needs_cuda(_Item(needs(cuda, reason="needs a machine without CUDA")), cuda=cuda)
        assert not kit.needs_cuda(_Item(needs(True, reason="../shared is absent")), cuda=cuda)
        assert not kit.needs_cuda(_Item(needs("sys.platform == 'x'", reason="cuda")), cuda=cuda)
        assert not kit.needs_cuda(_Item(), cuda=cuda)


def test_a_child_is_ended_with_everything_it_started(kit, tmp_path):
    """At its timeout, the child and its own child (a pytest worker, speedup.py) are ended, not left running."""
    log = tmp_path / "child.log"
    code = "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"
    rc, timed_out, _ = kit.run_child([sys.executable, "-c", code], timeout=3, log=log)
    assert (rc, timed_out) == (None, True)
    grandchild = int(log.read_text().split()[0])
    stat = pathlib.Path(f"/proc/{grandchild}/stat")
    for _ in range(300):  # ended: gone, or a zombie waiting for its new parent to reap it
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {grandchild} still runs after its group was ended")
    rc, timed_out, _ = kit.run_child([sys.executable, "-c", "raise SystemExit(4)"], timeout=30, log=log)
    assert (rc, timed_out) == (4, False)


def _part(path: pathlib.Path, status: str, *oks: bool) -> None:
    checks = [{"name": f"c{i}", "ok": ok, "detail": ""} for i, ok in enumerate(oks)]
    path.write_text(json.dumps({"part": "loss", "status": status, "checks": checks, "results": {"x": 1}}))


@pytest.mark.parametrize(
    "written,rc,timed_out,status",
    [
        (("pass", True), 0, False, "pass"),
        (("fail", True, False), 1, False, "fail"),
        (("running", True), None, True, "timeout"),  # killed at its budget: what it had stays
        (("running", True, False), None, True, "fail"),  # a check failed before the kill
        (("timeout", True), 3, False, "timeout"),  # stopped itself for want of time
        (("error", False), 1, False, "error"),
        (("running", True), -11, False, "error"),  # crashed
        (None, 1, False, "error"),  # crashed before writing anything
    ],
)
def test_a_parts_final_status(kit, tmp_path, written, rc, timed_out, status):
    if written is not None:
        _part(tmp_path / "loss.json", *written)
    data = kit.finish_part(tmp_path, "loss", rc=rc, timed_out=timed_out, seconds=1.23, budget=10.0)
    assert data["status"] == status and data["seconds"] == 1.2 and data["exit_status"] == rc
    assert json.loads((tmp_path / "loss.json").read_text()) == data
    if written is not None:
        assert data["results"] == {"x": 1}
    if status == "error" and written != ("error", False):
        assert "loss.log" in data["error"]


def test_exit_status(kit):
    assert kit.exit_status(["pass", "pass"]) == 0
    assert kit.exit_status(["pass", "timeout"]) == kit.exit_status(["skipped"]) == 3
    assert kit.exit_status(["timeout", "fail"]) == kit.exit_status(["error", "pass"]) == 1


def test_the_summary_of_an_incomplete_run(kit, tmp_path):
    kit_info = {
        "dry_run": False, "deadline_s": 450.0, "elapsed_s": 449.0, "checks": [],
        "environment": {"date": "d", "python": "3.12", "torch": "2.11", "cuda_runtime": "13.0", "git_commit": "abc",
                        "git_dirty": None, "gpu": "NVIDIA H200", "gpu_memory_gib": 139.8, "compute_capability": "9.0",
                        "multiprocessors": 132, "driver": "580"},
        "wheels": {"folder": ".gpu-wheels", "installed": []},
    }  # fmt: skip
    parts = {
        "tests": {"status": "timeout", "checks": [], "seconds": 150.0, "budget_s": 150.0, "error": "pytest stopped",
                  "results": {"outcomes": {"source": "log", "passed": 3, "failed": [], "errors": [],
                                           "skipped": [{"test": "t", "message": "needs vllm"}]}}},
        "loss": {"status": "skipped", "checks": [], "seconds": 0.0, "budget_s": 140.0, "results": {},
                 "error": "only 3 s left of --deadline"},
    }  # fmt: skip
    assert kit.write_summary(tmp_path, kit_info, parts) == 3
    md = (tmp_path / "summary.md").read_text()
    assert "NVIDIA H200, 139.8 GiB, compute capability 9.0, 132 SMs, driver 580" in md
    assert "| tests | timeout | 150.0 | 150 | 0/0 |" in md and "| loss | skipped |" in md
    assert "3 passed, 0 failed, 0 errors, 1 skipped (from pytest's log)" in md and "only 3 s left" in md
    assert json.loads((tmp_path / "summary.json").read_text())["exit_status"] == 3


def test_outcomes_from_junit_or_from_the_log(kit, tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest"><testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2">tb</failure></testcase>'
        '<testcase classname="tests.test_b" name="test_skip"><skipped message="needs vllm"/></testcase>'
        "</testsuite></testsuites>"
    )
    got = kit.junit_results(junit)
    assert (got["passed"], got["failed"], len(got["skipped"])) == (
        1, [{"test": "tests.test_a::test_bad", "message": "assert 1 == 2"}], 1
    )  # fmt: skip
    assert kit.junit_results(tmp_path / "absent.xml") is None
    log = (
        "[gw0] [ 25%] PASSED tests/test_a.py::test_ok[bf16]\n[gw1] [ 50%] FAILED tests/test_a.py::test_bad\n"
        "tests/test_b.py::test_c PASSED [ 75%]\ntests/test_b.py::test_d SKIPPED (needs vllm) [100%]\n"
    )
    got = kit.log_results(log)
    assert got["passed"] == 2 and [x["test"] for x in got["failed"]] == ["tests/test_a.py::test_bad"]
    assert [x["test"] for x in got["skipped"]] == ["tests/test_b.py::test_d"] and got["errors"] == []


def test_loss_summary_against_the_gemm_floor(kit):
    row = dict(fwd_s=0.001, bwd_s=0.002, peak_extra_bytes=2e9, workspace_bytes=1e9, loss=0.5)
    res = {
        "tokens": 4, "hidden": 8, "vocab": 16, "matmul_s": 0.001,
        "methods": {"fused-triton": {**row, "fwd_bwd_s": 0.003}, "naive": {**row, "fwd_bwd_s": 0.002, "loss": 0.7},
                    "liger-chunked": {**row, "fwd_bwd_s": 0.006}},
    }  # fmt: skip
    got = kit.loss_summary(res, {"loss64": 0.5})
    fused = got["methods"]["fused-triton"]
    assert fused["x_gemm_floor"] == pytest.approx(1.0) and fused["tflops"] == pytest.approx(
        6 * 4 * 8 * 16 / 3e-3 / 1e12
    )
    assert got["gemm"]["tflops"] == pytest.approx(2 * 4 * 8 * 16 / 1e-3 / 1e12)
    assert (got["fastest"], got["fastest_library"]) == ("naive", "fused-triton")
    assert [m["library"] for m in got["methods"].values()] == [True, False, False]
    assert got["methods"]["naive"]["loss_error"] == pytest.approx(0.2)


def test_no_wheel_folder_is_fine(kit, tmp_path):
    got = kit.install_wheels(tmp_path / "absent", tmp_path / "site")
    assert got["wheels"] == got["installed"] == [] and got["imports"] == {}


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--parts", "tests,bogus"], "--parts"),
        (["--parts", "loss,loss"], "--parts"),
        (["--deadline", "0"], "--deadline"),
        (["--deadline", "nan"], "--deadline"),
        (["--part", "loss"], "--out"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(kit, capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        kit.parse_args(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_out_that_is_or_lies_under_a_file_is_refused(kit, capsys, tmp_path, below):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        kit.parse_args(["--out", str(tmp_path / "file" / below)])
    assert e.value.code == 2 and f"'{tmp_path / 'file'}' is a file" in capsys.readouterr().err


def test_parts_run_in_their_order(kit):
    assert kit.parse_args(["--parts", "e2e, tests"]).parts == ["tests", "e2e"]
    assert kit.parse_args([]).parts == list(kit.PARTS)
    assert sum(kit.BUDGET_S.values()) + kit.RESERVE_S <= kit.DEADLINE_S <= 8 * 60
