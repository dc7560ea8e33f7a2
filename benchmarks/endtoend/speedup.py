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

``total_seconds`` is the sum of the ``train_step`` wall clocks. Building the model (``setup_seconds``), one
untimed warm-up step per arm on questions outside the measured set (``meta.warmup``, ``meta.warmup_seconds``: every
arm's engine has run before any timed step) and the weight reloads a vLLM engine shared by interleaved arms needs
(``reload_seconds``, done before the step: a run of one arm never pays it; ``endtoend/runner.py``) are reported
but excluded. ``cpu_seconds`` (the CPU time of this process and its finished children over the steps) is a check
on a shared machine; ``phase_cpu_seconds`` splits it by phase. On CPU the rates run
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
Batched GRPO (``--batched-grpo Q ...``): GRPO arms generating Q steps' questions in one call, training as GRPO
(``steps_per_generation`` Q, ``max_staleness`` Q - 1), beside CPPO's arms drawing as many questions per step: how much
of CPPO's speedup is pruning and how much batching. Rounds (``--rounds N``): every arm N times, each round its own
file, resumed across sessions, combined with 95% t intervals (``endtoend/wholerun.py``, ``endtoend/rounds.py``).

This file plans; ``benchmarks/endtoend/runner.py`` runs the arms, the command line is ``benchmarks/endtoend/args.py``,
and the rows, tables, JSON, PNGs and metadata are pure functions in ``benchmarks/endtoend/report.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import torch
from benchkit.out import new_run_folder
from tqdm.auto import tqdm

from cppo import TrainConfig
from cppo.tasks import count_local_problems, dataset_source, load_problems
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
    build_rows,
    collect_meta,
    compare_rows,
    format_accuracy_table,
    format_table,
    plot,
    plot_accuracy,
    write_json,
)
from endtoend.runner import (  # noqa: F401  (step_order, run_plans, timed_step, planned_steps: this module's API too)
    EvalPlan,
    eval_steps,
    planned_steps,
    run_label,
    run_plans,
    step_order,
    thread_record,
    timed_step,
    warm_up,
)
from endtoend.wholerun import collect, run_rounds


