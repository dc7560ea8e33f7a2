"""Accuracy over seeds: CPPO, its variants and GRPO, each seed with its own training questions, evaluated on the same
held-out problems; one JSON with every row, the paired summary (:mod:`sweeps.report`) and a plot.

**The sweep (``--arms``), the runner to use.** Its unit of work is one (seed, arm): an arm is a named trainer
configuration (:data:`accuracy_arm.ARMS`: the preset plus ``--set`` overrides), trained by ``accuracy_arm.py`` in a
child process of one torch thread (OMP_NUM_THREADS=1, ``--threads 1``), ``--jobs`` (2) at a time, each in its own
folder ``OUT/units/seedS-ARM/`` with its ``log`` and ``result.json`` (written atomically at the end). Before any arm,
one unit evaluates the untrained model (``OUT/units/before/``: the same weights and test problems for every seed and
arm, so it is measured once; per seed for a built-in tiny model) and every arm's row starts its curve from it. The
queue runs the seeds in order, every arm of a seed before the next seed, so that a partial sweep holds complete
seeds. The settings every unit shares follow ``--`` (:func:`accuracy_arm.add_base_args`; default: the
``smollm2-accuracy-cpu`` preset, 64 questions per seed, 300 test problems, one evaluation at the end):

    OMP_NUM_THREADS=1 nohup .venv/bin/python benchmarks/accuracy_seeds.py --seeds 45 46 47 48 49 50 \\
        --arms grpo cppo-pooled cppo-group max-variance control --jobs 2 --out /work/sweep-out \\
        --with benchmarks/results/accuracy-smollm2-seeds.json >> /work/sweep-out/sweep.log 2>&1 &

It is resumable: the same command with the same ``--out`` continues. A unit whose ``result.json`` is complete and
valid is never run again; one that was interrupted (its folder without a valid result) is moved aside to
``seedS-ARM.torn-N`` (kept, never appended to) and rerun from scratch in a fresh folder. ``OUT/sweep.json`` records the
shared settings and the arms' overrides: a later invocation with other ones is refused (its results would not
compare), and a lock (``OUT/.cppo-run.lock``) refuses a second sweep on the folder while one runs. ``--combine`` runs
nothing and combines the finished units (and ``--with`` files) as the end of a sweep does:

    .venv/bin/python benchmarks/accuracy_seeds.py --seeds 45 46 47 48 49 50 \\
        --arms grpo cppo-pooled cppo-group max-variance control --out /work/sweep-out --combine \\
        --with benchmarks/results/accuracy-smollm2-seeds.json

``--dry-run`` plans every unit without a model and checks that every arm of a seed trains the same question ids
(printing each arm's steps, warm-up steps and summed learning rate). The combination writes ``OUT/NAME-seeds.json``
(``{"meta", "rows", "summary"}``) and ``.png``; rows are ``speedup.py`` rows plus ``arm``, the columns against GRPO
filled from the same seed's GRPO row. ``--with FILE`` adds a former combined JSON (the committed three seeds) or a
unit's ``result.json``. ``--combine`` checks the command's shared settings and arms against ``OUT/sweep.json`` as a
continued run does, and every file combined must agree with the others (:mod:`sweeps.files`: every trainer setting
but the allow-list :data:`sweeps.files.MAY_DIFFER`, the environment, the questions per seed, the evaluation, the
untrained model's accuracy, every seed's question ids across its methods), else it is refused in one line naming the
file, the setting and both values.

The control arm is CPPO pooled *without* allocation (64 steps of one question, the same 64 questions in the same
order as GRPO, 2 of 8 completions kept per step), not GRPO with its learning rate divided by 4. It holds GRPO's
optimizer steps, warm-up steps (7), schedule and summed learning rate exactly and changes one thing relative to GRPO
(which completions train), and one thing relative to CPPO pooled with allocation (the step budget: 16 steps of 4
pooled questions against 64 of 1, the same questions and kept-completion count per question on average). GRPO at
lr / 4 would match the summed learning rate only, still differ from the pruned arms in steps (64 against 16), warm-up
(7 against 2) and per-step batch, and is a setting nobody would run, while ``allocation: false`` is a CPPO setting
a user can choose. So control - GRPO measures pruning at GRPO's step budget, and CPPO pooled - control what
allocation's 4x fewer steps cost or gain.

**Per seed (no ``--arms``): the three-seed run of issue 22.** ``benchmarks/speedup.py --eval`` once per seed with
``--seed S`` (the seed also draws the run's training questions), the sequential schedule and ``--threads 1``, every
method of the seed in one process, the seeds side by side. The default runs are GRPO, CPPO at P = 0.75 (allocation
on, the official recipe), random pruning and PODS' max-variance selector at 0.75, on 64 questions per seed,
evaluated on 300 distinct held-out problems (this made ``benchmarks/results/accuracy-smollm2-seeds.json``):

    OMP_NUM_THREADS=1 python benchmarks/accuracy_seeds.py --seeds 42 43 44 --out benchmarks/results

Everything after ``--`` replaces the default speedup.py arguments (:data:`DEFAULT_SPEEDUP_ARGS`). ``--from-runs
DIR`` combines the per-seed JSONs a former run left in DIR instead of running; a file that ran other speedup.py
arguments than this command passes (its ``meta.argv``), that disagrees with the others (as ``--with`` files), or
whose rows name another seed than the file, is refused. It writes ``NAME-seeds.json``, ``NAME-seeds.png`` and,
beside them, ``NAME-seeds-runs/`` with each seed's speedup.py output (``NAME-seedS.json``, its plots and log).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchkit.out import new_run_folder
from endtoend.report import relative_fields

from cppo.run import RunLock, RunLocked
from sweeps import arm as accuracy_arm
from sweeps.files import (  # noqa: F401  (per_problem_lines: named here by the tests)
    MAY_DIFFER,
    RECORDED_KEYS,
    ROW_AGREE_KEYS,
    agreed_meta,
    check_agree,
    check_command,
    per_problem_lines,
    read_result,
    with_records,
    write_combined,
)
from sweeps.report import TIME_BASES, method, summarise
from sweeps.units import Unit, check_finished_units, check_sweep_folder, finished, fresh_folder, sweep_settings

HERE = pathlib.Path(__file__).resolve().parents[1]  # benchmarks/: the scripts a seed or a unit runs
DEFAULT_SPEEDUP_ARGS = (
    "--config", "smollm2-accuracy-cpu", "--pruning-rates", "0", "0.75",
    "--selection-metric", "random@0.75", "max-variance@0.75", "--questions", "64", "--eval", "300",
    "--eval-points", "1",
)  # fmt: skip
#: Flags the driver sets itself for every seed.
OWN_FLAGS = ("--seed", "--threads", "--schedule", "--out", "--name", "--no-progress", "--dry-run")
#: Seconds between two looks at the running units.
POLL_SECONDS = 5.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The driver's flags, and after ``--`` speedup.py's (default :data:`DEFAULT_SPEEDUP_ARGS`) or with ``--arms``
    the settings every unit shares (:func:`accuracy_arm.add_base_args`)."""
    argv = list(argv)
    rest = argv[argv.index("--") + 1 :] if "--" in argv else None
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44], help="the seeds (distinct)")
    ap.add_argument(
        "--arms", nargs="+", choices=sorted(accuracy_arm.ARMS), help="the sweep: run these arms on every seed"
    )
    ap.add_argument("--jobs", type=int, help="units side by side (default: 2 with --arms, else every seed at once)")
    ap.add_argument("--out", type=pathlib.Path, help="the sweep's folder (--arms); default: a new benchmarks/runs/...")
    ap.add_argument("--name", default="accuracy-smollm2", help="NAME-seeds.json / .png; each seed's NAME-seedS.json")
    ap.add_argument("--from-runs", type=pathlib.Path, help="combine the NAME-seedS.json in this folder; run nothing")
    ap.add_argument("--combine", action="store_true", help="--arms: combine the finished units of --out; run nothing")
    ap.add_argument("--with", dest="with_files", type=pathlib.Path, action="append", default=[], metavar="FILE",
                    help="--arms: also combine this former NAME-seeds.json (e.g. the committed seeds)")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="check every seed's (or unit's) plan, write nothing")
    ap.add_argument("--time", choices=sorted(TIME_BASES), default="cpu",
                    help="the seconds of the time ratios to GRPO: process CPU (default; unaffected by a neighbour's "
                    "load) or wall")  # fmt: skip
    args = ap.parse_args(own)
    if len(set(args.seeds)) != len(args.seeds) or len(args.seeds) < (1 if args.arms else 2):
        raise ValueError(f"--seeds must be >= 2 distinct seeds (a 95% interval over seeds), got {args.seeds}")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.arms:
        if args.from_runs is not None:
            raise ValueError("--from-runs combines per-seed speedup.py files; with --arms use --combine")
        if args.out is None and not args.dry_run:
            raise ValueError("--arms needs --out DIR (the sweep's folder: a later run with it continues the sweep)")
        if len(set(args.arms)) != len(args.arms):
            raise ValueError(f"--arms repeats an arm: {args.arms}")
        worker = argparse.ArgumentParser(prog="accuracy_seeds.py --arms ... --")
        accuracy_arm.add_base_args(worker)
        args.unit_args = rest or []
        args.base = worker.parse_args(args.unit_args)
        accuracy_arm.check_base_args(args.base)
        return args
    if args.combine or args.with_files:
        raise ValueError("--combine and --with go with --arms (the sweep); per seed, --from-runs combines")
    rest = list(DEFAULT_SPEEDUP_ARGS) if rest is None else rest
    clash = sorted({a for a in rest if a in OWN_FLAGS})
    if clash:
        raise ValueError(f"speedup.py arguments after -- must not set {clash}: accuracy_seeds.py sets them per seed")
    args.speedup_args = rest
    return args


