"""One unit of an accuracy sweep (``benchmarks/accuracy_seeds.py --arms``, which starts this script once per unit in a
child process of one torch thread): an *arm*, a named trainer configuration, trained on one seed's questions and
evaluated after training, or the one evaluation of the untrained model that every arm starts from.

An arm is the preset plus the ``--set`` overrides of :data:`ARMS` (each names all four pruning settings, so it means
the same whatever the preset says), at the seed: ``seed=S`` also draws the seed's training questions
(``TrainConfig.training_question_seed``). It trains ``--questions`` questions (``num_steps`` = questions / the
questions a step draws, ``max_questions`` = questions: exactly what ``speedup.py`` plans for a rate), after one
untimed warm-up step on seed S + 1 (as ``speedup.py``), and is evaluated after ``--eval-points`` evenly spaced steps.
Its row is a ``speedup.py`` row (:func:`endtoend.report.run_row`) plus ``arm``; the columns measured against GRPO
(:data:`endtoend.report.RELATIVE_KEYS`) are filled when the sweep is combined, from the GRPO row of the same seed.

The evaluation before training (``--before-only``; 300 problems take ~2-8 min) is the same for every seed and arm when
the model is read from a file (the same weights, the same first N test problems, greedy decoding), so the sweep
measures it once (``before.json``) and every arm's row takes it as its first curve point, as ``speedup.py`` shares
one measurement between its rates; a built-in ``tiny-*`` model is initialised from the seed, so it is measured per
seed (``before-seedS.json``). :func:`before_name` says which.

    python benchmarks/accuracy_arm.py --before-only --seed 45 --result OUT/before.json
    python benchmarks/accuracy_arm.py --arm cppo-pooled --seed 45 --before OUT/before.json --result OUT/r.json

(both with the sweep's ``--config``, ``--set``, ``--questions``, ``--eval``, ``--eval-points``; ``--dry-run`` plans
without a model). The result file is written atomically once the run has ended: it exists complete or not at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import yaml
from endtoend.args import base_config
from endtoend.report import EvalPoint, collect_meta, relative_fields, run_row
from endtoend.runner import measure_accuracy, planned_steps, run_plans
from endtoend.speedup import check_eval, eval_meta

import cppo.trainer
from cppo import TrainConfig, fileio
from cppo.config import TINY_MODELS
from cppo.run import RunLock
from cppo.step import make_scheduler
from cppo.tasks import load_problems, question_id
from sweeps.report import AHEAD_DEFAULTS

#: The arms: name -> the ``--set`` overrides that make it (all at P = 0.75, the official recipe's rate).
ARMS: dict[str, tuple[str, ...]] = {
    "grpo": ("pruning_rate=0", "selection_metric=smallest", "selection_scope=batch", "allocation=true"),
    "cppo-pooled": ("pruning_rate=0.75", "selection_metric=smallest", "selection_scope=batch", "allocation=true"),
    "cppo-group": ("pruning_rate=0.75", "selection_metric=smallest", "selection_scope=group", "allocation=true"),
    "max-variance": ("pruning_rate=0.75", "selection_metric=max-variance", "selection_scope=group", "allocation=true"),
    "random": ("pruning_rate=0.75", "selection_metric=random", "selection_scope=batch", "allocation=true"),
    # the step-budget control: CPPO pooled without allocation, 64 steps of one question (GRPO's steps, warm-up and
    # summed learning rate), keeping 2 of each question's 8 completions
    "control": ("pruning_rate=0.75", "selection_metric=smallest", "selection_scope=batch", "allocation=false"),
    # issue 51: the cppo-pooled arm generating each step's rollouts while the previous step trains (one update old)
    "cppo-pooled-overlap": ("pruning_rate=0.75", "selection_metric=smallest", "selection_scope=batch",
                            "allocation=true", "max_staleness=1"),
    # issue 52: CPPO pooled (the cppo-pooled arm) for 2 epochs of the seed's questions: 32 steps, about GRPO's compute
    "cppo-pooled-2epochs": ("pruning_rate=0.75", "selection_metric=smallest", "selection_scope=batch",
                            "allocation=true", "num_epochs=2"),
    # issue 30: CPPO pooled for 3 epochs of the seed's questions, the run bounded by the data's epochs (num_steps
    # null: it ends when the question sampler has passed them), plain and with dynamic sampling + GRESO
    "cppo-epochs": ("pruning_rate=0.75", "selection_metric=smallest", "selection_scope=batch", "allocation=true",
                    "num_epochs=3"),
    "cppo-dyn": ("pruning_rate=0.75", "selection_metric=smallest", "selection_scope=batch", "allocation=true",
                 "num_epochs=3", "filter_groups=true", "greso=true"),
    # issue 38: 3 epochs of the seed's questions; CPPO per question, the same stopping 5 of each group's 8
    # completions at a quarter of max_completion_length (the learned head; the random scorer at the same rate), GRPO
    "grpo-epochs": ("pruning_rate=0", "selection_metric=smallest", "selection_scope=batch", "allocation=true",
                    "num_epochs=3"),
    "cppo-group-epochs": ("pruning_rate=0.75", "selection_metric=smallest", "selection_scope=group",
                          "allocation=true", "num_epochs=3"),
    "cppo-group-stop": ("pruning_rate=0.75", "selection_metric=smallest", "selection_scope=group", "allocation=true",
                        "num_epochs=3", "rollout_stop_rate=0.625", "rollout_stop_at=0.25",
                        "rollout_stop_scorer=learned"),
    "cppo-group-stop-random": ("pruning_rate=0.75", "selection_metric=smallest", "selection_scope=group",
                               "allocation=true", "num_epochs=3", "rollout_stop_rate=0.625", "rollout_stop_at=0.25",
                               "rollout_stop_scorer=random"),
}  # fmt: skip
#: What a row of an arm that does not set them has: a row matches an arm only when these agree too (:func:`arm_of`).
ROW_DEFAULTS: dict[str, Any] = {"num_epochs": None, "filter_groups": False, "greso": False, "rollout_stop_rate": 0.0,
                                 "rollout_stop_at": 0.25, "rollout_stop_scorer": "learned",
                                 **AHEAD_DEFAULTS}  # fmt: skip
#: Settings an arm or the sweep sets itself: a common ``--set`` of one would be overridden (or change every arm).
OWN_SETTINGS = (
    "pruning_rate", "selection_metric", "selection_scope", "allocation", "seed", "question_seed", "num_steps",
    "max_questions", "output_dir", "num_epochs", "filter_groups", "greso", "rollout_stop_rate", "rollout_stop_at",
    "rollout_stop_scorer", "rollout_stop", *AHEAD_DEFAULTS,
)  # fmt: skip
#: What the untrained model's evaluation depends on: a ``before.json`` is used only by arms that agree on these.
BEFORE_KEYS = ("model", "model_config", "dtype", "dataset", "dataset_path", "system_prompt", "max_prompt_length",
               "max_completion_length")  # fmt: skip


def arm_settings(arm: str) -> dict[str, Any]:
    """``ARMS[arm]`` as settings: ``{"pruning_rate": 0.75, ...}`` (values read as ``--set`` reads them)."""
    return {key: yaml.safe_load(value) for key, _, value in (o.partition("=") for o in ARMS[arm])}


def arm_of(row: dict[str, Any]) -> str | None:
    """The arm whose settings a result row has (a row of any ``speedup.py`` run names its pruning settings; a row
    without :data:`ROW_DEFAULTS`' keys, written before them, has their defaults); None when no arm matches."""

    def matches(arm: str) -> bool:
        return all(row.get(k, ROW_DEFAULTS.get(k)) == v for k, v in {**ROW_DEFAULTS, **arm_settings(arm)}.items())

    return next((arm for arm in ARMS if matches(arm)), None)


def add_base_args(ap: argparse.ArgumentParser) -> None:
    """The settings every unit of a sweep shares (the sweep passes them on unchanged)."""
    ap.add_argument("--config", default="smollm2-accuracy-cpu", help="a trainer preset or YAML file")
    ap.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                    help=f"trainer settings every arm shares (not {', '.join(OWN_SETTINGS)})")  # fmt: skip
    ap.add_argument("--questions", type=int, default=64, help="training questions per seed (every arm: the same)")
    ap.add_argument("--eval", type=int, default=300, metavar="N", help="greedy accuracy on the first N test problems")
    ap.add_argument("--eval-points", type=int, default=1, metavar="K", help="evaluations per run, the last at its end")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="no untimed warm-up step")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--arm", choices=sorted(ARMS), help="train this arm")
    which.add_argument("--before-only", action="store_true", help="evaluate the untrained model only")
    ap.add_argument("--seed", type=int, required=True, help="the seed (and the seed of the training questions)")
    ap.add_argument("--before", type=pathlib.Path, help="with --arm: the --before-only result to start the curve")
    ap.add_argument("--result", type=pathlib.Path, help="the JSON to write (not with --dry-run)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan; no model, nothing written")
    add_base_args(ap)
    args = ap.parse_args(argv)
    check_base_args(args)
    if not args.dry_run and args.result is None:
        raise ValueError("--result FILE is needed (where the unit's JSON goes)")
    if args.arm and not args.dry_run and args.before is None:
        raise ValueError("--arm needs --before FILE (the --before-only result every arm starts from)")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    return args


