"""A fixture that records every :class:`cppo.step.Pruning` built while a test runs (imported by the tests that check
the policy is built once per config)."""

from __future__ import annotations

import pytest

from cppo.step import Pruning


@pytest.fixture
def constructions(monkeypatch) -> list[Pruning]:
    """Every Pruning built while the test runs."""
    built, validate = [], Pruning.__post_init__

    def counted(self):
        validate(self)
        built.append(self)

    monkeypatch.setattr(Pruning, "__post_init__", counted)
    return built
