#!/usr/bin/env python
"""CPPO against GRPO, end to end, on the same questions: where the time goes and what pruning saves.

``python benchmarks/speedup.py`` trains GRPO (P = 0) and CPPO at several pruning rates P on the same
questions with the same seed, one fresh model per rate, and reports the wall time of every phase of
a training step summed over the run, the speedup of the training phases and of the whole run against
P = 0, the ideal training speedup 1/(1 - P), and the paper's reported GSM8K speedups beside ours.

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
``cpu_seconds`` (this process's CPU time over the steps) is a check on a shared machine. By default on CPU the
rates run interleaved (``--schedule``): all of them step through the questions together, so load from other
processes falls on every rate alike.

With allocation (the default, as in the paper) a CPPO step draws ``questions_per_step / (1 - P)`` questions,
so each rate runs ``questions / that`` steps and every rate processes exactly the same ``questions``.
Without allocation every rate runs the same steps on the same questions and trains fewer completions.

Writes ``speedup.json`` (one row per rate plus a ``meta`` block) and ``speedup.png`` (stacked phase
bars) to ``--out``, and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
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
from fractions import Fraction
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results"
DEFAULT_RATES = (0.0, 0.5, 0.75, 0.875, 0.9375)

#: Phase name in the results -> the trainer metric holding its seconds for one step.
PHASE_METRICS = {
    "generation": "time/generate",
    "reward": "time/reward",
    "selection": "time/select",
    "old_ref_logprobs": "time/logprobs",
    "policy_fwd_bwd": "time/update",
    "optimizer": "time/optimizer",
}
#: The phases whose work CPPO prunes: their sum is ``train_seconds``.
TRAIN_PHASES = ("old_ref_logprobs", "policy_fwd_bwd", "optimizer")
PHASES = (*PHASE_METRICS, "other")

#: Speedups reported by the paper (GSM8K, Qwen2.5-1.5B-Instruct, G = 16, whole training run vs GRPO).
PAPER_SPEEDUP_GSM8K = {0.0: 1.0, 0.5: 1.81, 0.75: 3.27, 0.875: 4.89, 0.9375: 8.32}

#: The default CPU model: the trainer's tiny Qwen2-architecture model, built from a config (no download), 1.3M
#: parameters with a 4096-token LM head: big enough that the training phases dominate a step on a CPU.
TINY_MODEL_CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
#: ``--preset``: the values of every option the command line leaves unset.
#:
#: - ``cpu`` (default): the tiny model on the procedural arithmetic task, no download. Its tokenizer is
#:   character-level, so the reasoning system prompt alone is ~440 tokens: its prompts keep their last 64 tokens
#:   (the question and the chat markers), a prompt:completion ratio near GSM8K's (other models keep 512). Packed
#:   rows attend through a dense block-diagonal mask on CPU (cost ~ row length^2), so 512-token micro-batches
#:   (4-5 sequences; at least one prompt + completion) train faster there than the trainer's 4096.
#:   ``questions`` defaults to twice the least count every rate divides. Rates run interleaved (tiny models).
#:   One torch thread: the ratios do not depend on it, and on a machine shared with other jobs two OpenMP threads
#:   per process oversubscribe the cores (measured here: steps 3-10x slower and far noisier than with one).
#: - ``gsm8k``: the paper's GSM8K setting (the trainer's ``gsm8k-qwen2.5-1.5b`` preset: Qwen2.5-1.5B-Instruct,
#:   G = 16, 8 questions per GRPO step, 1024 new tokens, bf16) for a fixed number of steps, on a GPU; rates run
#:   one after another (one model and rollout engine in GPU memory at a time).
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {
        "trainer_preset": None,
        "model": "tiny-qwen2",
        "dataset": "arith",
        "dtype": "float32",
        "max_new_tokens": 48,
        "max_prompt_length": 512,
        "tiny_max_prompt_length": 64,
        "micro_batch_tokens": 512,
        "questions_per_step": 1,
        "question_multiple": 2,
        "schedule": "interleaved",
        "threads": 1,
    },
    "gsm8k": {
        "trainer_preset": "gsm8k-qwen2.5-1.5b",
        "model": "Qwen/Qwen2.5-1.5B-Instruct",
        "dataset": "gsm8k",
        "dtype": "bfloat16",
        "max_new_tokens": 1024,
        "max_prompt_length": 512,
        "tiny_max_prompt_length": 512,
        "micro_batch_tokens": 16384,
        "questions_per_step": 8,
        "question_multiple": 1,
        "schedule": "sequential",
        "threads": None,
    },
}
#: GSM8K's training split where the workplace keeps it (used by ``--preset gsm8k`` when present).
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k"


# --------------------------------------------------------------------------------------------
# Schedule: which questions and how many steps each pruning rate runs
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RatePlan:
    """What one pruning rate runs: ``steps`` steps of ``step_questions`` questions, ``keep`` of G kept each."""

    pruning_rate: float
    keep: int
    group_size: int
    questions: int
    step_questions: int
    steps: int


def keep_for(pruning_rate: float, group_size: int) -> int:
    """Completions kept per question: round(G (1 - P)), at least 1 (else ValueError)."""
    keep = round(group_size * (1.0 - pruning_rate))
    if keep < 1:
        raise ValueError(
            f"pruning_rates: P={pruning_rate} with group_size={group_size} keeps round(G(1-P))={keep} completions;"
            " it must keep at least 1"
        )
    return keep


def step_questions_for(pruning_rate: float, *, questions_per_step: int, allocation: bool) -> int:
    """Questions one step draws: ``questions_per_step / (1 - P)`` with allocation, else ``questions_per_step``."""
    if not allocation:
        return questions_per_step
    exact = Fraction(questions_per_step) / (1 - Fraction(pruning_rate).limit_denominator(1 << 20))
    if exact.denominator != 1:
        raise ValueError(
            f"pruning_rates: with allocation a step draws questions_per_step/(1-P) questions, which must be a whole"
            f" number; P={pruning_rate} with questions_per_step={questions_per_step} gives {float(exact):g}"
        )
    return int(exact)


def check_rates(pruning_rates: Sequence[float]) -> list[float]:
    """The rates as floats; ValueError unless they are distinct values in [0, 1) starting with 0 (GRPO)."""
    rates = [float(p) for p in pruning_rates]
    if not rates:
        raise ValueError("pruning_rates must not be empty")
    for p in rates:
        if not (0.0 <= p < 1.0) or math.isnan(p):
            raise ValueError(f"pruning_rates must lie in [0, 1), got {p}")
    if len(set(rates)) != len(rates):
        raise ValueError(f"pruning_rates must be distinct, got {rates}")
    if rates[0] != 0.0:
        raise ValueError(
            f"pruning_rates must start with 0 (the GRPO baseline every speedup is measured against), got {rates}"
        )
    return rates


def plan_schedule(
    pruning_rates: Sequence[float], *, group_size: int, questions: int, questions_per_step: int, allocation: bool
) -> list[RatePlan]:
    """One :class:`RatePlan` per rate; every rate processes the same ``questions`` questions.

    ValueError (naming the argument) unless the rates are distinct values in [0, 1) starting with 0 (the GRPO
    baseline), each keeps at least one completion, and ``questions`` is a multiple of every rate's questions
    per step (the message gives the smallest valid value).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    if isinstance(questions_per_step, bool) or not isinstance(questions_per_step, int) or questions_per_step < 1:
        raise ValueError(f"questions_per_step must be an int >= 1, got {questions_per_step!r}")
    if isinstance(questions, bool) or not isinstance(questions, int) or questions < 1:
        raise ValueError(f"questions must be an int >= 1, got {questions!r}")
    rates = check_rates(pruning_rates)
    per_step = [step_questions_for(p, questions_per_step=questions_per_step, allocation=allocation) for p in rates]
    multiple = math.lcm(*per_step)
    if questions % multiple:
        raise ValueError(
            f"questions must be a multiple of {multiple} (the questions one step draws at every pruning rate: "
            f"{dict(zip(rates, per_step))}) so that every rate processes the same questions; got {questions}, "
            f"e.g. use {-(-questions // multiple) * multiple}"
        )
    return [
        RatePlan(
            pruning_rate=p,
            keep=keep_for(p, group_size),
            group_size=group_size,
            questions=questions,
            step_questions=q,
            steps=questions // q,
        )
        for p, q in zip(rates, per_step)
    ]


