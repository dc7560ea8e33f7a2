"""Checkpoints: model (``save_pretrained``), tokenizer, and trainer state, written atomically.

Layout: ``output_dir/checkpoint-{step:06d}/`` with ``model/`` (weights and tokenizer, loadable by
``from_pretrained``) and ``trainer_state.pt`` (optimizer, scheduler, RNG states, data position, step, config).
The folder is written under a temporary name and moved into place with ``os.replace``, so a run killed mid-save
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import random
import re
import shutil

import numpy as np
import torch

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: str, *, model, tokenizer, state: dict) -> str:
    """Writes a checkpoint folder at ``path`` atomically (temp folder + ``os.replace``)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{os.path.basename(path)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model.save_pretrained(os.path.join(tmp, "model"))
    tokenizer.save_pretrained(os.path.join(tmp, "model"))
    torch.save({**state, "rng": rng_state()}, os.path.join(tmp, "trainer_state.pt"))
    if os.path.exists(path):
        old = f"{tmp}-old"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)
    return path


def load_state(path: str) -> dict:
    """The trainer state of a checkpoint folder (restore the model from ``path/model``)."""
    file = os.path.join(path, "trainer_state.pt")
    if not os.path.isfile(file):
        raise ValueError(f"checkpoint {path!r} has no trainer_state.pt")
    return torch.load(file, map_location="cpu", weights_only=False)


def latest(output_dir: str) -> str | None:
    """The checkpoint folder with the highest step in ``output_dir``, or None."""
    if not os.path.isdir(output_dir):
        return None
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := CHECKPOINT_RE.match(name))]
    return os.path.join(output_dir, max(found)[1]) if found else None
