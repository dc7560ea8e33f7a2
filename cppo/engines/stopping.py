"""Stopping completions mid-generation (issue 38, pruning while generating): the engine decodes every row to a
checkpoint, a :class:`Stopper` looks at the unfinished rows there (their tokens so far and the policy's last hidden
state, from the same forward that produced them) and names the rows to stop; only the others are decoded further.

In the ``hf`` engine the continuation is transformers' ``generate`` resumed from the checkpoint's KV cache with the
surviving rows alone (``Cache.batch_select_indices``: the seam prefill-once uses), so a stopped row costs no decoding
step after its checkpoint and the survivors decode in a smaller batch; under greedy decoding their tokens are those of
an uninterrupted call. A stopped completion is its tokens up to the checkpoint, marked in :attr:`Rollout.stopped`.
A model whose cache cannot keep a subset of its rows (recurrent and hybrid caches: :func:`.prefill.cache_shares_rows`
declines) decodes every row to the end and the stopped rows are cut at the checkpoint: the same choice, no saving.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .base import cut_after_eos
from .prefill import _cache_name, _forward_parameters, _prefill, cache_shares_rows

__all__ = [
    "PartialRollout", "Stopper", "can_select_rows", "check_choice", "checkpoint_hidden", "checkpoint_tokens",
    "generate_with_stops",
]  # fmt: skip


@dataclass
class PartialRollout:
    """The rows at the checkpoint: every row's prompt and completion ids so far (``at`` tokens, or fewer for a row
    that ended with EOS), which rows have ended, and the policy's final hidden state ``[N, H]`` at each row's last
    forwarded position (None where the engine has none; zeros for the rows that ended where the engine computes them
    after the fact, :func:`checkpoint_hidden`: the vllm engine)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    finished: list[bool]
    hidden: torch.Tensor | None
    at: int


@dataclass
class Stopper:
    """When and whom to stop: ``at``, the checkpoint in new tokens (>= 1); ``choose(partial)``, a boolean per row
    (True: stop it). Rows that already ended are never stopped (whatever ``choose`` says of them). ``needs_hidden``:
    whether ``choose`` reads :attr:`PartialRollout.hidden`; when not, an engine that would compute them with an
    extra policy forward (``vllm``, the fallback for recurrent caches) passes None instead."""

    at: int
    choose: Callable[[PartialRollout], list[bool]]
    needs_hidden: bool = True


def checkpoint_tokens(at: float | int, max_completion_length: int) -> int:
    """The checkpoint in tokens: ``at`` >= 1 is a token count, 0 < ``at`` < 1 a fraction of ``max_completion_length``
    (rounded, at least 1). ValueError naming the setting otherwise, or when it is not before the last token."""
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not at > 0:
        raise ValueError(f"rollout_stop_at must be a token count >= 1 or a fraction in (0, 1), got {at!r}")
    if at < 1:
        tokens = max(1, round(at * max_completion_length))
    elif float(at).is_integer():
        tokens = int(at)
    else:
        raise ValueError(f"rollout_stop_at must be a token count >= 1 or a fraction in (0, 1), got {at!r}")
    if tokens >= max_completion_length:
        raise ValueError(
            f"rollout_stop_at={at!r} is {tokens} tokens, not before max_completion_length={max_completion_length}: "
            "nothing would be left to stop"
        )
    return tokens


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


def check_choice(chosen, finished: list[bool]) -> list[bool]:
    """A stopper's answer as the rows stopped: one bool per row (ValueError otherwise), never a row that ended."""
    chosen = list(chosen)
    if len(chosen) != len(finished):
        raise ValueError(f"the stopper chose for {len(chosen)} rows, the checkpoint holds {len(finished)}")
    return [bool(c) and not f for c, f in zip(chosen, finished)]


