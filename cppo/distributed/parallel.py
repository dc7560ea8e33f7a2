"""Data parallelism of the model: wrapping it for DDP or FSDP2 around the packed forward, and the gradient
synchronisation (when to sync, and the loss scale that turns the ranks' averaged gradient into the global one).

Every function is a no-op (or returns its input) in a single process, so the trainer has one code path.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch
from torch import nn

from cppo_kernels.config import check_choice

from .processes import DistInfo, require_group

__all__ = [
    "PARALLELISMS",
    "ForwardModule",
    "wrap_model",
    "mixed_precision",
    "unwrap_model",
    "is_fsdp2",
    "root_unsharded",
    "keep_gathered_after_forward",
    "is_sharded",
    "gradient_sync",
    "grad_scale",
]

#: ``parallelism``: how the model is replicated over torchrun's processes (``none``: one process only).
PARALLELISMS = ("none", "ddp", "fsdp2")


class ForwardModule(nn.Module):
    """Puts a custom forward (e.g. packed final hidden states, no logits) on a model, so that DDP and FSDP2 wrap a
    module whose ``forward`` is the pass the trainer differentiates. ``fn(model, *args, **kwargs)``."""

    def __init__(self, model: nn.Module, fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(self.model, *args, **kwargs)


def _fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: transformers' ``_no_split_modules`` classes, else the children of
    every ``nn.ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        blocks = [c for m in model.modules() if isinstance(m, nn.ModuleList) for c in m]
    return blocks


def wrap_model(
    model: nn.Module,
    *,
    parallelism: str,
    info: DistInfo,
    forward: Callable[..., torch.Tensor] | None = None,
    frozen: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """The module to call for the forward: ``model`` (``forward=None``) or ``ForwardModule(model, forward)``,
    wrapped for ``parallelism``.

    - ``"none"``: unwrapped (one process only: with several, replicas would drift apart, so that is a ValueError);
    - ``"ddp"``: ``DistributedDataParallel`` (gradients all-reduced and averaged in backward);
    - ``"fsdp2"``: ``fully_shard`` on each block (see :func:`_fsdp_blocks`) and on the root, with the root kept
      unsharded after forward so that parameters used outside forward (the LM head of a fused loss, read *after*
      the forward) are whole tensors. Parameters are sharded in place: use :func:`unwrap_model` for the model.
      With a ``compute_dtype`` other than float32 (see :func:`mixed_precision`) the shards stay in their own dtype
      (fp32 masters) while the gathered parameters are cast to ``compute_dtype`` and gradients reduced in fp32.

    In a single process every parallelism returns the unwrapped module (nothing to synchronise). A ``frozen`` model
    (e.g. the reference model) has no gradients to synchronise: only FSDP2 wraps it, to shard it.
    """
    check_choice("parallelism", parallelism, PARALLELISMS)
    module = model if forward is None else ForwardModule(model, forward)
    if not info.distributed or (frozen and parallelism != "fsdp2"):
        return module
    if parallelism == "none":
        raise ValueError(f"parallelism='none' with world_size={info.world_size}: use 'ddp' or 'fsdp2' under torchrun")
    require_group(info)
    if parallelism == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [info.device.index] if info.device.type == "cuda" else None
        # no buffer sync in forward: the ranks' buffers (e.g. rotary tables) are equal, and a broadcast in every
        # forward would tie the ranks' no-grad passes (old/ref log-probs) together. Recent torch names this
        # forward_sync_buffers (broadcast_buffers warns there); older torch only knows broadcast_buffers
        known = inspect.signature(DistributedDataParallel).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in known else {"broadcast_buffers": False}
        return DistributedDataParallel(module, device_ids=device_ids, **no_sync)
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:  # torch < 2.6
        raise ValueError("parallelism='fsdp2' needs torch >= 2.6 (torch.distributed.fsdp.fully_shard)") from e
    policy = mixed_precision(compute_dtype)
    for block in _fsdp_blocks(model):
        fully_shard(block, mp_policy=policy)
    root = fully_shard(module, reshard_after_forward=False, mp_policy=policy)
    # make `module` the root now: a first forward through a block (e.g. in generate) would otherwise claim it
    root._get_fsdp_state()._lazy_init()
    return root


def mixed_precision(compute_dtype: torch.dtype | None):
    """FSDP2's ``MixedPrecisionPolicy`` for ``compute_dtype``: parameters gathered in it, gradients reduced in fp32
    (the default policy, which computes in the parameters' own dtype, for None / float32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute_dtype is None or compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def unwrap_model(module: nn.Module) -> nn.Module:
    """The model inside :func:`wrap_model`'s result (DDP's ``.module``, then ``ForwardModule.model``)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        module = module.module
    return module.model if isinstance(module, ForwardModule) else module


def is_fsdp2(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 (``fully_shard``) module, whose parameters are sharded over the ranks."""
    return hasattr(module, "set_requires_gradient_sync") and hasattr(module, "reshard")


@contextlib.contextmanager
def root_unsharded(module: nn.Module):
    """Context in which an FSDP2 root's own parameters (embeddings, final norm, LM head) are whole tensors, so that
    code outside its forward (``generate``, reading the LM head) can use them; the blocks still gather their
    parameters in their own forward, so every rank must run as many forward passes (``generate(synced_gpus=True)``).
    A no-op for other modules."""
    if not is_fsdp2(module):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def keep_gathered_after_forward(model: nn.Module, module: nn.Module) -> nn.Module | None:
    """Makes the FSDP2 unit holding ``module``'s parameters (``module`` itself when ``fully_shard`` was applied to it,
    alone or in a group as accelerate's plugin shards the LM head with the final norm; else the root ``model``) keep
    them gathered after its forward, as :func:`wrap_model` does for its root: code run after the forward (a fused
    loss reading the LM head) then gets whole tensors, and FSDP2 reduce-scatters their gradient after the backward
    as every other parameter's. Returns that unit (None when ``model`` is not sharded); idempotent."""
    unit = module if is_fsdp2(module) else model if is_fsdp2(model) else None
    if unit is not None:
        unit.set_reshard_after_forward(False, recurse=False)
    return unit


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an FSDP2 shard (a ``DTensor``) rather than a whole tensor."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor has no FSDP2 either
        return False
    return isinstance(tensor, DTensor)


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool):
    """Context in which backward passes synchronise gradients (``enabled``) or only accumulate them locally.

    Accumulate micro-batches with ``enabled=False`` and run the last one with ``enabled=True``; every rank must
    run the same number of synchronised backward passes (FSDP2: the same number of forward passes too).
    """
    from torch.nn.parallel import DistributedDataParallel

    if enabled:
        yield
    elif isinstance(module, DistributedDataParallel):
        with module.no_sync():
            yield
    elif is_fsdp2(module):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def grad_scale(*, parallelism: str, info: DistInfo) -> float:
    """Factor on each rank's loss so that the synchronised gradient is the gradient of the global loss.

    DDP and FSDP2 average gradients over ranks, and each rank's loss is already a share of the global loss
    (normalised by :func:`cppo.distributed.global_counts`), so the average must be turned back into a sum:
    ``world_size``.
    """
    check_choice("parallelism", parallelism, PARALLELISMS)
    return float(info.world_size) if parallelism in ("ddp", "fsdp2") else 1.0
