"""Metric sinks, chosen by ``report_to`` (the name TRL and transformers use): each is one small class in a registry
that imports its library inside it, as transformers' ``INTEGRATION_TO_CALLBACK``.

- ``jsonl``: ``output_dir/metrics.jsonl``, one JSON object per logged step, rewritten atomically; a resumed run
  drops what a killed run logged after the checkpoint it resumes from (and a torn last line).
- ``tensorboard``: event files under ``output_dir/tensorboard/`` (``torch.utils.tensorboard.SummaryWriter``); a
  resumed run purges the events a killed run wrote after its checkpoint (``purge_step``).
- ``wandb``: a Weights & Biases run under ``output_dir/wandb/``, offline unless ``WANDB_MODE`` says otherwise (a
  resumed run is a new wandb run, logging from the resumed step on).
- ``none``: nothing (the progress bar and ``metrics.png`` are drawn whatever ``report_to`` says).

Only rank 0 has sinks. A sink is built (its library imported, its folder checked) before the model loads, started
when training starts and closed when it ends; tensorboard and wandb skip metrics that are not numbers. A sink that
fails while the run logs (a full disk, an unwritable events file, a sink's own error) is dropped with one warning
(:meth:`cppo.run.folder.Run.log`): the run and the other sinks go on.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod

from ..fileio import check_writable
from . import metrics

__all__ = [
    "MetricSink",
    "JsonlSink",
    "TensorBoardSink",
    "WandbSink",
    "register_sink",
    "available_sinks",
    "check_report_to",
    "make_sinks",
    "scalars",
]


class MetricSink(ABC):
    """One destination of the step metrics. Building it checks that it can start (its library is importable and its
    folder writable) and raises a ``ValueError`` naming ``report_to`` otherwise; it writes nothing before
    :meth:`start`."""

    #: The name ``report_to`` built it by (set by :func:`make_sinks`), for messages.
    name: str = ""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir

    @abstractmethod
    def start(self, settings: dict, *, step: int) -> None:
        """Opens the sink for a run of ``settings`` (``TrainConfig.to_dict()``) that continues after ``step`` (0: a
        new run)."""

    @abstractmethod
    def log(self, record: dict, step: int) -> None:
        """Writes one step's metrics."""

    @abstractmethod
    def close(self) -> None:
        """Flushes and releases what :meth:`start` opened; safe to call when it never started."""


def scalars(record: dict) -> dict[str, float]:
    """The metrics of ``record`` that are numbers (bools as 0 / 1), without ``step``; None and other values skipped."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


def _check_folder(output_dir: str, name: str, folder: str) -> str:
    """``output_dir/folder``, or a ``ValueError`` naming ``report_to`` when it cannot be written (nothing created)."""
    path = os.path.join(output_dir, folder)
    try:
        check_writable(path, create=False)
    except ValueError as e:
        raise ValueError(f"report_to: {name!r} writes to {path!r}, which cannot be written ({e})") from None
    return path


def _import(name: str, module: str, package: str) -> None:
    """Imports ``module``, or a ``ValueError`` naming ``report_to`` and the package to install."""
    try:
        __import__(module)
    except ImportError as e:
        raise ValueError(
            f"report_to: {name!r} needs the {package} package ({e}): pip install {package} (or cppo-kernels[report])"
        ) from None


class JsonlSink(MetricSink):
    """``output_dir/metrics.jsonl``: the run's records, one JSON object a line, each appended and fsynced (a log
    grows by a line a step: rewriting it whole would cost the square of the run's length). A kill can tear only the
    last line, which :func:`cppo.run.metrics.read_jsonl` drops; a resume first rewrites the log atomically up to its
    checkpoint (:func:`cppo.run.metrics.write_jsonl`)."""

    FILE = metrics.LOG_FILE

    def __init__(self, output_dir: str) -> None:
        super().__init__(output_dir)
        self.path = os.path.join(output_dir, self.FILE)

    def start(self, settings: dict, *, step: int) -> None:
        """Keeps the log's records up to ``step``: a resumed run drops what a killed run logged after its
        checkpoint, and a torn last line."""
        metrics.rewind_jsonl(self.path, step)

    def log(self, record: dict, step: int) -> None:
        metrics.append_jsonl(self.path, record)

    def close(self) -> None:
        """Nothing to release: every line is on disk once logged."""


class TensorBoardSink(MetricSink):
    """Scalars in TensorBoard event files under ``output_dir/tensorboard/``, one tag per metric (``time/step``
    ...), the step as TensorBoard's global step."""

    FOLDER = "tensorboard"

    def __init__(self, output_dir: str) -> None:
        super().__init__(output_dir)
        _import("tensorboard", "torch.utils.tensorboard", "tensorboard")
        self.log_dir = _check_folder(output_dir, "tensorboard", self.FOLDER)
        self.writer = None

    def start(self, settings: dict, *, step: int) -> None:
        """Opens a writer; after ``step`` > 0 (a resume) TensorBoard discards the older files' events past it."""
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_thread()
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=step + 1 if step else None)

    def log(self, record: dict, step: int) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _quiet_tensorboard_thread() -> None:
    """TensorBoard's writer thread hands a write error (a full disk) to its writer, which raises it at the next
    :meth:`TensorBoardSink.log` (the sink's failure: one warning, :meth:`cppo.run.folder.Run.log`), and re-raises it
    too: a thread's traceback on stderr that says nothing more. A ``threading.excepthook`` (installed once) drops that
    one and passes every other thread's exception on."""
    previous = threading.excepthook
    if getattr(previous, "cppo_quiet_tensorboard", False):
        return

    def hook(args) -> None:
        handed_on = getattr(args.thread, "exception", None) is args.exc_value
        if not (handed_on and type(args.thread).__module__.startswith("tensorboard.summary.writer")):
            previous(args)

    hook.cppo_quiet_tensorboard = True
    threading.excepthook = hook


