"""Generation ahead of training (``steps_per_generation``, ``max_staleness``; TRL's names): a queue of the steps'
rollouts, each stamped with the policy version that sampled it.

- ``steps_per_generation = n``: one generation call draws n steps' questions; each of the n steps then trains its own
  share (GRPO's or CPPO's rule unchanged), the i-th of them on rollouts i optimizer steps old.
- ``max_staleness >= n`` (overlap): while a step trains, the engine generates the next call's rollouts in a thread
  of this process, from the weights the engine holds (synced before the call is launched, never while it runs); the
  trainer waits for it only when it needs those rollouts. With n = 1 step k+1's rollouts are sampled with the weights
  after step k-1 while step k trains: one update old when they are trained.

A rollout is never trained more than ``max_staleness`` updates after the weights that sampled it (checked as each
step takes its draw). The stale behaviour policy is corrected by the loss's importance weights against the engine's
sampling log-probs (``vllm_importance_sampling_*``, TRL's truncated / masked IS): the engines that generate ahead
report them. A checkpoint waits for the call in flight and saves every queued draw (plain data, read with
``weights_only``), so a resumed run trains each rollout once and none is lost.

On the CPU the generation thread and the trainer each get their own cores (:func:`split_cpus`: the process's allowed
CPUs split in two halves, the generating thread pinned to the upper one with ``os.sched_setaffinity`` on its own
thread id, the training thread to the lower one; both restored when the queue closes). Torch ops release the GIL, so
the two threads compute at once; their Python glue takes turns. On a GPU the two share it (colocated time-slicing).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from .engines import Rollout
from .run import PhaseTimer
from .step import FilledStep, Selection

__all__ = ["StepDraw", "RolloutQueue", "make_queue", "split_cpus"]

log = logging.getLogger("cppo")


@dataclasses.dataclass
class StepDraw:
    """One step's rollouts, as :meth:`cppo.rollouts.StepRollouts.draw_step` returns them, with the policy
    ``version`` (optimizer steps trained) whose weights sampled them, the sampler's ``passed`` count after them, and
    the generation call's ``times`` (``time/...`` seconds; on the first draw of a call only)."""

    problems: list[dict]
    prompts: list[str]
    rollout: Rollout
    rewards: torch.Tensor
    scores: dict[str, list]
    correct: list
    filled: FilledStep | None
    extra: dict
    version: int
    passed: int
    times: dict[str, float] = dataclasses.field(default_factory=dict)

    def fields(self) -> tuple:
        """What ``Trainer.train_step`` reads: problems, prompts, rollout, rewards, scores, correct, filled, extra."""
        return (self.problems, self.prompts, self.rollout, self.rewards, self.scores, self.correct, self.filled,
                self.extra)  # fmt: skip

    def split(self, steps: int, group_size: int, passed_before: int) -> list[StepDraw]:
        """The ``steps`` steps' draws of one call, each its share of the questions in order (the call's metrics and
        times go with the first; the sampler's count shared out evenly)."""
        if steps == 1:
            return [self]
        if self.filled is not None:
            raise ValueError("a call of several steps cannot carry dynamic sampling's selection")
        q = len(self.problems) // steps
        out = []
        for i in range(steps):
            lo, hi = i * q, (i + 1) * q if i < steps - 1 else len(self.problems)
            rows = slice(lo * group_size, hi * group_size)
            passed = passed_before + (self.passed - passed_before) * (i + 1) // steps
            out.append(StepDraw(
                self.problems[lo:hi], self.prompts[lo:hi], _rows(self.rollout, rows, hi - lo, len(self.problems)),
                self.rewards[rows], {k: v[rows] for k, v in self.scores.items()}, self.correct[rows], None,
                self.extra if i == 0 else {}, self.version, passed, self.times if i == 0 else {},
            ))  # fmt: skip
        return out

    def to_state(self) -> dict:
        """Plain data (lists, numbers, strings, tensors) for a checkpoint's ``weights_only`` state."""
        state = {k: getattr(self, k) for k in ("problems", "prompts", "rewards", "scores", "correct", "extra",
                                                "version", "passed", "times")}  # fmt: skip
        state["rollout"] = dataclasses.asdict(self.rollout)
        if self.filled is not None:
            filled = {f.name: getattr(self.filled, f.name) for f in dataclasses.fields(self.filled)}
            filled["selection"] = dataclasses.asdict(self.filled.selection)
            state["filled"] = filled
        return state

    @classmethod
    def from_state(cls, state: dict) -> StepDraw:
        """The inverse of :meth:`to_state`."""
        state = dict(state)
        state["rollout"] = Rollout(**state["rollout"])
        filled = state.pop("filled", None)
        if filled is not None:
            filled = FilledStep(**{**filled, "selection": Selection(**filled["selection"])})
        return cls(filled=filled, **state)


