"""Generation ahead of training against the synchronous run, whole run, on the same questions (issue 51, part 3).

``python benchmarks/overlap.py [--config PRESET_OR_YAML] [--set key=value ...] --rates 0 0.875 --questions 32
--rounds 2 --out DIR`` runs, for every pruning rate P, the synchronous run (``max_staleness=0``) and the run
generating ahead (``max_staleness=1``: step k+1 generated while step k trains), every (arm, round) a unit in a process
of its own (an arm generating ahead runs its engine in a thread beside the trainer: two arms cannot share one vLLM
engine in one process as ``speedup.py``'s interleaved arms do). Units alternate within a round and every other round
runs them in reverse (ABBA: load drifting over the run falls on both sides alike). A unit builds the trainer, takes one
untimed warm-up step on other questions (the engine warmed, vLLM's first call out of the timings), then trains the
``--questions`` questions (``num_steps`` = questions / the questions a step draws) and records per step the wall
clock, the trainer's phase times, the generating thread's wait and staleness, and over the run the process's CPU
seconds (every thread's, children's apart: the vLLM engine core runs in this process here) and its peak RSS.

Each unit is written atomically to ``DIR/units/ARM-rR.json`` once it has ended (a rerun skips it; other settings are
refused); ``DIR/overlap.json`` combines them: per arm the whole-run wall and CPU seconds (mean and 95% t interval over
rounds) and its speedup against GRPO's synchronous run of the same round (P = 0, ``max_staleness=0``; per-round
ratios, their mean and interval). What this measures on a CPU: the engine and the trainer on their own cores
(:func:`cppo.overlap.split_cpus`); the synchronous run uses the torch threads it is given (``--threads``, default 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

from sweeps.stats import mean_interval

REPO = pathlib.Path(__file__).resolve().parents[2]
#: The two arms of every rate: the synchronous run and the run generating ahead.
ARMS = {"sync": 0, "overlap": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks/overlap.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="speedup-cpu", help="a trainer preset or YAML file (as cppo train --config)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.875], help="pruning rates; 0 (GRPO) first")
    ap.add_argument("--questions", type=int, default=32, help="training questions of every run")
    ap.add_argument("--rounds", type=int, default=2, help="rounds (each runs every unit once)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every unit")
    ap.add_argument("--out", type=pathlib.Path, required=True, help="folder of the units and overlap.json")
    ap.add_argument("--unit", help=argparse.SUPPRESS)  # internal: run one unit ARM@P,ROUND in this process
    args = ap.parse_args(argv)
    if not args.rates or args.rates[0] != 0.0 or len(set(args.rates)) != len(args.rates):
        ap.error(f"--rates must be distinct and start with 0 (GRPO, the baseline), got {args.rates}")
    for flag, value in (("--questions", args.questions), ("--rounds", args.rounds), ("--threads", args.threads)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    return args


def plan(args: argparse.Namespace) -> list[tuple[int, str, float]]:
    """``(round, arm, rate)`` of every unit in run order: within a round rate after rate, sync then overlap; every
    other round reversed."""
    units = []
    for r in range(1, args.rounds + 1):
        order = [(arm, p) for p in args.rates for arm in ARMS]
        units += [(r, arm, p) for arm, p in (order if r % 2 else order[::-1])]
    return units


def unit_name(arm: str, rate: float, r: int) -> str:
    return f"{arm}-p{rate:g}-r{r}"


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """What every unit of a folder must share (a rerun with others is refused)."""
    return {"config": args.config, "overrides": list(args.overrides), "rates": list(args.rates),
            "questions": args.questions, "threads": args.threads}  # fmt: skip


def unit_config(args: argparse.Namespace, arm: str, rate: float, output_dir: str):
    """The unit's trainer config: the base with the rate, the arm's ``max_staleness`` and the run's length."""
    import cppo  # the settings alone: the driver validates every unit's config without importing the trainer

    base = cppo.load_config(args.config, list(args.overrides))
    config = dataclasses.replace(base, pruning_rate=rate, max_staleness=ARMS[arm], output_dir=output_dir)
    drawn = config.pruning.questions_drawn
    if args.questions % drawn:
        raise ValueError(
            f"--questions {args.questions} must be a multiple of {drawn}, the questions a step draws at P={rate:g}"
        )
    return dataclasses.replace(config, num_steps=args.questions // drawn, max_questions=args.questions)


def run_unit(args: argparse.Namespace, arm: str, rate: float) -> dict[str, Any]:
    """One unit in this process: warm-up, then the timed steps (module docstring)."""
    import torch

    import cppo.trainer
    from cppo.fileio import run_metadata

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="cppo-overlap-") as tmp:
        config = unit_config(args, arm, rate, os.path.join(tmp, "run"))
        warm = dataclasses.replace(config, seed=config.seed + 1, num_steps=1, output_dir=os.path.join(tmp, "warm"))
        start = time.perf_counter()
        warmer = cppo.trainer.Trainer(warm)
        warmer.train_step()
        if warmer.queue is not None:
            warmer.queue.close()
        del warmer
        trainer = cppo.trainer.Trainer(config)
        setup = time.perf_counter() - start
        cpu0, children0 = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        steps, wall0 = [], time.perf_counter()
        for _ in range(trainer.num_steps):
            record = trainer.train_step()
            steps.append({k: v for k, v in record.items() if k.startswith(("time/", "staleness", "completions"))})
        if trainer.queue is not None:
            trainer.queue.close()
        wall = time.perf_counter() - wall0
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "arm": arm, "pruning_rate": rate, "max_staleness": ARMS[arm], "steps": len(steps), "wall_seconds": wall,
        "cpu_seconds": time.process_time() - cpu0,
        "children_cpu_seconds": children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime,
        "setup_seconds": setup, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "threads": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0)),
        "load_after": list(os.getloadavg()), "per_step": steps, "config": config.to_dict(), "meta": run_metadata(),
    }  # fmt: skip


