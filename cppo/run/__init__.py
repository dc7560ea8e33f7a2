"""The life of a run on disk: its output folder opened once (folder.py) under a lock (lock.py), checkpoints written
atomically and read without running code (checkpoint.py, shard_io.py, errors.py), the report_to sinks (sinks.py),
the step metrics, their log and plot (metrics.py), and stopping at a safe point on a signal (interrupt.py)."""

from .checkpoint import STATE_FILE, TRAINER_KEYS, CheckpointWriteError, latest, model_folder, read_state  # noqa: I001
from .checkpoint import load as load_checkpoint, save as save_checkpoint
from .errors import CorruptCheckpoint, UnsafeCheckpoint
from .folder import RUN_FILES, Run, existing_run, open_run, refuse_existing_run, resume, resume_candidates
from .interrupt import Interrupted, StopSignals
from .lock import RunLock, RunLocked, check_free
from .metrics import PHASES, PhaseTimer, metric_reduction, plot, plot_run, read_jsonl
from .sinks import (
    JsonlSink, MetricSink, TensorBoardSink, WandbSink, available_sinks, check_report_to, make_sinks, register_sink,
)  # fmt: skip

__all__ = [
    "STATE_FILE", "TRAINER_KEYS", "CheckpointWriteError", "latest", "model_folder", "read_state", "load_checkpoint",
    "save_checkpoint", "CorruptCheckpoint", "UnsafeCheckpoint", "RUN_FILES", "Run", "existing_run", "open_run",
    "refuse_existing_run", "resume", "resume_candidates", "Interrupted", "StopSignals", "RunLock", "RunLocked",
    "check_free", "PHASES", "PhaseTimer", "metric_reduction", "plot", "plot_run", "read_jsonl", "JsonlSink",
    "MetricSink", "TensorBoardSink", "WandbSink", "available_sinks", "check_report_to", "make_sinks", "register_sink",
]  # fmt: skip