def _rows(rollout: Rollout, rows: slice, questions: int, total: int) -> Rollout:
    """The completions ``rows`` of ``rollout`` (``questions`` of its ``total`` prompts: the prefill shared out)."""
    part = Rollout(rollout.prompt_ids[rows], rollout.completion_ids[rows], rollout.texts[rows])
    if rollout.sampling_logprobs is not None:
        part.sampling_logprobs = rollout.sampling_logprobs[rows]
    if rollout.prefill_tokens is not None:
        part.prefill_tokens = rollout.prefill_tokens * questions // total
    if rollout.stopped is not None:
        part.stopped = rollout.stopped[rows]
    return part


def split_cpus(device: torch.device) -> tuple[set[int], set[int]] | None:
    """``(training CPUs, generating CPUs)``: this process's allowed CPUs in two halves (the generation thread gets the
    upper, the larger when odd), on the CPU with at least two allowed; None otherwise (a GPU, one CPU, or no
    ``os.sched_setaffinity``)."""
    if device.type != "cpu" or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    half = len(allowed) // 2
    return set(allowed[:half]), set(allowed[half:])


def make_queue(cfg, draw_call: Callable, *, info, device: torch.device, **hooks) -> RolloutQueue | None:
    """The run's :class:`RolloutQueue` with ``steps_per_generation`` > 1 or ``max_staleness`` > 0 (CPUs split with
    :func:`split_cpus`), else None; ``hooks``: its ``sync``, ``passed`` and ``seed``. Generating ahead under torchrun
    (``info``) runs without dynamic sampling and GRESO: their collectives would run beside the training step's."""
    if cfg.steps_per_generation == 1 and cfg.max_staleness == 0:
        return None
    if cfg.max_staleness >= cfg.steps_per_generation and info.distributed and (cfg.filter_groups or cfg.greso):
        raise ValueError(
            "max_staleness: generating ahead under torchrun runs with neither filter_groups nor greso (their "
            "collectives would run beside the training step's); turn them off or set max_staleness below "
            "steps_per_generation"
        )
    if not cfg.vllm_importance_sampling_correction:
        log.warning(
            "max_staleness / steps_per_generation train rollouts sampled by an older policy, and "
            "vllm_importance_sampling_correction=false leaves that uncorrected"
        )
    return RolloutQueue(
        draw_call, steps_per_generation=cfg.steps_per_generation, max_staleness=cfg.max_staleness,
        group_size=cfg.group_size, device=device, pin=split_cpus(device), **hooks,
    )  # fmt: skip


