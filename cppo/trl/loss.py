"""The policy loss of :class:`cppo.trl.CPPOTrainer` through :func:`cppo_kernels.fused_cppo_loss`.

TRL 1.16's ``_compute_loss`` (``grpo_trainer.py`` line 3020) computes per-token log-probs through its chunked LM
head, then the clipped ratio, k3 KL and its ``loss_type``'s aggregation in PyTorch. Here the policy's final hidden
states of the positions that predict the completion tokens go to ``fused_cppo_loss`` with the LM-head weight, which
computes the same loss (and its gradients) without ``[tokens x vocab]`` logits:

- ``loss_type`` (all eight of TRL 1.16): the surrogate (:data:`SURROGATE`: cispo, sapo and vespo by name, the
  PPO clip for the others) and the aggregation (:data:`LOSS_AGG`: ``grpo`` / ``sapo`` = ``seq-mean-token-mean``,
  ``bnpo`` / ``dapo`` / ``cispo`` / ``vespo`` = ``token-mean``, the last three rescaled by TRL's
  ``num_items_in_batch`` normaliser, ``dr_grpo`` = ``seq-mean-token-sum-norm`` over ``max_completion_length``,
  ``luspo`` = ``seq-mean-token-sum``); the others divided by the gradient-accumulation steps, as TRL does;
- ``importance_sampling_level`` token or sequence (GSPO: the ratio of the sequence's mean log-ratio);
- ``epsilon`` / ``epsilon_high``, ``delta`` (the clip family only, as TRL), ``sapo_temperature_*``,
  ``vespo_k_*`` / ``vespo_lambda_*``, ``beta`` (k3 against ``ref_per_token_logps``) with
  ``use_bias_correction_kl`` (TRL's default), ``temperature``;
- ``off_policy_mask_threshold`` (from ``sampling_per_token_logps``, else the old log-probs, as TRL),
  ``top_entropy_quantile`` (on several processes the cut is the quantile of every process's tokens, gathered as
  TRL's ``get_high_entropy_mask`` does, through the fused loss's ``entropy_threshold_fn``), ``entropy_coef`` (the
  bonus is a mean over the kept tokens divided by the accumulation steps only, whatever the loss type's
  normaliser: the coefficient handed to the fused loss undoes the loss type's scale) and ``use_adaptive_entropy``
  (TRL's controller: the coefficient applied while the last window's entropy is at most ``entropy_target``, then
  moved by ``entropy_coef_delta`` from the window's entropy over every process, on TRL's own state, which TRL's
  checkpoints save);
- TRL's metrics ``kl``, ``entropy``, ``clip_ratio/low_mean``, ``high_mean``, ``region_mean`` (clip family),
  ``cispo_clip_ratio``, ``vespo/phi_seq_mean``, ``policy_loss`` with the entropy bonus (means over all processes,
  in TRL's units: the clip ratios per token, or per row with sequence-level ratios, of the ratio capped at
  ``delta``); ``clip_ratio/low_min`` / ``high_max`` (per-sequence extremes) are not computed by the fused kernel.
- the model's own logit scale and final cap (Gemma, Cohere, Granite, ...: :mod:`cppo.step.head`), as TRL's fused
  head applies them, the temperature dividing the result;
- vLLM's importance-sampling correction: the ratio of :mod:`cppo.trl.sampling` (computed on the kept rows, in any
  of TRL's four modes) goes in as ``importance_weights``, multiplied into the policy term only (VESPO folds it into
  its gamma weight), as TRL does;
- ``router_aux_loss_coef``: the mixture-of-experts load-balancing loss of the model's own forward, added as TRL does;
- a sharded LM head (FSDP2, DeepSpeed ZeRO-3): the weight is read where the engine has it gathered
  (:mod:`cppo.trl.sharding`), and its gradient is reduced by the engine as every other parameter's;

:func:`unsupported_setting` names the first setting the fused loss cannot express; the trainer then runs TRL's own
``_compute_loss`` (on the kept completions).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from accelerate.utils import is_peft_model
from torch import Tensor

from cppo_kernels import fused_cppo_loss
from cppo_kernels.config import LOSS_TYPES

from ..step import LogitTransform, check_logit_transform
from .sharding import gathered_head

__all__ = [
    "LOSS_AGG", "SURROGATE", "unsupported_setting", "install_hidden_forward",
    "model_logit_transform", "padded_hidden", "fused_policy_loss",
]  # fmt: skip

#: TRL ``loss_type`` -> ``fused_cppo_loss`` ``loss_agg`` and ``surrogate`` (the PPO clip for the others): the
#: kernels' one table (:data:`cppo_kernels.config.LOSS_TYPES`, which ``cppo train``'s ``loss.loss_type`` reads too).
LOSS_AGG = {name: agg for name, (_, agg) in LOSS_TYPES.items()}
SURROGATE = {name: surrogate for name, (surrogate, _) in LOSS_TYPES.items() if surrogate != "clip"}
#: The loss types TRL normalises by ``num_items_in_batch`` (the tokens of the whole generation batch).
ITEM_NORMALISED = ("dapo", "cispo", "vespo")


def unsupported_setting(trainer) -> str | None:
    """The first setting of ``trainer`` (a ``GRPOTrainer``) that ``fused_cppo_loss`` cannot express, as
    ``name=value``; None when the fused loss computes TRL's loss exactly."""
    checks = (
        (trainer.loss_type not in LOSS_AGG, f"loss_type={trainer.loss_type!r}"),
        (
            trainer.aux_loss_enabled and aux_loss_function(trainer.model) is None,
            f"router_aux_loss_coef={trainer.router_aux_loss_coef} ({type(trainer.model).__name__}'s modeling module "
            "has no load_balancing_loss_func)",
        ),
        (
            _fsdp_version(trainer) == 1,
            "FSDP version 1 (its LM head is a flat-parameter shard outside the forward: use FSDP2)",
        ),
    )
    return next((name for bad, name in checks if bad), None)


