"""Checkpoints of a run: one :func:`save` / :func:`load` pair for every format (single process, DDP, FSDP2 shards),
written atomically and read without running code.

Layout of ``output_dir/checkpoint-{step:06d}/``:

- single process and DDP: ``model/`` (weights and tokenizer, loadable by ``from_pretrained`` and by ``cppo eval``;
  with ``use_peft`` the adapter in PEFT's format instead, see :mod:`cppo.step.lora`) and ``trainer_state.pt`` (the
  caller's state, e.g. step, data position and config, plus world size, optimizer, scheduler and RNG states), both
  written by rank 0;
- FSDP2: ``dcp/`` (every rank's shards of the model and optimizer, through ``torch.distributed.checkpoint``) and
  ``trainer_state.pt`` (the same without the optimizer); it resumes at the world size that wrote it.

Writing: the folder is written under ``.tmp-checkpoint-N`` beside it, every file and folder is fsynced, and it is
moved into place with ``os.replace`` once every rank has written, so a run killed mid-save leaves the previous
checkpoint intact. Re-saving a step first renames the old folder to ``.replaced-checkpoint-N``:
:func:`remove_leftovers` puts it back if the new one never arrived, so a step's checkpoint always exists under one
of the two names. Several nodes need a shared filesystem.

Reading: ``trainer_state.pt`` holds only tensors and plain Python data (RNG states included) and is read with
``torch.load(weights_only=True)``; weights are safetensors; FSDP2 shard metadata is unpickled with an allowlist. A
file holding anything else is refused (:class:`UnsafeCheckpoint`); a missing, empty or truncated file is a
:class:`CorruptCheckpoint`, which a resume skips for the previous checkpoint.
"""

from __future__ import annotations

import glob
import os
import pickle
import random
import re
import shutil
import zipfile

import numpy as np
import torch
from safetensors import SafetensorError

from ..distributed import DistInfo, barrier, is_fsdp2, unwrap_model
from ..fileio import fsync, fsync_tree
from ..step import is_adapter_folder, is_lora, load_adapter_weights, save_adapter
from .errors import CorruptCheckpoint, UnsafeCheckpoint, first_line

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
#: A half-written folder (or metrics log) that a killed save leaves; see also :data:`REPLACED_PREFIX`.
TMP_RE = re.compile(r"^\.tmp-(checkpoint-\d+|metrics\.jsonl)$")
#: The old folder of a step being re-saved, until the new one is in place.
REPLACED_PREFIX = ".replaced-"
MODEL_DIR = "model"  # save_pretrained weights and tokenizer (single process, DDP)
SHARDS_DIR = "dcp"  # torch.distributed.checkpoint shards of the model and optimizer (FSDP2)
STATE_FILE = "trainer_state.pt"
STATE_KEYS = ("step", "world_size", "scheduler", "rng")
#: What :meth:`cppo.trainer.Trainer.save_checkpoint` adds to the state and its resume reads.
TRAINER_KEYS = ("sampler",)


