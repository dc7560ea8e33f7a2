"""What can be wrong with a checkpoint on disk: the exceptions :mod:`cppo.run.checkpoint` and :mod:`cppo.run.shard_io`
raise (a module of their own, so that neither imports the other for them)."""

from __future__ import annotations

__all__ = ["CorruptCheckpoint", "UnsafeCheckpoint", "first_line"]


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files are missing, empty or truncated (e.g. a disk that filled up); a resume skips it."""


class UnsafeCheckpoint(ValueError):
    """A checkpoint file holding objects other than tensors and plain data: loading it could run code."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), for one-line errors."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
