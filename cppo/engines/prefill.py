"""Each distinct prompt prefilled once: ``generate`` over rows that repeat their prompts (a question's G
completions) runs each distinct prompt's forward once, copies its KV cache to the rows that share it and decodes
from there, instead of running the same prompt G times.

Uses transformers' own continuation from a cache (``generate(..., cache=...)``: the cached positions are skipped),
so the decoding loop, the logits processors and the random draws are ``generate``'s. Whether a model's cache can be
shared is probed on the cache its forward returns (:func:`cache_shares_rows`), not read from a list of families.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref

import torch

__all__ = [
    "cache_name", "cache_shares_rows", "forward_parameters", "generate_prefilled_once", "prefill_cache",
    "prefill_once_applies", "prefill_positions", "prefilled_once",
]  # fmt: skip

#: The probe of :func:`cache_shares_rows`: 3 distinct prompts of 5 tokens, copied to 5 rows in this order.
_PROBE_ROWS, _PROBE_WIDTH, _PROBE_INDEX = 3, 5, (2, 0, 2, 1, 0)
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # base model -> its cache's verdict


def prefill_once_applies(model, generation_config) -> bool:
    """Whether :func:`generate_prefilled_once` can run ``generation_config`` on ``model``: one sequence per row
    (no beams, ``num_return_sequences`` 1), the default dynamic cache (no ``cache_implementation``, neither in the
    config nor in the model's own), no chunked prefill, a forward without dropout (a dropout draw in the prompt's
    forward would be shared by its rows and change the random stream), and a cache whose rows can be shared
    (:func:`cache_shares_rows`). Where it returns False the caller runs the plain ``generate``."""

    configs = (generation_config, getattr(model, "generation_config", None))

    def value(name: str, default):  # transformers 5 leaves unset fields None: the model's own, else the default
        return next((getattr(c, name) for c in configs if getattr(c, name, None) is not None), default)

    if value("cache_implementation", None) is not None or value("prefill_chunk_size", None) is not None:
        return False
    if not value("use_cache", True) or value("num_beams", 1) != 1 or value("num_return_sequences", 1) != 1:
        return False
    if model.training and _has_dropout(model):
        return False
    return cache_shares_rows(model)


def cache_shares_rows(model) -> bool:
    """Whether the cache ``model``'s forward returns can be copied from each distinct prompt to its rows, decided
    from what the cache does, once per model: a prefill of 3 distinct 5-token prompts (eval mode, no gradient, the
    RNG untouched), then ``Cache.batch_select_indices`` to 5 rows. Every per-row state of the cache and of each of
    its layers (each tensor whose first dimension is the 3 prompts: keys and values, a recurrent layer's conv and
    SSM states, an indexer's keys, a compressor's buffers) must come out as the selected rows, and the cache must
    count the 5 cached positions (``generate`` continues after them). Declined, so that the plain ``generate``
    runs: a layer without the method (transformers 5.19's ``LinearAttentionLayer``: Mamba, LFM2's convolutions,
    Qwen3-Next's linear attention), a selection that leaves a state behind (the attention + SSM layers of
    Falcon-H1: keys and values selected, conv and SSM states not; DeepSeek V4's compressor buffers), a cache that
    counts other positions (none with recurrent layers only), a forward that returns no cache."""
    base = _base(model)
    if base not in _VERDICTS:
        _VERDICTS[base] = _probe(model)
    return _VERDICTS[base]


def prefill_positions(prompt_ids: list[list[int]], *, shared: bool) -> int:
    """The prompt positions a call's prefill forwards for ``prompt_ids`` (one per row, left-padded to the longest,
    ``L``): with ``shared`` (:func:`generate_prefilled_once`) the distinct prompts' first ``L - 1`` positions once
    (a one-token prompt gets one masked column in front), then every row's last; else every row's ``L``."""
    width = max((len(p) for p in prompt_ids), default=0)
    if shared:
        return len({tuple(p) for p in prompt_ids}) * (max(width, 2) - 1) + len(prompt_ids)
    return len(prompt_ids) * width


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
    pad_column = input_ids.size(1) < 2  # a one-token prompt: one masked column in front, so that L - 1 >= 1
    if pad_column:
        input_ids = torch.nn.functional.pad(input_ids, (1, 0))  # [N, 2]
        attention_mask = torch.nn.functional.pad(attention_mask, (1, 0))  # [N, 2]
    rows = torch.cat([input_ids * attention_mask, attention_mask], dim=1)  # [N, 2L]: a row's prompt and its padding
    distinct, index = torch.unique(rows, dim=0, return_inverse=True)  # [U, 2L], [N]
    first = torch.full((len(distinct),), len(rows), device=rows.device).scatter_reduce(
        0, index, torch.arange(len(rows), device=rows.device), "amin"
    )  # [U]: a row holding each distinct prompt
    cache = prefill_cache(model, input_ids[first, :-1], attention_mask[first, :-1])  # the [U, L - 1] first positions
    if cache is None:
        raise ValueError(
            f"prefill_once: {type(model).__name__}'s forward returned no KV cache to share; set prefill_once to false"
        )
    cache.batch_select_indices(index)  # [U, ...] -> [N, ...]: each row gets its prompt's keys and values
    generate = model.generate if generate is None else generate
    result = generate(
        input_ids=input_ids, attention_mask=attention_mask, **{cache_name(model): cache}, **generate_kwargs
    )
    if not pad_column:
        return result
    if isinstance(result, torch.Tensor):
        return result[:, 1:]
    result.sequences = result.sequences[:, 1:]
    return result


@contextlib.contextmanager
def prefilled_once(model):
    """``model.generate`` is :func:`generate_prefilled_once` inside the block (an instance attribute over the
    class's method, removed at the end): for a caller's code that calls ``model.generate`` itself (``CPPOTrainer``:
    TRL's generation)."""
    model.generate = functools.partial(generate_prefilled_once, model, generate=model.generate)
    try:
        yield
    finally:
        del model.generate


def prefill_cache(model, ids: torch.Tensor, mask: torch.Tensor):
    """The prefill forward of ``ids`` / ``mask`` ``[U, T]`` (the logits of the last position only, position ids
    from the mask as ``generate`` derives them): the cache it returns, or None where it returns none."""
    from transformers import Cache

    forward = forward_parameters(model)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}  # the logits are not used
    if "position_ids" in forward:  # (generate passes them to a model that takes them; others count from the cache)
        extra["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # [U, T]: generate's rule
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **extra)
    cache = out.get(cache_name(model))
    return cache if isinstance(cache, Cache) else None


def _probe(model) -> bool:
    """:func:`cache_shares_rows`'s probe (any error in it declines: the plain ``generate`` is always right)."""
    config = _base(model).config
    vocab = getattr(config.get_text_config(decoder=True), "vocab_size", None) or 2
    ids = (torch.arange(_PROBE_ROWS * _PROBE_WIDTH).view(_PROBE_ROWS, _PROBE_WIDTH) * 7 + 3) % vocab  # [3, 5]
    device = model.device
    devices = [device] if device.type == "cuda" else []
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()  # (a training-mode forward may turn the cache off, under gradient checkpointing)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            cache = prefill_cache(model, ids.to(device), torch.ones_like(ids, device=device))
        if cache is None:
            return False
        index = torch.tensor(_PROBE_INDEX, device=device)
        holders = [cache, *cache.layers]  # (a cache may keep states of its own: MiniMax's linear attention)
        before = [{path: t.clone() for path, t in _row_states(holder)} for holder in holders]
        cache.batch_select_indices(index)
        for holder, states in zip(holders, before, strict=True):
            after = dict(_row_states(holder, rows=len(index)))
            if any(path not in after or not torch.equal(after[path], t[index]) for path, t in states.items()):
                return False
        return cache.get_seq_length() == _PROBE_WIDTH
    except Exception:  # noqa: BLE001  (a cache the probe cannot handle is one it does not share)
        return False
    finally:
        for module, training in modes:
            module.training = training


def _row_states(holder, rows: int = _PROBE_ROWS):
    """``(path, tensor)`` of every tensor a cache or cache layer holds (as an attribute, or in a dict / list / tuple
    of one) whose first dimension is ``rows``."""
    for name, value in vars(holder).items():
        if isinstance(value, torch.Tensor):
            found = [((name,), value)]
        elif isinstance(value, dict | list | tuple):
            found = [((name, k), v) for k, v in (value.items() if isinstance(value, dict) else enumerate(value))]
        else:
            continue
        yield from ((p, t) for p, t in found if isinstance(t, torch.Tensor) and t.dim() and t.size(0) == rows)


def cache_name(model=None) -> str:
    """The name transformers gives the KV cache in ``forward``, ``generate`` and model outputs (``past_key_values``
    before 5.x renamed it ``cache``; ``cache_params`` where a forward takes only that: Mamba, Mamba 2)."""
    from transformers import GenerationMixin

    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    name = "cache" if "cache" in parameters else "past_key_values"
    if model is None:
        return name
    forward = forward_parameters(model)
    return "cache_params" if name not in forward and "cache_params" in forward else name


def _base(model):
    """The causal LM under a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def forward_parameters(model) -> set[str]:
    """The keyword names the causal LM's ``forward`` takes (through a PEFT wrapper, its base model's)."""
    return set(inspect.signature(_base(model).forward).parameters)


def _has_dropout(model) -> bool:
    """A dropout that fires in training mode: an ``nn.Dropout`` module with p > 0 or a config's attention dropout."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    return bool(getattr(config, "attention_dropout", 0.0))
