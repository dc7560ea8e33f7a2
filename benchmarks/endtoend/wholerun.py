"""``benchmarks/speedup.py --rounds N``: the whole-run table, measured round after round so that it carries an interval.

Each round runs every arm (GRPO, CPPO at each ``--pruning-rates`` rate, each ``--batched-grpo`` arm) from a fresh
model over the same questions, interleaved step by step, and is written as ``--out/NAME-roundK.json`` when it ends
(:mod:`endtoend.rounds`); a rerun with the same ``--out`` and settings runs only the rounds still missing, so a run
longer than a session resumes where it stopped (an interrupted round runs again from its start). After every round
``NAME.json`` and ``NAME.png`` combine the rounds so far (:func:`endtoend.rounds.combine`) and the table is printed.
The warm-up (one untimed step per arm) runs once per process, before its first round. Each round records where it
ran: the load average before and after, the git commit, the threads after the engine started, the peak resident
memory of the process so far and the CPU seconds of its finished children.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

from cppo import fileio
from endtoend.report import build_rows, plot, write_json
from endtoend.rounds import combine, finished_rounds, format_rounds_table, mean_row, round_settings, write_round
from endtoend.runner import children_cpu_seconds, cpu_seconds, peak_rss_gib

#: Where the combined rows of one invocation are read from by :func:`collect`: ``FOLDER/NAME.json``.
COLLECTED = "{folder}/{name}.json"


def round_meta(
    info: dict[str, Any], *, started: float, load_before: list[float], cpu_before: float, children_before: float = 0.0
) -> dict[str, Any]:
    """Where and how one round ran: :func:`measure`'s ``info`` (warm-up, threads), the round's wall and CPU seconds
    (setup and any warm-up included), the load average before and after, the peak resident memory so far and the git
    commit."""
    commit, dirty = fileio.git_commit()
    return {
        **info,
        "date": fileio.run_metadata()["date"],
        "git_commit": commit,
        "git_dirty": dirty,
        "round_wall_seconds": time.perf_counter() - started,
        "round_cpu_seconds": cpu_seconds() - cpu_before,  # this process's threads and its finished children's
        "round_children_cpu_seconds": children_cpu_seconds() - children_before,
        "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()),
        "peak_rss_gib": peak_rss_gib(),
    }


def run_rounds(args: argparse.Namespace, p: Any, meta: dict[str, Any], *, measure: Callable) -> dict[str, Any]:
    """Runs the rounds of ``p`` (:class:`endtoend.speedup.Planned`) still missing in ``--out`` up to ``--rounds``,
    each written when it ends; returns (and writes) the combined ``{"meta", "rows"}``. ValueError when ``--out``
    holds rounds measured with other settings (:func:`endtoend.rounds.finished_rounds`)."""
    out, name = pathlib.Path(args.out), str(args.name)
    settings = round_settings(p.plans, schedule=p.schedule, threads=p.threads, warmup=bool(args.warmup))
    rounds = finished_rounds(out, name, settings)
    if rounds:
        print(f"{len(rounds)} of {args.rounds} round(s) already in {out}: " + ("running the rest" if len(rounds) <
              args.rounds else "nothing to run"), flush=True)  # fmt: skip
    warm = True
    for k in range(len(rounds) + 1, args.rounds + 1):
        started, load, cpu0, kids0 = time.perf_counter(), list(os.getloadavg()), cpu_seconds(), children_cpu_seconds()
        runs, info = measure(args, p.plans, schedule=p.schedule, evaluation=None, threads=p.threads, warm=warm)
        info["warmed_in_this_round"], warm = bool(info.get("warmup")), False
        rows = build_rows(runs)
        record = round_meta(info, started=started, load_before=load, cpu_before=cpu0, children_before=kids0)
        write_round(out, name, k, settings=settings, rows=rows, meta=record)
        rounds.append({"round": k, "settings": settings, "meta": record, "rows": rows})
        print(f"round {k} of {args.rounds} written ({record['round_wall_seconds']:.0f} s)", flush=True)
        if k < args.rounds:  # the rounds so far, readable while the next runs
            write_combined(args, p, meta, rounds)
    return write_combined(args, p, meta, rounds)


def write_combined(args: argparse.Namespace, p: Any, meta: dict[str, Any], rounds: list[dict]) -> dict[str, Any]:
    """``NAME.json`` (``meta`` with every round's own, and the combined rows) and ``NAME.png`` of the rounds so far;
    prints the table. Returns what it wrote."""
    rows = combine(rounds)
    meta = {**meta, "rounds_planned": args.rounds, "rounds_done": len(rounds),
            "rounds": [{"round": r["round"], **r["meta"]} for r in rounds],
            "timing": "per round: wall clock summed over every measured train_step of an arm (model build, warm-up "
            "and the shared engine's interleaving reloads excluded); over rounds: mean, 95% t interval"}  # fmt: skip
    write_json(pathlib.Path(p.files["json"]), rows, meta)
    if "png" in p.files:
        plot(pathlib.Path(p.files["png"]), [mean_row(r) for r in rows], meta)
    print(format_rounds_table(rows), flush=True)
    print("\nwrote " + ", ".join(p.files.values()), flush=True)
    return {"meta": meta, "rows": rows}


def collect(folders: list[pathlib.Path], *, name: str, out: pathlib.Path) -> dict[str, Any]:
    """The whole-run table of several invocations, each run apart (all arms of one process may not fit in memory):
    every row of each ``FOLDER/NAME.json`` (:func:`write_combined`'s), its speedups against the GRPO of its own
    invocation (interleaved with it), labelled with the folder it came from; written to ``out/NAME.json`` and printed.
    ValueError when a folder holds no combined file, or the invocations differ in anything but their arms."""
    rows, metas = [], []
    for folder in folders:
        path = pathlib.Path(COLLECTED.format(folder=folder, name=name))
        if not path.is_file():
            raise ValueError(f"--collect {folder}: no {path.name} there (run speedup.py --rounds with --out {folder})")
        data = json.loads(path.read_text())
        metas.append(data["meta"])
        where = pathlib.Path(folder).name
        rows += [{**r, "invocation": where, "label": r["label"] if r["arm"] else f"GRPO ({where})"}
                 for r in data["rows"]]  # fmt: skip
    keys = ("model", "dataset", "group_size", "max_completion_length", "rollout_backend", "questions", "seed")
    differ = [k for k in keys if len({str(m.get(k)) for m in metas}) > 1]
    if differ:
        raise ValueError(f"--collect: the invocations differ in {differ}: their rows would not compare")
    meta = {k: metas[0].get(k) for k in keys} | {"collected": [str(f) for f in folders], "invocations": metas}
    write_json(pathlib.Path(out) / f"{name}.json", rows, meta)
    print(format_rounds_table(rows), flush=True)
    return {"meta": meta, "rows": rows}
