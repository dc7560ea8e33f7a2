#!/usr/bin/env python
"""CPPO against GRPO, end to end, on the same questions: where the time goes and what pruning saves.

``python benchmarks/speedup.py [--config PRESET_OR_YAML] [--set key=value ...]`` trains GRPO (P = 0) and CPPO at
several pruning rates P from the same model, seed and questions, and reports each phase's wall time summed over
the run, the speedups of the training phases and of the whole run against P = 0, the ideal training speedup
1/(1 - P) and the paper's GSM8K speedups. The trainer config comes from ``cppo.load_config`` as in ``cppo train``
(default: the ``speedup-cpu`` preset); the benchmark sets only each rate's ``pruning_rate``, ``num_steps`` and
``max_questions``, on the trainer's rules: a rate keeps ``TrainConfig.keep`` completions per question and a step
draws ``TrainConfig.questions_drawn`` questions, so every rate processes the same ``questions``.

What is timed (wall clock, summed over every measured step of a rate):

- ``generation`` (``time/generate``: drawing questions, prompts, G rollouts each), ``reward`` (``time/reward``),
  ``selection`` (``time/select``: advantages over the full groups, pruning, allocation and packing);
- ``old_ref_logprobs`` (``time/logprobs``: the old-policy and reference passes), ``policy_fwd_bwd``
  (``time/update``: forward + backward over the mu updates), ``optimizer`` (``time/optimizer``: clipping, the
  optimizer and scheduler steps, and the rollout engine's weight sync, mu times a step): together the
  *training* time, the part CPPO prunes;
- ``other``: the rest of each ``Trainer.train_step`` call (advantages, packing, bookkeeping), measured as
  the step's wall clock minus the phases above.

``total_seconds`` is the sum of the ``train_step`` wall clocks. Building the model (``setup_seconds``) and
one warm-up step on questions outside the measured set (``meta.warmup_seconds``) are reported but excluded.
``cpu_seconds`` (this process's CPU time over the steps) is a check on a shared machine. On CPU the rates run
interleaved by default (``--schedule``) on one torch thread: all of them step through the questions together, so
load from other processes falls on every rate alike; on a GPU they run one after another (one model in memory).

Writes ``speedup.json`` (one row per rate plus a ``meta`` block: every setting of the base trainer config, the
machine and the software) and ``speedup.png`` (stacked phase bars) to ``--out``, and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.util
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

import cppo
from cppo import TrainConfig
from cppo.models import resolve_device

#: ``on_step(plan, metrics)`` after every measured step (progress).
OnStep = Callable[[TrainConfig, dict[str, float]], None] | None

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_RATES = (0.0, 0.5, 0.75, 0.875, 0.9375)
#: ``--preset NAME`` is ``--config PRESETS[NAME]`` (a trainer preset under cppo/presets/).
PRESETS = {"cpu": "speedup-cpu", "gsm8k": "gsm8k-qwen2.5-1.5b"}
#: GSM8K's training split where the workplace keeps it (used when the config reads gsm8k without a dataset_path).
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k"

#: Phase in the results -> (the trainer metric with its seconds in one step, plot label, plot colour): greys for
#: the phases pruning leaves alone, colours for the training phases; ``other`` is the rest of a step's wall clock.
PHASE_TABLE = {
    "generation": ("time/generate", "generation", "#9e9e9e"),
    "reward": ("time/reward", "reward", "#bdbdbd"),
    "selection": ("time/select", "selection", "#e0e0e0"),
    "old_ref_logprobs": ("time/logprobs", "old/ref log-probs", "#1f77b4"),
    "policy_fwd_bwd": ("time/update", "policy fwd+bwd", "#ff7f0e"),
    "optimizer": ("time/optimizer", "optimizer", "#2ca02c"),
    "other": (None, "other", "#d6d6f5"),
}
PHASES = tuple(PHASE_TABLE)
PHASE_METRICS = {phase: metric for phase, (metric, _, _) in PHASE_TABLE.items() if metric}
#: The phases whose work CPPO prunes: their sum is ``train_seconds``.
TRAIN_PHASES = ("old_ref_logprobs", "policy_fwd_bwd", "optimizer")
#: Step metrics summed over a rate's steps (``questions`` is reported as ``questions_seen``).
COUNTERS = ("tokens_trained", "tokens_forward", "completions", "completions_kept", "questions")
#: Speedups reported by the paper (GSM8K, Qwen2.5-1.5B-Instruct, G = 16, whole training run vs GRPO).
PAPER_SPEEDUP_GSM8K = {0.0: 1.0, 0.5: 1.81, 0.75: 3.27, 0.875: 4.89, 0.9375: 8.32}


def plan_schedule(
    base: TrainConfig, pruning_rates: Sequence[float], *, questions: int | None = None, least_times: int = 1
) -> list[TrainConfig]:
    """One trainer config per rate: ``base`` at ``pruning_rate`` P with ``max_questions = questions`` (default:
    ``least_times`` x the least count every rate divides) and ``num_steps`` steps of its ``questions_drawn``.

    ValueError naming the argument unless the rates are distinct and start with 0 (the GRPO baseline), each makes
    a valid trainer config (keep >= 1), and ``questions`` is a multiple of every rate's questions per step.
    """
    rates = [float(p) for p in pruning_rates]
    if not rates or rates[0] != 0.0 or len(set(rates)) != len(rates):
        raise ValueError(f"--pruning-rates must be distinct and start with 0 (the GRPO baseline), got {rates}")
    configs = []
    for p in rates:
        try:
            configs.append(dataclasses.replace(base, pruning_rate=p))
        except ValueError as e:
            raise ValueError(f"--pruning-rates {p:g}: {e}") from None
    per_step = [c.questions_drawn for c in configs]
    least = math.lcm(*per_step)
    questions = least * least_times if questions is None else questions
    if questions < 1:
        raise ValueError(f"--questions must be >= 1, got {questions}")
    if questions % least:
        raise ValueError(
            f"--questions must be a multiple of {least} (the questions one step draws at every pruning rate: "
            f"{dict(zip(rates, per_step))}) so that every rate processes the same questions; got {questions}, "
            f"e.g. use {-(-questions // least) * least}"
        )
    return [dataclasses.replace(c, num_steps=questions // c.questions_drawn, max_questions=questions) for c in configs]


@dataclasses.dataclass
class RateRun:
    """What one pruning rate measured: its planned trainer config and :func:`accumulate`'s sums over its steps."""

    config: TrainConfig
    sums: dict[str, Any]
    setup_seconds: float = 0.0
    cpu_seconds: float = float("nan")


