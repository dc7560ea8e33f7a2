"""The policy loss of :class:`cppo.trl.CPPOTrainer` through :func:`cppo_kernels.fused_cppo_loss`.

TRL 1.16's ``_compute_loss`` (``grpo_trainer.py`` line 3020) computes per-token log-probs through its chunked LM
head, then the clipped ratio, k3 KL and its ``loss_type``'s aggregation in PyTorch. Here the policy's final hidden
states of the positions that predict the completion tokens go to ``fused_cppo_loss`` with the LM-head weight, which
computes the same loss (and its gradients) without ``[tokens x vocab]`` logits:

- ``loss_type`` (all eight of TRL 1.16), read in one place: :func:`loss_settings` turns the trainer's settings into
  a :class:`cppo_kernels.LossConfig` and a :class:`ScaleRule` through :data:`LOSS_TABLE` (the surrogate: cispo,
  sapo and vespo by name, the PPO clip for the others; the aggregation: ``grpo`` / ``sapo`` =
  ``seq-mean-token-mean``, ``bnpo`` / ``dapo`` / ``cispo`` / ``vespo`` = ``token-mean``, ``dr_grpo`` =
  ``seq-mean-token-sum-norm`` over ``max_completion_length``, ``luspo`` = ``seq-mean-token-sum``; the scale:
  ``dapo`` / ``cispo`` / ``vespo`` by TRL's ``num_items_in_batch`` normaliser, the others by the
  gradient-accumulation steps, as TRL does); everything else here asks that result, never the name;
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

import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate.utils import is_peft_model
from torch import Tensor

from cppo_kernels import LossConfig, fused_cppo_loss
from cppo_kernels.config import LOSS_TYPES

from ..step import LogitTransform, check_logit_transform
from .sharding import gathered_head

__all__ = [
    "LOSS_TABLE", "ScaleRule", "loss_settings", "unsupported_setting", "install_hidden_forward",
    "model_logit_transform", "head_inputs", "padded_hidden", "fused_policy_loss",
]  # fmt: skip


@dataclass(frozen=True)
class ScaleRule:
    """What TRL 1.16's ``_compute_loss`` divides a loss type's aggregate by beyond the aggregation itself
    (``grpo_trainer.py`` 3166-3196): ``"accumulation"``, the gradient-accumulation steps (in training; grpo, bnpo,
    dr_grpo, sapo, luspo), or ``"items"``, TRL's ``num_items_in_batch`` normaliser: the tokens of the generation
    batch over all processes, brought to one process's accumulation window (dapo, cispo, vespo: the micro-batch's
    token sum over it). The fused loss comes back as its ``loss_agg``'s aggregate; :meth:`scales` says what
    multiplies it into TRL's loss and TRL's ``policy_loss`` metric."""

    normaliser: str

    def __post_init__(self) -> None:
        if self.normaliser not in ("accumulation", "items"):
            raise ValueError(f"ScaleRule.normaliser must be 'accumulation' or 'items', got {self.normaliser!r}")

    def scales(self, trainer, num_tokens: Tensor, num_items: Tensor) -> tuple[Tensor | float, Tensor | float]:
        """``(loss, logged)`` for a micro-batch of ``num_tokens`` completion tokens out of ``num_items`` (TRL's
        ``num_items_in_batch``): the fused aggregate times ``loss`` is TRL's loss, times ``logged`` TRL's
        ``policy_loss`` metric (the loss before the accumulation steps divide it, or with ``items`` the loss
        itself: TRL's normaliser already counts one window)."""
        train = trainer.model.training
        if self.normaliser == "accumulation":
            return (1.0 / trainer.current_gradient_accumulation_steps if train else 1.0), 1.0
        normalizer = num_items.clamp(min=1.0) / trainer.accelerator.num_processes
        if train:
            normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
        scale = num_tokens / normalizer  # the fused token mean turned back into this micro-batch's sum first
        return scale, scale

    @staticmethod
    def fused_entropy_coef(trainer, coef: float, scale: Tensor | float) -> float:
        """The fused loss's ``entropy_coef`` for TRL's ``coef``: TRL subtracts ``coef`` times the mean entropy
        divided by the accumulation steps only, whatever the loss type's normaliser, and the fused loss comes back
        multiplied by ``scale`` (the ``loss`` of :meth:`scales`): the coefficient divides that scale out (0 for a
        micro-batch without tokens: no entropy to reward)."""
        accumulation = trainer.current_gradient_accumulation_steps if trainer.model.training else 1
        scale = float(scale)
        return 0.0 if scale == 0.0 else float(coef) / (accumulation * scale)


#: TRL 1.16's ``loss_type`` -> how TRL normalises its aggregate (:class:`ScaleRule`).
_NORMALISERS = {
    "grpo": "accumulation", "bnpo": "accumulation", "dr_grpo": "accumulation", "dapo": "items", "cispo": "items",
    "sapo": "accumulation", "luspo": "accumulation", "vespo": "items",
}  # fmt: skip
#: TRL 1.16's ``loss_type`` -> ``(surrogate, loss_agg, scale rule)``: the surrogate and aggregation are the kernels'
#: one table (:data:`cppo_kernels.config.LOSS_TYPES`, which ``cppo train``'s ``loss.loss_type`` reads too), the scale
#: rule how TRL normalises that aggregate. The one reader of a ``loss_type`` in :mod:`cppo.trl` is
#: :func:`loss_settings`, through this table.
LOSS_TABLE: dict[str, tuple[str, str, ScaleRule]] = {
    name: (surrogate, agg, ScaleRule(_NORMALISERS[name])) for name, (surrogate, agg) in LOSS_TYPES.items()
}


def loss_settings(trainer) -> tuple[LossConfig, ScaleRule]:
    """``(LossConfig, ScaleRule)`` of ``trainer``'s (a ``GRPOTrainer``) settings, read where TRL's ``_compute_loss``
    reads them (the trainer's copies of ``GRPOConfig``'s ``loss_type``, ``beta``, ``epsilon_low`` / ``high``, ...,
    else ``args``), ``loss_type`` through :data:`LOSS_TABLE`. ``entropy_coef`` is the coefficient TRL applies in the
    current accumulation window (0 without the bonus, or while the adaptive controller's gate is shut), in TRL's
    units: :meth:`ScaleRule.fused_entropy_coef` gives the fused loss's. A ``ValueError`` names a ``loss_type`` the
    table lacks or a setting ``LossConfig`` refuses."""
    if trainer.loss_type not in LOSS_TABLE:
        raise ValueError(f"loss_type={trainer.loss_type!r}")
    surrogate, loss_agg, scale = LOSS_TABLE[trainer.loss_type]
    args, beta = trainer.args, trainer.beta
    bias_corrected = beta != 0.0 and bool(args.use_bias_correction_kl)
    coef = trainer.entropy_coef if trainer._entropy_bonus_enabled else 0.0
    if trainer.use_adaptive_entropy and trainer._last_world_entropy > args.entropy_target:
        coef = 0.0  # TRL's gate, from the end of the previous optimizer step
    config = LossConfig(
        temperature=trainer.temperature, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high,
        beta=beta, kl_estimator="k3", importance_sampling=trainer.importance_sampling_level, loss_agg=loss_agg,
        max_completion_length=trainer.max_completion_length if loss_agg == "seq-mean-token-sum-norm" else None,
        compute_entropy=True, surrogate=surrogate, delta=args.delta if surrogate == "clip" else None,
        sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
        vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg, use_bias_correction_kl=bias_corrected,
        off_policy_mask_threshold=trainer.off_policy_mask_threshold,
        top_entropy_quantile=float(trainer.top_entropy_quantile), entropy_coef=float(coef),
    )  # fmt: skip
    return config, scale


def unsupported_setting(trainer) -> str | None:
    """The first setting of ``trainer`` (a ``GRPOTrainer``) that ``fused_cppo_loss`` cannot express, as
    ``name=value``; None when the fused loss computes TRL's loss exactly."""
    refused = _refused_loss(trainer)
    checks = (
        (refused is not None, refused),
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


def _refused_loss(trainer) -> str | None:
    """Why :func:`loss_settings` refuses ``trainer``'s settings (a ``loss_type`` outside the table, or a value
    ``LossConfig`` refuses, e.g. ``epsilon >= 1``), None when it takes them."""
    try:
        loss_settings(trainer)
    except ValueError as e:
        return str(e)
    return None


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


def head_inputs(trainer, hidden: Tensor, model) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(hidden, weight, bias)`` in one dtype: the head's (fp32) with ``cast_lm_head_to_fp32``, else the hidden
    states' (what autocast gives a linear layer). Read after ``model``'s forward, where FSDP2 keeps it gathered
    (:func:`cppo.trl.sharding.gathered_head`: a whole tensor, or a ValueError). The fused policy loss here and the
    prefix-shared passes (:mod:`cppo.trl.packing`) read the head through it."""
    weight, bias = gathered_head(trainer, trainer.accelerator.unwrap_model(model))
    dtype = weight.dtype if trainer.args.cast_lm_head_to_fp32 else hidden.dtype
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


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
    hidden, weight, bias = head_inputs(trainer, hidden, model)  # [B, C, H]
    config, rule = loss_settings(trainer)
    scale, logged = rule.scales(trainer, completion_mask.sum(), inputs["num_items_in_batch"])
    config = dataclasses.replace(config, entropy_coef=rule.fused_entropy_coef(trainer, config.entropy_coef, scale))
    weights = {}
    if _vllm_correction(trainer):  # TRL's [B, C] (token modes) or [B, 1] (sequence modes) ratio, a constant
        ratio = inputs["importance_sampling_ratio"]
        weights["importance_weights"] = ratio.squeeze(1) if ratio.size(1) == 1 else ratio  # [B, C] or [B]
    off_policy = config.off_policy_mask_threshold is not None
    with torch.autocast(hidden.device.type, enabled=False):
        loss, metrics = fused_cppo_loss(
            hidden, weight, completion_ids, inputs["advantages"], mask=completion_mask, bias=bias,
            old_logprobs=inputs.get("old_per_token_logps"),
            ref_logprobs=inputs.get("ref_per_token_logps") if config.beta != 0.0 else None,
            sampling_logprobs=inputs.get("sampling_per_token_logps") if off_policy else None,
            config=config, entropy_threshold_fn=_gathered_cut(trainer),
            **trainer.logit_transform.kwargs(), **weights,
        )  # fmt: skip
    _adapt_entropy_coef(trainer, metrics)
    _log_metrics(trainer, config, metrics, logged, inputs["advantages"], completion_mask)
    loss = loss * scale
    if aux_loss is None:
        return loss
    mode = "train" if trainer.model.training else "eval"  # TRL's aux term: scaled for accumulation only
    normalizer = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    trainer._metrics[mode]["aux_loss"].append(trainer.accelerator.gather_for_metrics(aux_loss).mean().item())
    return loss + trainer.router_aux_loss_coef * aux_loss / normalizer


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


def _clip_counts(config: LossConfig, metrics: dict[str, Tensor], advantages: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """This process's counts behind TRL's clip ratios, each with its denominator as ``name -> [count, units]``: the
    units are TRL's, the completion tokens with token-level ratios and the rows (one ratio each, an empty row's 1)
    with ``importance_sampling_level="sequence"``; and with ``delta`` TRL tests the ratio capped at ``delta``, so
    ``min(r, delta) > 1 + epsilon_high`` (never, unless ``delta`` exceeds that bound) and ``min(r, delta) < 1 -
    epsilon_low`` (every ``A < 0`` unit once ``delta`` is below that bound), each compared in fp32 as TRL's; CISPO's
    ratio against its cap. ``config``: the call's (:func:`loss_settings`)."""
    sequence = config.importance_sampling == "sequence"
    prefix = "seq_" if sequence else ""
    units = metrics["num_tokens"].new_tensor(float(advantages.shape[0])) if sequence else metrics["num_tokens"]
    if config.surrogate == "cispo":
        return {"cispo_clip_ratio": torch.stack([metrics[prefix + "cispo_clip_fraction"] * units, units])}
    low, high = (metrics[f"{prefix}clip_fraction_{side}"] * units for side in ("low", "high"))
    delta = config.delta
    if delta is not None:
        bounds = [delta, 1 - config.epsilon_low, 1 + config.eps_high]
        delta, low_bound, high_bound = torch.tensor(bounds, dtype=torch.float32)  # TRL compares in fp32
        if not delta > high_bound:
            high = torch.zeros_like(high)
        if delta < low_bound:  # every A < 0 unit
            negative = (advantages < 0).to(units.dtype)  # [B]
            low = negative.sum() if sequence else (negative[:, None] * mask).sum()
    counts = {"low_mean": low, "high_mean": high, "region_mean": low + high}  # the two events are disjoint
    return {f"clip_ratio/{k}": torch.stack([v.to(units.dtype), units]) for k, v in counts.items()}


def _log_metrics(
    trainer, config: LossConfig, metrics: dict[str, Tensor], logged: Tensor | float, advantages: Tensor, mask: Tensor
) -> None:
    """TRL's loss metrics, each as TRL's ``global_masked_mean`` reduces it (this process's sum and count, summed over
    all processes): ``kl`` and ``entropy`` over the completion tokens, the clip ratios over TRL's units
    (:func:`_clip_counts`: the clip surrogate's, or CISPO's), VESPO's weight over the rows of ``advantages [B]``;
    with the entropy bonus the policy loss (TRL's mean over the processes of each one's policy loss as TRL divides
    it: the fused one times ``logged``, :meth:`ScaleRule.scales`). ``config``: the call's (:func:`loss_settings`)."""
    tokens = metrics["num_tokens"]
    rows = tokens.new_tensor(float(advantages.shape[0]))
    pairs = {"kl": torch.stack([metrics["kl"] * tokens, tokens])} if config.beta != 0.0 else {}
    pairs["entropy"] = torch.stack([metrics["entropy"] * tokens, tokens])
    if config.surrogate in ("clip", "cispo"):
        pairs.update(_clip_counts(config, metrics, advantages, mask))
    elif config.surrogate == "vespo":
        pairs["vespo/phi_seq_mean"] = torch.stack([metrics["vespo_phi_mean"] * rows, rows])
    if trainer._entropy_bonus_enabled:
        policy = metrics["policy_loss"] * logged
        pairs["policy_loss"] = torch.stack([policy, tokens.new_tensor(1.0)])  # a mean over the processes
    stacked = torch.stack(list(pairs.values())).to(trainer.accelerator.device)  # [metrics, 2]
    totals = trainer.accelerator.reduce(stacked, reduction="sum")
    means = (totals[:, 0] / totals[:, 1].clamp(min=1.0)).tolist()
    store = trainer._metrics["train" if trainer.model.training else "eval"]
    for name, value in zip(pairs, means):
        store[name].append(value)
    if trainer._entropy_bonus_enabled and trainer.model.training and trainer.accelerator.sync_gradients:
        store["entropy_coef"].append(trainer.entropy_coef)
