"""What one training step computes, in the order the data flows: selection (the pruning policy, the one caller of the
selection kernels), dynamic (dynamic sampling: zero-variance groups dropped, more questions drawn), balance (the kept
completions over the ranks), packing (micro-batches, each prompt once), weights (each micro-batch's share of the step's
loss), models (loading and the packed forward), head (the model's own logit transform), lora (PEFT adapters), optim
(AdamW, the schedule, one optimizer step)."""

from .balance import balance_samples, balance_sequences, lpt_assign, split_units  # noqa: I001  (grouped, as __all__)
from .dynamic import FilledStep, fill_step, zero_variance_groups
from .lora import (
    apply_lora, base_recipe, check_target_modules, is_adapter_folder, is_lora, load_adapter_model, load_adapter_weights,
    merge, reference_forward, save_adapter,
)  # fmt: skip
from .models import (
    DEFAULT_TINY, completion_hidden, decoder, enable_gradient_checkpointing, lm_head, load_model_and_tokenizer,
    packed_hidden, prefix_attention_mask, prefix_sharing_blocker, tiny_tokenizer, use_prefix_sharing,
)  # fmt: skip
from .head import LogitTransform, check_logit_transform, config_logit_transform, logit_transform
from .importance import (
    IS_MODES, MISMATCH_METRICS, bound_ratio, check_mode, correct_batches, importance_weights, mismatch_metrics,
    mismatch_values,
)  # fmt: skip
from .optim import NonFiniteUpdates, SkipCounter, apply_settings, make_optimizer, make_scheduler, optimizer_step
from .packing import (
    PackedBatch, Sample, SharedPrefix, allocate, loss_weight, pack, pack_all, pack_shared, phase_tokens, prompt_groups,
    shared_tokens,
)  # fmt: skip
from .quality import SCORERS, QualityHead, RolloutStopping, choose_stops, stops_per_group, survivor_selection
from .selection import SCOPES, Pruning, Selection, kept_count
from .varlen_attention import (
    REFERENCE_KERNEL, VARLEN_ATTENTION, VarlenKernel, register_varlen_attention, varlen_available,
)  # fmt: skip
from .weights import StepWeights, step_weights

__all__ = [
    "IS_MODES",
    "bound_ratio",
    "check_mode",
    "correct_batches",
    "importance_weights",
    "mismatch_metrics",
    "mismatch_values",
    "MISMATCH_METRICS",
    "balance_samples", "balance_sequences", "lpt_assign", "split_units", "FilledStep", "fill_step",
    "zero_variance_groups", "apply_lora", "base_recipe",
    "check_target_modules", "is_adapter_folder", "is_lora", "load_adapter_model", "load_adapter_weights", "merge",
    "reference_forward", "save_adapter", "DEFAULT_TINY", "completion_hidden", "decoder",
    "enable_gradient_checkpointing", "lm_head", "load_model_and_tokenizer", "packed_hidden", "prefix_attention_mask",
    "prefix_sharing_blocker", "tiny_tokenizer", "use_prefix_sharing", "LogitTransform", "check_logit_transform",
    "logit_transform", "config_logit_transform", "NonFiniteUpdates", "SkipCounter",
    "apply_settings", "make_optimizer", "make_scheduler", "optimizer_step", "PackedBatch", "Sample", "SharedPrefix",
    "allocate", "loss_weight", "pack", "pack_all", "pack_shared", "phase_tokens", "prompt_groups", "shared_tokens",
    "SCORERS", "QualityHead", "RolloutStopping", "choose_stops", "stops_per_group", "survivor_selection", "SCOPES",
    "Pruning", "Selection", "kept_count", "REFERENCE_KERNEL", "VARLEN_ATTENTION", "VarlenKernel",
    "register_varlen_attention", "varlen_available", "StepWeights", "step_weights",
]  # fmt: skip
