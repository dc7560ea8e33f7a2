"""Rollout engines behind one interface, picked by name (``rollout_backend``: ``auto``, ``hf``, ``vllm`` or any
registered name; ``cppo eval --rollout-backend``).

A new engine (SGLang, a vLLM server, ...) is one file: a :class:`RolloutEngine` subclass with ``generate`` and
``sync_weights``, and one ``register_engine("name", EngineClass)`` in it, imported below (or by the user's code
before the config is built).
"""

from .base import (
    EngineFactory,
    EngineSettings,
    Rollout,
    RolloutEngine,
    available_engines,
    check_engine_installed,
    check_engine_name,
    cut_after_eos,
    encode_prompts,
    engine_supports,
    eos_ids,
    make_engine,
    register_engine,
    resolve_engine_name,
)
from .hf import HFEngine  # importing an engine's module registers it
from .prefill import generate_prefilled_once, prefill_once_applies, prefilled_once
from .stopping import PartialRollout, Stopper, checkpoint_tokens
from .vllm import VLLMEngine, engine_parameter_names, quiet_logs, tied_weights  # vLLM: imported when built

__all__ = [
    "EngineFactory",
    "EngineSettings",
    "HFEngine",
    "PartialRollout",
    "Rollout",
    "RolloutEngine",
    "Stopper",
    "VLLMEngine",
    "available_engines",
    "checkpoint_tokens",
    "check_engine_installed",
    "check_engine_name",
    "cut_after_eos",
    "encode_prompts",
    "engine_parameter_names",
    "engine_supports",
    "eos_ids",
    "generate_prefilled_once",
    "make_engine",
    "prefill_once_applies",
    "prefilled_once",
    "quiet_logs",
    "register_engine",
    "resolve_engine_name",
    "tied_weights",
]
