#!/usr/bin/env python3
"""GPU validation kit: one command that checks and times every CUDA path of the project on a bare GPU machine.

    python3 benchmarks/gpu_check.py                 # = make gpu-check; results in benchmarks/results/gpu/
    python3 benchmarks/gpu_check.py --out DIR --deadline 475 --parts tests,loss,select,e2e --commit SHA
    python3 benchmarks/gpu_check.py --dry-run       # the kit's own plumbing on tiny CPU shapes (what CI runs)

It runs on the machine's own python3 and packages and downloads nothing: the repository goes on ``sys.path``
(no install), and the pure-Python wheels found in ``--wheels`` (default ``.gpu-wheels/``, e.g. Liger-Kernel) are
installed with ``pip --no-index --no-deps`` into a temporary folder put on the path (:mod:`gpukit.wheels`). Then
four parts, each in its own process group with a time budget (:data:`gpukit.plan.BUDGET_S`; :mod:`gpukit.runner`),
so that a crash or a hang costs one part and not the others:

1. ``tests``: the suite's tests marked ``cuda`` (``pytest -m cuda``: tests/kernels/test_cuda_kernels.py, the
   kernels' properties on the GPU, among them the loss at this kit's shapes against a float64 oracle; the CUDA
   tests of tests/kernels/test_loss_triton.py and tests/kernels/test_loss_grad_in_forward.py; the packed forward
   and prefix sharing (flex_attention) of tests/cppo/step/test_cuda_models.py) with ``TRITON_INTERPRET=0``
   (:mod:`gpukit.part_tests`);
2. ``loss``: every method of ``bench_loss.build_methods`` (forward + backward) at T=16,384, H=1,536, V=151,936 bf16
   and at the CPU benchmark's shape, against the plain ``[T,H] x [H,V]`` GEMM timed in the same run: milliseconds,
   TFLOP/s, peak memory; each loss's and ``fused_logprobs``' error against a float64 oracle (:mod:`gpukit.part_loss`);
3. ``select``: group_advantages / select_completions / cppo_select at N = 16 x {64, 1,024, 4,096} on both backends
   (CUDA events, ``bench_select``), with the kernels launched per call counted by torch.profiler
   (:mod:`gpukit.part_select`);
4. ``e2e``: the packed forward's error against separate forwards (flash-attention 2 when importable, sdpa
   otherwise); prefix-shared packing (flex_attention) against a prompt copy per completion: the error (checked),
   tokens through the model each way, forward+backward time and peak memory each way (:mod:`gpukit.part_prefix`);
   then ``benchmarks/speedup.py`` tiny on CUDA (HF rollouts; vLLM too when importable; :mod:`gpukit.part_e2e`).

Each part writes ``<out>/<part>.json`` (atomically) whenever it has a new result and the kit rewrites
``summary.md`` / ``summary.json`` after every part (:mod:`gpukit.report`), so a kill leaves everything finished so
far. Exit status: 0 when every check passed, 1 when a check failed or a part crashed, 2 for bad arguments, 3 when
nothing failed but a part ran out of time. Without CUDA (or with ``--dry-run``) it says so in one line and runs
every part's code path on tiny CPU shapes instead (nothing measured), into a temporary folder unless ``--out`` is
given.
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys
import tempfile
from collections.abc import Sequence

from gpukit.plan import BENCH, DEADLINE_S, DEFAULT_OUT, DEFAULT_WHEELS, DRY_PLAN, EXIT_FAIL, GPU_PLAN, PARTS, REPO


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The kit's flags; a bad one exits with status 2 and a line naming it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="See docs/gpu-kit.md.")
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


def _terminate(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_child, which ends the running part's process group


def main(argv: Sequence[str] | None = None) -> int:
    """The kit (or, with the hidden ``--part``, one part in a child process); returns the exit status."""
    args = parse_args(argv)
    for path in (BENCH, REPO):  # the repository first: its cppo, not an installed copy
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    if args.part:
        from gpukit.parts import run_part

        args.out.mkdir(parents=True, exist_ok=True)
        return run_part(args.part, DRY_PLAN if args.dry_run else GPU_PLAN, args.out, args.until)
    try:
        import torch
    except ImportError as e:
        print(f"gpu_check: torch is not importable by {sys.executable} ({e}); run the kit with a python that has "
              "torch (make gpu-check PYTHON=...)", file=sys.stderr)  # fmt: skip
        return EXIT_FAIL
    from gpukit.runner import orchestrate  # imports cppo (for cppo.fileio), so after torch is known to import

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