def _fsdp_version(trainer) -> int | None:
    """accelerate's FSDP plugin version (1 or 2), None without FSDP."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return getattr(plugin, "fsdp_version", None) if getattr(trainer, "is_fsdp_enabled", False) else None


def _vllm_correction(trainer) -> bool:
    """Whether TRL multiplies its policy term by vLLM's importance-sampling ratio (``inputs`` then hold it)."""
    return bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)


def aux_loss_function(model) -> Callable | None:
    """The mixture-of-experts load-balancing loss that ``model``'s own forward adds with ``output_router_logits``
    (the ``load_balancing_loss_func`` of its transformers modeling module, as TRL's ``aux_loss``); None if none."""
    inner = model.get_base_model() if is_peft_model(model) else model
    for cls in type(inner).__mro__:  # FSDP2 and PEFT subclass the model's class
        fn = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if fn is not None:
            return fn
    return None


def install_hidden_forward(model) -> None:
    """Lets ``model(..., cppo_hidden_states=True)`` return the backbone's final hidden states ``[B, L, H]`` (no LM
    head, no cache), through whatever wraps the model (DDP, PEFT) as TRL's own ``fused_lm_head=True`` does; with
    ``cppo_aux_loss=True`` also the mixture-of-experts load-balancing loss of those rows, as the model's own forward
    computes it (:func:`aux_loss_function`). Any other call is the previous forward, unchanged (generation
    included)."""
    inner = model.get_base_model() if is_peft_model(model) else model
    previous = inner.forward

    @functools.wraps(previous)
    def forward(*args, cppo_hidden_states: bool = False, cppo_aux_loss: bool = False, **kwargs):
        if not cppo_hidden_states:
            return previous(*args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k != "labels"}  # PEFT passes labels=None
        kwargs["use_cache"] = False
        if not cppo_aux_loss:
            return inner.base_model(*args, **kwargs).last_hidden_state
        out = inner.base_model(*args, **kwargs, output_router_logits=True)
        aux = aux_loss_function(inner)(
            out.router_logits, inner.num_experts, inner.num_experts_per_tok, kwargs.get("attention_mask")
        )
        return out.last_hidden_state, aux

    inner.forward = forward


def model_logit_transform(trainer) -> LogitTransform:
    """The logit scale and cap of ``trainer``'s model, read from its config as TRL's ``add_fused_lm_head`` reads it
    and checked once against the model's own logits through the hidden-state forward the fused passes use
    (:func:`install_hidden_forward`); a model whose head does anything else is refused in one line."""
    model = trainer.accelerator.unwrap_model(trainer.model)

    def hidden(ids: Tensor) -> Tensor:
        return model(input_ids=ids, cppo_hidden_states=True)

    return check_logit_transform(model, hidden_forward=hidden)


