"""The TRL drop-in's tests need trl (the ``trl`` extra, which the ``test`` extra installs): skipped without it."""

import importlib.util

import pytest
from pruning_counter import constructions  # noqa: F401  (a fixture: every Pruning a test builds)

collect_ignore_glob = [] if importlib.util.find_spec("trl") and importlib.util.find_spec("peft") else ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny Qwen2 saved to disk once per session (TRL rebuilds the reference model from the path)."""
    from trl_tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def ragged_tiny_model(tmp_path_factory) -> str:
    """The tiny Qwen2 whose generation also stops at 40 more tokens than its EOS (its ``generation_config``'s
    ``eos_token_id``, which TRL's completion mask reads too): a random tiny model's completions then end at
    different lengths (about 1 in 8 tokens ends one), where the tiny model's own run to ``max_completion_length``."""
    from transformers import GenerationConfig
    from trl_tiny import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-ragged"))
    config = GenerationConfig.from_pretrained(path)
    config.eos_token_id = [config.eos_token_id, *range(100, 140)]
    config.save_pretrained(path)
    return path
