"""The output folder of a run, opened once before the model loads (:func:`open_run`, for ``cppo train`` and
:meth:`cppo.trainer.Trainer.train` alike): checked writable, locked (one run per folder), never mixed with the run
already there (refused unless resuming or overwriting), cleaned of what a killed save left, and its ``report_to``
sinks built; then the checkpoint a resume continues from, whose saved settings the caller checks."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Collection

from ..distributed import DistInfo, barrier, max_across_ranks
from ..fileio import check_writable, write_json
from . import checkpoint, metrics, rewind
from .lock import RunLock, RunLocked
from .sinks import MetricSink, make_sinks

logger = logging.getLogger(__name__)

#: The files a run writes into its output_dir besides its checkpoint-N folders (folders: report_to's sinks, eval, and
#: stale: what a resume moved aside).
RUN_FILES = ("metrics.jsonl", "metrics.png", "tensorboard", "wandb", rewind.EVAL_FOLDER, rewind.STALE_FOLDER)
EVAL_FOLDER = rewind.EVAL_FOLDER
#: What :func:`open_run` does with a run already in the folder: refuse it (a new run), keep it (``--resume``),
#: delete it once the new run has loaded (``--overwrite``: :meth:`Run.clear`), or look when training starts
#: (``later``: the Python API, whose caller may still load a checkpoint into the trainer).
EXISTING = ("refuse", "resume", "overwrite", "later")


def existing_run(output_dir: str) -> list[str]:
    """The names of a run's files and checkpoints in ``output_dir`` (empty when it holds none)."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(
        name
        for name in os.listdir(output_dir)
        if name in RUN_FILES or checkpoint.CHECKPOINT_RE.match(name.removeprefix(checkpoint.REPLACED_PREFIX))
    )


def refuse_existing_run(output_dir: str) -> None:
    """``ValueError`` naming what ``output_dir`` holds when a run is there: a new run would mix with it."""
    found = existing_run(output_dir)
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise ValueError(
            f"output_dir {output_dir!r} already holds a run ({shown}): pass --resume to continue it, --overwrite to "
            "delete it and start again, or set another output_dir (from Python: another output_dir, or "
            "trainer.load_checkpoint(cppo.run.latest(output_dir)) to continue)"
        )


def _lock_on_rank0(output_dir: str, *, info: DistInfo) -> RunLock | None:
    """Rank 0 takes the lock; every rank learns whether it could (so none waits for a rank that gave up)."""
    lock, refused = None, None
    if info.is_main:
        try:
            lock = RunLock.of(output_dir).acquire()
        except RunLocked as e:
            refused = e
    if max_across_ranks(int(refused is not None), info=info):
        raise refused or RunLocked(f"output_dir {output_dir!r} is in use by another run (rank 0 names it)")
    return lock


def _clean_leftovers(output_dir: str, *, info: DistInfo) -> None:
    """Rank 0 deletes what killed saves left (:func:`cppo.run.checkpoint.remove_leftovers`, and the half-written plot
    or evaluation of a killed atomic write: :func:`cppo.run.rewind.remove_torn_writes`), every rank having looked
    first."""
    barrier(info)  # every rank has looked before rank 0 changes anything
    if info.is_main:
        for name in checkpoint.remove_leftovers(output_dir) + rewind.remove_torn_writes(output_dir):
            logger.warning("%s: cleaned up %s, left by a save that was killed", output_dir, name)
    barrier(info)


def open_run(output_dir: str, *, report_to: list[str], info: DistInfo, existing: str = "refuse") -> Run:
    """Opens ``output_dir`` for one run, before anything loads; every check once: the folder must be writable; rank
    0 builds the ``report_to`` sinks (each checks that it can start: its library, its folder); unless ``existing``
    is ``"later"``, rank 0 takes the folder's run lock (:mod:`cppo.run.lock`: a second run of the folder is refused,
    naming the holder), a run already in the folder is refused unless ``existing`` is ``"resume"`` or
    ``"overwrite"`` (the old run itself goes only in :meth:`Run.clear`, once the new one has loaded), and rank 0
    deletes what killed saves left. Call it on every rank; ``Run.close`` releases what it took."""
    if existing not in EXISTING:
        raise ValueError(f"existing must be one of {EXISTING}, got {existing!r}")
    created = not os.path.isdir(output_dir)  # a run that writes nothing into it removes it again (Run.close)
    check_writable(output_dir)
    sinks = make_sinks(report_to, output_dir) if info.is_main else []
    if existing == "later":
        return Run(output_dir, info=info, sinks=sinks)
    lock = _lock_on_rank0(output_dir, info=info)
    try:
        if existing == "refuse":
            refuse_existing_run(output_dir)
        _clean_leftovers(output_dir, info=info)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Run(output_dir, info=info, sinks=sinks, lock=lock, checked=True, created=created)