@torch.no_grad()
def checkpoint_hidden(
    model,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    *,
    compute_dtype=None,
    rows: list[int] | None = None,
) -> torch.Tensor:
    """``[N, H]``: the policy's final hidden state that produced each partial completion's last token (the input is
    the prompt and the completion but its last token, positions counted from the prompt's first token), as the ``hf``
    engine reads it from its own forward: for an engine that returns no hidden states.

    ``rows``: the indices of the rows to compute (default all); every other row's state is zeros (the caller leaves
    out the rows that ended before the checkpoint: a stopper never stops them and the quality head never trains on
    them). Each distinct prompt among them is forwarded once (left-padded, with its KV cache), the cache copied to
    its rows (``Cache.batch_select_indices``, as prefill-once does) and the completions but their last token forwarded
    on top (right-padded, positions continuing the prompt's); a completion of one token reads its prompt's last
    position. A model whose cache cannot be shared that way (:func:`.prefill.cache_shares_rows` declines: recurrent
    and hybrid layers) forwards every row's prompt and completion whole. The two agree within fp32 rounding."""
    n = len(prompt_ids)
    chosen = list(range(n)) if rows is None else sorted({int(i) for i in rows})
    if not chosen:
        head = model.get_output_embeddings().weight
        return torch.zeros((n, head.size(-1)), dtype=head.dtype, device=model.device)  # (autocast's norm: fp32)
    prompts, completions = [prompt_ids[i] for i in chosen], [completion_ids[i] for i in chosen]
    hidden = None
    if all(prompts) and cache_shares_rows(model):
        from ..distributed import autocast

        with _eval_mode(model), autocast(model.device, compute_dtype):
            hidden = _shared_prompt_hidden(model, prompts, completions)
    if hidden is None:  # a cache that cannot be shared, or a forward that returned none
        hidden = _full_forward_hidden(model, prompts, completions, compute_dtype=compute_dtype)
    if len(chosen) == n:
        return hidden
    out = hidden.new_zeros((n, hidden.size(-1)))  # [N, H]
    out[torch.tensor(chosen, device=hidden.device)] = hidden
    return out


def _shared_prompt_hidden(model, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> torch.Tensor | None:
    """:func:`checkpoint_hidden` of every row given, each distinct prompt forwarded once (None where the prompts'
    forward returns no cache). The caller has set eval mode and the compute dtype."""
    device = model.device
    slot: dict[tuple[int, ...], int] = {}
    index = [slot.setdefault(tuple(p), len(slot)) for p in prompt_ids]  # row -> its distinct prompt
    distinct = list(slot)
    width = max(len(p) for p in distinct)
    ids = torch.zeros((len(distinct), width), dtype=torch.long)  # [U, Lp], left-padded
    mask = torch.zeros_like(ids)  # [U, Lp]
    for u, p in enumerate(distinct):
        ids[u, width - len(p) :], mask[u, width - len(p) :] = torch.tensor(p), 1
    with _last_hidden(model) as box:
        cache = _prefill(model, ids.to(device), mask.to(device))
    if cache is None:
        return None
    hidden = box[0][:, -1, :][torch.tensor(index, device=device)]  # [N, H]: each row's prompt's last position
    tails = [c[:-1] for c in completion_ids]  # what produced each completion's last token, after the prompt
    longer = [i for i, t in enumerate(tails) if t]
    if not longer:
        return hidden
    span = max(len(tails[i]) for i in longer)
    tail_ids = torch.zeros((len(longer), span), dtype=torch.long)  # [M, T], right-padded
    tail_mask = torch.zeros_like(tail_ids)  # [M, T]
    for j, i in enumerate(longer):
        tail_ids[j, : len(tails[i])], tail_mask[j, : len(tails[i])] = torch.tensor(tails[i]), 1
    select = torch.tensor([index[i] for i in longer])  # [M]: each row's distinct prompt
    cache.batch_select_indices(select.to(device))  # [U, ...] -> [M, ...]
    starts = torch.tensor([len(prompt_ids[i]) for i in longer])  # [M]: the first position after each prompt
    last = torch.tensor([len(tails[i]) - 1 for i in longer])  # [M]: each row's last real column
    keep = torch.unique(last)  # [K], sorted: the columns whose states are read (their logits alone are computed)
    takes = _forward_parameters(model)
    extra = {"logits_to_keep": keep.to(device)} if "logits_to_keep" in takes else {}
    extra |= {"position_ids": (starts[:, None] + torch.arange(span)).to(device)} if "position_ids" in takes else {}
    both = torch.cat([mask[select], tail_mask], dim=1)  # [M, Lp + T]: the prompt's padding, then the tail's
    with _last_hidden(model) as box:
        model(input_ids=tail_ids.to(device), attention_mask=both.to(device), use_cache=True,
              **{_cache_name(model): cache}, **extra)  # fmt: skip
    states = box[0]  # [M, K, H] (or [M, T, H] where the forward keeps every position's logits)
    column = torch.searchsorted(keep, last) if states.size(1) == len(keep) else last
    hidden[torch.tensor(longer, device=device)] = states[torch.arange(len(longer)), column.to(device)].to(hidden.dtype)
    return hidden


@torch.no_grad()
def _full_forward_hidden(
    model, prompt_ids: list[list[int]], completion_ids: list[list[int]], *, compute_dtype=None
) -> torch.Tensor:
    """:func:`checkpoint_hidden` of every row given by one forward over each row's prompt and completion but its last
    token (left-padded, positions counted from each row's first token): for a cache that cannot be shared."""
    from ..distributed import autocast

    rows = [p + c[:-1] for p, c in zip(prompt_ids, completion_ids)]
    width, device = max(len(r) for r in rows), model.device
    ids = torch.zeros((len(rows), width), dtype=torch.long)  # [N, L]
    mask = torch.zeros_like(ids)  # [N, L]
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [N, L]
    takes = _forward_parameters(model)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}  # the logits are not used
    extra |= {"position_ids": positions.to(device)} if "position_ids" in takes else {}  # (recurrent models: none)
    extra |= {"attention_mask": mask.to(device)} if "attention_mask" in takes else {}
    with _eval_mode(model), _last_hidden(model) as box, autocast(device, compute_dtype):
        model(input_ids=ids.to(device), **extra)
    return box[0][:, -1, :]


