"""The model's own logit transform: what a causal LM does to ``h W^T + b`` before its logits, read from its config as
TRL's ``add_fused_lm_head`` reads it (``trl/trainer/utils.py``), and checked once against the model's own logits.

The fused ops compute ``logit_softcap * tanh((h W^T + b) * logit_scale / logit_softcap)`` (no tanh without a cap;
the temperature then divides it, as TRL divides ``model(...).logits``). The config names them per family:

- ``final_logit_softcapping``: the cap (Gemma 2 / 3, Gemma 3n, VaultGemma, nanochat, Muse); RecurrentGemma's
  ``logits_soft_cap`` and xLSTM's ``output_logit_soft_cap`` too (TRL reads neither);
- ``logit_scale`` (Cohere, Cohere 2), ``output_multiplier`` (Muse) or ``lm_head_multiplier`` (Falcon-H1): the scale;
- ``logits_scaling``: the scale's inverse (Granite, MiniCPM 3), the scale itself for HyperCLOVA X.

A model whose head does anything else (masks tokens, slices the vocabulary, a transform under another name) would
train on wrong log-probs without a word: :func:`check_logit_transform` runs the model once on a few tokens and
refuses it, in one line naming its class, when its log-probs are not those of the transform read here.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from .models import decoder, lm_head

__all__ = [
    "LogitTransform", "logit_transform", "config_logit_transform", "check_logit_transform", "CAP_NAMES", "PROBE_TOKENS"
]  # fmt: skip

#: The config fields that name the final tanh cap, the first one set counts.
CAP_NAMES = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
#: Tokens of the one forward that checks a model's transform (ids 0, 1, ..., in range of any vocabulary).
PROBE_TOKENS = 8


class LogitTransform(NamedTuple):
    """The keywords ``logit_scale`` and ``logit_softcap`` of ``fused_cppo_loss`` / ``fused_logprobs``."""

    logit_scale: float = 1.0
    logit_softcap: float | None = None

    def kwargs(self) -> dict[str, float | None]:
        return {"logit_scale": self.logit_scale, "logit_softcap": self.logit_softcap}


def logit_transform(model) -> LogitTransform:
    """The scale and cap of ``model``'s logits: :func:`config_logit_transform` of its config, errors naming its
    class."""
    return config_logit_transform(model.config, type(model).__name__)


def config_logit_transform(config, owner: str) -> LogitTransform:
    """The scale and cap of the logits of a model with ``config`` (its text config), TRL's reading:
    ``final_logit_softcapping`` (else RecurrentGemma's ``logits_soft_cap`` or xLSTM's ``output_logit_soft_cap``);
    the first set of ``logit_scale``, ``output_multiplier``, ``lm_head_multiplier``, and ``1 / logits_scaling``
    (``logits_scaling`` itself for HyperCLOVA X); 1.0 and no cap when none is set. Every field read must be a finite
    number > 0 (a scale of 0, a cap of 0, ``logits_scaling=0``: a one-line ``ValueError`` naming ``owner``, the
    model's class, and the field, before any arithmetic on it)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def first(names: tuple[str, ...]) -> float | None:
        name = next((n for n in names if getattr(text, n, None) is not None), None)
        return None if name is None else _positive(owner, name, getattr(text, name))

    cap = first(CAP_NAMES)
    scale = first(("logit_scale", "output_multiplier", "lm_head_multiplier"))
    scaling = first(("logits_scaling",)) if scale is None else None
    if scaling is not None:
        inverse = getattr(text, "model_type", None) != "hyperclovax"
        scale = _positive(owner, "1 / logits_scaling", 1.0 / scaling) if inverse else scaling
    return LogitTransform(1.0 if scale is None else scale, cap)


def _positive(owner: str, field: str, value) -> float:
    """``value`` (the config's ``field``) as a float when it is a finite real number > 0, else a one-line
    ``ValueError`` naming ``owner`` (the model's class) and the field."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < float(value) < math.inf
    if not ok:
        raise ValueError(f"{owner}: its config's {field} is {value!r}; the fused head needs a finite number > 0")
    return float(value)


def _transformed(hidden: torch.Tensor, weight: torch.Tensor, bias, t: LogitTransform) -> torch.Tensor:
    """fp32 ``[..., V]``: the transform of ``hidden @ weight^T + bias``."""
    y = hidden.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    y = y * t.logit_scale
    return y if t.logit_softcap is None else torch.tanh(y / t.logit_softcap) * t.logit_softcap


@torch.no_grad()
def check_logit_transform(model, *, hidden_forward=None) -> LogitTransform:
    """:func:`logit_transform` of ``model``, after one forward of :data:`PROBE_TOKENS` tokens (in eval mode, no
    gradients) shows that ``log_softmax`` of the model's own logits equals that of the transform of its final hidden
    states (``hidden_forward(ids)``, by default its decoder's ``last_hidden_state``) and LM head, within
    ``1e-3 + 2 eps (1 + max |logit|)`` nats (eps of the logits' dtype); else a one-line ``ValueError`` naming the
    model's class."""
    t = logit_transform(model)
    name = type(model).__name__
    weight, bias = lm_head(model)
    ids = (torch.arange(PROBE_TOKENS, device=weight.device) % weight.shape[0]).unsqueeze(0)  # [1, P]
    if hidden_forward is None:
        hidden_forward = lambda x: decoder(model)(input_ids=x, use_cache=False).last_hidden_state  # noqa: E731
    training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids, use_cache=False).logits  # [1, P, V]
        hidden = hidden_forward(ids)  # [1, P, H]
    except Exception as err:  # noqa: BLE001  (any failure of the model's forward: one line naming the model)
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(
            f"{name}: its forward on {PROBE_TOKENS} tokens, which checks its logit transform, failed "
            f"({type(err).__name__}: {message})"
        ) from None
    finally:
        model.train(training)
    if logits.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"{name}: its logits have {logits.shape[-1]} columns but its LM head {weight.shape[0]} rows; cppo's fused "
            "head cannot compute this model's log-probs"
        )
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{name}: its LM head takes {weight.shape[1]} features but its final hidden states have "
            f"{hidden.shape[-1]} (a projection between them); cppo's fused head cannot compute this model's log-probs"
        )
    want = torch.log_softmax(logits.float(), dim=-1)
    got = torch.log_softmax(_transformed(hidden, weight, bias, t), dim=-1)
    error = float((got - want).abs().max())
    tol = 1e-3 + 2 * torch.finfo(logits.dtype).eps * (1 + float(logits.float().abs().max()))
    if not error <= tol:
        raise ValueError(
            f"{name}: its logits are not softcap * tanh((h W^T + b) * scale / softcap) of its final hidden states "
            f"with the scale {t.logit_scale} and cap {t.logit_softcap} its config gives (log-probs {error:.3g} nats "
            "apart); cppo's fused head would train on wrong log-probs, so this model is not supported"
        )
    return t
