"""CPPO against GRPO, end to end, on the same questions: where the time goes and what pruning saves.

``python benchmarks/speedup.py [--config PRESET_OR_YAML] [--set key=value ...]`` trains GRPO (P = 0) and CPPO at
several pruning rates P from the same model, seed and questions, and reports each phase's wall time summed over
the run, the speedups of the training phases and of the whole run against P = 0, the ideal training speedup
1/(1 - P) and the paper's GSM8K speedups. The trainer config comes from ``cppo.load_config`` as in ``cppo train``
(default: the ``speedup-cpu`` preset); the benchmark sets only each rate's ``pruning_rate``, ``num_steps`` and
``max_questions``, on the trainer's rules: a rate keeps ``TrainConfig.pruning.keep`` completions per question and a step
draws ``TrainConfig.pruning.questions_drawn`` questions, so every rate processes the same ``questions``.

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

Ablations (``--selection-metric METRIC@P ...``, METRIC ``random`` or ``largest``): an extra run at pruning rate P
that prunes at random, or the largest |A|, instead of the smallest, on the same questions and seed; its own row
(every row has ``selection_metric``), speedups still against P = 0.

Accuracy (``--eval N [--eval-points K]``): greedy accuracy on the first N problems of the dataset's test split under
its official protocol (``Trainer.evaluate``: :mod:`cppo.evaluate`, the run's completion length), measured once before
training (every run starts from the same model) and after K evenly spaced steps of every run, the last one its end.
Evaluation is timed apart and left out of the training wall clock; each point records the training wall seconds so
far. Rows gain ``accuracy_before`` / ``accuracy_after`` with 95% Wilson score intervals, ``accuracy_curve`` and
``time_to_grpo_accuracy``: the training wall time at which the run's curve first reaches the lower end of GRPO's
final 95% interval (None: never).

Writes ``NAME.json`` (one row per run plus a ``meta`` block: every setting of the base trainer config, the machine
and the software), ``NAME.png`` (stacked phase bars) and with ``--eval`` ``NAME-accuracy.png`` (accuracy against
training wall clock) to ``--out`` (``--name``, default ``speedup``), and prints Markdown tables and the files it
wrote. Without ``--out`` they go to a new folder of the run's own, ``benchmarks/runs/NAME-<UTC time>[-N]/`` (ignored
by git): the committed reference results in ``benchmarks/results/`` change only with ``--out benchmarks/results``.
This file plans and runs; the command line is ``benchmarks/endtoend/args.py``, and the rows, tables, JSON, PNGs and
metadata are pure functions in ``benchmarks/endtoend/report.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from benchkit.out import new_run_folder
from tqdm.auto import tqdm

import cppo.trainer
from cppo import TrainConfig
from cppo.tasks import count_local_problems, dataset_source, load_problems, question_id
from endtoend.args import (
    base_config,
    check_out,
    compare_config,
    out_folder,
    output_files,
    parse_ablation,
    parse_args,
)
from endtoend.report import (
    EvalPoint,
    RateRun,
    accumulate,
    build_rows,
    collect_meta,
    compare_rows,
    format_accuracy_table,
    format_table,
    plot,
    plot_accuracy,
    write_json,
)

#: ``on_step(plan, metrics)`` after every measured step (progress).
OnStep = Callable[[TrainConfig, dict[str, float]], None] | None


def plan_schedule(
    base: TrainConfig,
    pruning_rates: Sequence[float],
    *,
    ablations: Sequence[tuple[str, float]] = (),
    questions: int | None = None,
    least_times: int = 1,
) -> list[TrainConfig]:
    """One trainer config per rate, then one per ablation ``(selection_metric, P)``: ``base`` at ``pruning_rate`` P
    (and that metric) with ``max_questions = questions`` (default: ``least_times`` x the least count every run
    divides) and ``num_steps`` steps of its ``questions_drawn``.

    ValueError naming the argument unless the rates are distinct and start with 0 (the GRPO baseline), the runs are
    distinct, each makes a valid trainer config (keep >= 1), and ``questions`` is a multiple of every run's
    questions per step.
    """
    rates = [float(p) for p in pruning_rates]
    if not rates or rates[0] != 0.0 or len(set(rates)) != len(rates):
        raise ValueError(f"--pruning-rates must be distinct and start with 0 (the GRPO baseline), got {rates}")
    runs = [(base.selection_metric, p) for p in rates] + [(m, float(p)) for m, p in ablations]
    if len(set(runs)) != len(runs):
        raise ValueError(f"--selection-metric repeats a run: {[f'{m}@{p:g}' for m, p in ablations]}")
    configs = []
    for i, (metric, p) in enumerate(runs):
        try:
            scope = "group" if metric == "max-variance" else base.selection_scope  # PODS' selector is per group
            configs.append(dataclasses.replace(base, pruning_rate=p, selection_metric=metric, selection_scope=scope))
        except ValueError as e:
            flag = f"--pruning-rates {p:g}" if i < len(rates) else f"--selection-metric {metric}@{p:g}"
            raise ValueError(f"{flag}: {e}") from None
    per_step = [c.pruning.questions_drawn for c in configs]
    least = math.lcm(*per_step)
    questions = least * least_times if questions is None else questions
    if questions < 1:
        raise ValueError(f"--questions must be >= 1, got {questions}")
    if questions % least:
        drawn = {run_label(c): c.pruning.questions_drawn for c in configs}
        raise ValueError(
            f"--questions must be a multiple of {least} (the questions one step draws in each run: {drawn}) so that "
            f"every rate processes the same questions; got {questions}, e.g. use {-(-questions // least) * least}"
        )
    return [
        dataclasses.replace(c, num_steps=questions // c.pruning.questions_drawn, max_questions=questions)
        for c in configs
    ]


def run_label(config: TrainConfig) -> str:
    """``P=0.75``, or ``P=0.75 random`` for a run that does not prune the smallest |A|."""
    metric = config.selection_metric
    return f"P={config.pruning_rate:g}" + ("" if metric == "smallest" else f" {metric}")


def eval_steps(num_steps: int, points: int) -> list[int]:
    """The steps after which a run of ``num_steps`` steps is evaluated: ``points`` evenly spaced ones, the k-th after
    ``ceil(k * num_steps / points)`` steps (the same share of the questions in every run), the last one the end.
    ValueError when ``points`` is not in [1, num_steps]."""
    if not 1 <= points <= num_steps:
        raise ValueError(f"--eval-points must be in [1, {num_steps}] (a run of {num_steps} steps), got {points}")
    return [-(-k * num_steps // points) for k in range(1, points + 1)]


def planned_steps(plan: TrainConfig) -> int:
    """The steps ``plan`` plans: ``num_steps``, else ``num_epochs`` over its ``max_questions`` (a run bounded by the
    data's epochs, which :func:`run_plans` ends as early as the trainer does: ``Trainer.stop_reason``)."""
    return plan.num_steps or plan.steps_for(plan.max_questions)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_step(trainer: Any, *, device: str) -> tuple[dict[str, float], float, float]:
    """One ``train_step``, the GPU synchronised around it: ``(metrics, wall seconds, this process's CPU seconds)``."""
    _sync(device)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    metrics = trainer.train_step()
    _sync(device)
    return metrics, time.perf_counter() - wall0, time.process_time() - cpu0


def measure_accuracy(trainer: Any, *, problems: int, device: str, train_seconds: float, step: int) -> EvalPoint:
    """Greedy accuracy of the trainer's policy now on the first ``problems`` test problems (``Trainer.evaluate``:
    the dataset's official protocol, the run's completion length), timed apart from the training steps."""
    _sync(device)
    wall0 = time.perf_counter()
    result = trainer.evaluate(limit=problems)
    _sync(device)
    if result["total"] != problems:
        raise RuntimeError(f"--eval {problems}: the test split gave {result['total']} problems")
    return EvalPoint(
        train_seconds=train_seconds,
        step=step,
        correct=int(result["correct"]),
        total=int(result["total"]),
        format_rate=float(result["format_rate"]),
        eval_seconds=time.perf_counter() - wall0,
        distinct=result.get("distinct_problems"),
        per_problem=result.get("per_problem"),
    )


def step_order(plans: Sequence[TrainConfig], *, interleave: bool) -> list[tuple[int, int]]:
    """``(rate index, step index)`` of every step of every rate (``num_steps`` each), in the order they run.

    Sequential: rate after rate. Interleaved: all rates advance together through the questions (steps sorted by
    the middle of the question range they cover, ties by rate), so a shared machine's changing load falls on
    every rate alike. Each rate's own steps keep their order, and every step reseeds, so the results are the same.
    """
    order = [(i, k) for i, plan in enumerate(plans) for k in range(planned_steps(plan))]
    return sorted(order, key=lambda ik: ((ik[1] + 0.5) / planned_steps(plans[ik[0]]), ik[0])) if interleave else order


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """``--eval N --eval-points K``: N test problems, K points per run (see :func:`eval_steps`)."""

    problems: int
    points: int


def run_plans(
    plans: Sequence[TrainConfig],
    *,
    device: str,
    interleave: bool,
    on_step: OnStep = None,
    evaluation: EvalPlan | None = None,
    on_eval: Callable[[TrainConfig, EvalPoint], None] | None = None,
    before: EvalPoint | None = None,
) -> list[RateRun]:
    """Trains every planned config from a fresh model (same seed for all) in :func:`step_order`; a RateRun each.

    A rate's trainer is built before its first step (``setup_seconds``, not timed as a step) and freed after its
    last. With ``evaluation`` the first trainer built is evaluated before its first step (every run starts from
    that model: the first point of every curve; ``before``: that measurement, made earlier on the same model and
    problems, is used instead) and each run after its :func:`eval_steps`. RuntimeError when a
    trainer draws other questions than its ``max_questions`` (the rates would not compare; None: not checked).
    """
    records: list[list[tuple[dict[str, float], float, float]]] = [[] for _ in plans]
    curves: list[list[EvalPoint]] = [[] for _ in plans]
    at = [set(eval_steps(planned_steps(p), evaluation.points)) if evaluation else set() for p in plans]
    setup, trainers, ids, ended = [0.0] * len(plans), {}, [None] * len(plans), set()

    def evaluate(i: int, step: int) -> EvalPoint:
        seconds = sum(w for _, w, _ in records[i])
        point = measure_accuracy(
            trainers[i], problems=evaluation.problems, device=device, train_seconds=seconds, step=step
        )
        if on_eval is not None:
            on_eval(plans[i], point)
        return point

    with tempfile.TemporaryDirectory(prefix="cppo-speedup-") as tmp:
        for i, k in step_order(plans, interleave=interleave):
            if i in ended:  # a run bounded by epochs that the trainer ended before its planned steps
                continue
            if k == 0:
                t0 = time.perf_counter()
                trainers[i] = cppo.trainer.Trainer(
                    dataclasses.replace(plans[i], output_dir=os.path.join(tmp, f"rate{i}"))
                )
                setup[i] = time.perf_counter() - t0
                ids[i] = [question_id(p) for p in trainers[i].problems]
                if evaluation is not None:  # the first run's model before training is every run's
                    curves[i].append(next((c[0] for c in curves if c), before) or evaluate(i, 0))
            records[i].append(timed_step(trainers[i], device=device))
            if on_step is not None:
                on_step(plans[i], records[i][-1][0])
            last = k == planned_steps(plans[i]) - 1 or (plans[i].num_steps is None and trainers[i].stop_reason())
            if k + 1 in at[i] or (last and evaluation is not None):  # the end is always evaluated
                curves[i].append(evaluate(i, k + 1))
            if last:
                ended.add(i)
                del trainers[i]
                gc.collect()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
    return [
        _finish(plan, steps, setup=t, curve=curve, question_ids=q)
        for plan, steps, t, curve, q in zip(plans, records, setup, curves, ids)
    ]


def _finish(
    plan: TrainConfig,
    steps: list[tuple[dict[str, float], float, float]],
    *,
    setup: float,
    curve: list[EvalPoint],
    question_ids: list[str] | None = None,
) -> RateRun:
    """A run's :class:`RateRun` from its steps' ``(metrics, wall, cpu)``; RuntimeError when it drew other questions
    than planned."""
    sums = accumulate([m for m, _, _ in steps], [w for _, w, _ in steps])
    sums["steps"] = len(steps)
    if plan.num_steps is not None and plan.max_questions is not None and sums["questions"] != plan.max_questions:
        raise RuntimeError(
            f"P={plan.pruning_rate}: the trainer drew {sums['questions']} questions in {plan.num_steps} step(s), "
            f"not the planned {plan.max_questions}: the rates would not see the same questions"
        )
    cpu = sum(c for _, _, c in steps)
    return RateRun(
        config=plan, sums=sums, setup_seconds=setup, cpu_seconds=cpu, curve=curve, train_question_ids=question_ids
    )


def check_eval(args: argparse.Namespace, plans: Sequence[TrainConfig]) -> EvalPlan | None:
    """``--eval N --eval-points K`` checked against the plan (None without ``--eval``): N >= 1; K (default 4, at most
    the shortest run's steps) in [1, the shortest run's steps]; a held-out test split (not the training file of a
    .jsonl dataset) holding at least N problems, counted when it is local (a hub dataset is not downloaded here)."""
    if args.eval is None:
        if args.eval_points is not None:
            raise ValueError("--eval-points needs --eval N (the test problems to evaluate on)")
        return None
    if args.eval < 1:
        raise ValueError(f"--eval must be >= 1 (test problems), got {args.eval}")
    shortest = min(plans, key=planned_steps)
    points = min(4, planned_steps(shortest)) if args.eval_points is None else args.eval_points
    if not 1 <= points <= planned_steps(shortest):
        raise ValueError(
            f"--eval-points must be in [1, {planned_steps(shortest)}] (the steps of the shortest run, "
            f"{run_label(shortest)}), got {points}"
        )
    base = plans[0]
    if base.dataset.endswith(".jsonl") or (base.dataset_path is not None and os.path.isfile(base.dataset_path)):
        raise ValueError(
            f"--eval needs held-out test problems, but dataset {base.dataset!r} is one file: its test split would be "
            "its training problems (use a folder with train.jsonl and test.jsonl as dataset_path)"
        )
    source = dataset_source(base.dataset)  # a generated dataset (arith) has its test split without a path
    if (source is not None and source.generate is not None) or base.dataset_path is not None:
        try:
            test = load_problems(base.dataset, split="test", dataset_path=base.dataset_path, max_questions=args.eval)
        except ValueError as e:
            raise ValueError(f"--eval {args.eval}: {e}") from None
        found = len(test)
        if found < args.eval:
            raise ValueError(f"--eval {args.eval}: the test split of {base.dataset!r} has only {found} problems")
    return EvalPlan(problems=args.eval, points=points)


def dry_run(
    args: argparse.Namespace, plans: Sequence[TrainConfig], *, schedule: str, evaluation: EvalPlan | None
) -> dict[str, Any]:
    """Validates the whole plan without building a model: the trainer config of every run (``plan_schedule``
    built each one, so every setting and the local model and dataset paths are checked), the schedule, the training
    data (read when local; a hub dataset is not downloaded), the evaluation (:func:`check_eval` ran) and the ``--out``
    folder (the one it names, not created). Prints and returns the plan."""
    check_out(out_folder(args), create=False)
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
            {"pruning_rate": c.pruning_rate, "selection_metric": c.selection_metric, "keep": c.pruning.keep,
             "questions_per_step": c.pruning.questions_drawn, "steps": c.num_steps, "questions": c.max_questions,
             "eval_steps": eval_steps(c.num_steps, evaluation.points) if evaluation else []}
            for c in plans
        ],
        "eval": dataclasses.asdict(evaluation) if evaluation else None,
        "out": str(out_folder(args)),
        "files": list(output_files(args, accuracy=evaluation is not None).values()),
    }  # fmt: skip
    print(json.dumps(plan, indent=1))
    return plan


