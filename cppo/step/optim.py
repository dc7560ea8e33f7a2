"""The optimizer side of a run: AdamW, the learning-rate schedule over optimizer steps, one optimizer step (gradient
clipping, update, schedule, zeroed gradients; skipped when the gradient is not finite) and the count of skipped
updates that stops a diverged run."""

from __future__ import annotations

import math

import torch


def make_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters (fp32 masters; after wrapping: FSDP2 replaces them with sharded
    ones; with LoRA the adapters only), with torch's defaults betas (0.9, 0.999) and eps 1e-8, as the Hugging Face
    Trainer's ``adamw_torch``."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)


def make_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str, warmup_ratio: float, total: int):
    """The ``schedule`` (``lr_schedule``: cosine, linear or constant) over ``total`` optimizer steps, after a linear
    warm-up of ``ceil(total * warmup_ratio)`` steps (the Hugging Face Trainer's count, which the official runs use;
    the float product included: 30 * 0.1 = 3.0000000000000004 warms up for 4 steps)."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    warmup = math.ceil(total * warmup_ratio)
    if schedule == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup, total)
    if schedule == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total)
    return get_constant_schedule_with_warmup(optimizer, warmup)


def apply_settings(optimizer: torch.optim.Optimizer, scheduler, *, lr: float, weight_decay: float) -> None:
    """After a resume restored ``optimizer`` and ``scheduler`` from a checkpoint: the run's own ``lr`` and
    ``weight_decay`` replace the saved ones, and the schedule (built by :func:`make_scheduler` for this run:
    ``lr_schedule``, ``warmup_ratio``, the run's length) sets the current learning rate at the restored step, so that
    a setting a resume accepts is applied, never recorded and ignored. With unchanged settings nothing changes (the
    same formula the schedule applied at its last step)."""
    scheduler.base_lrs = [float(lr)] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = float(lr)
        group["weight_decay"] = float(weight_decay)
        group["lr"] = float(lr) * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, *, max_grad_norm: float
) -> tuple[float, bool]:
    """Clips the gradients to ``max_grad_norm``, steps the optimizer and the schedule, zeroes the gradients. When the
    gradient norm is not finite (a NaN or inf anywhere in the gradients) neither the optimizer nor the schedule
    steps: the update is skipped and the parameters and optimizer state stay as they were.

    Returns:
        ``(the gradient norm before clipping, under FSDP2 the norm over all shards; whether the update was
        applied)``: one host sync, the norm read once. Under DDP / FSDP2 the norm is that of the synchronised
        gradients, so every rank decides alike.
    """
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2
    norm = float(grad_norm)
    applied = math.isfinite(norm)
    if applied:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, applied


class NonFiniteUpdates(RuntimeError):
    """Too many optimizer updates in a row had a non-finite gradient (see :class:`SkipCounter`)."""


class SkipCounter:
    """Counts skipped (non-finite) updates in a row and stops the run after ``limit`` of them."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_a_row = limit, 0

    def record(self, applied: bool, *, grad_norm: float, step: int) -> None:
        """Notes one update; raises :class:`NonFiniteUpdates` at the ``limit``-th skipped update in a row."""
        self.in_a_row = 0 if applied else self.in_a_row + 1
        if self.in_a_row >= self.limit:
            raise NonFiniteUpdates(
                f"step {step}: {self.in_a_row} optimizer updates in a row had a non-finite gradient norm "
                f"({grad_norm}) and were skipped (max_skipped_updates={self.limit}); the parameters are those of the "
                "last finite update. Lower lr or max_grad_norm, check the rewards and the data, or resume from the "
                "last checkpoint"
            )
