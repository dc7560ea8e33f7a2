"""Fused log-prob + clipped-ratio + KL loss from hidden states and the LM-head weight.

Placeholder wiring to the reference until the fused Triton / chunked PyTorch paths land.
"""

from __future__ import annotations

import torch

from . import reference
from .config import LossConfig

__all__ = ["fused_cppo_loss", "fused_logprobs", "cppo_loss_from_logits"]


def fused_cppo_loss(
    hidden,
    weight,
    targets,
    advantages,
    *,
    cu_seqlens=None,
    mask=None,
    old_logprobs=None,
    ref_logprobs=None,
    bias=None,
    **options,
):
    cfg = LossConfig(**options)
    return reference.fused_cppo_loss(
        hidden,
        weight,
        targets,
        advantages,
        cu_seqlens=cu_seqlens,
        mask=mask,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        bias=bias,
        config=cfg,
    )


@torch.no_grad()
def fused_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, compute_entropy=False):
    logp, ent = reference.token_logprobs(hidden, weight, targets, bias=bias, temperature=temperature)
    logp = logp.float()
    return (logp, ent.float()) if compute_entropy else logp


def cppo_loss_from_logits(logits, targets, advantages, **kwargs):
    raise NotImplementedError
