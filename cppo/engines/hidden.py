"""The policy's final hidden state at a stopping checkpoint (issue 38), for an engine that returns none: the ``vllm``
engine, and the ``hf`` engine's fallback for a cache that cannot keep a subset of its rows (:mod:`.resume`).
:func:`checkpoint_hidden` forwards each distinct prompt once and shares its KV cache with its rows (the seam of
:mod:`.prefill`); :func:`last_hidden` records what a forward of the policy computes, which the ``hf`` engine reads
from its own decoding forward."""

from __future__ import annotations

import contextlib

import torch

from .prefill import cache_name, cache_shares_rows, forward_parameters, prefill_cache

__all__ = ["checkpoint_hidden", "last_hidden"]


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
    with last_hidden(model) as box:
        cache = prefill_cache(model, ids.to(device), mask.to(device))
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
    takes = forward_parameters(model)
    extra = {"logits_to_keep": keep.to(device)} if "logits_to_keep" in takes else {}
    extra |= {"position_ids": (starts[:, None] + torch.arange(span)).to(device)} if "position_ids" in takes else {}
    both = torch.cat([mask[select], tail_mask], dim=1)  # [M, Lp + T]: the prompt's padding, then the tail's
    with last_hidden(model) as box:
        model(input_ids=tail_ids.to(device), attention_mask=both.to(device), use_cache=True,
              **{cache_name(model): cache}, **extra)  # fmt: skip
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
    takes = forward_parameters(model)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}  # the logits are not used
    extra |= {"position_ids": positions.to(device)} if "position_ids" in takes else {}  # (recurrent models: none)
    extra |= {"attention_mask": mask.to(device)} if "attention_mask" in takes else {}
    with _eval_mode(model), last_hidden(model) as box, autocast(device, compute_dtype):
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
def last_hidden(model):
    """Records the final hidden state of every forward of ``model`` (the input of its output embedding, i.e. after
    the final norm): ``box[0]`` holds the last forward's ``[N, L, H]``."""
    head = model.get_output_embeddings()
    box: list[torch.Tensor | None] = [None]
    handle = head.register_forward_pre_hook(lambda module, args: box.__setitem__(0, args[0].detach()))
    try:
        yield box
    finally:
        handle.remove()
