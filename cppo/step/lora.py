"""LoRA through PEFT: the policy wrapped with ``peft.get_peft_model``, its reference pass with the adapters disabled
(no second model in memory), and the adapter saved, loaded and merged in PEFT's own format.

An adapter folder (a LoRA checkpoint's ``model/``) holds what ``PeftModel.save_pretrained`` writes
(``adapter_config.json``, ``adapter_model.safetensors``), the tokenizer, and :data:`BASE_FILE`: how to rebuild the
base model (its name or path, a tiny model's config overrides and seed), so that ``cppo eval`` and ``cppo merge``
load base + adapter from the folder alone. Only the adapters train: the base, the embeddings and the LM head stay
frozen, so the fused loss gets an LM-head weight without ``requires_grad`` and computes no weight gradient.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile

import torch

from .. import fileio
from .models import BUILT_IN_MODELS, load_model_and_tokenizer, model_source

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # PEFT's
#: How to rebuild the base model of an adapter folder: ``{"model": ..., "model_config": ..., "seed": ...}``.
BASE_FILE = "base_model.json"


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (the policy of a ``use_peft`` run); never imports peft (a model cannot be
    one unless peft is loaded)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def is_adapter_folder(folder: str) -> bool:
    """Whether ``folder`` holds a PEFT adapter (``adapter_config.json``)."""
    return os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The names (last component) of the model's linear layers that may take adapters: every ``nn.Linear`` but the
    LM head (the fused loss reads its weight directly, so an adapter there would be ignored)."""
    head = model.get_output_embeddings()
    linear = (name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return sorted({name.rsplit(".", 1)[-1] for name in linear})


def check_target_modules(model: torch.nn.Module, targets: list[str] | str) -> None:
    """``ValueError`` naming ``lora_target_modules`` when one of ``targets`` is not a linear layer of ``model`` (PEFT
    itself only fails when none matches); ``all-linear`` always fits."""
    if targets == "all-linear" or targets == ["all-linear"]:
        return
    candidates = linear_module_names(model)
    missing = [t for t in targets if t not in candidates]
    if missing:
        raise ValueError(
            f"lora_target_modules: {missing} not among the linear modules of {type(model).__name__}; candidates: "
            f"{candidates} (or all-linear)"
        )


def apply_lora(
    model: torch.nn.Module,
    *,
    r: int,
    alpha: int,
    dropout: float,
    target_modules: list[str] | str,
    seed: int,
    base_model: str,
    base_config: dict | None = None,
) -> torch.nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with the run's LoRA settings (``lora_r``, ``lora_alpha``,
    ``lora_dropout``, ``lora_target_modules``; task CAUSAL_LM), the adapters initialised from ``seed`` (lora_B
    zero: the policy starts as the base); only they require gradients. The base recipe (``base_model``, the name or
    path ``model`` was loaded from, a tiny model's ``base_config`` overrides, ``seed``) rides along for
    :func:`save_adapter`."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules
    check_target_modules(model, targets)
    lora = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules="all-linear" if targets in ("all-linear", ["all-linear"]) else list(targets),
        task_type="CAUSAL_LM",
    )
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # lora_A's random init: the same in every run (and rank) of this seed
        peft_model = get_peft_model(model, lora)
    base = {
        "model": model_source(base_model),  # what loaded: a built-in by name, a local folder by its absolute path
        "model_config": base_config,
        "seed": seed,
    }
    peft_model.peft_config["default"].base_model_name_or_path = base["model"]
    peft_model.cppo_base = base  # read by save_adapter
    return peft_model


def reference_context(model: torch.nn.Module):
    """Context in which ``model`` (a PEFT model) runs as its base: the adapters disabled (``disable_adapter``)."""
    return model.disable_adapter()


def reference_forward(policy: torch.nn.Module, model: torch.nn.Module, *args) -> torch.Tensor:
    """``policy(*args)`` (the wrapped packed forward) with ``model``'s adapters disabled: the reference pass, on the
    very parameters of the policy (a ``ForwardModule`` fn: :func:`cppo.distributed.parallel.wrap_model`)."""
    with reference_context(model):
        return policy(*args)


def save_adapter(model: torch.nn.Module, folder: str, *, tokenizer) -> None:
    """The adapter in PEFT's format, the tokenizer and :data:`BASE_FILE` into ``folder`` (created)."""
    model.save_pretrained(folder, save_embedding_layers=False)  # no hub look-up: embeddings never adapt
    tokenizer.save_pretrained(folder)
    fileio.write_json(os.path.join(folder, BASE_FILE), getattr(model, "cppo_base", None) or _base_from_config(folder))


def _base_from_config(folder: str) -> dict:
    """The base recipe of a PEFT adapter folder without :data:`BASE_FILE`: ``base_model_name_or_path``."""
    with open(os.path.join(folder, ADAPTER_CONFIG), encoding="utf-8") as f:
        name = json.load(f).get("base_model_name_or_path")
    if not name:
        raise ValueError(f"adapter {folder!r} names no base model (no {BASE_FILE}, no base_model_name_or_path)")
    return {"model": name, "model_config": None, "seed": 0}


def base_recipe(folder: str) -> dict:
    """How to rebuild the base model of adapter ``folder``: :data:`BASE_FILE`, else PEFT's base model name."""
    path = os.path.join(folder, BASE_FILE)
    if not os.path.isfile(path):
        return _base_from_config(folder)
    recipe = _read_json(path, "the base model's recipe")
    if not isinstance(recipe.get("model"), str) or not recipe["model"]:
        raise ValueError(f'{path} names no base model (its "model" is {recipe.get("model")!r}): a corrupt file')
    return recipe