def eval_meta(evaluation: EvalPlan | None, runs: Sequence[RateRun], config: TrainConfig) -> dict[str, Any] | None:
    """The ``meta.eval`` block: what the accuracy columns mean and how they were measured (None without --eval)."""
    if evaluation is None:
        return None
    return {
        **dataclasses.asdict(evaluation),
        "dataset": config.dataset,
        "split": "test (the first N problems)",
        "protocol": "Trainer.evaluate: greedy, the dataset's official check (cppo.evaluate), max_completion_length "
        "new tokens",
        "interval": "Wilson score interval, 95% (z = 1.96)",
        "curve": "[training wall seconds so far (evaluation excluded), step, accuracy]; the first point is the one "
        "measurement before training that every run starts from",
        "time_to_grpo_accuracy": "training wall seconds of a run's first curve point at or above the lower end of "
        "GRPO's (P = 0) final 95% interval; None: never",
        "before_seconds": runs[0].curve[0].eval_seconds,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns ``{"meta": ..., "rows": [...]}`` as written to ``--out/NAME.json`` (with
    ``--dry-run``: the validated plan, see :func:`dry_run`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    config = base_config(args, need_cuda=not args.dry_run)
    on_cpu = config.device == "cpu"
    ablations = [parse_ablation(a) for a in args.ablations]
    plans = plan_schedule(
        config, args.pruning_rates, ablations=ablations, questions=args.questions, least_times=2 if on_cpu else 1
    )
    variant = compare_config(args, config, need_cuda=not args.dry_run)
    if variant is not None:  # each rate's run, then the same rate with the setting changed
        if ablations:
            raise ValueError("--compare runs every --pruning-rates rate twice; it takes no --selection-metric")
        others = plan_schedule(variant, args.pruning_rates, questions=plans[0].max_questions)
        plans = [c for pair in zip(plans, others) for c in pair]
    threads = args.threads if args.threads is not None else (1 if on_cpu else None)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    schedule = args.schedule or ("interleaved" if on_cpu else "sequential")
    evaluation = check_eval(args, plans)
    files = output_files(args, accuracy=evaluation is not None)
    if args.dry_run:
        return dry_run(args, plans, schedule=schedule, evaluation=evaluation)
    if args.out is None:  # a new folder of this run's own: never the committed benchmarks/results
        args.out = new_run_folder(args.name)
        files = output_files(args, accuracy=evaluation is not None)
    check_out(args.out, create=True)  # before the run, not after it
    if config.kernel_backend == "triton" and on_cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' first (lazy) import
    if threads is not None:
        torch.set_num_threads(threads)
    meta = collect_meta(config, argv=argv)
    meta.update(preset=args.preset, config=args.config, schedule=schedule, questions=plans[0].max_questions)
    meta["ablations"] = list(args.ablations)
    runs, meta["warmup_seconds"] = measure(args, plans, schedule=schedule, evaluation=evaluation)
    meta["eval"] = eval_meta(evaluation, runs, config)
    if variant is None:
        rows = build_rows(runs)
    else:  # the base runs and the changed ones, each against its own P = 0
        rows = [{**r, "variant": None} for r in build_rows(runs[0::2])]
        rows += [{**r, "variant": args.compare} for r in build_rows(runs[1::2])]
        meta["compare"] = compare_rows(rows, args.compare)
    write_json(pathlib.Path(files["json"]), rows, meta)
    if "png" in files:
        plot(pathlib.Path(files["png"]), rows, meta)
    if "accuracy_png" in files:
        plot_accuracy(pathlib.Path(files["accuracy_png"]), rows, meta)
    print(format_table(rows))
    if evaluation is not None:
        print("\n" + format_accuracy_table(rows))
    for pair in meta.get("compare", {}).get("pairs", []):
        print(
            f"\nP={pair['pruning_rate']:g}, {args.compare} / base: generation {pair['ratio_generation_seconds']:.3f}x, "
            f"train {pair['ratio_train_seconds']:.3f}x, "
            f"total {pair['ratio_total_seconds']:.3f}x, tokens through the model {pair['ratio_tokens_forward']:.3f}x"
        )
    print("\nwrote " + ", ".join(files.values()))
    return {"meta": meta, "rows": rows}


def measure(
    args: argparse.Namespace, plans: Sequence[TrainConfig], *, schedule: str, evaluation: EvalPlan | None
) -> tuple[list[RateRun], float | None]:
    """The warm-up step (unless ``--no-warmup``: its seconds, else None), then :func:`run_plans` with a progress
    bar; an accuracy point is written out as soon as it is measured."""
    device = plans[0].device
    bar = tqdm(total=sum(p.num_steps for p in plans), unit="step", desc="speedup", disable=args.no_progress)
    warmup = None
    if args.warmup:  # one P = 0 step with another seed (another model, other questions), not counted
        bar.set_postfix_str("warm-up")
        warm = dataclasses.replace(plans[0], num_steps=1, max_questions=None, seed=plans[0].seed + 1)
        warmup = run_plans([warm], device=device, interleave=False)[0].sums["total_seconds"]

    def on_step(plan: TrainConfig, metrics: dict[str, float]) -> None:
        bar.set_postfix_str(f"{run_label(plan)} keep {plan.pruning.keep}/{plan.group_size}", refresh=False)
        bar.update(1)

    def on_eval(plan: TrainConfig, point: EvalPoint) -> None:
        where = f"{run_label(plan)} step {point.step}/{plan.num_steps}, {point.train_seconds:.0f} s of training"
        where = "before training (every run's start)" if point.step == 0 else where
        bar.write(
            f"eval {where}: {point.correct}/{point.total} = {100 * point.accuracy:.1f}% "
            f"(format {100 * point.format_rate:.0f}%; {point.eval_seconds:.0f} s)"
        )
        sys.stdout.flush()  # a long run's log shows each point when it is measured

    interleave = schedule == "interleaved"
    runs = run_plans(
        plans, device=device, interleave=interleave, on_step=on_step, evaluation=evaluation, on_eval=on_eval
    )
    bar.close()
    return runs, warmup


def cli() -> None:
    """``python benchmarks/speedup.py``: :func:`main`, an error as one line and exit status 1."""
    try:
        main()
    except (ValueError, OSError) as e:
        sys.exit(f"speedup.py: error: {e}")