def accumulate(steps_metrics: Iterable[dict[str, float]], step_walls: Iterable[float]) -> dict[str, Any]:
    """Sums a rate's step metrics (``phase_seconds``, ``total_seconds``, :data:`COUNTERS`; averages ``reward_mean``
    and ``accuracy``). ``other`` is each step's wall clock minus its named phases (never below 0). ValueError when a
    metric the benchmark needs is missing from a step.
    """
    steps, nan = list(zip(steps_metrics, step_walls, strict=True)), float("nan")
    missing = sorted({k for m, _ in steps for k in (*PHASE_METRICS.values(), *COUNTERS) if k not in m})
    if missing:
        raise ValueError(f"train_step metrics lack {missing}; the benchmark needs them")
    phases = {phase: sum(float(m[key]) for m, _ in steps) for phase, key in PHASE_METRICS.items()}
    phases["other"] = sum(max(0.0, w - sum(float(m[key]) for key in PHASE_METRICS.values())) for m, w in steps)
    counters = {key: sum(int(round(float(m[key]))) for m, _ in steps) for key in COUNTERS}
    means = {k: sum(float(m.get(k, nan)) for m, _ in steps) / (len(steps) or nan) for k in ("reward_mean", "accuracy")}
    return {"phase_seconds": phases, "total_seconds": sum(w for _, w in steps), **counters, **means}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def build_rows(runs: Sequence[RateRun]) -> list[dict[str, Any]]:
    """Result rows, one per rate, with speedups against the first run (which must be P = 0).

    - ``keep``, ``kept_per_step``, ``questions_per_step``, ``steps``, ``questions``: the rate's ``TrainConfig.keep``
      (per question), ``kept_per_step`` (the step's official count), ``questions_drawn``, ``num_steps`` and
      ``max_questions``; ``questions_seen``: what its steps reported;
    - ``train_seconds``: old/ref log-probs + policy forward/backward + optimizer;
    - ``speedup_train`` / ``speedup_total``: P = 0's train / total seconds over this rate's;
    - ``ideal_speedup_train``: 1 / (1 - P); ``fraction_of_ideal``: speedup_train / ideal;
    - ``amdahl_speedup_total``: Amdahl's law for pruning the training alone: the whole-run speedup if the
      training phases shrank by (1 - P) and everything else cost what it cost at P = 0. A measured speedup above
      it means the unpruned phases got cheaper too (allocation's bigger generation batches);
    - ``speedup_total_cpu``: the same from the process's CPU seconds over the steps, a check on a shared machine
      (other processes' load slows wall clocks, not this process's CPU time; NaN/None where not measured);
    - ``generation_share``: generation seconds / total seconds of this rate;
    - ``paper_speedup_gsm8k``: the paper's reported whole-run speedup at this P (None where it reports none).
    """
    if not runs:
        raise ValueError("runs must not be empty")
    if runs[0].config.pruning_rate != 0.0:
        raise ValueError(f"runs[0] must be the P = 0 baseline, got P = {runs[0].config.pruning_rate}")
    rows = []
    for i, run in enumerate(runs):
        c, sums, p = run.config, run.sums, run.config.pruning_rate
        phases = {k: float(sums["phase_seconds"].get(k, 0.0)) for k in PHASES}
        train, total = sum(phases[k] for k in TRAIN_PHASES), sums["total_seconds"]
        if i == 0:
            base_train, base_total, base_cpu = train, total, run.cpu_seconds
        ideal, speedup_train = 1.0 / (1.0 - p), 1.0 if i == 0 else _ratio(base_train, train)
        amdahl = 1.0 if i == 0 else _ratio(base_total, base_total - base_train + base_train * (1.0 - p))
        rows.append({
            "pruning_rate": p, "keep": c.keep, "kept_per_step": c.kept_per_step, "group_size": c.group_size,
            "questions": c.max_questions,
            "questions_seen": sums["questions"], "questions_per_step": c.questions_drawn, "steps": c.num_steps,
            "phase_seconds": phases, "total_seconds": total, "train_seconds": train,
            "setup_seconds": run.setup_seconds, "cpu_seconds": run.cpu_seconds,
            **{k: sums[k] for k in COUNTERS[:-1]},
            "speedup_train": speedup_train, "speedup_total": 1.0 if i == 0 else _ratio(base_total, total),
            "ideal_speedup_train": ideal,
            "fraction_of_ideal": None if speedup_train is None else speedup_train / ideal,
            "speedup_total_cpu": 1.0 if i == 0 else _ratio(base_cpu, run.cpu_seconds),
            "amdahl_speedup_total": amdahl, "generation_share": _ratio(phases["generation"], total),
            "paper_speedup_gsm8k": PAPER_SPEEDUP_GSM8K.get(p),
            "reward_mean": sums["reward_mean"], "accuracy": sums["accuracy"],
        })  # fmt: skip
    return rows


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{suffix}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table (seconds summed over the run; speedups against P = 0)."""
    head = [
        "P", "keep", "questions", "steps", "gen s", "reward s", "select s", "old/ref logp s", "policy fwd+bwd s",
        "optim s", "other s", "total s", "train s", "tokens trained", "speedup train", "ideal", "% of ideal",
        "speedup total", "Amdahl (train only)", "gen share", "paper (GSM8K)",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for r in rows:
        percent = {k: None if r[k] is None else 100 * r[k] for k in ("fraction_of_ideal", "generation_share")}
        cells = [
            f"{r['pruning_rate']:g}",
            *(str(r[k]) for k in ("keep", "questions", "steps")),
            *(f"{r['phase_seconds'][k]:.2f}" for k in PHASES),
            *(f"{r[k]:.2f}" for k in ("total_seconds", "train_seconds")),
            str(r["tokens_trained"]),
            _fmt(r["speedup_train"], ".2f", "x"),
            f"{r['ideal_speedup_train']:.2f}x",
            _fmt(percent["fraction_of_ideal"], ".0f", "%"),
            *(_fmt(r[k], ".2f", "x") for k in ("speedup_total", "amdahl_speedup_total")),
            _fmt(percent["generation_share"], ".0f", "%"),
            _fmt(r["paper_speedup_gsm8k"], ".2f", "x"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: pathlib.Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """``{"meta": ..., "rows": [...]}``, NaN and infinities written as null."""
    safe = json.loads(json.dumps({"meta": meta, "rows": list(rows)}), parse_constant=lambda _: None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(safe, indent=2) + "\n", encoding="utf-8")


def plot(path: pathlib.Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Stacked bars of each phase's seconds per pruning rate, the speedups written above each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"P={r['pruning_rate']:g}\nkeep {r['keep']}/{r['group_size']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2.0), 5.0))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        heights = [r["phase_seconds"][phase] for r in rows]
        _, label, color = PHASE_TABLE[phase]
        ax.bar(labels, heights, bottom=bottom, label=label, color=color, edgecolor="white", linewidth=0.5)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, (r, top) in enumerate(zip(rows, bottom)):
        text = f"train {_fmt(r['speedup_train'], '.2f', 'x')} (ideal {r['ideal_speedup_train']:.2f}x)"
        text += f"\ntotal {_fmt(r['speedup_total'], '.2f', 'x')}"
        if r["paper_speedup_gsm8k"] is not None and r["pruning_rate"] > 0:
            text += f" (paper {r['paper_speedup_gsm8k']:.2f}x)"
        ax.annotate(text, (x, top), ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    ax.set_ylim(0, max(bottom) * 1.22 if max(bottom) > 0 else 1.0)
    ax.set_ylabel("seconds (summed over the run)")
    model, where = pathlib.Path(str(meta.get("model", "?"))).name, meta.get("device_name") or meta.get("device", "?")
    ax.set_title(
        f"CPPO vs GRPO on the same {rows[0]['questions']} questions, G={rows[0]['group_size']}, "
        f"{meta.get('max_completion_length', '?')} new tokens\n{model} on {where}",
        fontsize=9,
    )
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], fontsize=7, loc="upper right")  # top of the stack first
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timed_step(trainer: Any, *, device: str) -> tuple[dict[str, float], float, float]:
    """One ``train_step``, the GPU synchronised around it: ``(metrics, wall seconds, this process's CPU seconds)``."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    sync()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    metrics = trainer.train_step()
    sync()
    return metrics, time.perf_counter() - wall0, time.process_time() - cpu0


def step_order(plans: Sequence[TrainConfig], *, interleave: bool) -> list[tuple[int, int]]:
    """``(rate index, step index)`` of every step of every rate (``num_steps`` each), in the order they run.

    Sequential: rate after rate. Interleaved: all rates advance together through the questions (steps sorted by
    the middle of the question range they cover, ties by rate), so a shared machine's changing load falls on
    every rate alike. Each rate's own steps keep their order, and every step reseeds, so the results are the same.
    """
    order = [(i, k) for i, plan in enumerate(plans) for k in range(plan.num_steps)]
    return sorted(order, key=lambda ik: ((ik[1] + 0.5) / plans[ik[0]].num_steps, ik[0])) if interleave else order


def run_plans(plans: Sequence[TrainConfig], *, device: str, interleave: bool, on_step: OnStep = None) -> list[RateRun]:
    """Trains every planned config from a fresh model (same seed for all) in :func:`step_order`; a RateRun each.

    A rate's trainer is built before its first step (``setup_seconds``, not timed as a step) and freed after its
    last. RuntimeError when a trainer draws other questions than its ``max_questions`` (the rates would not
    compare; None: not checked).
    """
    records: list[list[tuple[dict[str, float], float, float]]] = [[] for _ in plans]
    setup, trainers = [0.0] * len(plans), {}
    with tempfile.TemporaryDirectory(prefix="cppo-speedup-") as tmp:
        for i, k in step_order(plans, interleave=interleave):
            if k == 0:
                t0 = time.perf_counter()
                trainers[i] = cppo.Trainer(dataclasses.replace(plans[i], output_dir=os.path.join(tmp, f"rate{i}")))
                setup[i] = time.perf_counter() - t0
            records[i].append(timed_step(trainers[i], device=device))
            if on_step is not None:
                on_step(plans[i], records[i][-1][0])
            if k == plans[i].num_steps - 1:
                del trainers[i]
                gc.collect()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
    runs = []
    for plan, steps, t in zip(plans, records, setup):
        sums = accumulate([m for m, _, _ in steps], [w for _, w, _ in steps])
        if plan.max_questions is not None and sums["questions"] != plan.max_questions:
            raise RuntimeError(
                f"P={plan.pruning_rate}: the trainer drew {sums['questions']} questions in {plan.num_steps} step(s), "
                f"not the planned {plan.max_questions}: the rates would not see the same questions"
            )
        runs.append(RateRun(config=plan, sums=sums, setup_seconds=t, cpu_seconds=sum(c for _, _, c in steps)))
    return runs


#: Shortcut flags, each a ``--set`` of one trainer setting: (flag, setting, how the value becomes YAML, help).
SHORTCUTS = (
    ("--model", "model", json.dumps, "'tiny-qwen2', a hub name, a local path or a .gguf file"),
    ("--model-config", "model_config", None, "JSON overrides of the tiny model's config"),
    ("--dataset", "dataset", json.dumps, "arith | gsm8k | math500 | a .jsonl path | a hub dataset"),
    ("--dataset-path", "dataset_path", json.dumps, "local file or folder for --dataset gsm8k / math500"),
    ("--device", "device", json.dumps, "auto | cpu | cuda | cuda:N"),
    ("--dtype", "dtype", json.dumps, "float32 | bfloat16 | float16"),
    ("--group-size", "group_size", int, "completions per question G"),
    ("--questions-per-step", "questions_per_step", int, "questions a GRPO step draws"),
    ("--max-new-tokens", "max_completion_length", int, "completion length cap"),
    ("--max-prompt-length", "max_prompt_length", int, "prompts keep their last N tokens"),
    ("--micro-batch-tokens", "micro_batch_tokens", int, "token budget per packed micro-batch"),
    ("--mu", "mu", int, "policy updates per rollout"),
    ("--backend", "kernel_backend", json.dumps, "auto | triton | torch (triton on CPU runs the interpreter)"),
    ("--rollout-backend", "rollout_backend", json.dumps, "auto | hf | vllm"),
    ("--seed", "seed", int, "the same seed for every rate"),
    ("--allocation", "allocation", None, "CPPO draws 1/(1-P) times more questions per step (the paper's allocation)"),
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``args.config`` and ``args.overrides`` are what ``cppo train --config --set`` takes.

    A shortcut flag given adds its ``setting=value`` after ``--set``'s; ``--model`` with a model that is not
    ``tiny-*`` also sets ``model_config=null`` (the preset's, if any, only applies to a tiny model).
    """
    ap = argparse.ArgumentParser(description="CPPO against GRPO, end to end, on the same questions (see docstring).")
    add = ap.add_argument
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--config", help="a trainer preset or a YAML file (default: speedup-cpu)")
    which.add_argument("--preset", choices=sorted(PRESETS), help=f"a shortcut for --config: {PRESETS}")
    add("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help="trainer setting")
    for flag, setting, to_yaml, text in SHORTCUTS:
        kind = {"action": argparse.BooleanOptionalAction} if setting == "allocation" else {"type": to_yaml}
        add(flag, dest=setting, **kind, help=f"--set {setting}=...: {text}")
    add("--pruning-rates", type=float, nargs="+", default=list(DEFAULT_RATES), help="the first must be 0 (GRPO)")
    add("--questions", type=int, help="questions every rate processes (default: the least valid, x2 on CPU)")
    add("--schedule", choices=["interleaved", "sequential"], help="default: interleaved on CPU, else sequential")
    add("--threads", type=int, help="torch.set_num_threads (default: 1 on CPU, else torch's choice)")
    add("--warmup", action=argparse.BooleanOptionalAction, default=True, help="one untimed step first")
    add("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results", help="for speedup.json and .png")
    add("--no-plot", action="store_true", help="skip the PNG")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--dry-run", action="store_true", help="validate the whole plan: no model built, nothing trained or written")
    args = ap.parse_args(argv)
    values = {setting: getattr(args, setting) for _, setting, _, _ in SHORTCUTS}
    given = {s: json.dumps(v) if isinstance(v, bool) else v for s, v in values.items() if v is not None}
    if "model" in given and not json.loads(given["model"]).startswith("tiny-"):
        given = {"model_config": "null", **given}  # only a tiny model takes a model_config
    args.overrides = [*args.overrides, *(f"{s}={v}" for s, v in given.items())]
    if args.config is None:
        args.preset = args.preset or "cpu"
        args.config = PRESETS[args.preset]
    return args


def base_config(args: argparse.Namespace, *, need_cuda: bool = True) -> TrainConfig:
    """``load_config(args.config, args.overrides)`` with ``device`` resolved (and ../shared's GSM8K if present).
    ``need_cuda=False`` (``--dry-run``) leaves a CUDA device unresolved on a machine without one."""
    config = cppo.load_config(args.config, args.overrides)
    if config.dataset == "gsm8k" and config.dataset_path is None and SHARED_GSM8K.is_dir():
        config = dataclasses.replace(config, dataset_path=str(SHARED_GSM8K))
    if not need_cuda and config.device.startswith("cuda") and not torch.cuda.is_available():
        return config
    device = resolve_device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={config.device!r} but CUDA is not available")
    if args.preset == "gsm8k" and device.type != "cuda":
        raise ValueError("--preset gsm8k trains Qwen2.5-1.5B-Instruct and needs a CUDA device (--device cuda)")
    return dataclasses.replace(config, device=str(device))


def dry_run(args: argparse.Namespace, plans: Sequence[TrainConfig], *, schedule: str) -> dict[str, Any]:
    """Validates the whole plan without building a model: the trainer config of every rate (``plan_schedule``
    built each one, so every setting and the local model and dataset paths are checked), the schedule, the training
    data (read when local; a hub dataset is not downloaded) and the ``--out`` folder. Prints and returns the plan."""
    from cppo.data import count_local_problems
    from cppo.rundir import check_writable

    check_writable(str(args.out), create=False)
    base = plans[0]
    problems = count_local_problems(base.dataset, dataset_path=base.dataset_path)
    order = step_order(plans, interleave=schedule == "interleaved")
    plan = {
        "dry_run": "ok",
        "config": args.config,
        "model": base.model,
        "dataset": base.dataset,
        "train_problems": problems,  # None: a hub dataset, not downloaded here
        "device": base.device,
        "schedule": schedule,
        "steps": len(order),
        "rates": [
            {"pruning_rate": c.pruning_rate, "keep": c.keep, "questions_per_step": c.questions_drawn,
             "steps": c.num_steps, "questions": c.max_questions}
            for c in plans
        ],
        "out": str(args.out),
    }  # fmt: skip
    print(json.dumps(plan, indent=1))
    return plan


def git_commit(repo: pathlib.Path = REPO) -> tuple[str, bool | None]:
    """``(HEAD commit, working tree dirty)``, ``("unknown", None)`` outside a git checkout."""
    try:
        out = [
            subprocess.run(["git", *cmd], cwd=repo, capture_output=True, text=True, check=True, timeout=10).stdout
            for cmd in (["rev-parse", "HEAD"], ["status", "--porcelain"])
        ]
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    return out[0].strip() or "unknown", bool(out[1].strip())


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or 'CPU'} ({os.cpu_count()} cores)"


def collect_meta(config: TrainConfig, *, argv: Sequence[str]) -> dict[str, Any]:
    """Where and how the numbers were measured: every setting of the base trainer config, the machine, the software."""
    triton = importlib.import_module("triton") if importlib.util.find_spec("triton") else None
    commit, dirty = git_commit()
    return {
        **config.to_dict(),
        "device_name": _device_name(config.device),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": getattr(triton, "__version__", None),
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(argv),
        "timing": (
            "wall clock summed over every measured train_step; train = old/ref log-probs + policy forward/backward"
            " + optimizer; total = sum of train_step wall clocks; model build and warm-up excluded"
        ),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns ``{"meta": ..., "rows": [...]}`` as written to ``--out/speedup.json`` (with
    ``--dry-run``: the validated plan, see :func:`dry_run`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    config = base_config(args, need_cuda=not args.dry_run)
    on_cpu = config.device == "cpu"
    plans = plan_schedule(config, args.pruning_rates, questions=args.questions, least_times=2 if on_cpu else 1)
    threads = args.threads if args.threads is not None else (1 if on_cpu else None)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    schedule = args.schedule or ("interleaved" if on_cpu else "sequential")
    if args.dry_run:
        return dry_run(args, plans, schedule=schedule)
    if config.kernel_backend == "triton" and on_cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' first (lazy) import
    if threads is not None:
        torch.set_num_threads(threads)
    meta = collect_meta(config, argv=argv)
    meta.update(preset=args.preset, config=args.config, schedule=schedule, questions=plans[0].max_questions)
    bar = tqdm(total=sum(p.num_steps for p in plans), unit="step", desc="speedup", disable=args.no_progress)
    meta["warmup_seconds"] = None
    if args.warmup:  # one P = 0 step with another seed (another model, other questions), not counted
        bar.set_postfix_str("warm-up")
        warm = dataclasses.replace(plans[0], num_steps=1, max_questions=None, seed=config.seed + 1)
        meta["warmup_seconds"] = run_plans([warm], device=config.device, interleave=False)[0].sums["total_seconds"]

    def on_step(plan: TrainConfig, metrics: dict[str, float]) -> None:
        bar.set_postfix_str(f"P={plan.pruning_rate:g} keep {plan.keep}/{plan.group_size}", refresh=False)
        bar.update(1)

    runs = run_plans(plans, device=config.device, interleave=schedule == "interleaved", on_step=on_step)
    bar.close()
    rows = build_rows(runs)
    out = pathlib.Path(args.out)
    write_json(out / "speedup.json", rows, meta)
    if not args.no_plot:
        plot(out / "speedup.png", rows, meta)
    print(format_table(rows))
    print(f"\nwrote {out / 'speedup.json'}" + ("" if args.no_plot else f" and {out / 'speedup.png'}"))
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError) as e:
        sys.exit(f"speedup.py: error: {e}")