def _read_json(path: str, what: str) -> dict:
    """The JSON object in ``path``; ``ValueError`` naming the file when it cannot be read or is no object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} ({what}) cannot be read ({e}): a truncated or corrupt file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} ({what}) holds {type(data).__name__}, not a JSON object: a corrupt file")
    return data


def check_adapter(folder: str) -> dict:
    """The base recipe of adapter ``folder`` (:func:`base_recipe`) once its files are checked, before any model loads
    (``cppo eval`` and ``cppo merge``): ``ValueError`` naming the file when :data:`ADAPTER_CONFIG`,
    :data:`BASE_FILE` or :data:`ADAPTER_WEIGHTS` is missing, truncated or corrupt, when the weights' rank is not the
    config's ``r``, or when the base model recorded no longer exists (moved or deleted)."""
    from safetensors import SafetensorError, safe_open

    config_path, weights = os.path.join(folder, ADAPTER_CONFIG), os.path.join(folder, ADAPTER_WEIGHTS)
    config = _read_json(config_path, "the LoRA adapter's config")
    base = base_recipe(folder)
    name = base["model"]
    if name not in BUILT_IN_MODELS and os.path.isabs(name) and not os.path.exists(name):
        raise ValueError(
            f"the base model of adapter {folder!r}, {name!r} (recorded in {os.path.join(folder, BASE_FILE)}), does not "
            "exist: it was moved or deleted; put it back, or write its new path there"
        )
    if not os.path.isfile(weights):
        raise ValueError(f"adapter {folder!r} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}: an incomplete adapter")
    try:
        with safe_open(weights, framework="pt") as f:
            ranks = {key: f.get_slice(key).get_shape()[0] for key in f.keys() if ".lora_A." in key}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights} cannot be read ({e}): a truncated or corrupt file") from None
    r = config.get("r")
    wrong = {k: v for k, v in ranks.items() if v != r}
    if not ranks or (wrong and not config.get("rank_pattern")):
        shown = ", ".join(map(str, sorted(set(wrong.values()))))
        found = f"weights of rank {shown} ({next(iter(wrong))})" if wrong else "no lora_A weights"
        raise ValueError(
            f"{config_path} says r={r!r}, but {weights} holds {found}: the two files are not of the same adapter"
        )
    return base


def load_adapter_weights(model: torch.nn.Module, folder: str) -> None:
    """Loads the adapter weights of ``folder`` into PEFT model ``model`` in place; ``ValueError`` when they do not
    fit it (another rank, other target modules, or no adapter at all)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = os.path.join(folder, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        raise ValueError(f"checkpoint {folder!r} holds no LoRA adapter ({ADAPTER_WEIGHTS}): it is a full model")
    state = load_file(file)
    try:
        result = set_peft_model_state_dict(model, state)
    except RuntimeError as e:  # a shape mismatch: another lora_r
        raise ValueError(f"adapter {file!r} does not fit the model: {str(e).splitlines()[-1].strip()}") from None
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(
            f"adapter {file!r} does not fit the model (lora_target_modules differ): unexpected "
            f"{list(result.unexpected_keys)[:3]}, missing {missing[:3]}"
        )


def load_adapter_model(folder: str, *, dtype: str = "float32", device: torch.device | str = "cpu"):
    """``(PEFT model, tokenizer)``: the base of adapter ``folder`` (:func:`base_recipe`) with the adapter loaded,
    for inference."""
    from peft import PeftModel

    base = check_adapter(folder)
    model, tokenizer = load_model_and_tokenizer(
        base["model"], model_config=base.get("model_config"), dtype=dtype, device=device, seed=base.get("seed", 0)
    )
    try:
        return PeftModel.from_pretrained(model, folder).to(device), tokenizer
    except RuntimeError as e:  # a shape mismatch: the adapter was trained on another base model
        problem = next((line.strip() for line in str(e).splitlines() if "mismatch" in line), str(e).strip())
        raise ValueError(
            f"adapter {folder!r} does not fit its base model {base['model']!r} ({problem}): another base model"
        ) from None


def merge(folder: str, output: str, *, dtype: str = "float32") -> str:
    """Writes base + adapter of ``folder`` merged (``merge_and_unload``) as a plain model and tokenizer that
    ``AutoModelForCausalLM.from_pretrained(output)`` loads. ``output`` must not exist or be an empty folder; it is
    written beside itself and renamed into place, so it never holds half a model. Returns its absolute path."""
    output = os.path.abspath(output)
    if os.path.isfile(output) or (os.path.isdir(output) and os.listdir(output)):
        raise ValueError(f"--output {output!r} exists and is not an empty folder: name a new one")
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    model, tokenizer = load_adapter_model(folder, dtype=dtype)
    merged = model.merge_and_unload()
    with _folder_in_place(output) as tmp:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return output


@contextlib.contextmanager
def _folder_in_place(target: str):
    """A fresh temporary folder beside ``target``, flushed and renamed to ``target`` when the block ends without
    error (removed otherwise)."""
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(target)}-", dir=os.path.dirname(target))
    try:
        yield tmp
        fileio.fsync_tree(tmp)
        os.chmod(tmp, 0o777 & ~_umask())
        os.replace(tmp, target)  # an empty target folder is replaced; a non-empty one was refused
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
