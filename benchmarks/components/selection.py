"""Times group_advantages, select_completions and cppo_select on each backend; writes JSON.

    python benchmarks/bench_select.py                      # CPU: torch path + Triton under the interpreter
    python benchmarks/bench_select.py --device cuda        # GPU: torch path + compiled Triton kernels

The JSON goes to ``--out``, by default ``select.json`` in a new folder of the run's own, ``benchmarks/runs/select-<UTC
time>/`` (ignored by git); the committed reference, ``benchmarks/results/select.json``, changes only with ``--out``.

N = 16 x {64, 1024, 4096} completions (group size 16, keep 4: CPPO's P = 0.75), scopes "group"
and "batch". Median of ``--repeats`` timed calls after ``--warmup`` calls: on CUDA each call is timed
with CUDA events recorded around it (GPU time from the call's start to its end, launch gaps and host
syncs inside the call included), on CPU with the wall clock. On CPU the Triton backend runs under
``TRITON_INTERPRET=1`` (set here before triton is imported): those numbers measure the interpreter,
not a GPU, and use ``--interpreter-repeats`` (fewer) calls. Each row also records whether the op's
output matched the fp64 reference (a correctness check for GPU runs).

The pieces (:func:`make_cases`, :func:`timer`, :func:`matches`, :func:`run`) are also called by
``benchmarks/gpu_check.py``, which adds kernel-launch counts to each row.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchkit.args import check_output_file, count
from benchkit.out import out_file

GROUP_SIZE = 16
KEEP = 4
NUM_GROUPS = (64, 1024, 4096)
SCOPES = ("group", "batch")

#: ``timer(fn, repeats=, warmup=)``: milliseconds of each timed call.
Timer = Callable[..., list[float]]


@dataclass(frozen=True)
class Case:
    """One timed op: ``fn()`` runs it on fixed inputs, ``expected`` is the fp64 reference's result."""

    op: str
    scope: str
    n: int
    fn: Callable[[], Any]
    expected: Any


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when present, else cpu")
    p.add_argument("--backend", default="torch,triton", help="comma-separated subset of torch,triton")
    p.add_argument("--warmup", type=count(0), default=2)
    p.add_argument("--repeats", type=count(1), default=15)
    p.add_argument("--interpreter-repeats", type=count(1), default=2)
    p.add_argument("--threads", type=count(1), default=1, help="torch CPU threads (1: steadier on a shared machine)")
    p.add_argument("--out", type=pathlib.Path, help="the JSON (default: select.json in a new benchmarks/runs/ folder)")
    args = p.parse_args()
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if not backends or set(backends) - {"torch", "triton"}:
        p.error(f"--backend must be a comma-separated subset of torch,triton, got {args.backend!r}")
    if args.out is not None:
        check_output_file(p, "--out", args.out)
    return args


def make_cases(num_groups: int, device: str) -> list[Case]:
    """The five timed ops on ``num_groups * GROUP_SIZE`` CPPO-like rewards (exact dyadic values, many ties)."""
    import torch

    from cppo_kernels import cppo_select, group_advantages, reference, select_completions

    n = num_groups * GROUP_SIZE
    gen = torch.Generator(device=device).manual_seed(num_groups)
    rewards = torch.randint(0, 4, (n,), generator=gen, device=device).float() / 2  # [N]
    adv = reference.group_advantages(rewards, GROUP_SIZE)  # [N]
    ref_adv = reference.group_advantages(rewards.double(), GROUP_SIZE)  # [N]
    cases = [Case("group_advantages", "-", n, lambda: group_advantages(rewards, GROUP_SIZE), ref_adv)]
    for s in SCOPES:
        cases += [
            Case(
                "select_completions", s, n, lambda s=s: select_completions(adv, GROUP_SIZE, KEEP, scope=s),
                reference.select_completions(adv, GROUP_SIZE, KEEP, scope=s),
            ),
            Case(
                "cppo_select", s, n, lambda s=s: cppo_select(rewards, GROUP_SIZE, KEEP, scope=s),
                (ref_adv, reference.select_completions(ref_adv, GROUP_SIZE, KEEP, scope=s)),
            ),
        ]  # fmt: skip
    return cases


