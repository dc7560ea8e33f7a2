"""One run per ``output_dir``: an exclusive lock taken before anything is written and held until the process exits.

The lock is ``output_dir/.cppo-run.lock``, held with ``flock`` (Linux and macOS; on NFS v4 it maps to a byte-range
lock the server enforces across nodes). The kernel drops it when its holder exits *in any way*, SIGKILL included,
so a lock whose holder died is stale by construction: the next run takes it over (after saying so), and no killed run
can leave a folder that cannot be resumed. The file's content names the holder (PID, host, start time, command) so
that a refused run can say who holds the folder. Under torchrun rank 0 takes it, before the other ranks start work.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import sys

try:
    import fcntl
except ImportError:  # Windows: no flock; the folder is then not protected
    fcntl = None

logger = logging.getLogger(__name__)

LOCK_NAME = ".cppo-run.lock"


class RunLocked(ValueError):
    """``output_dir`` is in use by another live run."""


class RunLock:
    """The lock of one ``output_dir`` (see the module docstring); :meth:`acquire` then :meth:`release` (or use it as a
    context manager). Re-entrant within a process: the trainer and the CLI may both ask for it."""

    _held: dict[str, RunLock] = {}  # realpath -> the lock this process holds on it

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.fd: int | None = None
        self.depth = 0

    @classmethod
    def of(cls, output_dir: str) -> RunLock:
        """This process's lock object for ``output_dir`` (one per folder, so that acquiring twice nests)."""
        key = os.path.realpath(output_dir)
        if key not in cls._held:
            cls._held[key] = cls(output_dir)
        return cls._held[key]

    def acquire(self) -> RunLock:
        """Takes the lock; ``RunLocked`` naming the holder when another live process has it."""
        if self.depth:
            self.depth += 1
            return self
        os.makedirs(self.output_dir, exist_ok=True)
        for _ in range(100):  # a holder may remove the file between our open and our flock: lock the one at the path
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunLocked(
                    f"output_dir {self.output_dir!r} is in use by another run ({holder}): wait for it to end or stop "
                    "it, or set another output_dir"
                ) from None
            if _is_at_path(fd, self.path):
                break
            os.close(fd)
        else:
            raise RunLocked(f"output_dir {self.output_dir!r}: its lock file keeps being removed by another process")
        previous = _read_holder(fd, default="")
        if previous:  # the lock was free, so its last holder is gone without releasing: a killed run
            logger.warning(
                "%s: took over the lock of a run that ended without releasing it (%s)", self.output_dir, previous
            )
        _write_holder(fd)
        self.fd, self.depth = fd, 1
        return self

    def release(self, *, remove_file: bool = False) -> None:
        """Releases the lock (the outermost release of a nested acquire): the file is left empty (released on
        purpose, not by a killed run), or with ``remove_file`` removed, while still held (a folder where the run
        wrote nothing keeps no lock file; a process that opened it meanwhile locks the file at the path instead)."""
        if not self.depth:
            return
        self.depth -= 1
        if self.depth or self.fd is None:
            return
        if remove_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        else:
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # drops the flock
        self.fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_free(output_dir: str) -> None:
    """``RunLocked`` naming the holder when a live run holds ``output_dir``; creates and writes nothing (dry runs)."""
    path = os.path.join(output_dir, LOCK_NAME)
    if fcntl is None or RunLock.of(output_dir).depth or not os.path.isfile(path):
        return
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunLocked(f"output_dir {output_dir!r} is in use by another run ({_read_holder(fd)})") from None
    finally:
        os.close(fd)  # drops the shared lock, if taken


def _is_at_path(fd: int, path: str) -> bool:
    """Whether the open file ``fd`` is still the one at ``path`` (not removed or replaced since it was opened)."""
    try:
        here, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read_holder(fd: int, default: str = "a process whose details cannot be read") -> str:
    """The holder recorded in the lock file, as words: ``PID 123 on host h, started 2026-12-01T20:00:00Z``."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 4096)
        holder = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return default
    if not isinstance(holder, dict):
        return default
    return f"PID {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def _write_holder(fd: int) -> None:
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:500],
    }
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(holder).encode() + b"\n")
    os.fsync(fd)