def rng_state() -> dict:
    """The torch, Python, NumPy (and CUDA) RNG states as tensors and plain Python data."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
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
        module: the model as :func:`cppo.distributed.parallel.wrap_model` returned it (FSDP2 modules are saved as
            shards).
        tokenizer: saved beside the full model.
        state: the caller's dict of tensors and plain data (e.g. step, data position, config); :func:`load`
            returns it.

    Returns:
        The absolute path of the checkpoint folder.
    """
    path = os.path.abspath(path)
    model = unwrap_model(module)  # the model inside DDP / the packed forward (FSDP2: sharded in place)
    tmp = os.path.join(os.path.dirname(path), f".tmp-{os.path.basename(path)}")
    if info.is_main:
        if os.path.lexists(tmp):
            remove(tmp)
        os.makedirs(tmp)
    barrier(info)
    try:
        _write(
            tmp, module=module, model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
            state=state, info=info,
        )  # fmt: skip
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk: torch's "unexpected pos", safetensors' error
        if info.is_main and os.path.lexists(tmp):
            remove(tmp)
        raise CheckpointWriteError(_write_failure(path, e, model=model, optimizer=optimizer)) from None
    barrier(info)
    if info.is_main:
        fsync_tree(tmp)
        _move_into_place(tmp, path)
    barrier(info)
    return path


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a quota); the temporary folder is removed and every earlier
    checkpoint is intact."""


def _write(tmp: str, *, module, model, tokenizer, optimizer, scheduler, state: dict, info: DistInfo) -> None:
    """The files of a checkpoint into the temporary folder ``tmp`` (every rank: FSDP2 writes shards from each):
    ``module`` as wrapped, ``model`` the model inside it."""
    sharded = is_fsdp2(module)
    if sharded:
        import torch.distributed.checkpoint as dcp

        dcp.save(_sharded_state(module, optimizer), checkpoint_id=os.path.join(tmp, SHARDS_DIR))
    elif info.is_main and is_lora(model):  # the adapter in PEFT's format, megabytes
        save_adapter(model, os.path.join(tmp, MODEL_DIR), tokenizer=tokenizer)
    elif info.is_main:
        model.save_pretrained(os.path.join(tmp, MODEL_DIR))
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


def _write_failure(path: str, error: BaseException, *, model, optimizer) -> str:
    """One line: which checkpoint, why, the free space against what it needs, and the one a resume would use."""
    folder = os.path.dirname(path)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(
        t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t)
    )
    need = _megabytes(params + moments)
    try:
        free = f"{_megabytes(shutil.disk_usage(folder).free)} free"
    except OSError:
        free = "free space unknown"
    previous = latest(folder)
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return f"cannot write checkpoint {path} ({first_line(error)}; {free}, about {need} needed): {kept}"


def _megabytes(n: int) -> str:
    return f"{n / 2**20:,.0f} MB"


def _move_into_place(tmp: str, path: str) -> None:
    """Replaces ``path`` (if any) by ``tmp`` with renames only; the old folder stays as ``.replaced-NAME`` until the
    new one is in place (see :func:`remove_leftovers`)."""
    parent = os.path.dirname(path)
    if not os.path.exists(path):
        os.replace(tmp, path)
        fsync(parent)
        return
    replaced = os.path.join(parent, REPLACED_PREFIX + os.path.basename(path))
    if os.path.lexists(replaced):
        remove(replaced)
    os.replace(path, replaced)  # a symlinked checkpoint moves as the link (its target is never touched)
    os.replace(tmp, path)
    fsync(parent)
    remove(replaced)


def remove_leftovers(output_dir: str) -> list[str]:
    """Cleans up after saves that were killed: removes ``.tmp-checkpoint-N`` folders (and a half-written
    ``.tmp-metrics.jsonl``), and puts a ``.replaced-checkpoint-N`` back in place when its re-save never arrived (else
    removes it). Other files are left alone. Returns the names removed or restored."""
    if not os.path.isdir(output_dir):
        return []
    done = []
    for name in sorted(os.listdir(output_dir)):
        full, target = os.path.join(output_dir, name), name.removeprefix(REPLACED_PREFIX)
        if TMP_RE.match(name):
            remove(full)
        elif name != target and CHECKPOINT_RE.match(target):
            if os.path.exists(os.path.join(output_dir, target)):  # the re-save arrived
                remove(full)
            else:  # it did not: the old folder goes back
                os.replace(full, os.path.join(output_dir, target))
        else:
            continue
        done.append(name)
    return done


def remove(path: str) -> None:
    """Deletes a file, or a folder with everything in it. A symbolic link (a checkpoint linked to an archive) is
    removed as a link: what it points to is never followed or deleted."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def read_state(path: str, *, mmap: bool = False, required: tuple[str, ...] = ()) -> dict:
    """The ``trainer_state.pt`` of checkpoint folder ``path``, read without running code. ``mmap``: tensors are
    mapped from the file and read only when used (a cheap look at the state; never hold them while the file changes).
    ``required``: the keys of the caller's own state that must be there too (the trainer's ``sampler``, ...).

    Raises:
        UnsafeCheckpoint: the file holds objects other than tensors and plain data.
        CorruptCheckpoint: the file is missing, empty, truncated, or lacks the keys :func:`save` writes (with the
            optimizer's unless the checkpoint is sharded) or ``required``.
    """
    file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(file):
        raise CorruptCheckpoint(f"checkpoint {path!r} has no {STATE_FILE}")
    if os.path.getsize(file) == 0:
        raise CorruptCheckpoint(f"{file!r} is empty")
    try:
        # only a zip archive (what save writes) can be mapped; anything else is unpickled as it is, with the same
        # allowlist, so that a crafted plain pickle is refused rather than called corrupt
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(file))
    except pickle.UnpicklingError as e:
        reason = next((line for line in str(e).splitlines() if "WeightsUnpickler error" in line), "").strip()
        raise UnsafeCheckpoint(
            f"{file!r} holds objects other than tensors and plain data; refused to load it, as that could run code"
            + (f" ({reason})" if reason else "")
        ) from None
    except (EOFError, RuntimeError, OSError) as e:
        raise CorruptCheckpoint(f"{file!r} cannot be read ({type(e).__name__}: {first_line(e)})") from None
    keys = STATE_KEYS + (() if os.path.isdir(os.path.join(path, SHARDS_DIR)) else ("optimizer",)) + required
    missing = [k for k in keys if k not in state] if isinstance(state, dict) else list(keys)
    if missing:
        raise CorruptCheckpoint(f"{file!r} lacks {missing}: not a trainer state written by cppo")
    return state


