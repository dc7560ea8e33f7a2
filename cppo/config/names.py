"""A sequence of names read from a registry each time it is used (the settings' ``dataset`` choices, the task kinds'
names): torch-free, so the settings can hold one without importing the registry that fills it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

__all__ = ["Names"]


class Names(Sequence):
    """A tuple of names read from a registry each time it is used (``names``: a function giving them), so that
    names registered after import count too: :data:`DATASETS` here, the task kinds' ``KINDS`` and ``DATASETS`` in
    :mod:`cppo.tasks.registry`. Compares and prints as the tuple (compared with a sequence: as a tuple of it)."""

    def __init__(self, names: Callable[[], tuple[str, ...]]) -> None:
        self._names = names

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __eq__(self, other) -> bool:
        return self._names() == (tuple(other) if isinstance(other, Sequence) and not isinstance(other, str) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._names())