def smallest_questions(pruning_rates: Sequence[float], *, questions_per_step: int, allocation: bool) -> int:
    """The least question count every rate's schedule divides (the lcm of the questions per step)."""
    rates = check_rates(pruning_rates)
    return math.lcm(
        *(step_questions_for(p, questions_per_step=questions_per_step, allocation=allocation) for p in rates)
    )


# --------------------------------------------------------------------------------------------
# Measurements -> result rows
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RateRun:
    """What one pruning rate measured: phase seconds and counters summed over its steps."""

    plan: RatePlan
    phase_seconds: dict[str, float]
    total_seconds: float
    tokens_trained: int
    tokens_forward: int = 0
    completions: int = 0
    completions_kept: int = 0
    questions_seen: int = 0
    setup_seconds: float = 0.0
    cpu_seconds: float = float("nan")
    reward_mean: float = float("nan")
    accuracy: float = float("nan")


def accumulate(steps_metrics: Iterable[dict[str, float]], step_walls: Iterable[float]) -> dict[str, Any]:
    """Sums a rate's per-step trainer metrics: phase seconds, wall total, token and completion counts.

    ``other`` is each step's wall clock minus its named phases (never below 0). ValueError when a metric
    the benchmark needs is missing from a step.
    """
    phases = dict.fromkeys(PHASES, 0.0)
    counters = {"tokens_trained": 0, "tokens_forward": 0, "completions": 0, "completions_kept": 0, "questions": 0}
    rewards, accuracies, total = [], [], 0.0
    for metrics, wall in zip(steps_metrics, step_walls, strict=True):
        missing = [k for k in (*PHASE_METRICS.values(), *counters) if k not in metrics]
        if missing:
            raise ValueError(f"train_step metrics lack {missing}; the benchmark needs them")
        named = 0.0
        for phase, key in PHASE_METRICS.items():
            phases[phase] += float(metrics[key])
            named += float(metrics[key])
        phases["other"] += max(0.0, wall - named)
        total += wall
        for key in counters:
            counters[key] += int(round(float(metrics[key])))
        rewards.append(float(metrics.get("reward_mean", float("nan"))))
        accuracies.append(float(metrics.get("accuracy", float("nan"))))
    return {
        "phase_seconds": phases,
        "total_seconds": total,
        **counters,
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "accuracy": sum(accuracies) / len(accuracies) if accuracies else float("nan"),
    }


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def build_rows(runs: Sequence[RateRun]) -> list[dict[str, Any]]:
    """Result rows, one per rate, with speedups against the first run (which must be P = 0).

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
    if runs[0].plan.pruning_rate != 0.0:
        raise ValueError(f"runs[0] must be the P = 0 baseline, got P = {runs[0].plan.pruning_rate}")
    rows = []
    base_train = base_total = base_cpu = 0.0
    for i, run in enumerate(runs):
        p = run.plan.pruning_rate
        phases = {k: float(run.phase_seconds.get(k, 0.0)) for k in PHASES}
        train = sum(phases[k] for k in TRAIN_PHASES)
        if i == 0:
            base_train, base_total, base_cpu = train, run.total_seconds, run.cpu_seconds
        ideal = 1.0 / (1.0 - p)
        speedup_train = 1.0 if i == 0 else _ratio(base_train, train)
        speedup_total = 1.0 if i == 0 else _ratio(base_total, run.total_seconds)
        amdahl = _ratio(base_total, base_total - base_train + base_train * (1.0 - p))
        rows.append(
            {
                "pruning_rate": p,
                "keep": run.plan.keep,
                "group_size": run.plan.group_size,
                "questions": run.plan.questions,
                "questions_seen": run.questions_seen,
                "questions_per_step": run.plan.step_questions,
                "steps": run.plan.steps,
                "phase_seconds": phases,
                "total_seconds": run.total_seconds,
                "train_seconds": train,
                "setup_seconds": run.setup_seconds,
                "cpu_seconds": run.cpu_seconds,
                "tokens_trained": run.tokens_trained,
                "tokens_forward": run.tokens_forward,
                "completions": run.completions,
                "completions_kept": run.completions_kept,
                "speedup_train": speedup_train,
                "speedup_total": speedup_total,
                "ideal_speedup_train": ideal,
                "fraction_of_ideal": None if speedup_train is None else speedup_train / ideal,
                "speedup_total_cpu": 1.0 if i == 0 else _ratio(base_cpu, run.cpu_seconds),
                "amdahl_speedup_total": 1.0 if i == 0 else amdahl,
                "generation_share": _ratio(phases["generation"], run.total_seconds),
                "paper_speedup_gsm8k": PAPER_SPEEDUP_GSM8K.get(p),
                "reward_mean": run.reward_mean,
                "accuracy": run.accuracy,
            }
        )
    return rows


# --------------------------------------------------------------------------------------------
# Report: table, JSON, PNG
# --------------------------------------------------------------------------------------------


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
        ph = r["phase_seconds"]
        cells = [
            f"{r['pruning_rate']:g}",
            str(r["keep"]),
            str(r["questions"]),
            str(r["steps"]),
            *(f"{ph[k]:.2f}" for k in PHASES),
            f"{r['total_seconds']:.2f}",
            f"{r['train_seconds']:.2f}",
            str(r["tokens_trained"]),
            _fmt(r["speedup_train"], ".2f", "x"),
            f"{r['ideal_speedup_train']:.2f}x",
            _fmt(None if r["fraction_of_ideal"] is None else 100 * r["fraction_of_ideal"], ".0f", "%"),
            _fmt(r["speedup_total"], ".2f", "x"),
            _fmt(r["amdahl_speedup_total"], ".2f", "x"),
            _fmt(None if r["generation_share"] is None else 100 * r["generation_share"], ".0f", "%"),
            _fmt(r["paper_speedup_gsm8k"], ".2f", "x"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: pathlib.Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """``{"meta": ..., "rows": [...]}``, NaN written as null."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe({"meta": meta, "rows": list(rows)}), indent=2) + "\n", encoding="utf-8")


