"""Whether the model and the data a run names exist, checked before anything loads (the trainer, ``cppo train
--dry-run`` and ``cppo eval``): ``ValueError`` naming the setting."""

from __future__ import annotations

import os

from ..fileio import shown_path
from .choices import DATASETS, DTYPES, HUB_ID_RE, TINY_MODELS
from .values import did_you_mean, naming


def check_model_and_data(
    *,
    model: str,
    dataset: str,
    dataset_path: str | None = None,
    model_config: dict | None = None,
    dtype: str = "float32",
    device: str = "auto",
) -> None:
    """Whether the model and the data exist, checked before anything loads (the trainer, ``cppo train --dry-run`` and
    ``cppo eval`` call it; it reads the file system and imports transformers for a tiny model's config):
    ``ValueError`` naming the setting."""
    from cppo_kernels.config import check_choice

    from ..distributed import check_device

    with naming("dtype"):
        check_choice("dtype", dtype, DTYPES)
    with naming("device"):
        check_device(device)
    with naming("dataset_path"):
        if dataset_path is not None and not os.path.exists(dataset_path):
            raise ValueError(f"dataset_path {shown_path(dataset_path)} does not exist")
    with naming("dataset"):
        _check_dataset(dataset)
    with naming("model"):
        _check_model(model)
    with naming("model_config"):
        if model_config is not None and not model.startswith("tiny-"):
            raise ValueError("model_config (overrides of the tiny model's config) only applies to a tiny-* model")
        if model_config is not None:
            check_tiny_config(model_config)


def _check_dataset(dataset: str) -> None:
    if dataset.endswith(".jsonl") and not os.path.isfile(dataset):
        raise ValueError(f"dataset file {shown_path(dataset)} does not exist")
    if not (dataset in DATASETS or dataset.endswith(".jsonl") or ("/" in dataset and HUB_ID_RE.match(dataset))):
        raise ValueError(
            f"dataset {dataset!r} is unknown{did_you_mean(dataset, DATASETS)}: use one of {DATASETS}, a .jsonl file "
            "or a hub dataset owner/name"
        )


def _check_model(model: str) -> None:
    if model.endswith(".gguf") and not os.path.isfile(model):
        raise ValueError(f"model file {shown_path(model)} does not exist")
    if model.startswith("tiny-") and model not in TINY_MODELS:
        raise ValueError(f"model {model!r}: the tiny models are {TINY_MODELS}")
    if not (model.startswith("tiny-") or os.path.exists(model) or HUB_ID_RE.match(model)):
        raise ValueError(
            f"model {shown_path(model)} does not exist (not a local folder or file, nor a hub name owner/name)"
        )
    owner = model.split("/", 1)[0]
    if "/" in model and not os.path.exists(model) and os.path.isdir(owner):  # a mistyped local path, not a hub name
        raise ValueError(
            f"model {shown_path(model)} does not exist ({owner}/ is a folder here, so this names a local path, not a "
            "hub model)"
        )


def check_tiny_config(model_config: dict) -> None:
    """``ValueError`` naming the keys of ``model_config`` that Qwen2's config does not know (they would be ignored)."""
    from transformers import Qwen2Config

    known = set(Qwen2Config().to_dict())
    try:
        built = set(Qwen2Config(**model_config).to_dict())
    except (TypeError, ValueError) as e:
        raise ValueError(f"model_config: {e}") from None
    unknown = sorted(set(model_config) & (built - known))  # an unknown key is kept as an extra attribute
    if unknown:
        raise ValueError(
            f"model_config: unknown key {unknown[0]!r}{did_you_mean(unknown[0], known)}: the keys are those of "
            "transformers' Qwen2Config"
        )
