"""The output folder of a run: checked writable before the model loads, never shared by two runs (refused unless
resuming or overwriting), cleaned of what a killed save left, and the checkpoint a resume continues from, whose
saved settings must be the run's."""

from __future__ import annotations

import dataclasses
import logging
import os

from . import checkpoint
from .config import TrainConfig
from .distributed import DistInfo, barrier, max_across_ranks
from .fileio import check_writable
from .runlock import RunLock, RunLocked

logger = logging.getLogger(__name__)

#: The files a run writes into its output_dir besides its checkpoint-N folders (the folders: report_to's sinks).
RUN_FILES = ("metrics.jsonl", "metrics.png", "tensorboard", "wandb")
#: Settings a resume may change without --allow-config-change: where and how often the run writes and evaluates,
#: its length (with a decaying lr_schedule, a new length reshapes the remaining schedule), and how (not what) it
#: computes. Any other difference changes the run.
RESUMABLE = frozenset(
    {"output_dir", "num_steps", "num_epochs", "save_every", "log_every", "eval_every", "eval_limit", "preset"}
    | {"report_to"}
    | {"device", "kernel_backend", "micro_batch_tokens", "parallelism", "gradient_checkpointing", "max_skipped_updates"}
)


#: Settings a resume cannot apply, even with --allow-config-change: the weights are of that model, the data
#: position of that question list.
FIXED = frozenset({"model", "model_config", "dataset", "dataset_path", "max_questions"})
#: LoRA: the checkpoint holds an adapter of that shape (or a full model), which only such a policy loads.
FIXED |= {"use_peft", "lora_r", "lora_target_modules"}


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
            "delete it and start again, or set another output_dir"
        )


def prepare(output_dir: str, *, resume: bool, overwrite: bool, info: DistInfo) -> RunLock | None:
    """Before anything loads: ``output_dir`` must be writable, rank 0 takes its run lock (:mod:`cppo.runlock`: a
    second run or resume of the folder is refused, naming the holder) and, unless ``resume`` or ``overwrite``, the
    folder must hold no run. Then rank 0 deletes what killed saves left (:func:`cppo.checkpoint.remove_leftovers`).
    The old run itself goes only in :func:`clear_run`, once the new one has loaded. Call it on every rank; rank 0
    gets the lock (held until it is released or the process exits), the others None."""
    if resume and overwrite:
        raise ValueError("--resume continues the run in output_dir and --overwrite deletes it: pass one of them")
    check_writable(output_dir)
    lock = _lock_on_rank0(output_dir, info=info)
    try:
        _check_and_clean(output_dir, fresh=not (resume or overwrite), info=info)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


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


def _check_and_clean(output_dir: str, *, fresh: bool, info: DistInfo) -> None:
    if fresh:
        refuse_existing_run(output_dir)
    barrier(info)  # every rank has looked before rank 0 changes anything
    if info.is_main:
        for name in checkpoint.remove_leftovers(output_dir):
            logger.warning("%s: cleaned up %s, left by a save that was killed", output_dir, name)
    barrier(info)


def clear_run(output_dir: str, *, info: DistInfo) -> None:
    """``--overwrite``: rank 0 deletes the old run's files and checkpoints (nothing else in the folder). Called after
    the new run's settings, rewards and model have all loaded, so a typo never costs the old run. Every rank."""
    barrier(info)
    if info.is_main:
        for name in existing_run(output_dir):
            checkpoint.remove(os.path.join(output_dir, name))
    barrier(info)


def run_changes(saved: dict, config: TrainConfig) -> list[str]:
    """What differs between the settings a checkpoint was saved with (``saved``: ``TrainConfig.to_dict()``) and
    ``config``, except the :data:`RESUMABLE` ones: ``"name: saved -> now"`` each. A setting the checkpoint predates
    counts as its default."""
    changes, defaults = [], TrainConfig().to_dict()
    for f in dataclasses.fields(TrainConfig):
        if f.name in RESUMABLE:
            continue
        was, now = saved.get(f.name, defaults[f.name]), getattr(config, f.name)
        if was != now:
            changes.append(f"{f.name}: {was!r} -> {now!r}")
    return changes


def resume_candidates(config: TrainConfig, *, allow_config_change: bool, info: DistInfo) -> list[str]:
    """The checkpoints a resume may load, newest first: from the newest whose files read (newer ones that do not are
    skipped with a warning naming them) down to the oldest, as fallbacks. Before any model loads.

    Raises:
        ValueError: there is no readable checkpoint, or the newest readable one was saved with settings that change
            the run (each difference named) and ``allow_config_change`` is false.
        cppo.checkpoint.UnsafeCheckpoint: a checkpoint holds more than plain data (never skipped).
    """
    paths = checkpoint.checkpoints(config.output_dir)
    if not paths:
        raise ValueError(f"--resume: no checkpoint-* folder in output_dir {config.output_dir!r}")
    for i, path in enumerate(paths):
        try:
            state = checkpoint.verify(path, required=checkpoint.TRAINER_KEYS)
        except checkpoint.CorruptCheckpoint as e:
            if info.is_main:
                logger.warning("--resume: skipping %s: %s", path, e)
            continue
        changes = run_changes(state.get("config", {}), config)
        fixed = [c for c in changes if c.split(":")[0] in FIXED]
        if fixed:
            raise ValueError(
                f"--resume: {path} was saved with other settings that a resume cannot apply ({'; '.join(fixed)}): the "
                "checkpoint's weights and data position belong to those; start a new run (another output_dir) instead"
            )
        if changes and not allow_config_change:
            raise ValueError(
                f"--resume: {path} was saved with other settings ({'; '.join(changes)}): resume with the saved "
                "settings, or pass --allow-config-change to continue with the new ones"
            )
        return paths[i:]
    raise ValueError(f"--resume: no checkpoint in output_dir {config.output_dir!r} can be read (see the warnings)")


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
