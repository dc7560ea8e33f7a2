"""CPPO against GRPO over seeds (issue 22): ``benchmarks/speedup.py --eval`` once per seed, side by side in child
processes with one torch thread each, then one JSON with every row, the paired summary and a plot.

Each seed is a whole speedup.py run with ``--seed S`` (the seed also draws the run's training questions: TrainConfig's
``question_seed`` defaults to it), the sequential schedule (one model in memory per process) and ``--threads 1``.
The default runs are the issue's: GRPO, CPPO at P = 0.75 (allocation on, the official recipe), random pruning and
PODS' max-variance selector at 0.75, on 64 questions per seed, evaluated on 300 distinct held-out problems:

    OMP_NUM_THREADS=1 python benchmarks/accuracy_seeds.py --seeds 42 43 44 --out benchmarks/results

Everything after ``--`` replaces the default speedup.py arguments (:data:`DEFAULT_SPEEDUP_ARGS`). ``--from-runs
DIR`` combines the per-seed JSONs a former run left in DIR instead of running. Predicted time on an idle 2-core CPU:
about 55 CPU minutes per seed (GRPO ~20 min of its 64 steps, each pruned run ~7-8 min, 300 problems ~2 min per
evaluation, 5 evaluations), so three seeds side by side take ~85-95 min.

Writes ``NAME-seeds.json`` (``{"meta", "rows", "summary"}``; each row is a speedup.py row, its ``seed`` among
them), ``NAME-seeds.png`` and, beside them, ``NAME-seeds-runs/`` with each seed's speedup.py output
(``NAME-seedS.json``, its plots and log).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from bench_out import new_run_folder
from seeds_report import by_seed, format_summary, plot, summarise

from cppo import fileio

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_SPEEDUP_ARGS = (
    "--config", "smollm2-accuracy-cpu", "--pruning-rates", "0", "0.75",
    "--selection-metric", "random@0.75", "max-variance@0.75", "--questions", "64", "--eval", "300",
    "--eval-points", "1",
)  # fmt: skip
#: What the summary reads of every row.
ROW_KEYS = ("pruning_rate", "selection_metric", "accuracy_after", "total_seconds", "train_seconds", "eval_problems")
#: Flags the driver sets itself for every seed.
OWN_FLAGS = ("--seed", "--threads", "--schedule", "--out", "--name", "--no-progress", "--dry-run")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The driver's flags, and speedup.py's (after ``--``; default :data:`DEFAULT_SPEEDUP_ARGS`)."""
    argv = list(argv)
    rest = argv[argv.index("--") + 1 :] if "--" in argv else list(DEFAULT_SPEEDUP_ARGS)
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44], help="one speedup.py run per seed (>= 2)")
    ap.add_argument("--jobs", type=int, help="runs side by side (default: every seed at once)")
    ap.add_argument("--out", type=pathlib.Path, help="default: a new benchmarks/runs/NAME-<UTC>/")
    ap.add_argument("--name", default="accuracy-smollm2", help="NAME-seeds.json / .png; each seed's NAME-seedS.json")
    ap.add_argument("--from-runs", type=pathlib.Path, help="combine the NAME-seedS.json in this folder; run nothing")
    ap.add_argument(
        "--dry-run", action="store_true", help="check every seed's plan (speedup.py --dry-run), write nothing"
    )
    args = ap.parse_args(own)
    if len(set(args.seeds)) != len(args.seeds) or len(args.seeds) < 2:
        raise ValueError(f"--seeds must be >= 2 distinct seeds (a 95% interval over seeds), got {args.seeds}")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    clash = sorted({a for a in rest if a in OWN_FLAGS})
    if clash:
        raise ValueError(f"speedup.py arguments after -- must not set {clash}: accuracy_seeds.py sets them per seed")
    args.speedup_args = rest
    return args


def seed_command(args: argparse.Namespace, seed: int, runs: pathlib.Path, *, dry: bool = False) -> list[str]:
    """The speedup.py command line of one seed."""
    own = ["--seed", str(seed), "--threads", "1", "--schedule", "sequential", "--no-progress"]
    where = ["--out", str(runs), "--name", f"{args.name}-seed{seed}"]
    return [sys.executable, str(HERE / "speedup.py"), *args.speedup_args, *own, *where, *(["--dry-run"] if dry else [])]