class RolloutQueue:
    """The steps' draws ahead of training. ``draw_call(timer, steps, step)``: one generation call of ``steps`` steps'
    questions, the first of which trains at ``step`` (generate and reward, on the engine's current weights), returning
    ``draw_step``'s fields over them all;
    ``sync()`` loads the policy's weights into the engine; ``passed()`` the sampler's count; ``seed(step)`` seeds the
    sampling of a call whose first draw trains at ``step``. ``pin``: :func:`split_cpus`'s halves, or None."""

    def __init__(
        self, draw_call: Callable, *, sync: Callable[[], None], passed: Callable[[], int], seed: Callable[[int], None],
        steps_per_generation: int, max_staleness: int, group_size: int, device: torch.device,
        pin: tuple[set[int], set[int]] | None = None,
    ) -> None:  # fmt: skip
        self.draw_call, self.sync, self.passed, self.seed = draw_call, sync, passed, seed
        self.steps, self.max_staleness = steps_per_generation, max_staleness
        self.group_size, self.device = group_size, device
        self.overlap = max_staleness >= steps_per_generation
        self.ready: list[StepDraw] = []
        self.engine_version: int | None = None  # the policy version the engine holds (None: unknown, sync first)
        self.pin, self._restore = pin, None  # the training thread's affinity before it was pinned
        pool = concurrent.futures.ThreadPoolExecutor
        self._pool = pool(1, thread_name_prefix="cppo-generate") if self.overlap else None
        self._pending: concurrent.futures.Future | None = None
        self.taken_passed: int | None = None  # the sampler's count after the last draw taken (questions trained)

    # What a step asks -----------------------------------------------------------------------------------------

    def take(self, step: int, timer: PhaseTimer, *, more: Callable[[int], bool]) -> tuple[StepDraw, dict]:
        """The draw step ``step`` trains (policy version ``step``): the queue's first, else the call in flight's
        (waited for), else a call made now; then, generating ahead, the next call launched when the queue ran dry and
        ``more(step)`` says a step after this one will train. Returns the draw and the step's metrics: its
        staleness, the main thread's wait for generation, the generation call's phase times (its first step)."""
        wait = 0.0
        if not self.ready and self._pending is not None:
            start = time.perf_counter()
            self._collect()
            wait = time.perf_counter() - start
        if not self.ready:
            self._sync_to(step)
            self.seed(step)
            before = self.passed()
            self._queue(self.draw_call(timer, self.steps, step), version=step, before=before)
        draw = self.ready.pop(0)
        self.taken_passed = draw.passed
        staleness = step - draw.version
        if not 0 <= staleness <= self.max_staleness:  # by construction never: a bug, not a setting
            raise RuntimeError(
                f"step {step} would train rollouts sampled by the policy of step {draw.version} (max_staleness "
                f"{self.max_staleness})"
            )
        if self.overlap and not self.ready and self._pending is None and more(step):
            self._launch(step)
        metrics = {"staleness": staleness, "time/generate_wait": wait, "overlap/queued": len(self.ready)}
        return draw, metrics | {f"time/{k}": v for k, v in draw.times.items()}

    def _launch(self, step: int) -> None:
        """Starts the call whose draws train from step ``step + 1``, on the engine synced to version ``step``."""
        self._sync_to(step)
        if self.pin is not None and self._restore is None:  # this (training) thread; the generating one pins itself
            self._restore = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.pin[0])
        self.seed(step + 1)  # before the thread starts: the sampler draws from torch's global RNG
        before = self.passed()

        def run():
            if self.pin is not None:
                os.sched_setaffinity(0, self.pin[1])  # this thread only (Linux: 0 is the calling thread)
            timer = PhaseTimer(self.device, clock=time.thread_time)  # this thread's CPU, not the trainer's beside it
            fields = self.draw_call(timer, self.steps, step + 1)
            return fields, dict(timer.seconds), before, step

        self._pending = self._pool.submit(run)

    def _collect(self) -> None:
        """Waits for the call in flight (its error raised here) and queues its draws."""
        future, self._pending = self._pending, None
        fields, times, before, version = future.result()
        self._queue(fields, version=version, before=before, times=times)

    def _queue(self, fields: tuple, *, version: int, before: int, times: dict | None = None) -> None:
        """One call's ``draw_step`` result, split into its steps' draws at the back of the queue."""
        draw = StepDraw(*fields, version=version, passed=self.passed(), times=times or {})
        self.ready.extend(draw.split(self.steps, self.group_size, before))

    def _sync_to(self, version: int) -> None:
        if self.engine_version != version:
            self.sync()
            self.engine_version = version

    # Around the steps -----------------------------------------------------------------------------------------

    def drain(self) -> None:
        """Waits for the call in flight, if any, and queues it (before a checkpoint, an evaluation, the end)."""
        if self._pending is not None:
            self._collect()

    def engine_at(self, version: int) -> None:
        """The engine holds the policy of ``version`` (after an evaluation's or a checkpoint load's sync)."""
        self.engine_version = version

    def sync_for_use(self, version: int) -> None:
        """Before another use of the engine (greedy evaluation): the call in flight waited for, the engine synced to
        the policy of ``version``."""
        self.drain()
        self._sync_to(version)

    def state_dict(self) -> dict:
        """The queued draws (the call in flight waited for first) and the trained count, for a checkpoint."""
        self.drain()
        return {"draws": [d.to_state() for d in self.ready], "taken_passed": self.taken_passed}

    def load_state_dict(self, ranks: list[dict], *, rank: int = 0, world_size: int = 1) -> None:
        """This rank's part of a checkpoint's queues (``ranks``: every rank's :meth:`state_dict`, in rank order).
        ValueError when the checkpoint was written by another number of processes: each rank's draws are its own."""
        if len(ranks) != world_size:
            raise ValueError(
                f"the checkpoint holds the rollouts generated ahead by {len(ranks)} process(es), each its own share of "
                f"the questions; resume it with {len(ranks)} process(es), not {world_size}"
            )
        self.ready = [StepDraw.from_state(d) for d in ranks[rank].get("draws", [])]
        self.taken_passed = ranks[rank].get("taken_passed")

    def close(self) -> None:
        """Waits for the call in flight (its rollouts dropped, its error logged) and restores the CPU pinning. Draws
        left untrained (a run bounded by epochs that ended before the steps a call drew for) are logged."""
        if self.ready:
            log.info("%d step(s)' rollouts generated ahead were not trained: the run ended first", len(self.ready))
        if self._pending is not None:
            try:
                self._pending.result()
            except Exception as e:  # noqa: BLE001  (the run is ending on another error already)
                log.warning("the generation running ahead failed too: %s", e)
            self._pending = None
        if self._restore is not None and threading.current_thread() is threading.main_thread():
            os.sched_setaffinity(0, self._restore)
            self._restore = None
