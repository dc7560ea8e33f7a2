"""Checkpoints of a run: one :func:`save` / :func:`load` pair for every format (single process, DDP, FSDP2 shards),
written atomically.

Layout of ``output_dir/checkpoint-{step:06d}/``:

- single process and DDP: ``model/`` (weights and tokenizer, loadable by ``from_pretrained`` and by ``cppo eval``)
  and ``trainer_state.pt`` (the caller's state, e.g. step, data position and config, plus world size, optimizer,
  scheduler and RNG states), both written by rank 0;
- FSDP2: ``dcp/`` (every rank's shards of the model and optimizer, through ``torch.distributed.checkpoint``) and
  ``trainer_state.pt`` (the same without the optimizer); it resumes at the world size that wrote it.

The folder is written under a temporary name beside it and moved into place with ``os.replace`` once every rank
has written, so a run killed mid-save leaves the previous checkpoint intact. Several nodes need a shared filesystem.
"""

from __future__ import annotations

import glob
import os
import random
import re
import shutil

import numpy as np
import torch

from .distributed import DistInfo, barrier
from .parallel import is_fsdp2, unwrap_model

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
MODEL_DIR = "model"  # save_pretrained weights and tokenizer (single process, DDP)
SHARDS_DIR = "dcp"  # torch.distributed.checkpoint shards of the model and optimizer (FSDP2)
STATE_FILE = "trainer_state.pt"


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


def save(
    path: str,
    *,
    module: torch.nn.Module,
    tokenizer,
    optimizer: torch.optim.Optimizer,
    scheduler,
    state: dict,
    info: DistInfo,
) -> str:
    """Writes a checkpoint folder at ``path`` atomically; call it on every rank.

    Args:
        module: the model as :func:`cppo.parallel.wrap_model` returned it (FSDP2 modules are saved as shards).
        tokenizer: saved beside the full model.
        state: the caller's plain dict (e.g. step, data position, config); :func:`load` returns it.

    Returns:
        The absolute path of the checkpoint folder.
    """
    path = os.path.abspath(path)
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.path.basename(path)}")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(info)
    sharded = is_fsdp2(module)
    if sharded:
        import torch.distributed.checkpoint as dcp

        dcp.save(_sharded_state(module, optimizer), checkpoint_id=os.path.join(tmp, SHARDS_DIR))
    elif info.is_main:
        unwrap_model(module).save_pretrained(os.path.join(tmp, MODEL_DIR))
        tokenizer.save_pretrained(os.path.join(tmp, MODEL_DIR))
    if info.is_main:
        optim = {} if sharded else {"optimizer": optimizer.state_dict()}  # FSDP2: in the shards
        full = {
            **state,
            "world_size": info.world_size,
            **optim,
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
        }
        torch.save(full, os.path.join(tmp, STATE_FILE))
    barrier(info)
    if info.is_main:
        _move_into_place(tmp, path)
    barrier(info)
    return path


def _move_into_place(tmp: str, path: str) -> None:
    """Replaces ``path`` (if any) by ``tmp`` with renames only."""
    if not os.path.exists(path):
        os.replace(tmp, path)
        return
    old = f"{tmp}-old"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old)


def load(path: str, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, info: DistInfo) -> dict:
    """Restores what :func:`save` wrote into ``module`` (weights), ``optimizer``, ``scheduler`` and the RNG states,
    in place; call it on every rank.

    Returns:
        The saved state: the caller's dict plus ``world_size`` (and the optimizer, scheduler and RNG states).
        ``ValueError`` when ``path`` is not a checkpoint or was written by another parallelism (full weights for
        FSDP2, shards for DDP) or, for shards, by another world size.
    """
    file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"checkpoint {path!r} has no {STATE_FILE}")
    state = torch.load(file, map_location="cpu", weights_only=False)
    sharded = os.path.isdir(os.path.join(path, SHARDS_DIR))
    _check_format(path, sharded=sharded, written_by=int(state["world_size"]), module=module, info=info)
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        shards = _sharded_state(module, optimizer)
        dcp.load(shards, checkpoint_id=os.path.join(path, SHARDS_DIR))
        set_state_dict(module, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])
    else:
        load_weights(unwrap_model(module), os.path.join(path, MODEL_DIR))
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state


def _check_format(path: str, *, sharded: bool, written_by: int, module: torch.nn.Module, info: DistInfo) -> None:
    if sharded and written_by != info.world_size:
        raise ValueError(
            f"checkpoint {path!r} was written by {written_by} processes; resume it with --nproc-per-node/--nnodes "
            f"giving world_size={written_by}, not {info.world_size}"
        )
    if sharded and not is_fsdp2(module):
        raise ValueError(f"checkpoint {path!r} holds FSDP2 shards: resume it with parallelism=fsdp2 under torchrun")
    if not sharded and is_fsdp2(module):
        raise ValueError(
            f"checkpoint {path!r} holds a full model (a single-process or DDP run): resume it with parallelism=ddp"
        )


def _sharded_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's shards of the model and optimizer states (what ``torch.distributed.checkpoint`` saves / fills)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def load_weights(model: torch.nn.Module, folder: str) -> None:
    """Loads ``save_pretrained`` safetensors into ``model`` in place; parameters tied to a loaded one may be absent."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"checkpoint {folder!r} has no .safetensors weights")
    loaded: set[str] = set()
    for f in files:
        part = load_file(f)
        unexpected = model.load_state_dict(part, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"checkpoint {f!r} has weights the model lacks: {unexpected[:3]}")
        loaded.update(part)
    state = model.state_dict()
    loaded_ptrs = {state[k].data_ptr() for k in loaded}
    missing = [k for k in state if k not in loaded and state[k].data_ptr() not in loaded_ptrs]
    if missing:
        raise ValueError(f"checkpoint {folder!r} lacks weights: {missing[:3]}")


def model_folder(path: str) -> str:
    """The folder ``from_pretrained`` loads: ``path/model`` for a checkpoint folder, else ``path`` itself."""
    inner = os.path.join(path, MODEL_DIR)
    return inner if os.path.isdir(inner) else path


def latest(output_dir: str) -> str | None:
    """The checkpoint folder with the highest step in ``output_dir``, or None."""
    if not os.path.isdir(output_dir):
        return None
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := CHECKPOINT_RE.match(name))]
    return os.path.join(output_dir, max(found)[1]) if found else None
