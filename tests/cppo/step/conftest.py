"""The selection-policy tests' shared fixture."""

from pruning_counter import constructions  # noqa: F401  (a fixture: every Pruning a test builds)