class Run:
    """An output folder opened by :func:`open_run`: rank 0's lock and ``report_to`` sinks, and whether a run already
    in the folder has been dealt with. :meth:`start` and :meth:`finish` bracket the training; :meth:`close` releases
    everything (idempotent)."""

    def __init__(
        self,
        output_dir: str,
        *,
        info: DistInfo,
        sinks: list[MetricSink],
        lock: RunLock | None = None,
        checked: bool = False,
        created: bool = False,
    ) -> None:
        self.output_dir, self.info, self.sinks = output_dir, info, sinks
        self._lock, self._own_lock, self._checked, self._created = lock, None, checked, created
        self._sinks_closed = False

    @property
    def sink_names(self) -> list[str]:
        """The names of the sinks still logging (a sink that failed is dropped: :meth:`log`)."""
        return [sink.name for sink in self.sinks]

    def clear(self) -> None:
        """``--overwrite``: rank 0 deletes the old run's files and checkpoints (nothing else in the folder). Called
        after the new run's settings, rewards and model have all loaded, so a typo never costs the old run. Every
        rank."""
        barrier(self.info)
        if self.info.is_main:
            for name in existing_run(self.output_dir):
                checkpoint.remove(os.path.join(self.output_dir, name))
        barrier(self.info)

    def start(self, settings: dict, *, step: int) -> None:
        """Training starts after ``step``: rank 0 holds the run lock (taken now when :func:`open_run` left it for
        later), a new run (``step`` 0) finds no run in the folder (looked at now when it was left for later), and the
        sinks start for a run of ``settings``. A resumed run (``step`` > 0) holds only what it did: rank 0 moves
        aside what the run there wrote after ``step`` (:func:`cppo.run.rewind.move_aside`, said in a warning) and the
        sinks drop what it logged after it."""
        if self.info.is_main and self._lock is None and self._own_lock is None:
            self._own_lock = RunLock.of(self.output_dir).acquire()
        if step == 0 and not self._checked:  # a new run never mixes with one already there (resume or delete it)
            refuse_existing_run(self.output_dir)
        if step and self.info.is_main:  # (the log too whatever report_to says now: it may have changed)
            metrics.rewind_jsonl(os.path.join(self.output_dir, metrics.LOG_FILE), step)
            _move_aside(self.output_dir, step)
        self._checked = True
        self._sinks_closed = False
        for sink in self.sinks:
            sink.start(settings, step=step)

    def log(self, record: dict, step: int) -> None:
        """One step's record to every sink. A sink that fails (an ``OSError`` of a full disk, a sink's own error)
        costs its own output alone: it is closed and dropped with one warning, and the record still reaches the
        sinks after it (``metrics.jsonl`` stays complete) while the training goes on."""
        for sink in list(self.sinks):
            try:
                sink.log(record, step)
            except Exception as e:  # noqa: BLE001  whatever a sink raises: the run and the other sinks go on
                self._drop(sink, e, step)

    def save_evaluation(self, result: dict, step: int) -> dict:
        """Rank 0 writes an evaluation's whole ``result`` (its per-problem records too) to ``eval/step-N.json``,
        atomically (a failed write: one warning, the training goes on); returns it without the records (what the
        sinks log)."""
        if self.info.is_main:
            path = os.path.join(self.output_dir, EVAL_FOLDER, f"step-{step}.json")
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_json(path, {"step": step, **result})
            except OSError as e:
                logger.warning("the evaluation of step %d could not be written to %s (%s): the training goes on",
                               step, path, e)  # fmt: skip
        return {k: v for k, v in result.items() if k != "per_problem"}

    def _drop(self, sink: MetricSink, error: Exception, step: int) -> None:
        self.sinks.remove(sink)
        others = [_shown(s) for s in self.sinks]
        logger.warning(
            "report_to: the %r sink failed at step %d (%s: %s): it logs nothing more in this run; %s and the "
            "training go on", _shown(sink), step, type(error).__name__,
            " ".join(str(error).split()), f"the sinks {others}" if others else "the checkpoints",
        )  # fmt: skip
        with contextlib.suppress(Exception):  # one warning a sink: what it holds is all it can keep
            sink.close()

    def finish(self) -> None:
        """The training ended: the sinks close (one that fails to: a warning), and the lock :meth:`start` took is
        released."""
        for sink in self.sinks if not self._sinks_closed else ():
            _close(sink)
        self._sinks_closed = True
        if self._own_lock is not None:
            self._own_lock.release()
            self._own_lock = None

    def close(self) -> None:
        """:meth:`finish`, and the lock :func:`open_run` took is released. Where no run is in the folder (a command
        that failed before writing anything: a ``--resume`` with no checkpoint to load), its lock file goes too, and
        the folder itself when :func:`open_run` made it: the folder is left as it was."""
        self.finish()
        if self._lock is not None:
            empty = not existing_run(self.output_dir)
            self._lock.release(remove_file=empty)
            self._lock = None
            if empty and self._created:
                with contextlib.suppress(OSError):  # not empty: something else was put there meanwhile
                    os.rmdir(self.output_dir)


