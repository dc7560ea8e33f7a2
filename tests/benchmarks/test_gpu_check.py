"""benchmarks/gpu_check.py and benchmarks/gpukit/, the GPU validation kit: its dry run end to end (what CI can run
of it) and its pieces."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import zipfile

import gpu_check
import pytest
from gpukit import part_loss, part_tests, parts, plan, report, runner, wheels

from cppo.fileio import run_metadata

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
TESTS = REPO / "tests"


def readme_budgets() -> dict[str, float]:
    """The budget column of the table of the kit's parts in its page, docs/gpu-kit.md."""
    page = (REPO / "docs" / "gpu-kit.md").read_text(encoding="utf-8")
    section = page.split("# GPU validation kit", 1)[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)` \|.*\| (\d+) s \|$", section, re.M)
    return {part: float(seconds) for part, seconds in rows}


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


def _assert_dry_results(parts: dict[str, dict], out: pathlib.Path) -> None:
    """What each part of the dry run recorded: the tests it selected, the loss shapes and methods, the selection rows,
    the packed forward's errors and the speedup runs."""
    selected = parts["tests"]["results"]["selected"]  # collection only: the CUDA tests, nothing else
    assert parts["tests"]["results"]["command"][1:4] == ["pytest", "-m", "cuda"]
    assert "tests/kernels/test_loss_triton.py::test_new_token_count_or_temperature_does_not_recompile" in selected
    assert any(t.startswith("tests/kernels/test_cuda_kernels.py::test_loss_matches_reference") for t in selected)
    assert any(t.startswith("tests/kernels/test_cuda_kernels.py::test_the_loss_at_the_kits_shapes") for t in selected)
    assert {t.split("::")[0] for t in selected} == {
        "tests/kernels/test_cuda_kernels.py",
        "tests/kernels/test_loss_triton.py",
        "tests/kernels/test_loss_grad_in_forward.py",
        "tests/kernels/test_loss_logit_transform.py",  # issue 26's logit transform on CUDA
        "tests/cppo/step/test_cuda_models.py",
    }
    shapes = {k: v for k, v in parts["loss"]["results"].items() if isinstance(v, dict) and "methods" in v}
    assert list(shapes) == ["T=512 H=32 V=1000 float32", "T=512 H=48 V=700 bfloat16"]
    for shape in shapes.values():
        fused = {"fused-grad-in-forward-torch", "fused-two-pass-torch"}
        fused |= {f"{name}-sapo" for name in fused}  # a new loss type beside dapo (issue 26)
        assert fused | {"naive"} <= set(shape["methods"]) and shape["gemm"]["ms"] > 0
        assert shape["accuracy"]["loss64_sapo"] != shape["accuracy"]["loss64"]
        assert all(shape["methods"][m]["loss_error"] < 1e-3 for m in fused), shape["methods"]
        assert all(shape["methods"][m]["library"] for m in fused) and not shape["methods"]["naive"]["library"]
    rows = parts["select"]["results"]["rows"]
    assert {(r["backend"], r["mode"]) for r in rows} == {("torch", "eager"), ("triton", "interpreter")}
    assert len(rows) == 10 and all(r["matches_reference"] and "launches_per_call" in r for r in rows)
    e2e = parts["e2e"]["results"]
    assert e2e["packed float32"]["control_error"] > 10 * e2e["packed float32"]["error"]
    varlen = e2e["varlen"]  # torch_varlen's code path with the reference kernel in place of varlen_attn's
    assert (varlen["attn_implementation"], varlen["fallbacks"]) == ("torch_varlen_reference", [])
    assert varlen["control_error"] > 10 * varlen["tolerance"] > 10 * varlen["error"]
    assert all(varlen[f"fwd_bwd_s_{k}"] > 0 for k in ("varlen", "sdpa_padded", "sdpa_packed"))
    assert [r["pruning_rate"] for r in e2e["speedup hf"]["rows"]] == [0.0, 0.5]
    assert (out / "speedup-hf" / "speedup.json").is_file()
    assert (
        e2e["speedup vllm"].startswith("dry run: arguments checked") and "--rollout-backend vllm" in e2e["speedup vllm"]
    )


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
    budgets = readme_budgets()  # the dry run announces the budgets the README documents
    assert budgets == {"tests": 200.0, "loss": 130.0, "select": 35.0, "e2e": 100.0}
    for part, seconds in budgets.items():
        assert f"[{part}] start (budget {seconds:.0f} s)" in done.stdout, done.stdout[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_status"] == 0 and summary["kit"]["dry_run"] is True
    assert summary["kit"]["budgets_s"] == budgets
    assert all(c["ok"] for c in summary["kit"]["checks"]), summary["kit"]["checks"]
    assert summary["kit"]["wheels"]["installed"] == ["gpu_kit_demo-0.1"]
    assert summary["kit"]["wheels"]["imports"] == {"gpu_kit_demo": "ok"}
    assert set(summary["kit"]["environment"]) >= {"torch", "triton", "python", "git_commit", "cuda_available"}
    parts = {p: json.loads((out / f"{p}.json").read_text()) for p in ("tests", "loss", "select", "e2e")}
    assert list(summary["parts"]) == list(parts)
    for name, part in parts.items():
        assert part["status"] == "pass" and part["checks"], name
        assert all(c["ok"] for c in part["checks"]), part["checks"]
        assert summary["parts"][name]["status"] == "pass" and part["budget_s"] == budgets[name]

    _assert_dry_results(parts, out)

    md = (out / "summary.md").read_text()
    assert md.startswith("# GPU validation kit: results") and "**Dry run**" in md
    for part in parts:
        assert f"| {part} | pass |" in md and f"## {part}" in md
    assert "gpu_kit_demo-0.1" in md and md in done.stdout  # the summary is printed last


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------


def _marks(decorators: list[ast.expr]) -> set[str]:
    """``cuda`` for ``pytest.mark.cuda``, ``skip`` for ``pytest.mark.skipif(not torch.cuda.is_available(), ...)``."""
    found = set()
    for node in decorators:
        text = ast.unparse(node)
        if text == "pytest.mark.cuda":
            found.add("cuda")
        elif text.startswith("pytest.mark.skipif(not torch.cuda.is_available()"):
            found.add("skip")
    return found


def test_a_test_skipped_without_cuda_is_marked_cuda_and_the_other_way_round():
    """The kit's tests part selects with ``-m cuda``: a CUDA test without the marker would never run on the GPU, a
    marked test that runs without CUDA would be a CPU test in the GPU's time."""
    tests = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
                module |= _marks(list(getattr(node.value, "elts", [node.value])))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                marks = module | _marks(node.decorator_list)
                tests.append((f"{path.relative_to(REPO)}::{node.name}", marks))
                assert marks != {"cuda"} and marks != {"skip"}, f"{tests[-1][0]}: marks {marks}"
    marked = [name for name, marks in tests if marks]
    assert "tests/kernels/test_loss_grad_in_forward.py::test_cuda_grad_in_forward_matches_the_triton_two_pass" in marked
    assert len({name.split("::")[0] for name in marked}) == 5, marked


def test_no_benchmark_module_imports_a_test_module():
    test_modules = {path.stem for path in TESTS.rglob("*.py")}  # test_*, conftest and the helpers of tests/support
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            bad = {name.split(".")[0] for name in names} & test_modules
            assert not bad, f"{path.relative_to(REPO)}:{node.lineno} imports the test module(s) {sorted(bad)}"


def test_the_tests_part_selects_by_marker(tmp_path):
    for dry in (True, False):
        cmd = part_tests.tests_command(plan.DRY_PLAN if dry else plan.GPU_PLAN, tmp_path)
        assert cmd[1:5] == ["-m", "pytest", "-m", "cuda"] and str(TESTS) in cmd and "gpu_check" not in cmd
        assert ("--collect-only" in cmd) == dry and any(a.startswith("--junitxml=") for a in cmd) != dry


def test_the_budgets_are_the_readmes_and_fit_the_deadline():
    assert readme_budgets() == plan.BUDGET_S
    assert list(parts.PART_FUNCTIONS) == list(plan.PARTS) == list(plan.BUDGET_S)
    assert sum(plan.BUDGET_S.values()) + plan.RESERVE_S <= plan.DEADLINE_S <= 8 * 60


def test_the_environment_record_is_run_metadata_with_the_cuda_side():
    """What the kit records (cppo.fileio.run_metadata(cuda=True)); on a machine without CUDA, no GPU fields."""
    import torch

    meta = run_metadata(device="cpu", commit="abc", argv=["gpu_check.py"], cuda=True)
    assert meta["cuda_available"] == torch.cuda.is_available() and meta["cuda_runtime"] == torch.version.cuda
    assert meta["git_commit"] == "abc" and meta["git_dirty"] is None and meta["argv"] == ["gpu_check.py"]
    assert {"date", "python", "torch", "triton", "device_name"} <= set(meta)
    assert ("gpu" in meta) == torch.cuda.is_available()
    assert "cuda_runtime" not in run_metadata(device="cpu", commit="abc")


def test_a_child_is_ended_with_everything_it_started(tmp_path):
    """At its timeout, the child and its own child (a pytest worker, speedup.py) are ended, not left running."""
    log = tmp_path / "child.log"
    code = "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"
    rc, timed_out, _ = runner.run_child([sys.executable, "-c", code], timeout=3, log=log)
    assert (rc, timed_out) == (None, True)
    grandchild = int(log.read_text().split()[0])
    stat = pathlib.Path(f"/proc/{grandchild}/stat")
    for _ in range(300):  # ended: gone, or a zombie waiting for its new parent to reap it
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {grandchild} still runs after its group was ended")
    rc, timed_out, _ = runner.run_child([sys.executable, "-c", "raise SystemExit(4)"], timeout=30, log=log)
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
def test_a_parts_final_status(tmp_path, written, rc, timed_out, status):
    if written is not None:
        _part(tmp_path / "loss.json", *written)
    data = runner.finish_part(tmp_path, "loss", rc=rc, timed_out=timed_out, seconds=1.23, budget=10.0)
    assert data["status"] == status and data["seconds"] == 1.2 and data["exit_status"] == rc
    assert json.loads((tmp_path / "loss.json").read_text()) == data
    if written is not None:
        assert data["results"] == {"x": 1}
    if status == "error" and written != ("error", False):
        assert "loss.log" in data["error"]


def test_exit_status():
    assert report.exit_status(["pass", "pass"]) == 0
    assert report.exit_status(["pass", "timeout"]) == report.exit_status(["skipped"]) == 3
    assert report.exit_status(["timeout", "fail"]) == report.exit_status(["error", "pass"]) == 1


def test_the_summary_of_an_incomplete_run(tmp_path):
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
    assert report.write_summary(tmp_path, kit_info, parts) == 3
    md = (tmp_path / "summary.md").read_text()
    assert "NVIDIA H200, 139.8 GiB, compute capability 9.0, 132 SMs, driver 580" in md
    assert "| tests | timeout | 150.0 | 150 | 0/0 |" in md and "| loss | skipped |" in md
    assert "3 passed, 0 failed, 0 errors, 1 skipped (from pytest's log)" in md and "only 3 s left" in md
    assert json.loads((tmp_path / "summary.json").read_text())["exit_status"] == 3


def test_outcomes_from_junit_or_from_the_log(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest"><testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2">tb</failure></testcase>'
        '<testcase classname="tests.test_b" name="test_skip"><skipped message="needs vllm"/></testcase>'
        "</testsuite></testsuites>"
    )
    got = part_tests.junit_results(junit)
    assert (got["passed"], got["failed"], len(got["skipped"])) == (
        1, [{"test": "tests.test_a::test_bad", "message": "assert 1 == 2"}], 1
    )  # fmt: skip
    assert part_tests.junit_results(tmp_path / "absent.xml") is None
    log = (
        "[gw0] [ 25%] PASSED tests/test_a.py::test_ok[bf16]\n[gw1] [ 50%] FAILED tests/test_a.py::test_bad\n"
        "tests/test_b.py::test_c PASSED [ 75%]\ntests/test_b.py::test_d SKIPPED (needs vllm) [100%]\n"
    )
    got = part_tests.log_results(log)
    assert got["passed"] == 2 and [x["test"] for x in got["failed"]] == ["tests/test_a.py::test_bad"]
    assert [x["test"] for x in got["skipped"]] == ["tests/test_b.py::test_d"] and got["errors"] == []


def test_a_stopped_tests_part_keeps_each_failures_message(tmp_path):
    """The failure log tests/conftest.py writes as failures happen fills in what a stopped run's log lacks, and adds
    a failure the log had not shown yet."""
    failures = tmp_path / "tests-failures.jsonl"
    failures.write_text(
        json.dumps({"test": "tests/test_a.py::test_bad", "when": "call", "message": "assert 1 == 2"}) + "\n"
        + json.dumps({"test": "tests/test_a.py::test_later", "when": "call", "message": "boom"}) + "\nnot json\n"
    )  # fmt: skip
    got = part_tests.log_results("[gw1] [ 50%] FAILED tests/test_a.py::test_bad\n")
    got = part_tests.with_failure_messages(got, failures)
    assert got["failed"] == [
        {"test": "tests/test_a.py::test_bad", "message": "assert 1 == 2"},
        {"test": "tests/test_a.py::test_later", "message": "boom"},
    ]
    assert part_tests.with_failure_messages({"failed": [], "errors": []}, tmp_path / "absent") == {
        "failed": [], "errors": []
    }  # fmt: skip


def test_conftest_writes_a_failure_the_moment_it_happens(tmp_path):
    """A real pytest run with CPPO_TEST_FAILURE_LOG set: the failing test's message is in the file."""
    (tmp_path / "test_one.py").write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2\n")
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    log = tmp_path / "failures.jsonl"
    env = {**os.environ, "CPPO_TEST_FAILURE_LOG": str(log)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["test"].split("::")[-1] for x in lines] == ["test_bad"] and "assert 1 == 2" in lines[0]["message"]


def test_a_comparison_method_that_raises_is_recorded_and_left_out(monkeypatch):
    """A peer's failure (Liger's torch.compile on the H200) costs neither the library's rows nor the run."""
    import bench_loss
    import torch

    real = bench_loss.build_methods

    def with_a_broken_peer(device, inputs):
        def broken():
            raise RuntimeError("peer exploded\nlast line")

        return {**real(device, inputs), "liger-broken": bench_loss.Method(broken, False)}

    monkeypatch.setattr(bench_loss, "build_methods", with_a_broken_peer)
    res = bench_loss.run_config(512, 16, 64, torch.float32, torch.device("cpu"), 1, 0)
    assert res["failed_methods"] == {"liger-broken": "RuntimeError: last line"}
    assert "liger-broken" not in res["methods"] and any(n.startswith("fused") for n in res["methods"])


def test_loss_summary_against_the_gemm_floor():
    row = dict(fwd_s=0.001, bwd_s=0.002, peak_extra_bytes=2e9, workspace_bytes=1e9, loss=0.5)
    res = {
        "tokens": 4, "hidden": 8, "vocab": 16, "matmul_s": 0.001,
        "methods": {"fused-triton": {**row, "fwd_bwd_s": 0.003}, "naive": {**row, "fwd_bwd_s": 0.002, "loss": 0.7},
                    "liger-chunked": {**row, "fwd_bwd_s": 0.006}},
    }  # fmt: skip
    res["methods"]["fused-triton-sapo"] = {**row, "fwd_bwd_s": 0.004, "loss": 0.25}
    got = part_loss.loss_summary(res, {"loss64": 0.5, "loss64_sapo": 0.3})
    assert got["methods"].pop("fused-triton-sapo")["loss_error"] == pytest.approx(0.05)  # against sapo's oracle
    fused = got["methods"]["fused-triton"]
    assert fused["x_gemm_floor"] == pytest.approx(1.0) and fused["tflops"] == pytest.approx(
        6 * 4 * 8 * 16 / 3e-3 / 1e12
    )
    assert got["gemm"]["tflops"] == pytest.approx(2 * 4 * 8 * 16 / 1e-3 / 1e12)
    assert (got["fastest"], got["fastest_library"]) == ("naive", "fused-triton")
    assert [m["library"] for m in got["methods"].values()] == [True, False, False]
    assert got["methods"]["naive"]["loss_error"] == pytest.approx(0.2)


def test_the_varlen_row_is_checked_and_rendered_and_an_error_is_a_failed_check(tmp_path, monkeypatch):
    from gpukit import part_varlen

    ms = {"varlen": 1, "sdpa_padded": 3, "sdpa_packed": 2}
    timings = {f"fwd_bwd_s_{k}": n / 1e3 for k, n in ms.items()} | {f"peak_extra_gb_{k}": n / 10 for k, n in ms.items()}
    row = dict(attn_implementation="torch_varlen", kernel="varlen_attn", dtype="bfloat16", tolerance=2e-2,
               lengths=[1, 2], error=3e-3, control_error=0.1, fallbacks=["torch_varlen: x: runs sdpa"],
               timing_lengths=[5, 6], tokens_packed=11, tokens_padded=12, speedup_vs_sdpa_padded=3.0,
               speedup_vs_sdpa_packed=2.0, **timings)  # fmt: skip
    md = "\n".join(report.render_e2e({"varlen": row}))
    assert "| torch_varlen | packed | 1.00 | 0.10 |" in md and "| sdpa | padded | 3.00 | 0.30 |" in md
    assert "speedup against sdpa padded 3.00x" in md and "calls run by sdpa instead: 1" in md
    got = runner.Report(tmp_path / "e2e.json", "e2e", plan.DRY_PLAN)
    monkeypatch.setattr(part_varlen, "varlen_packed", lambda p: row)
    part_varlen.record(plan.DRY_PLAN, got)
    assert [c["ok"] for c in got.data["checks"]] == [True, False, False]  # within 2e-2; no leak; one fallback

    def broken(p):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(part_varlen, "varlen_packed", broken)
    part_varlen.record(plan.DRY_PLAN, got)
    assert got.data["results"]["varlen"] == "error: RuntimeError: no kernel image" and not got.data["checks"][-1]["ok"]


def test_no_wheel_folder_is_fine(tmp_path):
    got = wheels.install_wheels(tmp_path / "absent", tmp_path / "site")
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
def test_bad_arguments_are_refused_naming_the_flag(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_out_that_is_or_lies_under_a_file_is_refused(capsys, tmp_path, below):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(["--out", str(tmp_path / "file" / below)])
    assert e.value.code == 2 and f"'{tmp_path / 'file'}' is a file" in capsys.readouterr().err


def test_parts_run_in_their_order():
    assert gpu_check.parse_args(["--parts", "e2e, tests"]).parts == ["tests", "e2e"]
    assert gpu_check.parse_args([]).parts == list(plan.PARTS)
