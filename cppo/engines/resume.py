"""The ``hf`` engine's generation with a :class:`~.stopping.Stopper` (issue 38): transformers' ``generate`` to the
checkpoint, the stopper asked on the rows there, and ``generate`` resumed from the checkpoint's KV cache with the
surviving rows alone (``Cache.batch_select_indices``: the seam prefill-once uses), so a stopped row costs no decoding
step after its checkpoint and the survivors decode in a smaller batch; under greedy decoding their tokens are those of
an uninterrupted call. A model whose cache cannot keep a subset of its rows (recurrent and hybrid caches:
:func:`.prefill.cache_shares_rows` declines) decodes every row to the end and the stopped rows are cut at the
checkpoint: the same choice, no saving.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from .base import cut_after_eos
from .hidden import checkpoint_hidden, last_hidden
from .prefill import cache_name, cache_shares_rows
from .stopping import PartialRollout, Stopper, check_choice

__all__ = ["can_select_rows", "generate_with_stops"]


def can_select_rows(cache) -> bool:
    """Whether ``cache`` (what ``generate`` returned) can keep a subset of its rows: a transformers ``Cache`` whose
    every layer implements ``batch_select_indices``."""
    from transformers import Cache

    if not isinstance(cache, Cache):
        return False
    layers = getattr(cache, "layers", None)
    if layers is None:
        return hasattr(cache, "batch_select_indices")
    return all(callable(getattr(layer, "batch_select_indices", None)) for layer in layers)


def _unpadded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each left-padded row's prompt token ids (its masked positions left out)."""
    return [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(input_ids.tolist(), attention_mask.tolist())]


def generate_with_stops(
    model,
    generate: Callable,
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config,
    stopper: Stopper,
    eos: set[int],
    pad_id: int,
    **generate_kwargs,
) -> tuple[torch.Tensor, list[bool]]:
    """``generate`` (``model.generate``, or the prefill-once call) to the checkpoint, ``stopper`` asked, the survivors
    resumed from the cache with ``model.generate``. Returns ``([N, Lp + Lc] token ids, stopped per row)``: a stopped
    row is padded after its checkpoint tokens (``pad_id``), so the caller's cut (at the first EOS, at most
    ``max_completion_length`` tokens) needs the stopped rows' checkpoint length: :attr:`PartialRollout.at`."""
    rows = dict(input_ids=input_ids, attention_mask=attention_mask)
    if not cache_shares_rows(model):  # a recurrent / hybrid cache: decode every row, stop after the fact
        return _stops_after_the_fact(model, generate, **rows, generation_config=generation_config, stopper=stopper,
                                     eos=eos, pad_id=pad_id, **generate_kwargs)  # fmt: skip
    first = copy.deepcopy(generation_config)
    first.max_new_tokens, first.return_dict_in_generate = stopper.at, True
    with last_hidden(model) as box:
        out = generate(**rows, generation_config=first, **generate_kwargs)
    sequences, width = out.sequences, input_ids.size(1)  # [N, Lp + <= at]
    new = sequences[:, width:].tolist()
    finished = [any(t in eos for t in row) for row in new]
    partial = PartialRollout(
        prompt_ids=_unpadded(input_ids, attention_mask),
        completion_ids=[cut_after_eos(row, eos, stopper.at) for row in new], finished=finished,
        hidden=None if box[0] is None else box[0][:, -1, :], at=stopper.at,  # [N, H]: each row's last position
    )  # fmt: skip
    stopped = check_choice(stopper.choose(partial), finished)
    result = torch.full((len(new), width + generation_config.max_new_tokens), pad_id, dtype=sequences.dtype,
                        device=sequences.device)  # fmt: skip
    result[:, : sequences.size(1)] = sequences
    if all(f or s for f, s in zip(finished, stopped)):  # nothing left to decode (every row ended or stopped)
        return result, stopped
    held = [f or s for f, s in zip(finished, stopped)]  # rows that must not go on
    cont, keep = _resume(model, out, attention_mask, generation_config, held, any(stopped), eos=eos, at=stopper.at)
    for j, i in enumerate(keep):
        if not held[i]:
            result[i, : cont.size(1)] = cont[j]
    return result, stopped