def plan_schedule(
    base: TrainConfig,
    pruning_rates: Sequence[float],
    *,
    ablations: Sequence[tuple[str, float]] = (),
    batched: Sequence[int] = (),
    questions: int | None = None,
    least_times: int = 1,
) -> list[TrainConfig]:
    """One trainer config per rate, then one per ablation ``(selection_metric, P)``, then one per ``batched`` Q (GRPO
    generating Q steps' questions in one call: P = 0 with ``steps_per_generation`` Q and ``max_staleness`` Q - 1,
    training as GRPO's): ``base`` at ``pruning_rate`` P (and that metric) with ``max_questions = questions``
    (default: ``least_times`` x the least count every run divides) and ``num_steps`` steps of its
    ``questions_drawn``.

    ValueError naming the argument unless the rates are distinct and start with 0 (the GRPO baseline), the runs are
    distinct, each makes a valid trainer config (keep >= 1), and ``questions`` is a multiple of every run's
    questions per generation call.
    """
    configs = _arm_configs(base, pruning_rates, ablations=ablations, batched=batched)
    per_call = {run_label(c): c.pruning.questions_drawn * c.steps_per_generation for c in configs}
    least = math.lcm(*per_call.values())
    questions = least * least_times if questions is None else questions
    if questions < 1:
        raise ValueError(f"--questions must be >= 1, got {questions}")
    if questions % least:
        raise ValueError(
            f"--questions must be a multiple of {least} (the questions one generation call draws in each run: "
            f"{per_call}) so that every rate processes the same questions; got {questions}, e.g. use "
            f"{-(-questions // least) * least}"
        )
    return [
        dataclasses.replace(c, num_steps=questions // c.pruning.questions_drawn, max_questions=questions)
        for c in configs
    ]


def _arm_configs(
    base: TrainConfig, pruning_rates: Sequence[float], *, ablations: Sequence[tuple[str, float]], batched: Sequence[int]
) -> list[TrainConfig]:
    """:func:`plan_schedule`'s configs before their questions and steps, each checked (ValueError naming its flag)."""
    rates = [float(p) for p in pruning_rates]
    if not rates or rates[0] != 0.0 or len(set(rates)) != len(rates):
        raise ValueError(f"--pruning-rates must be distinct and start with 0 (the GRPO baseline), got {rates}")
    runs = [(base.selection_metric, p) for p in rates] + [(m, float(p)) for m, p in ablations]
    if len(set(runs)) != len(runs):
        raise ValueError(f"--selection-metric repeats a run: {[f'{m}@{p:g}' for m, p in ablations]}")
    if len(set(batched)) != len(batched) or any(q < 2 for q in batched):
        raise ValueError(f"--batched-grpo takes distinct Q >= 2 (steps' questions per generation call), got {batched}")
    configs = []
    for i, (metric, p) in enumerate(runs):
        try:
            scope = "group" if metric == "max-variance" else base.selection_scope  # PODS' selector is per group
            configs.append(dataclasses.replace(base, pruning_rate=p, selection_metric=metric, selection_scope=scope))
        except ValueError as e:
            flag = f"--pruning-rates {p:g}" if i < len(rates) else f"--selection-metric {metric}@{p:g}"
            raise ValueError(f"{flag}: {e}") from None
    for q in batched:
        try:
            configs.append(dataclasses.replace(base, pruning_rate=0.0, steps_per_generation=q, max_staleness=q - 1))
        except ValueError as e:
            raise ValueError(f"--batched-grpo {q}: {e}") from None
    return configs


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
            {"arm": run_label(c), "pruning_rate": c.pruning_rate, "selection_metric": c.selection_metric,
             "steps_per_generation": c.steps_per_generation, "max_staleness": c.max_staleness, "keep": c.pruning.keep,
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


@dataclasses.dataclass
class Planned:
    """What :func:`plan` made of the command line: the base config, every arm's config, the ``--compare`` variant,
    the torch threads, the schedule, the evaluation and the files."""

    config: TrainConfig
    plans: list[TrainConfig]
    variant: TrainConfig | None
    threads: int | None
    schedule: str
    evaluation: EvalPlan | None
    files: dict[str, str]


def plan(args: argparse.Namespace) -> Planned:
    """The arms of ``args`` (:func:`plan_schedule`; with ``--compare`` each rate twice), checked."""
    config = base_config(args, need_cuda=not args.dry_run)
    on_cpu = config.device == "cpu"
    ablations = [parse_ablation(a) for a in args.ablations]
    plans = plan_schedule(config, args.pruning_rates, ablations=ablations, batched=args.batched,
                          questions=args.questions, least_times=2 if on_cpu else 1)  # fmt: skip
    variant = compare_config(args, config, need_cuda=not args.dry_run)
    if variant is not None:  # each rate's run, then the same rate with the setting changed
        if ablations or args.batched:
            raise ValueError("--compare runs every --pruning-rates rate twice; it takes no --selection-metric or "
                             "--batched-grpo")  # fmt: skip
        others = plan_schedule(variant, args.pruning_rates, questions=plans[0].max_questions)
        plans = [c for pair in zip(plans, others) for c in pair]
    threads = args.threads if args.threads is not None else (1 if on_cpu else None)
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if args.rounds is not None and (args.rounds < 1 or variant is not None or args.eval is not None):
        raise ValueError(f"--rounds must be >= 1 and takes no --compare or --eval, got --rounds {args.rounds}")
    schedule = args.schedule or ("interleaved" if on_cpu else "sequential")
    evaluation = check_eval(args, plans)
    files = output_files(args, accuracy=evaluation is not None)
    return Planned(config, plans, variant, threads, schedule, evaluation, files)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; returns ``{"meta": ..., "rows": [...]}`` as written to ``--out/NAME.json`` (with
    ``--dry-run``: the validated plan, see :func:`dry_run`; with ``--rounds``: :func:`endtoend.wholerun.run_rounds`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.collect:
        if args.out is None:
            raise ValueError("--collect needs --out (the folder its NAME.json goes to)")
        return collect(args.collect, name=str(args.name), out=args.out)
    p = plan(args)
    if args.dry_run:
        return dry_run(args, p.plans, schedule=p.schedule, evaluation=p.evaluation)
    if args.out is None:  # a new folder of this run's own: never the committed benchmarks/results
        args.out = new_run_folder(args.name)
        p.files = output_files(args, accuracy=p.evaluation is not None)
    check_out(args.out, create=True)  # before the run, not after it
    if p.config.kernel_backend == "triton" and p.config.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' first (lazy) import
    if p.threads is not None:
        torch.set_num_threads(p.threads)
    meta = collect_meta(p.config, argv=argv)
    meta.update(preset=args.preset, config=args.config, schedule=p.schedule, questions=p.plans[0].max_questions)
    meta["ablations"], meta["batched_grpo"] = list(args.ablations), list(args.batched)
    meta["threads_before_engine_start"] = thread_record(p.threads)
    if args.rounds is not None:
        return run_rounds(args, p, meta, measure=measure)
    return run_once(args, p, meta)


def run_once(args: argparse.Namespace, p: Planned, meta: dict[str, Any]) -> dict[str, Any]:
    """One run of every arm: ``NAME.json``, the PNGs and the tables (the run without ``--rounds``)."""
    runs, info = measure(args, p.plans, schedule=p.schedule, evaluation=p.evaluation, threads=p.threads)
    meta.update(info)
    meta["eval"] = eval_meta(p.evaluation, runs, p.config)
    if p.variant is None:
        rows = build_rows(runs)
    else:  # the base runs and the changed ones, each against its own P = 0
        rows = [{**r, "variant": None} for r in build_rows(runs[0::2])]
        rows += [{**r, "variant": args.compare} for r in build_rows(runs[1::2])]
        meta["compare"] = compare_rows(rows, args.compare)
    files = p.files
    write_json(pathlib.Path(files["json"]), rows, meta)
    if "png" in files:
        plot(pathlib.Path(files["png"]), rows, meta)
    if "accuracy_png" in files:
        plot_accuracy(pathlib.Path(files["accuracy_png"]), rows, meta)
    print(format_table(rows))
    if p.evaluation is not None:
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
    args: argparse.Namespace,
    plans: Sequence[TrainConfig],
    *,
    schedule: str,
    evaluation: EvalPlan | None,
    threads: int | None = None,
    warm: bool = True,
) -> tuple[list[RateRun], dict[str, Any]]:
    """The warm-up (with ``--warmup`` and ``warm``: one untimed step per arm, :func:`endtoend.runner.warm_up`), then
    :func:`run_plans` with a progress bar; an accuracy point is written out as soon as it is measured. Returns the
    runs and ``{"warmup_seconds", "warmup": per arm, "threads_after_engine_start"}`` (:func:`thread_record` once the
    first measured trainer, and so its engine, is built)."""
    device = plans[0].device
    bar = tqdm(total=sum(p.num_steps for p in plans), unit="step", desc="speedup", disable=args.no_progress)
    info: dict[str, Any] = {"warmup_seconds": None, "warmup": None}
    if args.warmup and warm:
        bar.set_postfix_str("warm-up")
        info["warmup"] = warm_up(plans, device=device)
        info["warmup_seconds"] = sum(w["seconds"] for w in info["warmup"])

    done = dict.fromkeys(map(run_label, plans), 0)

    def on_step(plan: TrainConfig, metrics: dict[str, float]) -> None:
        bar.set_postfix_str(f"{run_label(plan)} keep {plan.pruning.keep}/{plan.group_size}", refresh=False)
        bar.update(1)
        if args.rounds is not None:  # a line per step: a long run's log keeps what a killed round measured
            done[run_label(plan)] += 1
            cpu, label = sum(v for k, v in metrics.items() if k.startswith("time/cpu/")), run_label(plan)
            generation = metrics.get("time/generate", 0.0)
            bar.write(f"{label} step {done[label]}/{plan.num_steps}: {metrics['time/step']:.1f} s (generation "
                      f"{generation:.1f} s), {cpu:.1f} CPU s in its phases")  # fmt: skip
            sys.stdout.flush()

    def on_eval(plan: TrainConfig, point: EvalPoint) -> None:
        where = f"{run_label(plan)} step {point.step}/{plan.num_steps}, {point.train_seconds:.0f} s of training"
        where = "before training (every run's start)" if point.step == 0 else where
        bar.write(
            f"eval {where}: {point.correct}/{point.total} = {100 * point.accuracy:.1f}% "
            f"(format {100 * point.format_rate:.0f}%; {point.eval_seconds:.0f} s)"
        )
        sys.stdout.flush()  # a long run's log shows each point when it is measured

    def on_built(trainer: Any) -> None:
        info.setdefault("threads_after_engine_start", thread_record(threads))

    runs = run_plans(plans, device=device, interleave=schedule == "interleaved", on_step=on_step,
                     evaluation=evaluation, on_eval=on_eval, on_built=on_built)  # fmt: skip
    bar.close()
    return runs, info


def cli() -> None:
    """``python benchmarks/speedup.py``: :func:`main`, an error as one line and exit status 1."""
    try:
        main()
    except (ValueError, OSError) as e:
        sys.exit(f"speedup.py: error: {e}")