@contextlib.contextmanager
def _eval_mode(model):
    """``model`` in eval mode (no dropout), each module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _last_hidden(model):
    """Records the final hidden state of every forward of ``model`` (the input of its output embedding, i.e. after
    the final norm): ``box[0]`` holds the last forward's ``[N, L, H]``."""
    head = model.get_output_embeddings()
    box: list[torch.Tensor | None] = [None]
    handle = head.register_forward_pre_hook(lambda module, args: box.__setitem__(0, args[0].detach()))
    try:
        yield box
    finally:
        handle.remove()


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
    width, total = input_ids.size(1), generation_config.max_new_tokens
    if not cache_shares_rows(model):  # a recurrent / hybrid cache: decode every row, stop after the fact
        return _stops_after_the_fact(model, generate, input_ids=input_ids, attention_mask=attention_mask,
                                     generation_config=generation_config, stopper=stopper, eos=eos, pad_id=pad_id,
                                     **generate_kwargs)  # fmt: skip
    first = copy.deepcopy(generation_config)
    first.max_new_tokens, first.return_dict_in_generate = stopper.at, True
    with _last_hidden(model) as box:
        out = generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=first, **generate_kwargs)
    sequences = out.sequences  # [N, Lp + <= at]
    new = sequences[:, width:].tolist()
    finished = [any(t in eos for t in row) for row in new]
    hidden = None if box[0] is None else box[0][:, -1, :]  # [N, H]: each row's last forwarded position
    partial = PartialRollout(
        prompt_ids=_unpadded(input_ids, attention_mask),
        completion_ids=[cut_after_eos(row, eos, stopper.at) for row in new],
        finished=finished, hidden=hidden, at=stopper.at,
    )  # fmt: skip
    stopped = check_choice(stopper.choose(partial), finished)
    # nothing stopped: every row decodes on, the ended ones held at EOS, exactly as one uninterrupted call (the same
    # batch, inputs and random draws); else only the unfinished survivors, in a smaller batch
    keep = list(range(len(new))) if not any(stopped) else [i for i, (f, s) in enumerate(zip(finished, stopped))
                                                           if not f and not s]  # fmt: skip
    result = torch.full((len(new), width + total), pad_id, dtype=sequences.dtype, device=sequences.device)
    result[:, : sequences.size(1)] = sequences
    if all(f or s for f, s in zip(finished, stopped)):  # nothing left to decode (every row ended or stopped)
        return result, stopped
    cache = getattr(out, "past_key_values", None)
    cache = getattr(out, "cache", None) if cache is None else cache  # the output's name for it
    name = _cache_name(model)  # generate's keyword for a cache to continue from
    rest = copy.deepcopy(generation_config)
    rest.max_new_tokens = total - stopper.at
    if len(keep) < len(new) and not can_select_rows(cache):
        raise RuntimeError(f"{type(model).__name__}: the checkpoint's cache cannot keep the surviving rows")
    index = torch.tensor(keep, device=sequences.device)
    if len(keep) < len(new):
        cache.batch_select_indices(index)
    held = [j for j, i in enumerate(keep) if finished[i] or stopped[i]]  # rows in the batch that must not go on
    processors = [_HoldAtEos(held, min(eos))] if held else []
    mask = torch.cat([attention_mask[index], torch.ones_like(sequences[index, width:])], dim=1)
    cont = model.generate(input_ids=sequences[index], attention_mask=mask, generation_config=rest,
                          logits_processor=processors, **{name: cache})  # fmt: skip
    for j, i in enumerate(keep):
        if not (finished[i] or stopped[i]):
            result[i, : cont.size(1)] = cont[j]
    return result, stopped


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
