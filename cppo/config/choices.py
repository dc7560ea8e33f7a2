"""The choices of the settings that are names (dtypes, schedules, back-ends, datasets, the tiny models) and which
settings a resume may change (:data:`RESUMABLE`) or never (:data:`FIXED`)."""

from __future__ import annotations

import re

from .names import Names

#: Models built in code (no download).
TINY_MODELS = ("tiny-qwen2",)
#: ``dtype``: the compute dtype (master weights and optimizer state are always float32).
DTYPES = ("float32", "bfloat16", "float16")
#: ``lr_schedule``: cosine / linear decay or constant, each after a linear warm-up.
LR_SCHEDULES = ("cosine", "linear", "constant")
#: ``kernel_backend``: the cppo_kernels path (``auto`` leaves ``$CPPO_KERNELS_BACKEND`` in charge).
KERNEL_BACKENDS = ("auto", "triton", "torch")


def _task_datasets() -> tuple[str, ...]:
    """The dataset names the task kinds provide (imported when used: the task kinds import torch, settings not)."""
    from ..tasks import DATASETS as names

    return tuple(names)


#: ``dataset`` names (besides a .jsonl file and a hub dataset ``owner/name``): those the task kinds provide
#: (:mod:`cppo.tasks.registry`; read each time, so a kind registered later adds its own), sorted.
DATASETS = Names(_task_datasets)
#: A hub repository id: ``name`` or ``owner/name`` (a local path that does not exist is none).
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
#: ``lora_target_modules`` by default: the attention and MLP projections (Llama, Qwen2, Mistral, SmolLM2 names).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: ``seed`` is at most this (the per-step seeds derived from it must fit torch's 64-bit seed).
MAX_SEED = 2**32 - 1
#: Settings a resume may change without --allow-config-change: where and how often the run writes and evaluates,
#: its length (with a decaying lr_schedule, a new length reshapes the remaining schedule), and how (not what) it
#: computes. Any other difference changes the run (:meth:`TrainConfig.changes_from`).
RESUMABLE = frozenset(
    {"output_dir", "num_steps", "num_epochs", "save_every", "log_every", "eval_every", "eval_limit", "preset"}
    | {"report_to"}
    | {"device", "kernel_backend", "micro_batch_tokens", "parallelism", "gradient_checkpointing", "max_skipped_updates"}
)
#: Settings a resume cannot apply, even with --allow-config-change: the weights are of that model, the data
#: position of that question list; LoRA: the checkpoint holds an adapter of that shape (or a full model), which only
#: such a policy loads.
FIXED = frozenset({"model", "model_config", "dataset", "dataset_path", "max_questions"})
FIXED |= {"use_peft", "lora_r", "lora_target_modules"}
