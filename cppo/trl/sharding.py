"""The LM head of a sharded model, for the fused loss and log-probs of :class:`cppo.trl.CPPOTrainer`.

``fused_cppo_loss`` and ``fused_logprobs`` read the LM-head weight directly, after the backbone's forward, instead of
calling the head module. Under a sharded engine that weight is whole only where the engine has gathered it:

- **FSDP2** (accelerate's plugin, or ``fully_shard`` by hand): the FSDP2 unit holding the head (the head itself,
  which accelerate 1.15 shards with the final norm, or the root) is told to keep it gathered after its forward
  (:func:`cppo.distributed.keep_gathered_after_forward`, the path of the cppo trainer's ``parallelism='fsdp2'``); the
  loss then reads the unsharded parameter, and FSDP2 reduce-scatters its gradient after the backward as it does for
  every other parameter. A no-grad pass (old policy, reference model) reshards it afterwards (:func:`release_head`).
- **DeepSpeed ZeRO-3**: the head's partitioned parameters are gathered with ``deepspeed.zero.GatheredParameters``
  from the first read of a training step until the step's backward is over (:class:`ZeroHead`, opened by the
  trainer's ``training_step``), so its gradient is computed on the whole weight and handed to ZeRO-3's reduction
  while gathered. Tested with a stand-in for the partitioned weight; it has not run on a real ZeRO-3 job.
"""

from __future__ import annotations

import contextlib

from torch import Tensor, nn

from ..distributed import is_sharded, keep_gathered_after_forward
from ..step import lm_head

__all__ = ["zero3_enabled", "ZeroHead", "prepare_head", "gathered_head", "release_head"]


def zero3_enabled(trainer) -> bool:
    """Whether ``trainer`` runs under DeepSpeed ZeRO-3 (its parameters partitioned outside their module's forward)."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool(getattr(trainer, "is_deepspeed_enabled", False) and plugin is not None and plugin.zero_stage == 3)


class ZeroHead:
    """The LM-head parameters gathered under ZeRO-3 for one training step: :meth:`step` opens the step (a context,
    around ``training_step`` or ``prediction_step``), :meth:`gather` gathers parameters once inside it, held until the
    step ends (after the backward). Outside ZeRO-3 nothing is gathered."""

    def __init__(self):
        self._stack: contextlib.ExitStack | None = None
        self._held: set[int] = set()

    @contextlib.contextmanager
    def step(self):
        with contextlib.ExitStack() as stack:
            self._stack, self._held = stack, set()
            try:
                yield
            finally:
                self._stack, self._held = None, set()

    def gather(self, params: list[Tensor | None]) -> None:
        """Gathers the partitioned ones of ``params`` (``deepspeed.zero.GatheredParameters``) until the step ends."""
        todo = [p for p in params if p is not None and hasattr(p, "ds_id") and id(p) not in self._held]
        # already gathered (a tied embedding holds it): left to its holder, as TRL's maybe_gather_lm_head_ctx does
        todo = [p for p in todo if getattr(getattr(p, "ds_status", None), "name", None) != "AVAILABLE"]
        todo = list({id(p): p for p in todo}.values())  # tied weights: once
        if not todo:
            return
        if self._stack is None:
            raise RuntimeError("CPPOTrainer: the ZeRO-3 LM head was read outside a training or prediction step")
        import deepspeed

        self._stack.enter_context(deepspeed.zero.GatheredParameters(todo, modifier_rank=None))
        self._held.update(id(p) for p in todo)


def _head_module(model: nn.Module) -> nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def prepare_head(model: nn.Module) -> None:
    """Before a forward of ``model`` (unwrapped) whose hidden states meet the LM head: under FSDP2 its unit keeps the
    head gathered after that forward; otherwise nothing."""
    head = _head_module(model)
    if head is not None:
        keep_gathered_after_forward(model, head)


def gathered_head(trainer, model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(weight [V, H], bias [V] or None)`` of ``model``'s (unwrapped) LM head as whole tensors: FSDP2's unsharded
    parameters (after the forward :func:`prepare_head` ran before), or ZeRO-3's gathered ones. A ``ValueError`` when
    the weight is still an FSDP2 shard (a forward that did not go through the head's unit)."""
    if zero3_enabled(trainer):  # before lm_head's checks: a partitioned weight is an empty 1-D tensor
        head = _head_module(model)
        trainer.zero_head.gather([getattr(head, "weight", None), getattr(head, "bias", None)])
    weight, bias = lm_head(model)
    if is_sharded(weight):
        raise ValueError(
            f"the LM-head weight of {type(model).__name__} is an FSDP2 shard {tuple(weight.shape)} after the forward: "
            "shard the model with fully_shard on its root (accelerate's FSDP2 plugin does), so that the head's unit "
            "gathers it"
        )
    return weight, bias


def release_head(model: nn.Module) -> None:
    """After a no-grad pass of ``model`` (unwrapped): reshards the FSDP2 unit holding its LM head (no backward will);
    nothing otherwise."""
    head = _head_module(model)
    unit = None if head is None else keep_gathered_after_forward(model, head)
    if unit is not None:
        unit.reshard()