def check_base_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag: a common ``--set`` of a setting an arm or the sweep sets (:data:`OWN_SETTINGS`),
    ``--questions`` / ``--eval`` below 1."""
    own = sorted({o.partition("=")[0].strip() for o in args.overrides} & set(OWN_SETTINGS))
    if own:
        raise ValueError(f"--set must not set {own}: the arms and the sweep set them per unit")
    if args.questions < 1:
        raise ValueError(f"--questions must be >= 1, got {args.questions}")
    if args.eval < 1:
        raise ValueError(f"--eval must be >= 1 (test problems), got {args.eval}")


def arm_config(args: argparse.Namespace, arm: str | None, seed: int) -> TrainConfig:
    """The trainer config of ``arm`` at ``seed`` (None: the untrained model's, the preset's pruning), device
    resolved; ``max_questions``/``num_steps`` as :func:`plan_arm` sets them."""
    overrides = [*args.overrides, *(ARMS[arm] if arm else ()), f"seed={seed}"]
    base = base_config(argparse.Namespace(config=args.config, overrides=overrides, preset=None))
    return plan_arm(base, args.questions, epochs=arm is not None and "num_epochs" in arm_settings(arm))


def plan_arm(base: TrainConfig, questions: int, *, epochs: bool = False) -> TrainConfig:
    """``base`` training ``questions`` questions: ``num_steps`` = questions / the questions a step draws (as
    ``speedup.plan_schedule`` plans a rate); ``epochs``: ``num_steps`` null, the run bounded by ``base.num_epochs``
    epochs of the questions (``speedup.planned_steps`` plans them). ValueError naming ``--questions`` unless a step's
    draw divides it."""
    drawn = base.pruning.questions_drawn
    if questions % drawn:
        raise ValueError(
            f"--questions must be a multiple of {drawn} (the questions one step of P={base.pruning_rate:g} with "
            f"allocation={str(base.allocation).lower()} draws), got {questions}"
        )
    steps = None if epochs else questions // drawn
    return dataclasses.replace(base, num_steps=steps, max_questions=questions)


def before_name(config: TrainConfig) -> str:
    """The file of the untrained model's evaluation: ``before.json`` when the weights come from a file (the same for
    every seed), ``before-seedS.json`` for a built-in tiny model (initialised from the seed)."""
    return f"before-seed{config.seed}.json" if config.model in TINY_MODELS else "before.json"


def summed_lr(config: TrainConfig) -> dict[str, Any]:
    """The run's learning-rate schedule in numbers: optimizer steps, warm-up steps, and the sum of the learning
    rates of every optimizer step (what the weights move by, roughly, under Adam)."""
    total = planned_steps(config) * config.mu
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
    scheduler = make_scheduler(optimizer, schedule=config.lr_schedule, warmup_ratio=config.warmup_ratio, total=total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return {"optimizer_steps": total, "warmup_steps": math.ceil(total * config.warmup_ratio), "summed_lr": sum(lrs)}


def plan(args: argparse.Namespace, arm: str | None, seed: int) -> dict[str, Any]:
    """The unit's plan without a model: its settings, steps, learning-rate budget, training question ids (the
    trainer's problems: :func:`cppo.tasks.load_problems` as the trainer calls it, the row's ``train_question_ids``;
    every arm of a seed walks them in the same seeded order, ``questions_per_step`` at a time) and the evaluation
    (``speedup.check_eval``: the test split holds ``--eval`` problems). ValueError on a bad setting."""
    config = arm_config(args, arm, seed)
    evaluation = check_eval(argparse.Namespace(eval=args.eval, eval_points=args.eval_points), [config])
    problems = load_problems(
        config.dataset, split="train", dataset_path=config.dataset_path, max_questions=config.max_questions,
        question_seed=config.training_question_seed,
    )  # fmt: skip
    return {
        "arm": arm, "seed": seed, "pruning_rate": config.pruning_rate, "selection_metric": config.selection_metric,
        "selection_scope": config.selection_scope, "allocation": config.allocation,
        "questions_per_step": config.pruning.questions_drawn, "kept_per_step": config.pruning.kept_per_step,
        "steps": planned_steps(config), "bounded_by": "steps" if config.num_steps else f"{config.num_epochs} epochs",
        "filter_groups": config.filter_groups, "greso": config.greso, "questions": config.max_questions,
        **summed_lr(config),
        "train_question_ids": [question_id(p) for p in problems], "eval": dataclasses.asdict(evaluation),
        "before": before_name(config),
    }  # fmt: skip


def read_before(path: pathlib.Path, config: TrainConfig, problems: int) -> EvalPoint:
    """The untrained model's :class:`EvalPoint` from a ``--before-only`` result; ValueError naming the file when it is
    not one, or measured another model or evaluation (:data:`BEFORE_KEYS`, the problems, a tiny model's seed)."""
    try:
        data = json.loads(path.read_text())
        point, made = EvalPoint(**data["point"]), data["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        kind = f"{type(e).__name__}: {e}"
        raise ValueError(f"--before {path}: not an accuracy_arm.py --before-only result ({kind})") from None
    keys = BEFORE_KEYS + (("seed",) if config.model in TINY_MODELS else ())
    wrong = {k: (made.get(k), getattr(config, k)) for k in keys if made.get(k) != getattr(config, k)}
    if point.total != problems:
        wrong["eval problems"] = (point.total, problems)
    if wrong:
        raise ValueError(f"--before {path}: measured with other settings, (its, this arm's): {wrong}")
    return point


def run_before(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluates the untrained model (a trainer built from the sweep's settings at ``--seed``) on ``--eval``
    problems; ``{"config", "point", "meta"}``."""
    config = arm_config(args, None, args.seed)
    with tempfile.TemporaryDirectory(prefix="cppo-before-") as tmp:
        trainer = cppo.trainer.Trainer(dataclasses.replace(config, output_dir=tmp))
        point = measure_accuracy(trainer, problems=args.eval, device=config.device, train_seconds=0.0, step=0)
    print(f"before training: {point.correct}/{point.total} = {100 * point.accuracy:.1f}% ({point.eval_seconds:.0f} s)")
    meta = fileio.run_metadata(device=config.device, argv=sys.argv[1:])
    return {"config": config.to_dict(), "point": dataclasses.asdict(point), "meta": meta}


def run_arm(args: argparse.Namespace) -> dict[str, Any]:
    """Trains the arm (after the warm-up step) and evaluates it; ``{"meta", "rows": [its row]}`` (see the module
    docstring). Each step and evaluation is printed as it ends (the unit's log shows its progress)."""
    config = arm_config(args, args.arm, args.seed)
    evaluation = check_eval(argparse.Namespace(eval=args.eval, eval_points=args.eval_points), [config])
    before = read_before(args.before, config, args.eval)
    warmup = None
    if args.warmup:  # as speedup.py: one untimed step with another seed (other questions), before the run
        warm = dataclasses.replace(config, num_steps=1, max_questions=None, seed=config.seed + 1)
        warmup = run_plans([warm], device=config.device, interleave=False)[0].sums["total_seconds"]
        print(f"warm-up step: {warmup:.1f} s", flush=True)
    start, done = time.perf_counter(), [0]

    def on_step(plan: TrainConfig, metrics: dict[str, float]) -> None:
        done[0] += 1
        print(f"step {done[0]}/{planned_steps(plan)}: {time.perf_counter() - start:.0f} s since the start", flush=True)

    def on_eval(plan: TrainConfig, point: EvalPoint) -> None:
        print(f"eval after step {point.step}: {point.correct}/{point.total} = {100 * point.accuracy:.1f}% "
              f"({point.eval_seconds:.0f} s)", flush=True)  # fmt: skip

    (run,) = run_plans([config], device=config.device, interleave=False, on_step=on_step, evaluation=evaluation,
                       on_eval=on_eval, before=before)  # fmt: skip
    row = {"arm": args.arm, **run_row(run)}
    if config.pruning_rate == 0.0:  # GRPO: its own reference (the others are measured against it when combined)
        row.update(relative_fields(row, row))
    meta = collect_meta(config, argv=sys.argv[1:])
    meta.update(config=args.config, arm=args.arm, arm_overrides=list(ARMS[args.arm]), questions=args.questions,
                schedule="sequential", warmup_seconds=warmup, eval=eval_meta(evaluation, [run], config))  # fmt: skip
    meta["eval"]["before"] = (
        f"measured once by accuracy_arm.py --before-only ({args.before.name}; a model read from a file: once for every "
        "seed and arm, a tiny model: per seed), the first point of every arm's curve"
    )
    return {"meta": meta, "rows": [row]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs (or with ``--dry-run`` plans) the unit; returns what it wrote to ``--result``."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.dry_run:
        result = plan(args, args.arm, args.seed)
        print(json.dumps(result, indent=1))
        return result
    torch.set_num_threads(args.threads)
    with RunLock.of(str(args.result.parent)):  # the sweep does not move a folder aside while its unit runs
        result = run_before(args) if args.before_only else run_arm(args)
        fileio.write_json(args.result, result)
    print(f"wrote {args.result}", flush=True)
    return result


def cli() -> None:
    """``python benchmarks/accuracy_arm.py``: :func:`main`, an error as one line and exit status 1."""
    try:
        main()
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"accuracy_arm.py: error: {e}")
