"""Each distinct prompt prefilled once: ``generate`` over rows that repeat their prompts (a question's G
completions) runs each distinct prompt's forward once, copies its KV cache to the rows that share it and decodes
from there, instead of running the same prompt G times.

Uses transformers' own continuation from a cache (``generate(..., cache=...)``: the cached positions are skipped),
so the decoding loop, the logits processors and the random draws are ``generate``'s.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["generate_prefilled_once", "prefill_once_applies"]


def prefill_once_applies(model, generation_config) -> bool:
    """Whether :func:`generate_prefilled_once` can run ``generation_config`` on ``model``: one sequence per row
    (no beams, ``num_return_sequences`` 1), the default dynamic cache (no ``cache_implementation``, neither in the
    config nor in the model's own), no chunked prefill, and a forward without dropout (a dropout draw in the prompt's
    forward would be shared by its rows and change the random stream)."""

    configs = (generation_config, getattr(model, "generation_config", None))

    def value(name: str, default):  # transformers 5 leaves unset fields None: the model's own, else the default
        return next((getattr(c, name) for c in configs if getattr(c, name, None) is not None), default)

    if value("cache_implementation", None) is not None or value("prefill_chunk_size", None) is not None:
        return False
    if not value("use_cache", True) or value("num_beams", 1) != 1 or value("num_return_sequences", 1) != 1:
        return False
    return not (model.training and _has_dropout(model))


def generate_prefilled_once(
    model, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, generate=None, **generate_kwargs
):
    """``model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)`` with each distinct
    row's prompt prefilled once (``generate``: the generate method to continue with; default ``model.generate``).

    ``input_ids`` / ``attention_mask`` ``[N, L]``, left-padded; rows equal in both share one prefill. The distinct
    rows' first ``L - 1`` positions run one forward (position ids from the mask, as ``generate`` derives them), its
    KV cache is copied to the ``N`` rows (``Cache.batch_select_indices``), and ``generate`` continues: it runs the
    last prompt position of every row, then decodes as always. Every row keeps its own padding, mask and positions,
    so the tokens are those of the plain call (the logits within fp32 rounding: the prefill's batch is smaller), and
    sampling draws the same ``[N, V]`` multinomials from the same RNG. One forward more than the plain call on every
    rank whatever the rows hold, so FSDP / ZeRO-3 ranks (``synced_gpus``) stay in step. The caller checks
    :func:`prefill_once_applies` first.
    """
    from transformers import Cache

    pad_column = input_ids.size(1) < 2  # a one-token prompt: one masked column in front, so that L - 1 >= 1
    if pad_column:
        input_ids = torch.nn.functional.pad(input_ids, (1, 0))  # [N, 2]
        attention_mask = torch.nn.functional.pad(attention_mask, (1, 0))  # [N, 2]
    rows = torch.cat([input_ids * attention_mask, attention_mask], dim=1)  # [N, 2L]: a row's prompt and its padding
    distinct, index = torch.unique(rows, dim=0, return_inverse=True)  # [U, 2L], [N]
    first = torch.full((len(distinct),), len(rows), device=rows.device).scatter_reduce(
        0, index, torch.arange(len(rows), device=rows.device), "amin"
    )  # [U]: a row holding each distinct prompt
    ids, mask = input_ids[first, :-1], attention_mask[first, :-1]  # [U, L - 1]
    forward = _forward_parameters(model)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}  # the logits are not used
    if "position_ids" in forward:  # (generate passes them to a model that takes them; others count from the cache)
        extra["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # [U, L - 1]: generate's rule
    name = _cache_name()
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **extra)
    cache = out.get(name)
    if not isinstance(cache, Cache):
        raise ValueError(
            f"prefill_once: {type(model).__name__}'s forward returned no KV cache to share; set prefill_once to false"
        )
    cache.batch_select_indices(index)  # [U, ...] -> [N, ...]: each row gets its prompt's keys and values
    generate = model.generate if generate is None else generate
    result = generate(input_ids=input_ids, attention_mask=attention_mask, **{name: cache}, **generate_kwargs)
    if not pad_column:
        return result
    if isinstance(result, torch.Tensor):
        return result[:, 1:]
    result.sequences = result.sequences[:, 1:]
    return result


def _cache_name() -> str:
    """The name transformers gives the KV cache in ``forward``, ``generate`` and model outputs (``past_key_values``
    before 5.x renamed it ``cache``)."""
    from transformers import GenerationMixin

    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _forward_parameters(model) -> set[str]:
    """The keyword names the causal LM's ``forward`` takes (through a PEFT wrapper, its base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.forward).parameters)


def _has_dropout(model) -> bool:
    """A dropout that fires in training mode: an ``nn.Dropout`` module with p > 0 or a config's attention dropout."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    return bool(getattr(config, "attention_dropout", 0.0))