def run_seeds(args: argparse.Namespace, runs: pathlib.Path) -> None:
    """Every seed's speedup.py, ``--jobs`` at a time, each with one thread (OMP_NUM_THREADS=1) and its own log;
    a RuntimeError naming the seeds whose run failed (their logs say why)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    pending, failed = list(args.seeds), []
    jobs = args.jobs or len(args.seeds)
    while pending:
        batch, pending = pending[:jobs], pending[jobs:]
        procs = {}
        for seed in batch:
            log = open(runs / f"{args.name}-seed{seed}.log", "w")  # noqa: SIM115 - closed below
            cmd = seed_command(args, seed, runs)
            procs[seed] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
            print(f"seed {seed}: {' '.join(cmd[1:])}", flush=True)
        for seed, (proc, log) in procs.items():
            if proc.wait() != 0:
                failed.append(seed)
            log.close()
    if failed:
        last = {s: (runs / f"{args.name}-seed{s}.log").read_text().strip().splitlines()[-1:] for s in failed}
        raise RuntimeError(
            f"speedup.py failed for seeds {failed} (logs: {runs}/{args.name}-seed<S>.log); last lines: {last}"
        )


def combine(args: argparse.Namespace, runs: pathlib.Path) -> dict[str, Any]:
    """Every seed's rows and meta from ``runs``; ValueError naming the missing file."""
    rows, metas = [], {}
    for seed in args.seeds:
        path = runs / f"{args.name}-seed{seed}.json"
        if not path.is_file():
            raise ValueError(f"--from-runs: {path} is missing (seed {seed} did not finish)")
        try:
            data = json.loads(path.read_text())
            metas[seed] = data["meta"]
            found = [{**r, "seed": r.get("seed", seed)} for r in data["rows"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a speedup.py result ({type(e).__name__}: {e})") from None
        missing = sorted({k for r in found for k in ROW_KEYS if k not in r})
        if missing or not found:
            raise ValueError(f"{path}: its rows lack {missing or 'rows'} (not a speedup.py --eval result)")
        rows += found
    return {"rows": rows, "metas": metas}


def meta_of(metas: dict[int, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The combined meta: the first seed's (model, versions, settings) less its per-run fields, the commands, and
    each seed's date, git commit and warm-up."""
    first = dict(next(iter(metas.values())))
    for key in ("argv", "date", "seed", "question_seed", "warmup_seconds", "git_commit", "git_dirty"):
        first.pop(key, None)
    per_seed = {
        s: {k: m.get(k) for k in ("date", "git_commit", "git_dirty", "warmup_seconds", "argv")}
        for s, m in metas.items()
    }
    return {**first, "seeds": list(args.seeds), "speedup_args": list(args.speedup_args), "per_seed": per_seed}


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """Every seed's ``speedup.py --dry-run`` (settings, data, schedule, evaluation): prints and returns
    ``{"dry_run": "ok", "seeds": {seed: its plan}}``; ValueError with the child's error when a plan is invalid."""
    plans = {}
    with tempfile.TemporaryDirectory(prefix="accuracy-seeds-") as tmp:
        for seed in args.seeds:
            done = subprocess.run(seed_command(args, seed, pathlib.Path(tmp), dry=True), capture_output=True, text=True)
            if done.returncode != 0:
                raise ValueError(f"seed {seed}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            plans[seed] = json.loads(done.stdout[done.stdout.index("{") :])
    result = {"dry_run": "ok", "seeds": plans}
    print(json.dumps(result, indent=1))
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs (or with ``--from-runs`` combines) the seeds; returns ``{"meta", "rows", "summary"}`` as written."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.dry_run:
        return dry_run(args)
    out = args.out or new_run_folder(f"{args.name}-seeds")
    runs = args.from_runs or out / f"{args.name}-seeds-runs"
    if args.from_runs is None:
        runs.mkdir(parents=True, exist_ok=False)  # never a former run's folder
        run_seeds(args, runs)
    found = combine(args, runs)
    summary, table = summarise(found["rows"]), by_seed(found["rows"])
    data = {"meta": meta_of(found["metas"], args), "rows": found["rows"], "summary": summary}
    path, png = out / f"{args.name}-seeds.json", out / f"{args.name}-seeds.png"
    out.mkdir(parents=True, exist_ok=True)
    fileio.write_json(path, data)
    plot(png, summary, table, data["meta"])
    print(format_summary(summary, table))
    print(f"\nwrote {path}, {png}")
    return data


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, RuntimeError, subprocess.CalledProcessError) as e:
        sys.exit(f"accuracy_seeds.py: error: {e}")
