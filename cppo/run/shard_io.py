"""Reading FSDP2 checkpoint shards (``torch.distributed.checkpoint``) without running code: DCP unpickles its
``.metadata`` with plain ``pickle`` and its non-tensor entries with ``torch.load(weights_only=False)``; the reader and
planner here allow only the classes that metadata holds and plain data in the entries (:func:`load_shards`)."""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

from .errors import CorruptCheckpoint, UnsafeCheckpoint, first_line

#: Globals DCP's metadata pickles besides its own ``torch.distributed.checkpoint.metadata`` classes and dtypes.
ALLOWED_GLOBALS = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "Path"),
    }
)


class RefusedGlobal(pickle.UnpicklingError):
    """A global the metadata may not name (its other unpickling errors are a torn or corrupt file)."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP's metadata classes, ``torch`` dtypes and :data:`ALLOWED_GLOBALS`."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in ALLOWED_GLOBALS or module == "torch.distributed.checkpoint.metadata":
            return super().find_class(module, name)
        raise RefusedGlobal(f"global {module}.{name} is not allowed in checkpoint shard metadata")


def read_metadata(folder: str):
    """The DCP ``Metadata`` of a shard folder. ``UnsafeCheckpoint`` when it holds other globals, ``CorruptCheckpoint``
    when it is missing or unreadable."""
    file = os.path.join(folder, ".metadata")
    try:
        with open(file, "rb") as f:
            return MetadataUnpickler(f).load()
    except RefusedGlobal as e:
        raise UnsafeCheckpoint(f"{file!r}: {e}; refused to load it, as that could run code") from None
    except (pickle.UnpicklingError, EOFError, OSError, AttributeError, TypeError, ValueError) as e:  # torn, corrupt
        raise CorruptCheckpoint(f"{file!r} cannot be read ({type(e).__name__}: {first_line(e)})") from None


class SafeShardReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_metadata` instead of ``pickle.load``."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that refuses a non-tensor entry holding more than plain data: each is read with
    ``weights_only=True`` first; the parent then reads the same bytes, now known to hold only plain data."""

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpoint(f"shard entry {read_item.dest_index.fqn!r}: {first_line(e)}") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def load_shards(state: dict, folder: str) -> None:
    """``dcp.load(state)`` from ``folder`` through :class:`SafeShardReader` and :class:`SafeLoadPlanner`, on every
    rank. DCP gathers every rank's failure into a ``CheckpointException`` (a ``BaseException``): an unsafe entry
    comes back as :class:`UnsafeCheckpoint`, anything else as :class:`CorruptCheckpoint` naming the folder."""
    try:
        dcp.load(state, storage_reader=SafeShardReader(folder), planner=SafeLoadPlanner())
    except CheckpointException as e:
        errors = [failure[0] if isinstance(failure, tuple) else failure for failure in e.failures.values()]
        unsafe = [err for err in errors if isinstance(err, UnsafeCheckpoint)]
        if unsafe:
            raise unsafe[0] from None
        raise CorruptCheckpoint(f"{folder!r} cannot be read: {first_line(errors[0]) if errors else e}") from None
