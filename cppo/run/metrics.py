"""A step's metrics: the timer of its phases, how each metric combines over ranks, reading and writing the JSON-lines
log (the ``jsonl`` sink of :mod:`cppo.run.sinks` writes it) and the PNG of the reward and per-phase time curves."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import torch

from ..fileio import atomic_path, atomic_write

logger = logging.getLogger(__name__)

#: The JSON-lines log of a run's step records in its output_dir (the ``jsonl`` sink).
LOG_FILE = "metrics.jsonl"
#: The timed phases of a step, in order (``time/<phase>`` metrics; ``time/step`` is the whole step).
PHASES = ("generate", "reward", "select", "logprobs", "update", "optimizer")

#: Counts, and each rank's share of a global token-mean (normalised by the global token count): they add up.
SUMMED = frozenset(
    {"questions", "completions", "completions_kept", "tokens_trained", "tokens_forward", "micro_batches"}
    | {"tokens/generate_prompt", "tokens/generate_completion", "tokens/train_prompt", "tokens/train_completion"}
    | {"rollout_stop/stopped", "rollout_stop/tokens_saved_max"}
    | {"loss", "kl", "clip_fraction", "entropy", "kept_zero_advantage", "filter_groups/zero_variance_dropped"}
)
#: Equal on every rank (computed from gathered or synchronised values); wall times take the slowest rank too.
MAXED = frozenset({"step", "reward_mean", "reward_std", "grad_norm", "lr", "skipped_updates"}) | {
    "generation_calls", "filter_groups/bound_reached", "greso/questions_skipped", "greso/explore",
}  # fmt: skip


class PhaseTimer:
    """Accumulates wall seconds per phase (synchronising CUDA so GPU work lands in the right phase), and CPU seconds
    per phase under ``cpu/<phase>`` by ``clock``: by default this process's (every thread's: robust to a neighbour's
    load); ``time.thread_time`` for a thread's own while another works beside it (generation ahead of training)."""

    def __init__(self, device: torch.device, *, clock=time.process_time) -> None:
        self.device, self.seconds, self.clock = device, {}, clock

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start, cpu = time.perf_counter(), self.clock()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
        self.seconds[f"cpu/{phase}"] = self.seconds.get(f"cpu/{phase}", 0.0) + self.clock() - cpu


def metric_reduction(name: str) -> str:
    """How :func:`cppo.distributed.reduce_metrics` combines a step metric over ranks: counts and loss shares add
    up, times take the slowest rank, per-completion means are weighted by each rank's completions."""
    if name in SUMMED:
        return "sum"
    if name in MAXED or name.startswith("time/") or (name.startswith("sampling/") and name.endswith("/max")):
        return "max"
    if name.startswith("sampling/") and name.endswith("/min"):
        return "min"
    return "mean:completions"


def append_jsonl(path: str, record: dict) -> None:
    """Appends ``record`` as one JSON line and fsyncs it (a log: see :class:`cppo.run.sinks.JsonlSink`)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_jsonl(path: str, records: list[dict]) -> None:
    """Replaces ``path`` with ``records``, one JSON object per line, atomically (:func:`cppo.fileio.atomic_write`)."""
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in records))


def rewind_jsonl(path: str, step: int) -> int:
    """Drops the records of the log at ``path`` (if any) logged after ``step``, and a torn last line; returns how many
    records were dropped (the file is rewritten, atomically, only then)."""
    if not os.path.isfile(path):
        return 0
    records = read_jsonl(path)
    kept = [r for r in records if r["step"] <= step]
    if len(kept) < len(records) or _torn(path):
        write_jsonl(path, kept)
    return len(records) - len(kept)


def _torn(path: str) -> bool:
    """Whether the log's last line lacks its newline (a write a kill cut short)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if not f.tell():
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def read_jsonl(path: str) -> list[dict]:
    """The records of the log at ``path``. A torn last line (a run killed mid-write) is dropped with a warning naming
    the file; any other line that is not a JSON object with a ``step`` is a ``ValueError`` naming file and line."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines[: last + 1]):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == last:
                logger.warning("%s: dropped its last line, which is incomplete (a run killed mid-write)", path)
                break
            raise ValueError(f"{path}, line {i + 1}: not a JSON record ({e.msg})") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}, line {i + 1}: not a step record (a JSON object with a 'step')")
        records.append(record)
    return records


def _reward_panel(ax, records: list[dict], title: str) -> None:
    """Reward and accuracy of the sampled training completions per step, a running mean of the reward over a run of
    10 or more steps, and the held-out greedy accuracy (``eval/accuracy``) where the run evaluated. When the reward
    is the accuracy at every step (the format reward never fired) one line carries both, so neither hides the other."""
    steps = [r["step"] for r in records]
    reward, accuracy = [r["reward_mean"] for r in records], [r["accuracy"] for r in records]
    if reward == accuracy:
        ax.plot(steps, reward, label="reward mean = training-batch accuracy (no format reward)", marker=".", alpha=0.6)
    else:
        ax.plot(steps, reward, label="reward mean (training batch)", marker=".", alpha=0.5)
        ax.plot(steps, accuracy, label="accuracy (training batch, sampled)", marker=".", alpha=0.5)
    window = min(10, len(reward) // 5)
    if window >= 2:
        smooth = [sum(reward[max(0, i - window + 1) : i + 1]) / len(reward[max(0, i - window + 1) : i + 1])
                  for i in range(len(reward))]  # fmt: skip
        ax.plot(steps, smooth, label=f"reward, running mean over {window} steps", color="black")
    held = [(r["step"], r["eval/accuracy"]) for r in records if r.get("eval/accuracy") is not None]
    if held:
        ax.plot(*zip(*held), label="held-out accuracy (greedy, test split)", marker="s", color="tab:red")
    ax.set_xlabel("step")
    ax.set_title(f"{title}: reward and accuracy")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)


def plot_run(output_dir: str, *, log_kept: bool, logged: list[dict]) -> None:
    """``output_dir/metrics.png`` over the whole run: from its :data:`LOG_FILE` when the run keeps one (``log_kept``:
    ``report_to`` names ``jsonl``), else from the records this process logged (none: no plot)."""
    log_path = os.path.join(output_dir, LOG_FILE)
    records = read_jsonl(log_path) if log_kept and os.path.isfile(log_path) else logged
    if records:
        plot(records, os.path.join(output_dir, "metrics.png"))


def plot(records: list[dict], path: str, *, title: str = "CPPO") -> str:
    """Two panels: the reward, training-batch accuracy and held-out accuracy per step (:func:`_reward_panel`);
    seconds per phase per step (stacked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    _reward_panel(ax1, records, title)
    ax2.stackplot(steps, *[[r.get(f"time/{p}", 0.0) for r in records] for p in PHASES], labels=PHASES)
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.set_title("time per phase")
    ax2.legend(loc="upper left", fontsize="small")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path
