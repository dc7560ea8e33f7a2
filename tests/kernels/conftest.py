"""Fixtures of the kernel tests: ``small_chunks`` (the torch backend's blocks as small as the test shapes need) and
``loss_path`` (a test once per CPU path of the fused loss)."""

from loss_cases import loss_path, small_chunks  # noqa: F401  (fixtures: used by name)
