"""The TRL drop-in's tests need trl (the ``trl`` extra, which the ``test`` extra installs): skipped without it."""

import importlib.util

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("trl") and importlib.util.find_spec("peft") else ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny Qwen2 saved to disk once per session (TRL rebuilds the reference model from the path)."""
    from trl_tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))