def _resume(model, out, attention_mask, generation_config, held: list[bool], prune: bool, *, eos: set[int], at: int):
    """The continuation of :func:`generate_with_stops` from the checkpoint's output ``out``: ``(the continued rows'
    [M, Lp + Lc] token ids, their indices among the N)``. Nothing stopped (``prune`` False): every row decodes on,
    the ended ones held at EOS, exactly as one uninterrupted call (the same batch, inputs and random draws); else only
    the unfinished survivors, in a smaller batch."""
    sequences, width = out.sequences, attention_mask.size(1)
    keep = [i for i, h in enumerate(held) if not h] if prune else list(range(len(held)))
    cache = getattr(out, "past_key_values", None)
    cache = getattr(out, "cache", None) if cache is None else cache  # the output's name for it
    rest = copy.deepcopy(generation_config)
    rest.max_new_tokens = generation_config.max_new_tokens - at
    if len(keep) < len(held) and not can_select_rows(cache):
        raise RuntimeError(f"{type(model).__name__}: the checkpoint's cache cannot keep the surviving rows")
    index = torch.tensor(keep, device=sequences.device)
    if len(keep) < len(held):
        cache.batch_select_indices(index)
    ended = [j for j, i in enumerate(keep) if held[i]]  # in the batch, held at EOS
    processors = [_HoldAtEos(ended, min(eos))] if ended else []
    mask = torch.cat([attention_mask[index], torch.ones_like(sequences[index, width:])], dim=1)
    cont = model.generate(input_ids=sequences[index], attention_mask=mask, generation_config=rest,
                          logits_processor=processors, **{cache_name(model): cache})  # fmt: skip
    return cont, keep


def _stops_after_the_fact(
    model, generate, *, input_ids, attention_mask, generation_config, stopper, eos, pad_id, **generate_kwargs
) -> tuple[torch.Tensor, list[bool]]:
    """:func:`generate_with_stops` for a model whose cache cannot keep a subset of its rows
    (:func:`cache_shares_rows` declines: recurrent and hybrid layers): one uninterrupted ``generate``, then the
    stopper asked on each row's first ``at`` tokens (hidden states from :func:`checkpoint_hidden`) and the stopped
    rows cut there. The same completions' shape and choice, no decoding saved."""
    width = input_ids.size(1)
    out = generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config,
                   **generate_kwargs)  # fmt: skip
    sequences = out if isinstance(out, torch.Tensor) else out.sequences  # [N, Lp + Lc]
    new = [row[: stopper.at] for row in sequences[:, width:].tolist()]
    partial_ids = [cut_after_eos(row, eos, stopper.at) for row in new]
    finished = [len(c) < stopper.at or c[-1] in eos for c in partial_ids]
    prompts = _unpadded(input_ids, attention_mask)
    open_rows = [i for i, f in enumerate(finished) if not f]
    hidden = checkpoint_hidden(model, prompts, partial_ids, rows=open_rows) if stopper.needs_hidden else None
    stopped = check_choice(stopper.choose(PartialRollout(prompts, partial_ids, finished, hidden, stopper.at)), finished)
    result = torch.full((len(new), width + generation_config.max_new_tokens), pad_id, dtype=sequences.dtype,
                        device=sequences.device)  # fmt: skip
    result[:, : sequences.size(1)] = sequences
    for i, s in enumerate(stopped):
        if s:
            result[i, width + stopper.at :] = pad_id
    return result, stopped


class _HoldAtEos:
    """A logits processor that makes the batch rows ``rows`` emit ``eos`` (rows that ended, or were stopped, before
    the continuation: they end at its first step, as they had, and their draws are made as before)."""

    def __init__(self, rows: list[int], eos: int) -> None:
        self.rows, self.eos = rows, eos

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[self.rows] = float("-inf")
        scores[self.rows, self.eos] = 0.0
        return scores