def verify(path: str, *, required: tuple[str, ...] = ()) -> dict:
    """Reads what :func:`load` needs before it loads anything into a model: the trainer state (:func:`read_state`) and
    the headers of the weight files (or the FSDP2 shard metadata). Returns the trainer state (tensors mapped).
    ``required`` as :func:`read_state`."""
    state = read_state(path, mmap=True, required=required)
    _verify_weights(path)
    return state


def _verify_weights(path: str) -> None:
    if os.path.isdir(os.path.join(path, SHARDS_DIR)):
        from .shard_io import read_metadata  # torch.distributed.checkpoint: imported when a checkpoint is sharded

        read_metadata(os.path.join(path, SHARDS_DIR))
        return
    from safetensors import SafetensorError, safe_open

    for f in _weight_files(os.path.join(path, MODEL_DIR)):
        try:
            with safe_open(f, framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise CorruptCheckpoint(f"{f!r} cannot be read ({first_line(e)})") from None


def load(
    path: str,
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    info: DistInfo,
    required: tuple[str, ...] = (),
) -> dict:
    """Restores what :func:`save` wrote into ``module`` (weights), ``optimizer``, ``scheduler`` and the RNG states,
    in place; call it on every rank.

    Returns:
        The saved state: the caller's dict plus ``world_size`` (and the optimizer, scheduler and RNG states).
        ``ValueError`` when ``path`` was written by another parallelism (full weights for FSDP2, shards for DDP), for
        shards by another world size, or for another model shape; :class:`CorruptCheckpoint` /
        :class:`UnsafeCheckpoint` as :func:`read_state`.
    """
    state = read_state(path, required=required)
    sharded = os.path.isdir(os.path.join(path, SHARDS_DIR))
    _check_format(path, sharded=sharded, written_by=int(state["world_size"]), module=module, info=info)
    _verify_weights(path)  # every file is readable before anything changes
    if sharded:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from .shard_io import load_shards

        shards = _sharded_state(module, optimizer)
        load_shards(shards, os.path.join(path, SHARDS_DIR))
        set_state_dict(module, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])
    else:
        _load_model_dir(unwrap_model(module), os.path.join(path, MODEL_DIR))
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


def _weight_files(folder: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise CorruptCheckpoint(f"checkpoint {folder!r} has no .safetensors weights")
    return files


def load_weights(model: torch.nn.Module, folder: str) -> None:
    """Loads ``save_pretrained`` safetensors into ``model`` in place; parameters tied to a loaded one may be absent."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    loaded: set[str] = set()
    for f in _weight_files(folder):
        try:
            part = load_file(f)
        except (SafetensorError, OSError) as e:
            raise CorruptCheckpoint(f"{f!r} cannot be read ({first_line(e)})") from None
        try:
            unexpected = model.load_state_dict(part, strict=False).unexpected_keys
        except RuntimeError as e:  # a shape mismatch: another model
            lines = [line.strip() for line in str(e).splitlines() if "size mismatch" in line] or [first_line(e)]
            raise ValueError(f"checkpoint {f!r} does not fit the model: {lines[0]}") from None
        if unexpected:
            raise ValueError(f"checkpoint {f!r} has weights the model lacks: {unexpected[:3]}")
        loaded.update(part)
    state = model.state_dict()
    loaded_ptrs = {state[k].data_ptr() for k in loaded}
    missing = [k for k in state if k not in loaded and state[k].data_ptr() not in loaded_ptrs]
    if missing:
        raise ValueError(f"checkpoint {folder!r} lacks weights: {missing[:3]}")


def _load_model_dir(model: torch.nn.Module, folder: str) -> None:
    """The weights of a checkpoint's ``model/`` into ``model``: a LoRA adapter into a PEFT model, full weights into
    a plain one; ``ValueError`` naming ``use_peft`` when the two do not match."""
    if is_lora(model):
        load_adapter_weights(model, folder)
    elif is_adapter_folder(folder):
        raise ValueError(f"checkpoint {folder!r} holds a LoRA adapter: resume it with use_peft=true")
    else:
        load_weights(model, folder)


def model_folder(path: str) -> str:
    """The folder ``from_pretrained`` loads: ``path/model`` for a checkpoint folder, else ``path`` itself."""
    inner = os.path.join(path, MODEL_DIR)
    return inner if os.path.isdir(inner) else path


def checkpoints(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders in ``output_dir``, highest step first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := CHECKPOINT_RE.match(name))]
    return [os.path.join(output_dir, name) for _, name in sorted(found, reverse=True)]


def latest(output_dir: str) -> str | None:
    """The checkpoint folder with the highest step in ``output_dir``, or None (see :func:`checkpoints`)."""
    found = checkpoints(output_dir)
    return found[0] if found else None
