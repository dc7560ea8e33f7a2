"""Part ``select``: group_advantages / select_completions / cppo_select at the plan's sizes on both backends
(``bench_select.run``: CUDA events on a GPU, each row checked against the float64 reference), with the GPU kernels
launched per call counted by torch.profiler."""

from __future__ import annotations

import pathlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from gpukit.plan import Plan
from gpukit.runner import Report, seconds_left


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


def run(plan: Plan, out: pathlib.Path, report: Report, until: float) -> None:
    """``bench_select.run`` on both backends, each row with its launch counts, then the reference check."""
    import bench_select

    rows: list[dict] = []

    def on_row(case, row: dict) -> None:
        row["launches_per_call"] = count_launches(case.fn, plan.device, calls=plan.launch_calls)
        rows.append(row)
        report.add("rows", rows)
        seconds_left(until, margin=2.0)

    report.add("meta", bench_select.meta(plan.device))
    bench_select.run(
        ("torch", "triton"), plan.device, num_groups=plan.select_groups, repeats=plan.select_repeats,
        warmup=plan.select_warmup, interpreter_repeats=1, on_row=on_row,
    )  # fmt: skip
    wrong = [f"{r['backend']} {r['op']} {r['scope']} N={r['n']}" for r in rows if not r["matches_reference"]]
    detail = f"{len(rows) - len(wrong)}/{len(rows)} rows match" + (f"; wrong: {', '.join(wrong)}" if wrong else "")
    report.check("every op on both backends matches the fp64 reference", bool(rows) and not wrong, detail)