def combine(units: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (rate, arm): wall and CPU seconds over rounds, and the speedup against GRPO's synchronous run of the same
    round (per-round ratios: mean and 95% t interval)."""
    base = {u["round"]: u for u in units if u["arm"] == "sync" and u["pruning_rate"] == 0.0}
    rows = []
    for rate in sorted({u["pruning_rate"] for u in units}):
        for arm in ARMS:
            mine = sorted((u for u in units if u["arm"] == arm and u["pruning_rate"] == rate), key=lambda u: u["round"])
            if not mine:
                continue
            paired = [u for u in mine if u["round"] in base]
            rows.append({
                "arm": arm, "pruning_rate": rate, "max_staleness": ARMS[arm], "rounds": [u["round"] for u in mine],
                "wall_seconds": mean_interval([u["wall_seconds"] for u in mine]),
                "cpu_seconds": mean_interval([u["cpu_seconds"] for u in mine]),
                "speedup_vs_grpo_sync": mean_interval([base[u["round"]]["wall_seconds"] / u["wall_seconds"]
                                                       for u in paired]) if paired else None,
                "cpu_ratio_vs_grpo_sync": mean_interval([base[u["round"]]["cpu_seconds"] / u["cpu_seconds"]
                                                         for u in paired]) if paired else None,
                "generate_wait_seconds": mean_interval([sum(s.get("time/generate_wait", 0.0) for s in u["per_step"])
                                                        for u in mine]),
            })  # fmt: skip
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(d, spec):
        if d is None:
            return "-"
        ci = d.get("ci95")
        return f"{d['mean']:{spec}}" + (f" [{ci[0]:{spec}}, {ci[1]:{spec}}]" if ci else "")

    lines = [
        "| P | arm | rounds | wall s | CPU s | speedup vs GRPO sync (wall) | CPU ratio | training thread's wait s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['pruning_rate']:g} | {r['arm']} | {len(r['rounds'])} | {cell(r['wall_seconds'], '.0f')} | "
            f"{cell(r['cpu_seconds'], '.0f')} | {cell(r['speedup_vs_grpo_sync'], '.2f')} | "
            f"{cell(r['cpu_ratio_vs_grpo_sync'], '.2f')} | {cell(r['generate_wait_seconds'], '.0f')} |"
        )
    return "\n".join(lines)


def write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    from cppo.fileio import atomic_write

    atomic_write(path, json.dumps(data, indent=1) + "\n")


def drive(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Every unit not yet written, each in a process of its own, then ``overlap.json``."""
    for _, arm, rate in plan(args)[: 2 * len(args.rates)]:  # every unit's config valid before any runs
        try:
            unit_config(args, arm, rate, str(args.out / "run"))
        except ValueError as e:
            raise SystemExit(f"benchmarks/overlap.py: {e}") from None
    units_dir = args.out / "units"
    units_dir.mkdir(parents=True, exist_ok=True)
    settings_file = args.out / "settings.json"
    if settings_file.exists() and json.loads(settings_file.read_text()) != settings_of(args):
        raise SystemExit(f"benchmarks/overlap.py: {args.out} holds units of other settings ({settings_file}); "
                         "use another --out")  # fmt: skip
    write_json(settings_file, settings_of(args))
    done = []
    for r, arm, rate in plan(args):
        path = units_dir / f"{unit_name(arm, rate, r)}.json"
        if not path.exists():
            print(f"overlap: {path.name} ...", flush=True)
            cmd = [sys.executable, str(REPO / "benchmarks" / "overlap.py"), *argv, "--unit", f"{arm}@{rate:g},{r}"]
            subprocess.run(cmd, check=True, cwd=REPO)
        done.append(json.loads(path.read_text()))
    result = {"settings": settings_of(args), "rows": combine(done), "units": [u["name"] for u in done]}
    write_json(args.out / "overlap.json", result)
    print(format_table(result["rows"]))
    return result


def cli(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.unit is None:
        drive(args, argv)
        return
    arm_rate, _, r = args.unit.partition(",")
    arm, _, rate = arm_rate.partition("@")
    unit = run_unit(args, arm, float(rate))
    unit.update(round=int(r), name=unit_name(arm, float(rate), int(r)))
    write_json(args.out / "units" / f"{unit['name']}.json", unit)
