"""Fixtures of the kernel tests: ``small_chunks`` (the torch backend's blocks as small as the test shapes need)."""

from loss_cases import small_chunks  # noqa: F401  (a fixture: used by name)
