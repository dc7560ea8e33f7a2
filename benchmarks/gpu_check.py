#!/usr/bin/env python3
"""GPU validation kit: one command that checks and times every CUDA path of the project on a bare GPU machine.

    python3 benchmarks/gpu_check.py                 # = make gpu-check; results in benchmarks/results/gpu/
    python3 benchmarks/gpu_check.py --out DIR --deadline 450 --parts tests,loss,select,e2e --commit SHA
    python3 benchmarks/gpu_check.py --dry-run       # the kit's own plumbing on tiny CPU shapes (what CI runs)

It runs on the machine's own python3 and packages and downloads nothing: the repository goes on ``sys.path``
(no install), and the pure-Python wheels found in ``--wheels`` (default ``.gpu-wheels/``, e.g. Liger-Kernel) are
installed with ``pip --no-index --no-deps`` into a temporary folder put on the path. Then four parts, each in its own
process group with a time budget (:data:`BUDGET_S`), so that a crash or a hang costs one part and not the others:

1. ``tests``: the suite's CUDA tests (those skipped for want of CUDA, tests/test_cuda_kernels.py among them: the
   kernels' properties on the GPU) through pytest with ``TRITON_INTERPRET=0``;
2. ``loss``: every method of ``bench_loss.build_methods`` (forward + backward) at T=16,384, H=1,536, V=151,936 bf16
   and at the CPU benchmark's shape, against the plain ``[T,H] x [H,V]`` GEMM timed in the same run: milliseconds,
   TFLOP/s, peak memory; the library's losses and ``fused_logprobs`` against a float64 oracle;
3. ``select``: group_advantages / select_completions / cppo_select at N = 16 x {64, 1,024, 4,096} on both backends
   (CUDA events, ``bench_select``), with the kernels launched per call counted by torch.profiler;
4. ``e2e``: the packed forward (sequences in one row, position_ids restarting) against separate forwards
   (flash-attention 2 when importable, sdpa otherwise), then ``benchmarks/speedup.py`` tiny on CUDA (HF rollouts;
   vLLM too when importable).

Each part writes ``<out>/<part>.json`` (atomically) whenever it has a new result and the kit rewrites
``summary.md`` / ``summary.json`` after every part, so a kill leaves everything finished so far. Exit status: 0 when
every check passed, 1 when a check failed or a part crashed, 2 for bad arguments, 3 when nothing failed but a part
ran out of time. Without CUDA (or with ``--dry-run``) it says so in one line and runs every part's code path on tiny
CPU shapes instead (nothing measured), into a temporary folder unless ``--out`` is given.

Loaded as a pytest plugin (``pytest -p gpu_check``, as part 1 does), it keeps only the suite's CUDA tests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
TESTS = REPO / "tests"
DEFAULT_OUT = BENCH / "results" / "gpu"
DEFAULT_WHEELS = REPO / ".gpu-wheels"
PARTS = ("tests", "loss", "select", "e2e")

#: Seconds each part may take on one H200, Triton compilation and process start-up included; its process group is
#: killed after that. Expected: tests about 90 (some 100 Triton binaries compiled by 4 pytest workers, hypothesis
#: examples checked against fp64 oracles on the CPU), loss about 60 (plus about 60 for torch.compile when
#: Liger-Kernel is carried), select about 20, e2e about 50. They add up to 430 s, inside DEADLINE_S with the set-up
#: (imports, wheels: about 15 s).
BUDGET_S = {"tests": 150.0, "loss": 140.0, "select": 40.0, "e2e": 100.0}
#: The default --deadline: the whole kit, set-up and summary included, well under the issue's 8 minutes.
DEADLINE_S = 450.0
#: Seconds kept back for the summary; a part is skipped when less than MIN_PART_S would be left for it.
RESERVE_S = 5.0
MIN_PART_S = 10.0
#: Budget of each dry-run part (tiny CPU shapes, but a loaded 2-core machine).
DRY_BUDGET_S = 240.0
#: Exit statuses.
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3

#: Modules the parts import (``import`` checked by the parent first) and optional ones (looked up only).
REQUIRED = (
    "torch", "triton", "transformers", "pytest", "hypothesis", "matplotlib", "yaml", "tqdm", "cppo_kernels", "cppo",
    "cppo.models", "cppo.packing", "bench_loss", "bench_select", "speedup", "test_loss_triton",
)  # fmt: skip
OPTIONAL = ("xdist", "liger_kernel", "flash_attn", "vllm", "math_verify", "gguf")
#: Method-name prefixes of ``bench_loss``'s reference points; every other method is the library's own and must match
#: the float64 oracle.
COMPARISONS = ("naive", "liger")
#: ||packed - alone|| / ||alone|| allowed per dtype (one rounding per op, different attention kernels either side);
#: a leak between sequences gives O(0.1-1), which the negative control shows.
PACKED_TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}
TINY_QWEN2 = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 1,
}  # fmt: skip
#: The packed-forward check's model on a GPU: head dim 64 (within flash-attention's), 2 layers, grouped KV heads.
PACKED_QWEN2 = {
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the parts run: on the GPU (:data:`GPU_PLAN`) or the dry run's tiny CPU version of the same code paths."""

    dry: bool
    device: str
    budgets: dict[str, float]
    loss_shapes: tuple[tuple[int, int, int, str], ...]  # (T, H, V, dtype)
    loss_repeats: int
    loss_warmup: int
    select_groups: tuple[int, ...]
    select_repeats: int
    select_warmup: int
    launch_calls: int  # profiled calls per op for the launch counts
    pytest_workers: int  # pytest-xdist workers (0: none)
    packed_dtypes: tuple[str, ...]
    packed_lengths: tuple[int, ...]
    packed_model: dict[str, int]
    speedup_argv: tuple[str, ...]  # speedup.py's arguments, less --out and --rollout-backend