def _move_aside(output_dir: str, step: int) -> None:
    """:func:`cppo.run.rewind.move_aside`, said in one warning naming the folder and every path moved."""
    folder, moved = rewind.move_aside(output_dir, step, checkpoints=checkpoint.CHECKPOINT_RE)
    if moved:
        logger.warning(
            "resuming after step %d: moved aside what the run there wrote after that step, to %s: %s", step, folder,
            ", ".join(moved),
        )  # fmt: skip


def _close(sink: MetricSink) -> None:
    """Closes ``sink``; a failure is a warning (what it logged before is all it can keep)."""
    try:
        sink.close()
    except Exception as e:  # noqa: BLE001  a sink's own error: the run's end goes on
        logger.warning("report_to: the %r sink failed to close (%s: %s)", _shown(sink), type(e).__name__, e)


def _shown(sink: MetricSink) -> str:
    return sink.name or type(sink).__name__


def resume_candidates(
    output_dir: str,
    *,
    changes_from: Callable[[dict], list[str]],
    fixed: Collection[str],
    allow_config_change: bool,
    info: DistInfo,
) -> list[str]:
    """The checkpoints a resume may load, newest first: from the newest whose files read (newer ones that do not are
    skipped with a warning naming them) down to the oldest, as fallbacks. Before any model loads.

    ``changes_from(saved)``: what differs between the settings a checkpoint was saved with and the run's, as
    ``"name: saved -> now"`` (``TrainConfig.changes_from``); ``fixed``: the settings among them that no resume can
    apply (``cppo.config.FIXED``).

    Raises:
        ValueError: there is no readable checkpoint, or the newest readable one was saved with settings that change
            the run (each difference named): refused when one is ``fixed``, or when ``allow_config_change`` is false.
        cppo.run.checkpoint.UnsafeCheckpoint: a checkpoint holds more than plain data (never skipped).
    """
    paths = checkpoint.checkpoints(output_dir)
    if not paths:
        raise ValueError(f"--resume: no checkpoint-* folder in output_dir {output_dir!r}")
    for i, path in enumerate(paths):
        try:
            state = checkpoint.verify(path, required=checkpoint.TRAINER_KEYS)
        except checkpoint.CorruptCheckpoint as e:
            if info.is_main:
                logger.warning("--resume: skipping %s: %s", path, e)
            continue
        changes = changes_from(state.get("config", {}))
        refused = [c for c in changes if c.split(":")[0] in fixed]
        if refused:
            raise ValueError(
                f"--resume: {path} was saved with other settings that a resume cannot apply ({'; '.join(refused)}): "
                "the checkpoint's weights and data position belong to those; start a new run (another output_dir) "
                "instead"
            )
        if changes and not allow_config_change:
            raise ValueError(
                f"--resume: {path} was saved with other settings ({'; '.join(changes)}): resume with the saved "
                "settings, or pass --allow-config-change to continue with the new ones"
            )
        return paths[i:]
    raise ValueError(f"--resume: no checkpoint in output_dir {output_dir!r} can be read (see the warnings)")


def resume(trainer, candidates: list[str]) -> str:
    """Loads the first of ``candidates`` that loads into ``trainer`` (see :func:`resume_candidates`), warning about
    each one skipped; returns its path. A checkpoint that fails part-way is overwritten whole by the next one."""
    for path in candidates:
        try:
            trainer.load_checkpoint(path)
            return path
        except checkpoint.CorruptCheckpoint as e:
            if trainer.info.is_main:
                logger.warning("--resume: skipping %s: %s", path, e)
    raise ValueError(f"--resume: none of {candidates} could be loaded (see the warnings)")