def _head_inputs(trainer, hidden: Tensor, model) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(hidden, weight, bias)`` in one dtype: the head's (fp32) with ``cast_lm_head_to_fp32``, else the hidden
    states' (what autocast gives a linear layer). Read after ``model``'s forward, where FSDP2 keeps it gathered
    (:func:`cppo.trl.sharding.gathered_head`: a whole tensor, or a ValueError)."""
    weight, bias = gathered_head(trainer, trainer.accelerator.unwrap_model(model))
    dtype = weight.dtype if trainer.args.cast_lm_head_to_fp32 else hidden.dtype
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _scale(trainer, num_tokens: Tensor, num_items: Tensor) -> Tensor | float:
    """What TRL divides its aggregate by beyond the aggregation itself: the gradient-accumulation steps (grpo,
    bnpo, dr_grpo, sapo, luspo), or for dapo, cispo and vespo the tokens of one accumulation window over the
    processes (the fused token mean is turned back into a sum over this micro-batch's ``num_tokens`` first)."""
    train = trainer.model.training
    if trainer.loss_type not in ITEM_NORMALISED:
        return 1.0 / trainer.current_gradient_accumulation_steps if train else 1.0
    normalizer = num_items.clamp(min=1.0) / trainer.accelerator.num_processes
    if train:
        normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    return num_tokens / normalizer


def padded_hidden(trainer, model, inputs: dict) -> tuple[Tensor, Tensor | None]:
    """``([B, C, H], aux)``: hidden states of TRL's padded ``[B, P + C]`` rows at the positions that predict the
    completion tokens (position t predicts token t + 1: the C positions before the last), and with TRL's
    ``aux_loss_enabled`` the rows' mixture-of-experts load-balancing loss (else None)."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)  # [B, L]
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)  # [B, L]
    width, aux = completion_ids.size(1), trainer.aux_loss_enabled
    with trainer.accelerator.autocast():
        out = model(input_ids=input_ids, attention_mask=attention_mask, cppo_hidden_states=True, cppo_aux_loss=aux)
    hidden, aux_loss = out if aux else (out, None)  # [B, L, H]
    return hidden[:, -width - 1 : -1], aux_loss


def fused_policy_loss(trainer, model, inputs: dict, hidden: Tensor | None = None) -> Tensor:
    """TRL's policy loss of the batch ``inputs`` (the layout ``_generate_and_score_completions`` returns) from
    ``model``'s hidden states through ``fused_cppo_loss``; TRL's loss metrics appended to ``trainer._metrics``.
    ``hidden [B, C, H]``: those of the completion positions, already computed (prefix sharing,
    :mod:`cppo.trl.packing`); None: from TRL's padded rows (:func:`padded_hidden`)."""
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    aux_loss = None
    if hidden is None:
        hidden, aux_loss = padded_hidden(trainer, model, inputs)
    hidden, weight, bias = _head_inputs(trainer, hidden, model)  # [B, C, H]
    args, loss_type = trainer.args, trainer.loss_type
    surrogate = SURROGATE.get(loss_type, "clip")
    off_policy = trainer.off_policy_mask_threshold is not None
    scale = _scale(trainer, completion_mask.sum(), inputs["num_items_in_batch"])
    weights = {}
    if _vllm_correction(trainer):  # TRL's [B, C] (token modes) or [B, 1] (sequence modes) ratio, a constant
        ratio = inputs["importance_sampling_ratio"]
        weights["importance_weights"] = ratio.squeeze(1) if ratio.size(1) == 1 else ratio  # [B, C] or [B]
    with torch.autocast(hidden.device.type, enabled=False):
        loss, metrics = fused_cppo_loss(
            hidden, weight, completion_ids, inputs["advantages"], mask=completion_mask, bias=bias,
            old_logprobs=inputs.get("old_per_token_logps"),
            ref_logprobs=inputs.get("ref_per_token_logps") if trainer.beta != 0.0 else None,
            sampling_logprobs=inputs.get("sampling_per_token_logps") if off_policy else None,
            temperature=trainer.temperature, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high,
            beta=trainer.beta, kl_estimator="k3", importance_sampling=trainer.importance_sampling_level,
            loss_agg=LOSS_AGG[loss_type], compute_entropy=True, surrogate=surrogate,
            max_completion_length=trainer.max_completion_length if loss_type == "dr_grpo" else None,
            delta=args.delta if surrogate == "clip" else None,
            sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            use_bias_correction_kl=trainer.beta != 0.0 and bool(args.use_bias_correction_kl),
            off_policy_mask_threshold=trainer.off_policy_mask_threshold,
            top_entropy_quantile=float(trainer.top_entropy_quantile), entropy_coef=_entropy_coef(trainer, scale),
            entropy_threshold_fn=_gathered_cut(trainer), **trainer.logit_transform.kwargs(), **weights,
        )  # fmt: skip
    _adapt_entropy_coef(trainer, metrics)
    _log_metrics(trainer, metrics, scale, inputs["advantages"], completion_mask)
    loss = loss * scale
    if aux_loss is None:
        return loss
    mode = "train" if trainer.model.training else "eval"  # TRL's aux term: scaled for accumulation only
    normalizer = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    trainer._metrics[mode]["aux_loss"].append(trainer.accelerator.gather_for_metrics(aux_loss).mean().item())
    return loss + trainer.router_aux_loss_coef * aux_loss / normalizer


def _entropy_coef(trainer, scale: Tensor | float) -> float:
    """The ``entropy_coef`` of the fused loss: TRL subtracts ``entropy_coef`` times the mean entropy divided by the
    accumulation steps only, whatever the loss type's own normaliser, and the fused loss comes back multiplied by
    ``scale``: the coefficient divides that scale out (0 for a micro-batch without tokens: no entropy to reward)."""
    if not trainer._entropy_bonus_enabled:
        return 0.0
    coef = trainer.entropy_coef
    if trainer.use_adaptive_entropy and trainer._last_world_entropy > trainer.args.entropy_target:
        coef = 0.0  # TRL's gate, from the end of the previous optimizer step
    accumulation = trainer.current_gradient_accumulation_steps if trainer.model.training else 1
    scale = float(scale)
    return 0.0 if scale == 0.0 else float(coef) / (accumulation * scale)


def _gathered_cut(trainer) -> Callable[[Tensor], Tensor | float] | None:
    """On several processes with ``top_entropy_quantile < 1``: the entropy mask's cut as TRL's
    ``get_high_entropy_mask`` takes it, the quantile of every process's counted tokens (padded across processes with
    a negative sentinel, gathered, the sentinel dropped); None on one process (the call's own quantile is that)."""
    if trainer.top_entropy_quantile >= 1.0 or trainer.accelerator.num_processes == 1:
        return None
    accelerator, pad = trainer.accelerator, -1e9

    def cut(local: Tensor) -> Tensor | float:
        padded = accelerator.pad_across_processes(local.to(accelerator.device), dim=0, pad_index=pad)
        gathered = accelerator.gather(padded)
        gathered = gathered[gathered != pad]
        if gathered.numel() == 0:  # no process has a token: the mask has nothing to cut
            return 0.0
        return torch.quantile(gathered, 1.0 - trainer.top_entropy_quantile)

    return cut


def _adapt_entropy_coef(trainer, metrics: dict[str, Tensor]) -> None:
    """TRL's adaptive entropy controller (``use_adaptive_entropy``, training only): the micro-batch's entropy sum
    and token count over the tokens the bonus acts on (the entropy mask's, with ``top_entropy_quantile``) are added
    to the window; at the optimizer step the window's totals over every process move ``entropy_coef`` by
    ``entropy_coef_delta`` towards ``entropy_target`` (within its bounds) and set the gate of the next window."""
    if not (trainer.use_adaptive_entropy and trainer.model.training):
        return
    count = metrics["num_tokens"]
    mean = metrics["entropy"]
    if "entropy_mask_fraction" in metrics:  # the tokens at or above the cut
        count = torch.round(metrics["entropy_mask_fraction"] * count)
        mean = metrics["entropy_masked_mean"]
    stats = torch.stack([mean * count, count]).to(trainer.accelerator.device)
    window = trainer._entropy_window_stats
    trainer._entropy_window_stats = stats if window is None else window + stats
    if not trainer.accelerator.sync_gradients:
        return
    totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
    world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
    args = trainer.args
    if world_entropy <= args.entropy_target:
        trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
    else:
        trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
    trainer._last_world_entropy = world_entropy
    trainer._entropy_window_stats = None


def _clip_counts(trainer, metrics: dict[str, Tensor], advantages: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """This process's counts behind TRL's clip ratios, each with its denominator as ``name -> [count, units]``: the
    units are TRL's, the completion tokens with token-level ratios and the rows (one ratio each, an empty row's 1)
    with ``importance_sampling_level="sequence"``; and with ``delta`` TRL tests the ratio capped at ``delta``, so
    ``min(r, delta) > 1 + epsilon_high`` (never, unless ``delta`` exceeds that bound) and ``min(r, delta) < 1 -
    epsilon_low`` (every ``A < 0`` unit once ``delta`` is below that bound), each compared in fp32 as TRL's."""
    sequence = trainer.importance_sampling_level == "sequence"
    prefix = "seq_" if sequence else ""
    units = metrics["num_tokens"].new_tensor(float(advantages.shape[0])) if sequence else metrics["num_tokens"]
    if trainer.loss_type == "cispo":
        return {"cispo_clip_ratio": torch.stack([metrics[prefix + "cispo_clip_fraction"] * units, units])}
    low, high = (metrics[f"{prefix}clip_fraction_{side}"] * units for side in ("low", "high"))
    delta = trainer.args.delta
    if delta is not None:
        bounds = [delta, 1 - trainer.epsilon_low, 1 + trainer.epsilon_high]
        delta, low_bound, high_bound = torch.tensor(bounds, dtype=torch.float32)  # TRL compares in fp32
        if not delta > high_bound:
            high = torch.zeros_like(high)
        if delta < low_bound:  # every A < 0 unit
            negative = (advantages < 0).to(units.dtype)  # [B]
            low = negative.sum() if sequence else (negative[:, None] * mask).sum()
    counts = {"low_mean": low, "high_mean": high, "region_mean": low + high}  # the two events are disjoint
    return {f"clip_ratio/{k}": torch.stack([v.to(units.dtype), units]) for k, v in counts.items()}


def _log_metrics(trainer, metrics: dict[str, Tensor], scale: Tensor | float, advantages: Tensor, mask: Tensor) -> None:
    """TRL's loss metrics, each as TRL's ``global_masked_mean`` reduces it (this process's sum and count, summed over
    all processes): ``kl`` and ``entropy`` over the completion tokens, the clip ratios over TRL's units
    (:func:`_clip_counts`), VESPO's weight over the rows of ``advantages [B]``; with the entropy bonus the policy
    loss (TRL's mean over the processes of each one's policy loss as TRL divides it: by the items for dapo, cispo
    and vespo, not by the accumulation steps)."""
    loss_type, tokens = trainer.loss_type, metrics["num_tokens"]
    rows = tokens.new_tensor(float(advantages.shape[0]))
    pairs = {"kl": torch.stack([metrics["kl"] * tokens, tokens])} if trainer.beta != 0.0 else {}
    pairs["entropy"] = torch.stack([metrics["entropy"] * tokens, tokens])
    if loss_type not in SURROGATE or loss_type == "cispo":
        pairs.update(_clip_counts(trainer, metrics, advantages, mask))
    elif loss_type == "vespo":
        pairs["vespo/phi_seq_mean"] = torch.stack([metrics["vespo_phi_mean"] * rows, rows])
    if trainer._entropy_bonus_enabled:
        policy = metrics["policy_loss"] * (scale if loss_type in ITEM_NORMALISED else 1.0)
        pairs["policy_loss"] = torch.stack([policy, tokens.new_tensor(1.0)])  # a mean over the processes
    stacked = torch.stack(list(pairs.values())).to(trainer.accelerator.device)  # [metrics, 2]
    totals = trainer.accelerator.reduce(stacked, reduction="sum")
    means = (totals[:, 0] / totals[:, 1].clamp(min=1.0)).tolist()
    logged = trainer._metrics["train" if trainer.model.training else "eval"]
    for name, value in zip(pairs, means):
        logged[name].append(value)
    if trainer._entropy_bonus_enabled and trainer.model.training and trainer.accelerator.sync_gradients:
        logged["entropy_coef"].append(trainer.entropy_coef)
