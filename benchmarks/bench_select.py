"""Times group_advantages, select_completions and cppo_select on each backend; writes JSON.

    python benchmarks/bench_select.py                      # CPU: torch path + Triton under the interpreter
    python benchmarks/bench_select.py --device cuda        # GPU: torch path + compiled Triton kernels

N = 16 x {64, 1024, 4096} completions (group size 16, keep 4: CPPO's P = 0.75), scopes "group"
and "batch". Median of ``--repeats`` timed calls after ``--warmup`` calls. On CPU the Triton
backend runs under ``TRITON_INTERPRET=1`` (set here before triton is imported): those numbers
measure the interpreter, not a GPU, and use ``--interpreter-repeats`` (fewer) calls. Each row
also records whether the op's output matched the fp64 reference (a correctness check for GPU runs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time

GROUP_SIZE = 16
KEEP = 4
NUM_GROUPS = (64, 1024, 4096)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when present, else cpu")
    p.add_argument("--backend", default="torch,triton", help="comma-separated subset of torch,triton")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--interpreter-repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "select.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if not backends or set(backends) - {"torch", "triton"}:
        sys.exit(f"--backend must be a comma-separated subset of torch,triton, got {args.backend!r}")

    import torch

    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but no CUDA device is visible")
    if device == "cpu" and "triton" in backends:
        os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit runs, i.e. when cppo_kernels is imported

    import triton

    from cppo_kernels import cppo_select, group_advantages, reference, select_completions

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn, repeats: int, warmup: int) -> list[float]:
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

    scopes = ("group", "batch")

    def matches(got, want) -> bool:
        """Indices exactly, advantages within 1e-5 of the fp64 reference (rewards are exact dyadic values)."""
        if isinstance(got, tuple):
            return all(matches(g, w) for g, w in zip(got, want))
        if got.dtype == torch.long:
            return bool(torch.equal(got, want))
        return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5))

    results = []
    for backend in backends:
        os.environ["CPPO_KERNELS_BACKEND"] = backend
        mode = "eager" if backend == "torch" else ("compiled" if device == "cuda" else "interpreter")
        repeats = args.interpreter_repeats if mode == "interpreter" else args.repeats
        warmup = min(args.warmup, 1) if mode == "interpreter" else args.warmup
        for q in NUM_GROUPS:
            n = q * GROUP_SIZE
            gen = torch.Generator(device=device).manual_seed(q)
            rewards = torch.randint(0, 4, (n,), generator=gen, device=device).float() / 2  # [N] CPPO-like values
            adv = reference.group_advantages(rewards, GROUP_SIZE)  # [N]
            ref_adv = reference.group_advantages(rewards.double(), GROUP_SIZE)  # [N]
            cases = [("group_advantages", "-", lambda r=rewards: group_advantages(r, GROUP_SIZE))]
            for s in scopes:
                cases += [
                    ("select_completions", s, lambda a=adv, s=s: select_completions(a, GROUP_SIZE, KEEP, scope=s)),
                    ("cppo_select", s, lambda r=rewards, s=s: cppo_select(r, GROUP_SIZE, KEEP, scope=s)),
                ]
            expected = {
                ("group_advantages", "-"): ref_adv,
                **{
                    ("select_completions", s): reference.select_completions(adv, GROUP_SIZE, KEEP, scope=s)
                    for s in scopes
                },
                **{
                    ("cppo_select", s): (ref_adv, reference.select_completions(ref_adv, GROUP_SIZE, KEEP, scope=s))
                    for s in scopes
                },
            }
            for op, scope, fn in cases:
                times = timed(fn, repeats, warmup)
                ok = matches(fn(), expected[op, scope])
                row = {
                    "op": op,
                    "scope": scope,
                    "n": n,
                    "group_size": GROUP_SIZE,
                    "keep": KEEP,
                    "backend": backend,
                    "device": device,
                    "mode": mode,
                    "median_ms": round(statistics.median(times), 4),
                    "min_ms": round(min(times), 4),
                    "repeats": repeats,
                    "matches_reference": ok,
                }
                results.append(row)
                line = f"{backend:6} {mode:11} {op:18} {scope:5} N={n:6}  {row['median_ms']:10.3f} ms  ok={ok}"
                print(line, flush=True)

    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores visible)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_threads": torch.get_num_threads(),
        "note": "mode=interpreter: Triton kernels run by the CPU interpreter (TRITON_INTERPRET=1), not a GPU",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