def time_wall(fn: Callable[[], Any], *, repeats: int, warmup: int, sync: Callable[[], None] = lambda: None):
    """Milliseconds of each of ``repeats`` calls by the host clock, ``sync()`` after each."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def time_cuda_events(fn: Callable[[], Any], *, repeats: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls between CUDA events recorded before and after it."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def timer(device: str) -> Timer:
    """CUDA events on a GPU, the host clock on CPU."""
    return time_cuda_events if device == "cuda" else time_wall


def matches(got, want) -> bool:
    """Indices exactly, advantages within 1e-5 of the fp64 reference (rewards are exact dyadic values)."""
    import torch

    if isinstance(got, tuple):
        return all(matches(g, w) for g, w in zip(got, want))
    if got.dtype == torch.long:
        return bool(torch.equal(got, want))
    return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))


def mode_of(backend: str, device: str) -> str:
    """``eager`` (torch), ``compiled`` (Triton on CUDA) or ``interpreter`` (Triton on CPU)."""
    return "eager" if backend == "torch" else ("compiled" if device == "cuda" else "interpreter")


def measure(case: Case, *, backend: str, device: str, repeats: int, warmup: int) -> dict:
    """One result row: median and min milliseconds of ``case.fn`` and whether its output matches the reference."""
    times = timer(device)(case.fn, repeats=repeats, warmup=warmup)
    return {
        "op": case.op,
        "scope": case.scope,
        "n": case.n,
        "group_size": GROUP_SIZE,
        "keep": KEEP,
        "backend": backend,
        "device": device,
        "mode": mode_of(backend, device),
        "median_ms": round(statistics.median(times), 4),
        "min_ms": round(min(times), 4),
        "repeats": repeats,
        "matches_reference": matches(case.fn(), case.expected),
    }


def run(
    backends: Sequence[str],
    device: str,
    *,
    num_groups: Sequence[int] = NUM_GROUPS,
    repeats: int,
    warmup: int,
    interpreter_repeats: int,
    on_row: Callable[[Case, dict], None] | None = None,
) -> list[dict]:
    """Every case of every backend at every size, one row each (printed as it comes).

    ``on_row(case, row)`` is called with each row before it is printed, under the row's backend (it may add keys).
    """
    from cppo_kernels import use_backend

    rows = []
    for backend in backends:
        interpreted = mode_of(backend, device) == "interpreter"
        reps = interpreter_repeats if interpreted else repeats
        warm = min(warmup, 1) if interpreted else warmup
        with use_backend(backend):
            for q in num_groups:
                for case in make_cases(q, device):
                    row = measure(case, backend=backend, device=device, repeats=reps, warmup=warm)
                    if on_row is not None:
                        on_row(case, row)
                    rows.append(row)
                    line = (
                        f"{backend:6} {row['mode']:11} {case.op:18} {case.scope:5} N={case.n:6}  "
                        f"{row['median_ms']:10.3f} ms  ok={row['matches_reference']}"
                    )
                    print(line, flush=True)
    return rows


def meta(device: str) -> dict:
    """Where the rows were measured: :func:`cppo.fileio.run_metadata` (date, machine, versions of torch, triton and
    the rest, torch threads, git commit, command line) and the device as this benchmark names it."""
    import torch

    from cppo.fileio import run_metadata

    return {
        **run_metadata(device=device),
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores visible)",
        "note": "mode=interpreter: Triton kernels run by the CPU interpreter (TRITON_INTERPRET=1), not a GPU",
    }


def main() -> None:
    args = parse_args()
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]

    import torch

    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but no CUDA device is visible")
    if device == "cpu" and "triton" in backends:
        os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, i.e. when cppo_kernels is imported
    from cppo.fileio import write_json  # after TRITON_INTERPRET: importing cppo imports cppo_kernels

    out = out_file(args.out, benchmark="select", filename="select.json", prog="bench_select.py")

    results = run(
        backends, device, repeats=args.repeats, warmup=args.warmup, interpreter_repeats=args.interpreter_repeats
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"meta": meta(device), "results": results}, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