def plot(path: pathlib.Path, rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Stacked bars of each phase's seconds per pruning rate, the speedups written above each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {  # phase -> (legend label, colour): grey for the unpruned phases, colours for the training phases
        "generation": ("generation", "#9e9e9e"),
        "reward": ("reward", "#bdbdbd"),
        "selection": ("selection", "#e0e0e0"),
        "old_ref_logprobs": ("old/ref log-probs", "#1f77b4"),
        "policy_fwd_bwd": ("policy fwd+bwd", "#ff7f0e"),
        "optimizer": ("optimizer", "#2ca02c"),
        "other": ("other", "#d6d6f5"),
    }
    labels = [f"P={r['pruning_rate']:g}\nkeep {r['keep']}/{r['group_size']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(rows) + 2.0), 5.0))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        heights = [r["phase_seconds"][phase] for r in rows]
        label, color = style[phase]
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
    model = pathlib.Path(str(meta.get("model", "?"))).name
    where = meta.get("device_name") or meta.get("device", "?")
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


def git_commit(repo: pathlib.Path = REPO) -> tuple[str, bool | None]:
    """``(HEAD commit, working tree dirty)``, ``("unknown", None)`` outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, check=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    return head or "unknown", bool(status.strip())


# --------------------------------------------------------------------------------------------
# Running the trainer
# --------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed_step(trainer: Any, *, device: str) -> tuple[dict[str, float], float, float]:
    """One ``train_step``: ``(metrics, wall seconds, this process's CPU seconds)``."""
    _sync(device)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    metrics = trainer.train_step()
    _sync(device)
    return metrics, time.perf_counter() - wall0, time.process_time() - cpu0


def step_order(plans: Sequence[RatePlan], *, interleave: bool) -> list[tuple[int, int]]:
    """``(rate index, step index)`` of every step of every rate, in the order they run.

    Sequential: rate after rate. Interleaved: all rates advance together through the questions (steps sorted by
    the middle of the question range they cover, ties by rate), so a shared machine's changing load falls on
    every rate alike. Each rate's own steps keep their order, and every step reseeds, so the results are the same.
    """
    if not interleave:
        return [(i, k) for i, plan in enumerate(plans) for k in range(plan.steps)]
    keyed = [((k + 0.5) / plan.steps, i, k) for i, plan in enumerate(plans) for k in range(plan.steps)]
    return [(i, k) for _, i, k in sorted(keyed)]


def run_plans(
    plans: Sequence[RatePlan],
    base_config: Any,
    *,
    device: str,
    interleave: bool,
    on_step: Callable[[RatePlan, dict[str, float]], None] | None = None,
) -> list[RateRun]:
    """Trains every rate from a fresh model (same seed for all) in :func:`step_order`; one :class:`RateRun` each.

    A rate's trainer is built before its first step (``setup_seconds``, not timed as a step) and freed after its
    last. RuntimeError when a trainer draws other questions than the plan says (the rates would not compare).
    """
    from cppo import Trainer

    steps: list[list[tuple[dict[str, float], float, float]]] = [[] for _ in plans]
    setup = [0.0] * len(plans)
    trainers: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="cppo-speedup-") as tmp:
        for i, k in step_order(plans, interleave=interleave):
            plan = plans[i]
            if k == 0:
                config = dataclasses.replace(
                    base_config,
                    pruning_rate=plan.pruning_rate,
                    num_steps=plan.steps,
                    max_questions=plan.questions,
                    output_dir=os.path.join(tmp, f"rate{i}"),
                )
                t0 = time.perf_counter()
                trainers[i] = Trainer(config)
                setup[i] = time.perf_counter() - t0
            steps[i].append(timed_step(trainers[i], device=device))
            if on_step is not None:
                on_step(plan, steps[i][-1][0])
            if k == plan.steps - 1:
                del trainers[i]
                _free(device)
    return [_rate_run(plan, records, setup=t) for plan, records, t in zip(plans, steps, setup)]


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _rate_run(plan: RatePlan, records: list[tuple[dict[str, float], float, float]], *, setup: float) -> RateRun:
    acc = accumulate([m for m, _, _ in records], [w for _, w, _ in records])
    if acc["questions"] != plan.questions:
        raise RuntimeError(
            f"P={plan.pruning_rate}: the trainer drew {acc['questions']} questions in {plan.steps} step(s), the plan"
            f" expected {plan.questions} ({plan.step_questions} per step): the rates would not see the same questions"
        )
    return RateRun(
        plan=plan,
        phase_seconds=acc["phase_seconds"],
        total_seconds=acc["total_seconds"],
        tokens_trained=acc["tokens_trained"],
        tokens_forward=acc["tokens_forward"],
        completions=acc["completions"],
        completions_kept=acc["completions_kept"],
        questions_seen=acc["questions"],
        setup_seconds=setup,
        cpu_seconds=sum(c for _, _, c in records),
        reward_mean=acc["reward_mean"],
        accuracy=acc["accuracy"],
    )


def warmup(base_config: Any, *, device: str) -> float:
    """One P = 0 step with another seed (other questions, another model), not counted; returns its seconds."""
    from cppo import Trainer

    with tempfile.TemporaryDirectory(prefix="cppo-speedup-warmup-") as tmp:
        config = dataclasses.replace(
            base_config, pruning_rate=0.0, num_steps=1, max_questions=None, seed=base_config.seed + 1, output_dir=tmp
        )
        trainer = Trainer(config)
        _, wall, _ = timed_step(trainer, device=device)
        del trainer
    _free(device)
    return wall


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except for options whose default comes from ``--preset`` (their help says so)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def _preset_help(key: str) -> str:
    return " (default: " + ", ".join(f"{name} {preset[key]}" for name, preset in PRESETS.items()) + ")"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; options left unset (None) take the ``--preset``'s value in :func:`apply_preset`."""
    ap = argparse.ArgumentParser(
        description="CPPO against GRPO, end to end, on the same questions (see the module docstring).",
        formatter_class=_HelpFormatter,
    )
    add = ap.add_argument
    add(
        "--preset",
        choices=sorted(PRESETS),
        default="cpu",
        help="cpu: tiny model + arithmetic, no download; gsm8k: the paper's GSM8K setting (needs a GPU)",
    )
    add(
        "--model",
        help="'tiny-qwen2' (built from a config), a hub name, a local path or a .gguf file" + _preset_help("model"),
    )
    add("--model-config", help=f"JSON overrides of the tiny model's config (default: {json.dumps(TINY_MODEL_CONFIG)})")
    add("--dataset", help="arith | gsm8k | math500 | a .jsonl path | a hub dataset" + _preset_help("dataset"))
    add("--dataset-path", help="local file or folder for --dataset gsm8k / math500")
    add("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    add("--dtype", help="float32 | bfloat16 | float16" + _preset_help("dtype"))
    add(
        "--pruning-rates",
        type=float,
        nargs="+",
        default=list(DEFAULT_RATES),
        help="pruning rates P; the first must be 0 (GRPO)",
    )
    add("--group-size", type=int, default=16, help="completions per question G")
    add(
        "--questions",
        type=int,
        help="questions every rate processes, a multiple of each rate's questions per step"
        " (default: the least such multiple, times 2 on the cpu preset)",
    )
    add(
        "--questions-per-step",
        type=int,
        help="questions a GRPO step draws (with allocation CPPO draws this/(1-P))" + _preset_help("questions_per_step"),
    )
    add("--max-new-tokens", type=int, help="completion length cap" + _preset_help("max_new_tokens"))
    add("--max-prompt-length", type=int, help="prompts keep their last N tokens (default: 64 for tiny-qwen2, else 512)")
    add(
        "--allocation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPPO draws 1/(1-P) times more questions per step (the paper's allocation)",
    )
    add("--mu", type=int, default=2, help="policy updates per rollout")
    add(
        "--backend",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="kernel backend (auto: Triton on CUDA; triton on CPU runs the interpreter: slow)",
    )
    add(
        "--rollout-backend",
        choices=["auto", "hf", "vllm"],
        default="auto",
        help="auto: vLLM on CUDA when installed, transformers generate otherwise",
    )
    add(
        "--micro-batch-tokens",
        type=int,
        help="token budget per packed micro-batch, at least prompt + completion" + _preset_help("micro_batch_tokens"),
    )
    add("--seed", type=int, default=0, help="the same seed for every rate")
    add(
        "--schedule",
        choices=["interleaved", "sequential"],
        help="interleaved: all rates step through the questions together (one model per rate in memory; evens out"
        " a shared machine's load); sequential: rate after rate (one model at a time)" + _preset_help("schedule"),
    )
    add(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run one untimed step first (its seconds go to meta.warmup_seconds)",
    )
    add("--threads", type=int, help="torch.set_num_threads" + _preset_help("threads").replace("None", "torch's choice"))
    add("--out", type=pathlib.Path, default=DEFAULT_OUT, help="folder for speedup.json and speedup.png")
    add("--no-plot", action="store_true", help="skip the PNG")
    add("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


def apply_preset(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the options left unset from ``PRESETS[args.preset]`` and checks the integer options."""
    preset = PRESETS[args.preset]
    for key in ("model", "dataset", "dtype", "max_new_tokens", "schedule", "threads"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.max_prompt_length is None:
        args.max_prompt_length = preset["tiny_max_prompt_length" if args.model == "tiny-qwen2" else "max_prompt_length"]
    if args.micro_batch_tokens is None:
        args.micro_batch_tokens = max(preset["micro_batch_tokens"], args.max_prompt_length + args.max_new_tokens)
    if args.questions_per_step is None:
        args.questions_per_step = preset["questions_per_step"]
    if args.dataset_path is None and args.dataset == "gsm8k" and SHARED_GSM8K.is_dir():
        args.dataset_path = str(SHARED_GSM8K)
    for name in ("max_new_tokens", "max_prompt_length", "micro_batch_tokens", "mu", "group_size"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.questions is None:
        least = smallest_questions(
            args.pruning_rates, questions_per_step=args.questions_per_step, allocation=args.allocation
        )
        args.questions = preset["question_multiple"] * least
    return args


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available")
    return device


def base_config(args: argparse.Namespace, *, device: str) -> Any:
    """The trainer config shared by every rate (everything but the rate, its steps and the output folder)."""
    from cppo import TrainConfig, load_config

    trainer_preset = PRESETS[args.preset]["trainer_preset"]
    config = load_config(trainer_preset) if trainer_preset else TrainConfig()
    model_config = json.loads(args.model_config) if args.model_config else None
    if args.model == "tiny-qwen2" and model_config is None:
        model_config = dict(TINY_MODEL_CONFIG)
    return dataclasses.replace(
        config,
        model=args.model,
        model_config=model_config,
        dataset=args.dataset,
        dataset_path=args.dataset_path,
        dtype=args.dtype,
        device=device,
        group_size=args.group_size,
        max_prompt_length=args.max_prompt_length,
        max_completion_length=args.max_new_tokens,
        micro_batch_tokens=args.micro_batch_tokens,
        questions_per_step=args.questions_per_step,
        allocation=args.allocation,
        mu=args.mu,
        kernel_backend=args.backend,
        rollout_backend=args.rollout_backend,
        seed=args.seed,
        num_epochs=1,
        save_every=0,
        eval_every=0,
    )


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or 'CPU'} ({os.cpu_count()} cores)"


def collect_meta(config: Any, *, device: str, argv: Sequence[str]) -> dict[str, Any]:
    """Where and how the numbers were measured."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit, dirty = git_commit()
    device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else _cpu_name()
    return {
        "device": device,
        "device_name": device_name,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model": config.model,
        "model_config": config.model_config,
        "dataset": config.dataset,
        "dtype": config.dtype,
        "group_size": config.group_size,
        "max_prompt_length": config.max_prompt_length,
        "max_completion_length": config.max_completion_length,
        "micro_batch_tokens": config.micro_batch_tokens,
        "questions_per_step": config.questions_per_step,
        "allocation": config.allocation,
        "mu": config.mu,
        "beta": config.beta,
        "kernel_backend": config.kernel_backend,
        "rollout_backend": config.rollout_backend,
        "seed": config.seed,
        "torch": torch.__version__,
        "triton": triton_version,
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
    """Runs the benchmark; returns ``{"meta": ..., "rows": [...]}`` as written to ``--out/speedup.json``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = apply_preset(parse_args(argv))
    plans = plan_schedule(
        args.pruning_rates,
        group_size=args.group_size,
        questions=args.questions,
        questions_per_step=args.questions_per_step,
        allocation=args.allocation,
    )
    if args.backend == "triton" and not args.device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import (CPU interpreter)

    import torch
    from tqdm.auto import tqdm

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if args.preset == "gsm8k" and not device.startswith("cuda"):
        raise ValueError("--preset gsm8k trains Qwen2.5-1.5B-Instruct and needs a CUDA device (--device cuda)")
    config = base_config(args, device=device)
    meta = collect_meta(config, device=device, argv=argv)
    meta.update(preset=args.preset, schedule=args.schedule, questions=args.questions)

    bar = tqdm(total=sum(p.steps for p in plans), unit="step", desc="speedup", disable=args.no_progress)
    meta["warmup_seconds"] = None
    if args.warmup:
        bar.set_postfix_str("warm-up")
        meta["warmup_seconds"] = warmup(config, device=device)

    def on_step(plan: RatePlan, metrics: dict[str, float]) -> None:
        bar.set_postfix_str(f"P={plan.pruning_rate:g} keep {plan.keep}/{plan.group_size}", refresh=False)
        bar.update(1)

    runs = run_plans(plans, config, device=device, interleave=args.schedule == "interleaved", on_step=on_step)
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
    main()