# ---------------------------------------------------------------------------------------------------------------
# Per seed: speedup.py --eval once per seed (the three-seed run)
# ---------------------------------------------------------------------------------------------------------------


def seed_command(args: argparse.Namespace, seed: int, runs: pathlib.Path, *, dry: bool = False) -> list[str]:
    """The speedup.py command line of one seed."""
    own = ["--seed", str(seed), "--threads", "1", "--schedule", "sequential", "--no-progress"]
    where = ["--out", str(runs), "--name", f"{args.name}-seed{seed}"]
    return [sys.executable, str(HERE / "speedup.py"), *args.speedup_args, *own, *where, *(["--dry-run"] if dry else [])]


def one_thread_env() -> dict[str, str]:
    """This process's environment with one OpenMP / MKL thread (each child runs one torch thread)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_seeds(args: argparse.Namespace, runs: pathlib.Path) -> None:
    """Every seed's speedup.py, ``--jobs`` at a time, each with one thread (OMP_NUM_THREADS=1) and its own log;
    a RuntimeError naming the seeds whose run failed (their logs say why)."""
    pending, failed = list(args.seeds), []
    jobs = args.jobs or len(args.seeds)
    while pending:
        batch, pending = pending[:jobs], pending[jobs:]
        procs = {}
        for seed in batch:
            log = open(runs / f"{args.name}-seed{seed}.log", "w")  # noqa: SIM115 - closed below
            cmd = seed_command(args, seed, runs)
            procs[seed] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=one_thread_env()), log)
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
    """Every seed's rows and meta from ``runs``; ValueError naming the file that is missing, is not a result, names
    another seed in its rows or meta, ran other speedup.py arguments than this command passes
    (:func:`sweeps.files.check_command`) or disagrees with the first file (:func:`check_agree`)."""
    rows, metas, sources = [], {}, []
    for seed in args.seeds:
        path = runs / f"{args.name}-seed{seed}.json"
        if not path.is_file():
            raise ValueError(f"--from-runs: {path} is missing (seed {seed} did not finish)")
        meta, found = read_result(path, "a speedup.py result")
        seeds = sorted({r.get("seed", seed) for r in found} | {meta.get("seed", seed)})
        if seeds != [seed]:
            raise ValueError(f"{path}: its rows or meta are of seed(s) {seeds}, but the file is named for seed {seed}")
        check_command(path, meta, args.speedup_args, OWN_FLAGS)
        found = [{**r, "seed": seed} for r in found]
        metas[seed] = meta
        sources.append((path, meta, found))
        rows += found
    check_agree(sources)
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


# ---------------------------------------------------------------------------------------------------------------
# The sweep: one (seed, arm) per child process, resumable
# ---------------------------------------------------------------------------------------------------------------


def plan_units(args: argparse.Namespace) -> list[Unit]:
    """The sweep's queue: the evaluations before training (one, or one per seed for a tiny model), then every arm of
    the first seed, then of the next seed, and so on (a partial sweep holds complete seeds)."""
    befores: dict[str, Unit] = {}
    arms = []
    for seed in args.seeds:
        name = accuracy_arm.before_name(accuracy_arm.arm_config(args.base, None, seed)).removesuffix(".json")
        befores.setdefault(name, Unit(seed, None, name))
        arms += [Unit(seed, arm, f"seed{seed}-{arm}", before=name) for arm in args.arms]
    return [*befores.values(), *arms]


def unit_command(args: argparse.Namespace, unit: Unit, out: pathlib.Path) -> list[str]:
    """The ``accuracy_arm.py`` command line of ``unit`` (one torch thread)."""
    before = out / "units" / str(unit.before) / "result.json"
    what = ["--before-only"] if unit.arm is None else ["--arm", unit.arm, "--before", str(before)]
    return [sys.executable, str(HERE / "accuracy_arm.py"), *what, "--seed", str(unit.seed), "--threads", "1",
            "--result", str(unit.result(out)), *args.unit_args]  # fmt: skip


def run_units(
    args: argparse.Namespace, units: Sequence[Unit], out: pathlib.Path, *, poll: float = POLL_SECONDS
) -> list[str]:
    """Runs every unit that has not finished, ``--jobs`` at a time, in queue order (an arm once its evaluation before
    training has finished; if that failed, the arm is not run); returns the names of the units that failed. Each
    child writes its log to its folder; this prints a line when a unit starts, is skipped or ends. Interrupted
    (SIGTERM, Ctrl-C), it terminates its children (their folders become torn attempts) and re-raises."""
    pending = collections.deque(u for u in units if not finished(u, out))
    for u in units:
        if u not in pending:
            print(f"{u.name}: finished before, skipped", flush=True)
    running: dict[Unit, tuple[subprocess.Popen, Any, float]] = {}
    failed: list[str] = []
    jobs = args.jobs or 2
    try:
        while pending or running:
            busy = {u.name for u in pending} | {u.name for u in running}
            ready = [u for u in pending if u.before not in busy]
            for u in ready:
                if len(running) >= jobs:
                    break
                pending.remove(u)
                if u.before in failed:
                    failed.append(u.name)
                    print(f"{u.name}: not run, its evaluation before training ({u.before}) failed", flush=True)
                    continue
                try:
                    folder = fresh_folder(u, out)
                except ValueError as e:  # a former sweep's child still runs it
                    failed.append(u.name)
                    print(f"{u.name}: not run: {e}", flush=True)
                    continue
                log = open(folder / "log", "w")  # noqa: SIM115 - closed when the child ends
                cmd = unit_command(args, u, out)
                log.write(" ".join(cmd) + "\n")
                log.flush()
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=one_thread_env())
                running[u] = (proc, log, time.time())
                print(f"{u.name}: started (pid {proc.pid}, log {folder / 'log'})", flush=True)
            time.sleep(poll if running else 0)
            for u, (proc, log, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[u]
                ok = proc.returncode == 0 and finished(u, out)
                if not ok:
                    failed.append(u.name)
                state = "finished" if ok else f"FAILED (exit {proc.returncode}; see its log)"
                print(f"{u.name}: {state} after {(time.time() - t0) / 60:.1f} min", flush=True)
    finally:
        for proc, log, _ in running.values():
            proc.terminate()
            proc.wait()
            log.close()
    return failed


def sweep_dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """Every arm's plan (:func:`accuracy_arm.plan`, no model), printed as a table; ValueError when the arms of a seed
    would train different question ids. Returns ``{"dry_run": "ok", "units": [names in queue order], "plans"}``."""
    units = plan_units(args)
    plans = {u.name: accuracy_arm.plan(args.base, u.arm, u.seed) for u in units if u.arm}
    for seed in args.seeds:
        ids = {name: p["train_question_ids"] for name, p in plans.items() if p["seed"] == seed}
        first = next(iter(ids))
        other = next((n for n in ids if ids[n] != ids[first]), None)
        if other is not None:
            raise ValueError(f"seed {seed}: {other} would train other questions than {first}")
    print("| unit | planned steps | bounded by | questions / step | kept / step | warm-up steps | summed lr | ids |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, p in plans.items():
        ids = p["train_question_ids"]
        print(
            f"| {name} | {p['steps']} | {p['bounded_by']} | {p['questions_per_step']} | {p['kept_per_step']} | "
            f"{p['warmup_steps']} | {p['summed_lr']:.3g} | {len(ids)} ({len(set(ids))} distinct), the seed's |"
        )
    result = {"dry_run": "ok", "units": [u.name for u in units], "plans": plans}
    print(json.dumps({k: result[k] for k in ("dry_run", "units")}))  # the queue, in order
    return result


def combine_sweep(args: argparse.Namespace, out: pathlib.Path) -> dict[str, Any]:
    """The finished arms of the sweep in ``out`` and the ``--with`` files, checked to agree (:func:`check_agree`),
    every row named by its arm (:func:`accuracy_arm.arm_of`) and the sweep's rows measured against their seed's GRPO
    row (:func:`endtoend.report.relative_fields`); ``{"meta", "rows", "summary"}``. ValueError naming the file that is
    not a result (a unit's result.json that is not valid: :func:`sweeps.files.read_result`) or does not agree, or when
    nothing is there to combine."""
    units = [u for u in plan_units(args) if u.arm]
    done = [u for u in units if finished(u, out)]
    for u in units:  # a result written whole (atomically) but not valid: said, not left out as if still running
        if u not in done and u.result(out).is_file():
            read_result(u.result(out), "a unit's result")  # names the file and the field
            raise ValueError(f"{u.result(out)}: not one row of arm {u.arm} and seed {u.seed} (move its folder aside)")
    sources = [(u.result(out), *read_result(u.result(out), "a unit's result")) for u in done]
    for path in args.with_files:  # a combined file: its per-problem records from beside it
        meta, rows = read_result(path, "an accuracy_seeds.py result")
        sources.append((path, meta, with_records(path, rows)))
    if not sources:
        raise ValueError(f"{out}: no unit has finished, and no --with file: nothing to combine")
    check_agree(sources)
    sweep_rows, former = [], []
    for path, _, rows in sources:
        for r in rows:
            arm = accuracy_arm.arm_of(r)
            if r.get("arm", arm) != arm:
                raise ValueError(f"{path}: a row says arm {r['arm']!r}, but its settings are those of {arm!r}")
            (sweep_rows if "arm" in r else former).append({**r, "arm": arm})
    grpo = {r["seed"]: r for r in former + sweep_rows if r["arm"] == "grpo"}  # a --with file's seed has its GRPO
    sweep_rows = [r if r["arm"] == "grpo" or r["seed"] not in grpo else {**r, **relative_fields(r, grpo[r["seed"]])}
                  for r in sweep_rows]  # fmt: skip
    rows = sorted(former + sweep_rows, key=lambda r: (r["seed"], method(r)))
    have = {(r["seed"], r["arm"]) for r in rows}
    missing = [u.name for u in units if (u.seed, u.arm) not in have]  # neither finished nor in a --with file
    summary = summarise(rows, time=args.time)
    first = sources[0][1]
    meta = {
        **agreed_meta(first), "questions": first.get("questions"), "eval": first.get("eval"),
        "agree": f"every file combined agrees on every trainer setting but {sorted(MAY_DIFFER)} (a setting a file "
        "predates: its default), the Python and library versions, torch's threads, the questions per seed, the "
        f"evaluation's problems and points, the rows' {list(ROW_AGREE_KEYS)}, the untrained model's accuracy (a model "
        "read from a file) and, per seed, the training question ids; sources records where and when each ran",
        "sweep": {"out": str(out), "seeds": list(args.seeds), "arms": list(args.arms), **sweep_settings(args),
                  "missing": missing},
        "sources": [
            {"file": str(path), "seeds": sorted({r["seed"] for r in rows}),
             "methods": sorted({method(r) for r in rows}), **{k: meta.get(k) for k in RECORDED_KEYS}}
            for path, meta, rows in sources
        ],
    }  # fmt: skip
    return {"meta": meta, "rows": rows, "summary": summary}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    """``--arms``: runs the sweep's unfinished units (unless ``--combine``) under the folder's lock, then combines
    what has finished; RuntimeError naming the units that failed (after combining the rest)."""
    out, failed = args.out, []
    if not args.combine:
        out.mkdir(parents=True, exist_ok=True)
        lock = RunLock.of(str(out))
        try:
            lock.acquire()
        except RunLocked as e:
            raise ValueError(f"--out {out}: another sweep is running in it ({e})") from None
        try:
            check_sweep_folder(args, out)
            units = plan_units(args)
            check_finished_units(args, units, out)  # an edited preset or another environment would not pool
            print(f"sweep in {out}: {len(units)} units, {args.jobs or 2} at a time: {', '.join(u.name for u in units)}")
            failed = run_units(args, units, out)
        finally:
            lock.release()
    if args.combine:  # the command line must be the sweep's, as a continued run's must
        check_sweep_folder(args, out, record=False)
    data = combine_sweep(args, out)
    write_combined(data, out, args.name)
    if data["meta"]["sweep"]["missing"]:
        print(f"left out (not finished, and in no --with file): {', '.join(data['meta']['sweep']['missing'])}")
    if failed:
        raise RuntimeError(
            f"units {failed} failed (logs: {out}/units/NAME/log); the others are combined; the same command reruns them"
        )
    return data


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs (or with ``--from-runs`` / ``--combine`` combines) the seeds; returns ``{"meta", "rows", "summary"}`` as
    written (with ``--dry-run``: the plans)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.arms:
        return sweep_dry_run(args) if args.dry_run else sweep(args)
    if args.dry_run:
        return dry_run(args)
    out = args.out or new_run_folder(f"{args.name}-seeds")
    runs = args.from_runs or out / f"{args.name}-seeds-runs"
    if args.from_runs is None:
        runs.mkdir(parents=True, exist_ok=False)  # never a former run's folder
        run_seeds(args, runs)
    found = combine(args, runs)
    summary = summarise(found["rows"], time=args.time)
    data = {"meta": meta_of(found["metas"], args), "rows": found["rows"], "summary": summary}
    write_combined(data, out, args.name)
    return data


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM ends the sweep like Ctrl-C: its children are terminated on the way out."""
    raise SystemExit(128 + signum)


def cli() -> None:
    """``python benchmarks/accuracy_seeds.py``: :func:`main` (a SIGTERM stops it as Ctrl-C does), an error as one line
    and exit status 1."""
    signal.signal(signal.SIGTERM, _stop)
    try:
        main()
    except (ValueError, OSError, RuntimeError, subprocess.CalledProcessError) as e:
        sys.exit(f"accuracy_seeds.py: error: {e}")