GPU_PLAN = Plan(
    dry=False,
    device="cuda",
    budgets=BUDGET_S,
    loss_shapes=((16_384, 1536, 151_936, "bfloat16"), (2048, 896, 151_936, "float32")),
    loss_repeats=5,
    loss_warmup=2,
    select_groups=(64, 1024, 4096),
    select_repeats=200,
    select_warmup=20,
    launch_calls=10,
    pytest_workers=4,
    packed_dtypes=("float32", "bfloat16"),
    packed_lengths=(1, 37, 64, 129, 200, 300),
    packed_model=PACKED_QWEN2,
    # the speedup-cpu preset (tiny Qwen2, G = 16, 48 new tokens): GRPO 4 steps of 1 question, CPPO P=0.75 1 of 4
    speedup_argv=("--device", "cuda", "--pruning-rates", "0", "0.75", "--questions", "4", "--no-progress"),
)
DRY_PLAN = Plan(
    dry=True,
    device="cpu",
    budgets=dict.fromkeys(PARTS, DRY_BUDGET_S),
    loss_shapes=((512, 32, 1000, "float32"), (512, 48, 700, "bfloat16")),
    loss_repeats=1,
    loss_warmup=0,
    select_groups=(4,),
    select_repeats=2,
    select_warmup=1,
    launch_calls=1,
    pytest_workers=0,
    packed_dtypes=("float32",),
    packed_lengths=(1, 9, 5),
    packed_model={**TINY_QWEN2, "vocab_size": 300},
    speedup_argv=(
        *("--device", "cpu", "--model-config", json.dumps(TINY_QWEN2)),
        *"--group-size 4 --pruning-rates 0 0.5 --questions 2 --set max_completion_length=4 --backend torch".split(),
        *("--no-warmup", "--no-progress", "--no-plot"),
    ),
)


# --------------------------------------------------------------------------------------------
# Files: atomic JSON, one report per part
# --------------------------------------------------------------------------------------------