class WandbSink(MetricSink):
    """A Weights & Biases run in ``output_dir/wandb/``: ``mode="offline"`` unless ``WANDB_MODE`` is set (``wandb
    sync`` uploads an offline run later), project ``$WANDB_PROJECT`` or ``cppo``, the run's settings as its config."""

    def __init__(self, output_dir: str) -> None:
        super().__init__(output_dir)
        _import("wandb", "wandb", "wandb")
        _check_folder(output_dir, "wandb", "wandb")
        self.run = None

    def start(self, settings: dict, *, step: int) -> None:
        import wandb

        self.run = wandb.init(
            dir=self.output_dir,
            mode=os.environ.get("WANDB_MODE") or "offline",
            project=os.environ.get("WANDB_PROJECT") or "cppo",
            name=os.path.basename(os.path.abspath(self.output_dir)),
            config=settings,
        )

    def log(self, record: dict, step: int) -> None:
        self.run.log(scalars(record), step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


_SINKS: dict[str, type[MetricSink]] = {}
#: The built-in sinks' names (set below, once they are registered), which :func:`register_sink` may not replace.
_BUILT_IN: frozenset[str] = frozenset()


def register_sink(name: str, sink: type[MetricSink]) -> None:
    """Makes ``report_to: [name]`` build ``sink(output_dir)``: a name your code registered again is replaced; a
    built-in sink's name is refused (a resume rewinds ``metrics.jsonl`` and the plot reads it: ``jsonl`` is the
    built-in's)."""
    if not isinstance(name, str) or not name or name == "none":
        raise ValueError(f"register_sink: name must be a non-empty string other than 'none', got {name!r}")
    if name in _BUILT_IN:
        raise ValueError(f"register_sink: {name!r} is a built-in sink: register yours under another name")
    if not (isinstance(sink, type) and issubclass(sink, MetricSink)):
        raise ValueError(f"register_sink: sink of {name!r} must be a MetricSink subclass, got {sink!r}")
    _SINKS[name] = sink


def available_sinks() -> tuple[str, ...]:
    """The registered sink names (``report_to`` also takes ``none``)."""
    return tuple(_SINKS)


def check_report_to(names: list[str]) -> list[str]:
    """``names`` when ``report_to`` may take them: registered sinks, each once, or ``none`` alone; else a
    ``ValueError`` naming ``report_to``."""
    choices = (*available_sinks(), "none")
    if not names:
        raise ValueError(f"report_to must name at least one of {choices} (none: no sink), got []")
    for name in names:
        if not isinstance(name, str) or name not in choices:
            raise ValueError(f"report_to must list names of {choices}, got {name!r} in {names!r}")
    if len(set(names)) != len(names) or ("none" in names and len(names) > 1):
        raise ValueError(f"report_to must name each sink once, or be [none] alone, got {names!r}")
    return names


def make_sinks(report_to: list[str], output_dir: str) -> list[MetricSink]:
    """The sinks ``report_to`` names (as :func:`check_report_to` accepted it when the settings were built), each
    built for ``output_dir``, which checks that it can start; not yet started."""
    sinks = []
    for name in report_to:
        if name != "none":
            sinks.append(_sink_class(name)(output_dir))
            sinks[-1].name = name
    return sinks


def _sink_class(name: str) -> type[MetricSink]:
    if name not in _SINKS:
        raise ValueError(f"report_to: no sink is registered as {name!r}; the sinks are {available_sinks()}")
    return _SINKS[name]


register_sink("jsonl", JsonlSink)
register_sink("tensorboard", TensorBoardSink)
register_sink("wandb", WandbSink)
_BUILT_IN = frozenset(_SINKS)