def write_json(path: pathlib.Path, data: Any) -> None:
    """Writes ``data`` as JSON through a temporary file and a rename (never half-written); NaN/inf become null."""
    safe = json.loads(json.dumps(data, default=str), parse_constant=lambda _: None)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(safe, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class PartTimeout(Exception):
    """A part stopped before its end for want of time (its partial results stay)."""


class Report:
    """One part's ``<part>.json``: checks and results, rewritten whenever something is added."""

    def __init__(self, path: pathlib.Path, part: str, plan: Plan) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "part": part,
            "status": "running",
            "checks": [],
            "results": {},
            "meta": {"plan": dataclasses.asdict(plan), "started": _now()},
        }
        write_json(path, self.data)

    def add(self, key: str, value: Any) -> None:
        self.data["results"][key] = value
        write_json(self.path, self.data)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Records a pass/fail check and prints it."""
        self.data["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        write_json(self.path, self.data)
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def finish(self, status: str, error: str | None = None) -> None:
        self.data["status"] = status
        if error:
            self.data["error"] = error
        write_json(self.path, self.data)

    @property
    def failed(self) -> bool:
        return any(not c["ok"] for c in self.data["checks"])


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------
# Child processes: a process group each, killed whole at its deadline
# --------------------------------------------------------------------------------------------


def child_env(extra_path: Sequence[str] = (), **variables: str) -> dict[str, str]:
    """This environment with the repository, benchmarks/, tests/ and ``extra_path`` first on PYTHONPATH."""
    paths = [str(REPO), str(BENCH), str(TESTS), *extra_path]
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])), **variables}


def run_child(cmd: Sequence[str], *, timeout: float, log: pathlib.Path, env: dict[str, str] | None = None):
    """Runs ``cmd`` in the repository with its output appended to ``log``, in a process group of its own that is
    ended whole (the command and whatever it started) when it returns or after ``timeout`` seconds.

    Returns ``(exit status or None if timed out, timed_out, seconds)``.
    """
    start = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            list(cmd), cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=os.setpgrp,
        )  # fmt: skip
        try:
            rc, timed_out = proc.wait(timeout=max(timeout, 0.1)), False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
        finally:
            _end_group(proc)
    return rc, timed_out, time.monotonic() - start


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group of ``proc``, SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _seconds_left(until: float, margin: float = 5.0) -> float:
    left = until - time.time() - margin
    if left <= 1.0:
        raise PartTimeout("no time left in this part's budget")
    return left


# --------------------------------------------------------------------------------------------
# Part 1: the suite's CUDA tests (and the pytest plugin that selects them)
# --------------------------------------------------------------------------------------------


def needs_cuda(item, *, cuda: bool) -> bool:
    """Whether a collected test is one of the suite's CUDA tests: it has a ``skipif`` whose reason names CUDA or a
    GPU and whose condition (a bool) holds exactly when CUDA is absent (so ``skipif(cuda_available, reason="needs a
    machine without CUDA")`` is not one)."""
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", "")).lower()
        conditions = mark.args or (mark.kwargs.get("condition"),)
        if not ("cuda" in reason or "gpu" in reason) or not all(isinstance(c, (bool, int)) for c in conditions):
            continue
        if any(conditions) == (not cuda):
            return True
    return False


def pytest_collection_modifyitems(config, items) -> None:
    """pytest hook (``pytest -p gpu_check``): deselects every test but the CUDA ones."""
    import torch

    cuda = torch.cuda.is_available()
    keep = [item for item in items if needs_cuda(item, cuda=cuda)]
    dropped = [item for item in items if not needs_cuda(item, cuda=cuda)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def tests_command(plan: Plan, out: pathlib.Path) -> list[str]:
    """pytest over tests/ with this module as a plugin: a real run on the GPU, collection only in the dry run."""
    cmd = [sys.executable, "-m", "pytest", "-p", "gpu_check", "-p", "no:cacheprovider", "-rfEs", str(TESTS)]
    if plan.dry:
        return cmd + ["--collect-only", "-q"]
    cmd += ["-v", f"--junitxml={out / 'tests-junit.xml'}"]
    if plan.pytest_workers and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(plan.pytest_workers)]
    return cmd


def junit_results(path: pathlib.Path) -> dict | None:
    """Outcomes from pytest's JUnit XML: passed count, failed / errors / skipped with their messages."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    out: dict[str, Any] = {"source": "junit", "passed": 0, "failed": [], "errors": [], "skipped": []}
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        for tag, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                out[key].append({"test": test, "message": (node.get("message") or node.text or "")[:500]})
                break
        else:
            out["passed"] += 1
    return out


_OUTCOME = r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)"
_LOG_LINE = re.compile(rf"(tests/\S+::\S+)\s+{_OUTCOME}|{_OUTCOME}\s+(tests/\S+::\S+)")


def log_results(text: str) -> dict:
    """Outcomes read off pytest's ``-v`` lines (with or without xdist): what is left when pytest was stopped."""
    seen: dict[str, str] = {}
    for m in _LOG_LINE.finditer(text):
        test, outcome = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        seen[test] = outcome
    by = {o: [{"test": t, "message": ""} for t, x in seen.items() if x == o] for o in ("FAILED", "ERROR", "SKIPPED")}
    passed = sum(o in ("PASSED", "XFAIL") for o in seen.values())
    return {"source": "log", "passed": passed, "failed": by["FAILED"], "errors": by["ERROR"], "skipped": by["SKIPPED"]}


def part_tests(plan: Plan, out: pathlib.Path, report: Report, until: float) -> None:
    """The suite's CUDA tests on the GPU; in the dry run, that pytest selects them (collection only)."""
    log = out / "tests.pytest.log"
    log.write_bytes(b"")
    env = child_env(TRITON_INTERPRET="1" if plan.dry else "0")  # tests/conftest.py sets 1 only by default
    cmd = tests_command(plan, out)
    report.add("command", cmd[1:])
    rc, timed_out, seconds = run_child(cmd, timeout=_seconds_left(until), log=log, env=env)
    text = log.read_text(encoding="utf-8", errors="replace")
    report.add("seconds", round(seconds, 1))
    if plan.dry:
        ids = re.findall(r"^(tests/\S+::\S+)$", text, re.M)
        report.add("selected", ids)
        detail = f"{len(ids)} tests selected, pytest exit status {rc}"
        report.check("pytest with -p gpu_check selects the suite's CUDA tests", rc == 0 and bool(ids), detail)
        return
    results = junit_results(out / "tests-junit.xml") if not timed_out else None
    results = results or log_results(text)
    report.add("outcomes", results)
    if timed_out:
        raise PartTimeout(f"pytest stopped after {seconds:.0f} s; outcomes so far read from its log")
    bad = len(results["failed"]) + len(results["errors"])
    detail = (
        f"{results['passed']} passed, {len(results['failed'])} failed, {len(results['errors'])} errors, "
        f"{len(results['skipped'])} skipped; pytest exit status {rc}"
    )
    report.check("the suite's CUDA tests pass", rc == 0 and bad == 0 and results["passed"] > 0, detail)


# --------------------------------------------------------------------------------------------
# Part 2: the loss against the GEMM floor and a float64 oracle
# --------------------------------------------------------------------------------------------


def mask_broken(*modules: str) -> dict[str, str]:
    """Optional modules that are installed but fail to import with something other than ImportError (a carried wheel
    built for other versions) are set to None in ``sys.modules``, so that later imports raise ImportError and
    ``bench_loss``'s ``except ImportError`` skips their methods instead of the whole part failing."""
    broken = {}
    for name in modules:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            pass
        except Exception as e:  # noqa: BLE001 - any failure of an optional package
            broken[name] = f"{type(e).__name__}: {e}"[:300]
            sys.modules[name] = None  # type: ignore[assignment]
    return broken


def loss_accuracy(inputs: dict, *, chunk: int = 1024) -> dict:
    """The float64 oracle at a benchmark shape (``bench_loss.make_inputs``), computed ``chunk`` tokens at a time.

    ``logp_error``: max |fused_logprobs - fp64 logp| against ``logp_bound``, the kernels' forward error bound
    (tests/test_loss_triton.py: FWD_ATOL * Z * max(1, sqrt(H) / 8), Z the largest sum_h |h_th| |w_vh|).
    ``loss64``: the fp64 loss (bench_loss's options); ``loss_bound``: what a logp error within ``logp_bound`` can do
    to it, to first order, times 2 (``2 E sum_t |dloss/dlogp_t|``, the gradient from autograd), plus 1e-5 of the
    loss's scale for the fp32 arithmetic of the policy terms and their sum.
    """
    import bench_loss
    import torch
    from test_loss_triton import _logit_error

    from cppo_kernels import LossConfig, fused_logprobs, reference, use_backend

    h, w, t = inputs["hidden"].detach(), inputs["weight"].detach(), inputs["targets"]
    T, H = h.shape
    w64 = w.double()  # [V, H]
    w_abs = w64.abs()  # [V, H]
    logp64 = torch.empty(T, dtype=torch.float64, device=h.device)  # [T]
    z_max = 1.0
    with torch.no_grad():
        for a in range(0, T, chunk):
            h64 = h[a : a + chunk].double()  # [C, H]
            logp64[a : a + chunk] = reference.token_logprobs(h64, w64, t[a : a + chunk])[0]
            z_max = max(z_max, (h64.abs() @ w_abs.t()).max().item())
        with use_backend("auto"):
            got = fused_logprobs(h, w, t)  # [T] fp32, the default backend (Triton on CUDA)
    del w64, w_abs
    logp = logp64.clone().requires_grad_()
    loss64, _ = reference.policy_loss(
        logp, inputs["adv"].double(), inputs["cu"], old_logprobs=inputs["old"].double(),
        ref_logprobs=inputs["ref"].double(), config=LossConfig(**bench_loss.OPTIONS),
    )  # fmt: skip
    (dlogp,) = torch.autograd.grad(loss64, logp)  # [T]
    bound, sensitivity = _logit_error(z_max, H), dlogp.abs().sum().item()
    return {
        "logp_error": (got.double() - logp64).abs().max().item(),
        "logp_bound": bound,
        "z_max": z_max,
        "loss64": loss64.item(),
        "loss_bound": 2 * bound * sensitivity + 1e-5 * (abs(loss64.item()) + sensitivity) + 1e-7,
    }


def loss_summary(res: dict, accuracy: dict) -> dict:
    """``bench_loss.run_config``'s result in the kit's terms. FLOPs are counted as the three GEMMs any method needs
    (logits, dhidden, dweight: ``6 T H V``), so TFLOP/s ranks the methods, and ``x_gemm_floor`` is the time over
    three plain GEMMs of the same shape measured in the same run (1.0 = as fast as the floor)."""
    T, H, V = res["tokens"], res["hidden"], res["vocab"]
    gemm_s, gemm_flop = res["matmul_s"], 2 * T * H * V
    methods = {}
    for name, row in res["methods"].items():
        seconds = row["fwd_bwd_s"]
        methods[name] = {
            "fwd_ms": row["fwd_s"] * 1e3,
            "bwd_ms": row["bwd_s"] * 1e3,
            "fwd_bwd_ms": seconds * 1e3,
            "tflops": 3 * gemm_flop / seconds / 1e12,
            "x_gemm_floor": seconds / (3 * gemm_s),
            "peak_extra_gb": row["peak_extra_bytes"] / 1e9,
            "workspace_gb": row["workspace_bytes"] / 1e9,
            "loss": row["loss"],
            "loss_error": abs(row["loss"] - accuracy["loss64"]),
            "library": not name.startswith(COMPARISONS),
        }
    library = [n for n, m in methods.items() if m["library"]]
    fastest = min(methods, key=lambda n: methods[n]["fwd_bwd_ms"]) if methods else None
    return {
        "gemm": {"ms": gemm_s * 1e3, "tflops": gemm_flop / gemm_s / 1e12},
        "methods": methods,
        "fastest": fastest,
        "fastest_library": min(library, key=lambda n: methods[n]["fwd_bwd_ms"]) if library else None,
        "accuracy": accuracy,
        "bench_loss": res,
    }


def part_loss(plan: Plan, out: pathlib.Path, report: Report, until: float) -> None:
    """Each shape: the fp64 oracle, then ``bench_loss.run_config`` (every method and the GEMM, interleaved)."""
    import torch

    report.add("masked_optional_modules", mask_broken("liger_kernel.chunked_loss", "liger_kernel.transformers"))
    import bench_loss

    device = torch.device(plan.device)
    for T, H, V, dtype_name in plan.loss_shapes:
        _seconds_left(until)
        key = f"T={T} H={H} V={V} {dtype_name}"
        dtype = getattr(torch, dtype_name)
        accuracy = loss_accuracy(bench_loss.make_inputs(T, H, V, dtype, device))
        report.check(
            f"{key}: fused_logprobs within the kernels' error bound of the fp64 oracle",
            accuracy["logp_error"] <= accuracy["logp_bound"],
            f"max abs error {accuracy['logp_error']:.3g}, bound {accuracy['logp_bound']:.3g}",
        )
        row = loss_summary(bench_loss.run_config(T, H, V, dtype, device, plan.loss_repeats, plan.loss_warmup), accuracy)
        for name, m in row["methods"].items():
            if m["library"]:
                report.check(
                    f"{key}: {name} loss matches the fp64 oracle",
                    m["loss_error"] <= accuracy["loss_bound"],
                    f"abs error {m['loss_error']:.3g}, bound {accuracy['loss_bound']:.3g}",
                )
        report.add(key, row)
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Part 3: selection and advantages, with launch counts
# --------------------------------------------------------------------------------------------


def count_launches(fn: Callable[[], Any], device: str, *, calls: int) -> dict:
    """GPU work per call of ``fn`` as torch.profiler records it over ``calls`` calls (after one unrecorded call):
    kernels, memcpy/memset operations, and the kernels' names. On CPU nothing runs on a GPU: zeros."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync()
    names = Counter(e.name[:100] for e in prof.events() if e.device_type == DeviceType.CUDA)
    memory_ops = sum(n for name, n in names.items() if name.lower().startswith(("memcpy", "memset")))
    return {
        "kernels": (sum(names.values()) - memory_ops) / calls,
        "memcpy_memset": memory_ops / calls,
        "names": {name: n / calls for name, n in names.items()},
    }


def part_select(plan: Plan, out: pathlib.Path, report: Report, until: float) -> None:
    """``bench_select.run`` on both backends, each row with its launch counts, then the reference check."""
    import bench_select

    rows: list[dict] = []

    def on_row(case, row: dict) -> None:
        row["launches_per_call"] = count_launches(case.fn, plan.device, calls=plan.launch_calls)
        rows.append(row)
        report.add("rows", rows)
        _seconds_left(until, margin=2.0)

    report.add("meta", bench_select.meta(plan.device))
    bench_select.run(
        ("torch", "triton"), plan.device, num_groups=plan.select_groups, repeats=plan.select_repeats,
        warmup=plan.select_warmup, interpreter_repeats=1, on_row=on_row,
    )  # fmt: skip
    wrong = [f"{r['backend']} {r['op']} {r['scope']} N={r['n']}" for r in rows if not r["matches_reference"]]
    detail = f"{len(rows) - len(wrong)}/{len(rows)} rows match" + (f"; wrong: {', '.join(wrong)}" if wrong else "")
    report.check("every op on both backends matches the fp64 reference", bool(rows) and not wrong, detail)


# --------------------------------------------------------------------------------------------
# Part 4: the packed forward and speedup.py end to end
# --------------------------------------------------------------------------------------------


def packed_check(plan: Plan, dtype: str) -> dict:
    """Final hidden states of sequences packed in one row (position_ids restarting at 0) against each sequence run
    alone: the largest ``||packed - alone|| / ||alone||`` over the sequences. The negative control runs the same row
    with position_ids running on (one long causal sequence): its later sequences see the earlier ones, the leak
    this check exists to catch, so its error must be far above the tolerance."""
    import torch

    from cppo.models import load_model_and_tokenizer, packed_hidden

    device = torch.device(plan.device)
    model, _ = load_model_and_tokenizer("tiny-qwen2", model_config=plan.packed_model, dtype=dtype, device=device)
    model.eval()
    g = torch.Generator().manual_seed(0)
    lengths = plan.packed_lengths
    ids = torch.randint(5, plan.packed_model["vocab_size"], (1, sum(lengths)), generator=g).to(device)  # [1, L]
    restart = torch.cat([torch.arange(n) for n in lengths])[None].to(device)  # [1, L]
    running = torch.arange(sum(lengths), device=device)[None]  # [1, L]
    bounds = list(itertools.accumulate(lengths, initial=0))
    with torch.no_grad():
        packed = packed_hidden(model, ids, restart).double()  # [L, H]
        control = packed_hidden(model, ids, running).double()  # [L, H]
        errors, leaks = [], []
        for a, b in zip(bounds, bounds[1:]):
            alone = packed_hidden(model, ids[:, a:b], restart[:, a:b]).double()  # [n, H]
            errors.append(((packed[a:b] - alone).norm() / alone.norm()).item())
            leaks.append(((control[a:b] - alone).norm() / alone.norm()).item())
    return {
        "dtype": dtype,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "lengths": list(lengths),
        "error": max(errors),
        "errors": errors,
        "control_error": max(leaks[1:]),
        "tolerance": PACKED_TOL[dtype],
    }


def speedup_rows(path: pathlib.Path) -> list[dict]:
    """The headline columns of a ``speedup.json``'s rows (the whole file stays beside the part's JSON)."""
    data = read_json(path) or {}
    keys = ("pruning_rate", "keep", "steps", "total_seconds", "train_seconds", "speedup_train", "speedup_total")
    return [{k: row.get(k) for k in (*keys, "phase_seconds")} for row in data.get("rows", [])]


def run_speedup(argv: Sequence[str], folder: pathlib.Path, report: Report, until: float, label: str) -> None:
    """``benchmarks/speedup.py ARGV --out FOLDER`` in a child process; a check that it ran and wrote its rows."""
    cmd = [sys.executable, str(BENCH / "speedup.py"), *argv, "--out", str(folder)]
    log = folder.with_suffix(".log")
    rc, timed_out, seconds = run_child(cmd, timeout=_seconds_left(until), log=log, env=child_env())
    rows = speedup_rows(folder / "speedup.json")
    report.add(label, {"command": cmd[1:], "exit_status": rc, "seconds": round(seconds, 1), "rows": rows})
    if timed_out:
        raise PartTimeout(f"speedup.py ({label}) stopped after {seconds:.0f} s")
    report.check(f"speedup.py runs end to end ({label})", rc == 0 and bool(rows), f"exit status {rc}, see {log.name}")


def vllm_argv(plan: Plan, folder: pathlib.Path) -> list[str]:
    """speedup.py's arguments for vLLM rollouts. vLLM loads a model folder, so the HF run's tiny model (its config,
    its seed) is saved to ``folder`` and named by ``--model`` instead of ``--model-config``."""
    import speedup

    from cppo.models import load_model_and_tokenizer

    config = speedup.base_config(speedup.parse_args(list(plan.speedup_argv)))
    model, tokenizer = load_model_and_tokenizer(
        config.model, model_config=config.model_config, dtype="bfloat16", seed=config.seed
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    argv = list(plan.speedup_argv)
    if "--model-config" in argv:  # only a tiny-* model takes one
        del argv[argv.index("--model-config") : argv.index("--model-config") + 2]
    return [*argv, "--model", str(folder), "--dtype", "bfloat16", "--rollout-backend", "vllm"]


def part_e2e(plan: Plan, out: pathlib.Path, report: Report, until: float) -> None:
    """The packed-forward check per dtype, then speedup.py with HF rollouts (and vLLM ones when importable)."""
    for dtype in plan.packed_dtypes:
        r = packed_check(plan, dtype)
        report.add(f"packed {dtype}", r)
        what = f"packed forward ({r['attn_implementation']}, {dtype})"
        report.check(f"{what} equals separate forwards", r["error"] <= r["tolerance"],
                     f"max relative error {r['error']:.3g}, tolerance {r['tolerance']:g}")  # fmt: skip
        report.check(f"{what}: the negative control (position_ids not restarting) shows a leak",
                     r["control_error"] > 10 * r["tolerance"], f"its error {r['control_error']:.3g}")  # fmt: skip
    run_speedup([*plan.speedup_argv, "--rollout-backend", "hf"], out / "speedup-hf", report, until, "speedup hf")
    if not plan.dry and importlib.util.find_spec("vllm") is None:
        report.add("speedup vllm", "skipped: vllm is not importable")
        return
    with tempfile.TemporaryDirectory(prefix="gpu-check-model-") as tmp:
        argv = vllm_argv(plan, pathlib.Path(tmp))
        if not plan.dry:
            run_speedup(argv, out / "speedup-vllm", report, until, "speedup vllm")
            return
        import speedup  # the dry run checks the arguments only: vLLM needs a GPU

        config = speedup.base_config(speedup.parse_args(argv))
        ok = (config.rollout_backend, config.model, config.model_config) == ("vllm", tmp, None)
        report.add("speedup vllm", f"dry run: arguments checked, not run ({' '.join(argv)})")
        report.check("speedup.py takes the vLLM run's arguments (saved tiny model, vllm rollouts)", ok)


PART_FUNCTIONS: dict[str, Callable[[Plan, pathlib.Path, Report, float], None]] = {
    "tests": part_tests,
    "loss": part_loss,
    "select": part_select,
    "e2e": part_e2e,
}


def run_part(part: str, plan: Plan, out: pathlib.Path, until: float) -> int:
    """A child process's whole job: one part, its JSON finished with its status (pass, fail, timeout, error)."""
    report = Report(out / f"{part}.json", part, plan)
    try:
        PART_FUNCTIONS[part](plan, out, report, until)
    except PartTimeout as e:
        report.finish("timeout", str(e))
        return EXIT_INCOMPLETE
    except Exception:  # noqa: BLE001 - recorded in the part's JSON, the other parts go on
        report.finish("error", traceback.format_exc()[-4000:])
        print(traceback.format_exc(), flush=True)
        return EXIT_FAIL
    report.finish("fail" if report.failed else "pass")
    return EXIT_FAIL if report.failed else EXIT_PASS


# --------------------------------------------------------------------------------------------
# The parent: wheels, imports, environment, the parts in turn, the summary
# --------------------------------------------------------------------------------------------


def install_wheels(folder: pathlib.Path, target: pathlib.Path) -> dict:
    """Installs every ``*.whl`` of ``folder`` into ``target`` (pip, no index, no dependencies) and imports each
    top-level module they brought. Nothing in the folder (or no folder) is fine: the optional parts are skipped."""
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    info: dict[str, Any] = {"folder": str(folder), "wheels": [w.name for w in wheels], "installed": [], "imports": {}}
    if not wheels:
        return info
    cmd = [
        sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
        "--disable-pip-version-check", "--target", str(target), *map(str, wheels),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        info["error"] = (proc.stdout + proc.stderr)[-2000:]
        return info
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    entries = sorted(p.name for p in target.iterdir())
    info["installed"] = [name.removesuffix(".dist-info") for name in entries if name.endswith(".dist-info")]
    modules = [
        p.name.removesuffix(".py") for p in map(target.joinpath, entries)
        if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.name != "__init__.py")
    ]  # fmt: skip
    info["imports"] = {name: _try_import(name) for name in modules}
    return info


def _try_import(name: str) -> str:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        return f"{type(e).__name__}: {e}"[:300]
    return "ok"


def check_imports() -> dict:
    """``ok`` or the error of every module the parts import; optional modules: whether they are installed."""
    required = {name: _try_import(name) for name in REQUIRED}
    optional = {name: importlib.util.find_spec(name) is not None for name in OPTIONAL}
    return {"required": required, "optional": optional}


def _nvidia_smi(field: str) -> str | None:
    try:
        cmd = ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def environment(commit: str | None) -> dict:
    """The machine and software: GPU, driver, CUDA, versions, the git commit (``commit`` when given)."""
    import torch
    from speedup_report import git_commit

    found, dirty = git_commit(REPO)
    versions = {}
    for name in ("triton", "transformers", "liger-kernel", "flash-attn", "vllm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    info = {
        "date": _now(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        **versions,
        "cpus": os.cpu_count(),
        "git_commit": commit or found,
        "git_dirty": None if commit else dirty,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), compute_capability=f"{p.major}.{p.minor}",
            multiprocessors=p.multi_processor_count, driver=_nvidia_smi("driver_version"),
        )  # fmt: skip
    return info


def finish_part(out: pathlib.Path, part: str, *, rc: int | None, timed_out: bool, seconds: float, budget: float):
    """The part's JSON as its process left it, with the final status: ``error`` (crashed) before ``fail`` (a check
    failed) before ``timeout`` (killed at its budget, or stopped for want of time) before ``pass``."""
    path = out / f"{part}.json"
    data = read_json(path) or {"part": part, "status": "running", "checks": [], "results": {}}
    status = data.get("status", "running")
    if status == "running":  # the process ended before it could say how the part went
        status = "timeout" if timed_out else "error"
        if not timed_out:
            data.setdefault("error", f"the part's process ended with exit status {rc}; see {part}.log")
    if status != "error" and any(not c["ok"] for c in data.get("checks", [])):
        status = "fail"
    data.update(status=status, exit_status=rc, seconds=round(seconds, 1), budget_s=budget)
    write_json(path, data)
    return data


def exit_status(statuses: Sequence[str]) -> int:
    if any(s in ("fail", "error") for s in statuses):
        return EXIT_FAIL
    if any(s in ("timeout", "skipped") for s in statuses):
        return EXIT_INCOMPLETE
    return EXIT_PASS


def run_parts(args: argparse.Namespace, plan: Plan, out: pathlib.Path, env: dict, kit: dict, start: float) -> dict:
    """Each part in its own process, under min(its budget, what the deadline leaves); the summary after each."""
    parts: dict[str, dict] = {}
    for part in args.parts:
        left = args.deadline - (time.monotonic() - start) - RESERVE_S
        budget = min(plan.budgets[part], left)
        if budget < MIN_PART_S:
            error = f"only {left:.0f} s left of --deadline"
            parts[part] = {"part": part, "status": "skipped", "checks": [], "results": {}, "seconds": 0.0}
            parts[part].update(budget_s=plan.budgets[part], error=error)
            write_json(out / f"{part}.json", parts[part])
            print(f"[{part}] skipped: only {left:.0f} s left of the deadline", flush=True)
            continue
        print(f"[{part}] start (budget {budget:.0f} s)", flush=True)
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--part", part, "--out", str(out)]
        cmd += ["--until", f"{time.time() + budget:.1f}"] + (["--dry-run"] if plan.dry else [])
        log = out / f"{part}.log"
        log.write_bytes(b"")
        rc, timed_out, seconds = run_child(cmd, timeout=budget, log=log, env=env)
        parts[part] = finish_part(out, part, rc=rc, timed_out=timed_out, seconds=seconds, budget=budget)
        passed = sum(c["ok"] for c in parts[part]["checks"])
        print(f"[{part}] {parts[part]['status']} in {seconds:.0f} s: {passed}/{len(parts[part]['checks'])} checks",
              flush=True)  # fmt: skip
        for c in parts[part]["checks"]:
            if not c["ok"]:
                print(f"  FAIL {c['name']}: {c['detail']}", flush=True)
        kit["elapsed_s"] = round(time.monotonic() - start, 1)
        write_summary(out, kit, parts)
    return parts


# --------------------------------------------------------------------------------------------
# The summary: summary.json and summary.md
# --------------------------------------------------------------------------------------------


def _cell(text: Any, width: int = 200) -> str:
    return " ".join(str(text).split())[:width].replace("|", "/")


def render_tests(r: dict) -> list[str]:
    if "selected" in r:
        return [f"{len(r['selected'])} CUDA tests selected (collection only: dry run)."]
    o = r.get("outcomes")
    if not o:
        return ["No outcomes recorded."]
    lines = [
        f"{o['passed']} passed, {len(o['failed'])} failed, {len(o['errors'])} errors, {len(o['skipped'])} skipped "
        f"(from pytest's {o['source']}) in {r.get('seconds')} s.",
        "",
    ]
    lines += [f"- FAILED `{x['test']}`: {_cell(x['message'])}" for x in o["failed"] + o["errors"]]
    for reason, n in Counter(_cell(x["message"], 150) for x in o["skipped"]).items():
        lines.append(f"- skipped x{n}: {reason}")
    return lines


def render_loss(r: dict) -> list[str]:
    lines = []
    if r.get("masked_optional_modules"):
        lines.append(f"Optional modules that failed to import (their methods skipped): {r['masked_optional_modules']}")
    for key, row in r.items():
        if not (isinstance(row, dict) and "methods" in row):
            continue
        gemm, acc = row["gemm"], row["accuracy"]
        lines += [
            "",
            f"**{key}**: GEMM floor (one plain [T,H]x[H,V] matmul) {gemm['ms']:.2f} ms = {gemm['tflops']:.0f} "
            f"TFLOP/s; fastest {row['fastest']}, fastest of the library's {row['fastest_library']}; fused_logprobs "
            f"max abs error {acc['logp_error']:.2g} (bound {acc['logp_bound']:.2g}); loss error bound "
            f"{acc['loss_bound']:.2g}",
            "",
            "| method | fwd ms | bwd ms | fwd+bwd ms | TFLOP/s (6THV) | x 3-GEMM floor | peak extra GB | workspace GB "
            "| loss abs error vs fp64 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, m in row["methods"].items():
            lines.append(
                f"| {name}{'' if m['library'] else ' (comparison)'} | {m['fwd_ms']:.2f} | {m['bwd_ms']:.2f} | "
                f"{m['fwd_bwd_ms']:.2f} | {m['tflops']:.1f} | {m['x_gemm_floor']:.2f} | {m['peak_extra_gb']:.2f} | "
                f"{m['workspace_gb']:.2f} | {m['loss_error']:.2g} |"
            )
    return lines


def render_select(r: dict) -> list[str]:
    table: dict[tuple, dict[str, dict]] = {}
    for row in r.get("rows", []):
        table.setdefault((row["op"], row["scope"], row["n"]), {})[row["backend"]] = row
    lines = [
        "Median ms per call (CUDA events on a GPU), GPU kernels per call (torch.profiler).",
        "",
        "| op | scope | N | torch ms | triton ms | torch kernels/call | triton kernels/call | matches fp64 |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for (op, scope, n), by in table.items():
        ms = [f"{by[b]['median_ms']:.4f}" if b in by else "-" for b in ("torch", "triton")]
        kernels = [f"{by[b]['launches_per_call']['kernels']:g}" if b in by else "-" for b in ("torch", "triton")]
        ok = "yes" if all(x["matches_reference"] for x in by.values()) else "**no**"
        lines.append(f"| {op} | {scope} | {n:,} | {' | '.join(ms)} | {' | '.join(kernels)} | {ok} |")
    return lines


def render_e2e(r: dict) -> list[str]:
    lines = []
    for key, v in r.items():
        if key.startswith("packed"):
            lines.append(
                f"- {key} ({v['attn_implementation']}, lengths {v['lengths']}): max relative error {v['error']:.2g} "
                f"(tolerance {v['tolerance']:g}); negative control {v['control_error']:.2g}"
            )
        elif isinstance(v, str):
            lines.append(f"- {key}: {v}")
        else:
            lines += [f"- {key}: exit status {v['exit_status']} in {v['seconds']} s", ""]
            lines += ["| P | keep | steps | total s | train s | speedup train | speedup total |", "|" + "---:|" * 7]
            for row in v["rows"]:
                cells = [row.get(k) for k in ("pruning_rate", "keep", "steps", "total_seconds", "train_seconds")]
                cells += [row.get("speedup_train"), row.get("speedup_total")]
                lines.append("| " + " | ".join("-" if c is None else f"{c:.3g}" for c in cells) + " |")
            lines.append("")
    return lines


RENDERERS: dict[str, Callable[[dict], list[str]]] = {
    "tests": render_tests,
    "loss": render_loss,
    "select": render_select,
    "e2e": render_e2e,
}


def render_summary(kit: dict, parts: dict[str, dict], status: int) -> str:
    env = kit["environment"]
    gpu = "no CUDA device"
    if env.get("gpu"):
        gpu = (f"{env['gpu']}, {env['gpu_memory_gib']} GiB, compute capability {env['compute_capability']}, "
               f"{env['multiprocessors']} SMs, driver {env.get('driver')}")  # fmt: skip
    wheels = kit["wheels"]
    lines = ["# GPU validation kit: results", ""]
    if kit["dry_run"]:
        lines += ["**Dry run**: the kit's plumbing on tiny CPU shapes; nothing here is a GPU measurement.", ""]
    lines += [
        f"- GPU: {gpu}",
        f"- software: python {env['python']}, torch {env['torch']} (CUDA runtime {env['cuda_runtime']}), "
        f"triton {env.get('triton')}, transformers {env.get('transformers')}, liger-kernel {env.get('liger-kernel')}",
        f"- git commit: {env['git_commit']} (uncommitted changes: {env['git_dirty']})",
        f"- wheels from {wheels['folder']}: {', '.join(wheels['installed']) or 'none'}",
        f"- {env['date']}; the kit took {kit.get('elapsed_s')} s of its {kit['deadline_s']:.0f} s deadline; "
        f"exit status {status}",
        "",
        "| part | status | seconds | budget (s) | checks passed |",
        "|---|---|---:|---:|---:|",
    ]
    for part, data in parts.items():
        passed = sum(c["ok"] for c in data["checks"])
        lines.append(f"| {part} | {data['status']} | {data.get('seconds')} | {data.get('budget_s'):.0f} | "
                     f"{passed}/{len(data['checks'])} |")  # fmt: skip
    lines += ["", "## Checks", ""]
    for owner, checks in [("kit", kit["checks"])] + [(p, d["checks"]) for p, d in parts.items()]:
        for c in checks:
            detail = f" ({_cell(c['detail'])})" if c["detail"] else ""
            lines.append(f"- [{'x' if c['ok'] else ' '}] {owner}: {c['name']}{detail}")
    for part, data in parts.items():
        lines += ["", f"## {part}", ""] + RENDERERS[part](data.get("results", {}))
        if data.get("error"):
            lines += ["", "```", *str(data["error"]).strip().splitlines()[-12:], "```"]
    return "\n".join(lines) + "\n"


def write_summary(out: pathlib.Path, kit: dict, parts: dict[str, dict]) -> int:
    """Writes summary.json and summary.md; returns the exit status they report."""
    statuses = [d["status"] for d in parts.values()]
    status = EXIT_FAIL if any(not c["ok"] for c in kit["checks"]) else exit_status(statuses)
    brief = {p: {k: d.get(k) for k in ("status", "seconds", "budget_s", "checks", "error")} for p, d in parts.items()}
    write_json(out / "summary.json", {"kit": kit, "exit_status": status, "parts": brief})
    tmp = out / "summary.md.tmp"
    tmp.write_text(render_summary(kit, parts, status), encoding="utf-8")
    os.replace(tmp, out / "summary.md")
    return status


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="See README.md, 'GPU validation kit'.")
    ap.add_argument("--out", type=pathlib.Path, help="results folder (default benchmarks/results/gpu; dry run: a new "
                    "temporary folder)")  # fmt: skip
    ap.add_argument(
        "--deadline", type=float, default=DEADLINE_S, help="seconds for the whole kit (default %(default)g)"
    )
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of %(default)s")
    ap.add_argument("--wheels", type=pathlib.Path, default=DEFAULT_WHEELS, help="folder of optional wheels to add")
    ap.add_argument("--commit", help="git commit to record (for a copy of the tree without .git)")
    ap.add_argument("--dry-run", action="store_true", help="the plumbing on tiny CPU shapes, even with CUDA")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # a child process: run this part only
    ap.add_argument("--until", type=float, default=float("inf"), help=argparse.SUPPRESS)  # its end (epoch seconds)
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or set(parts) - set(PARTS) or len(set(parts)) != len(parts):
        ap.error(f"--parts must be distinct names among {','.join(PARTS)}, got {args.parts!r}")
    if not 0 < args.deadline < float("inf"):
        ap.error(f"--deadline must be a positive number of seconds, got {args.deadline:g}")
    if args.part and args.out is None:
        ap.error("--part needs --out")
    if args.out is not None:  # the nearest existing folder on its path: a file there would stop the kit at mkdir
        existing = args.out
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            ap.error(f"--out {str(args.out)!r} must be a folder, but {str(existing)!r} is a file")
    args.parts = [p for p in PARTS if p in parts]
    return args


def orchestrate(args: argparse.Namespace, plan: Plan, out: pathlib.Path, site: pathlib.Path) -> int:
    """Wheels, imports, environment, the parts, the summary (printed last); returns the exit status."""
    start = time.monotonic()
    print(f"gpu_check: parts {', '.join(args.parts)}; deadline {args.deadline:g} s; results in {out}", flush=True)
    wheels = install_wheels(args.wheels, site)
    print(f"wheels: {', '.join(wheels['installed']) or 'none'} (from {args.wheels})", flush=True)
    imports = check_imports()
    missing = {n: e for n, e in imports["required"].items() if e != "ok"}
    print(f"imports: {len(imports['required']) - len(missing)}/{len(imports['required'])} required ok; optional "
          f"installed: {[n for n, ok in imports['optional'].items() if ok]}", flush=True)  # fmt: skip
    checks = [{"name": "every module the parts import imports", "ok": not missing, "detail": str(missing or "")}]
    if wheels["wheels"]:
        bad = {n: e for n, e in wheels["imports"].items() if e != "ok"}
        ok = bool(wheels["installed"]) and not bad
        checks.append({"name": "the carried wheels install and import", "ok": ok,
                       "detail": wheels.get("error", "") or str(bad or wheels["installed"])})  # fmt: skip
    kit = {
        "dry_run": plan.dry, "deadline_s": args.deadline, "parts": args.parts, "out": str(out),
        "budgets_s": {p: plan.budgets[p] for p in args.parts}, "environment": environment(args.commit),
        "wheels": wheels, "imports": imports, "checks": checks, "elapsed_s": round(time.monotonic() - start, 1),
    }  # fmt: skip
    write_summary(out, kit, {})
    env = child_env([str(site)] if wheels["installed"] else [], TRITON_INTERPRET="1" if plan.dry else "0")
    parts = run_parts(args, plan, out, env, kit, start)
    kit["elapsed_s"] = round(time.monotonic() - start, 1)
    status = write_summary(out, kit, parts)
    print("\n" + (out / "summary.md").read_text(encoding="utf-8"), flush=True)
    return status


def _terminate(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_child, which ends the running part's process group


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for path in (TESTS, BENCH, REPO):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    if args.part:
        args.out.mkdir(parents=True, exist_ok=True)
        return run_part(args.part, DRY_PLAN if args.dry_run else GPU_PLAN, args.out, args.until)
    try:
        import torch
    except ImportError as e:
        print(f"gpu_check: torch is not importable by {sys.executable} ({e}); run the kit with a python that has "
              "torch (make gpu-check PYTHON=...)", file=sys.stderr)  # fmt: skip
        return EXIT_FAIL
    cuda = torch.cuda.is_available()
    plan = DRY_PLAN if args.dry_run or not cuda else GPU_PLAN
    if plan.dry:
        why = "--dry-run" if cuda else "no CUDA device visible"
        print(f"gpu_check: {why}: dry run of the kit's plumbing on tiny CPU shapes (nothing is measured)", flush=True)
    out = args.out or (pathlib.Path(tempfile.mkdtemp(prefix="gpu-check-dry-")) if plan.dry else DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _terminate)
    with tempfile.TemporaryDirectory(prefix="gpu-check-wheels-") as site:
        return orchestrate(args, plan, out, pathlib.Path(site))


if __name__ == "__main__":
    sys.exit(main())
