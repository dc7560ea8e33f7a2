"""checkpoint_hidden (issue 38: the hidden states of an engine that returns none, vLLM) forwards each distinct prompt
once and the partial completions on top of its shared cache; it must equal the plain forward of every row's prompt
and completion whole (kept as ``_full_forward_hidden``, the fallback of the recurrent and hybrid families) within
fp32 rounding: prompts of different lengths, groups of different sizes (one prompt asked again further on),
completions of one token and longer, and rows left out giving zeros."""

from __future__ import annotations

import pytest
import torch
from tiny_families import tiny_family
from tiny_generation import tiny

from cppo.engines.hidden import _full_forward_hidden, checkpoint_hidden
from cppo.engines.prefill import cache_shares_rows
from cppo.step import tiny_tokenizer

#: (prompt, group size): prompts of 1 to 19 tokens, groups of 1 to 4 rows, the first prompt asked again at the end.
GROUPS = [
    ([5, 17, 30, 2, 9, 41, 12], 3),
    ([7], 1),
    ([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], 4),
    ([60, 61, 62], 2),
    ([5, 17, 30, 2, 9, 41, 12], 2),
]
#: Completion lengths, row after row: one token (the prompt's last state) and longer, different within a group.
LENGTHS = [1, 4, 9, 3, 5, 1, 9, 2, 6, 6, 1, 8]


def rows():
    """The rows as an engine lays them out: each prompt repeated for its group, each row's partial completion."""
    prompts = [p for p, g in GROUPS for _ in range(g)]
    gen = torch.Generator().manual_seed(0)
    completions = [torch.randint(3, 90, (n,), generator=gen).tolist() for n in LENGTHS]
    return prompts, completions


def forward_shapes(model):
    """The ``input_ids`` shape of every forward of ``model`` (a list filled as it runs) and the hook's handle."""
    shapes = []
    handle = model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return shapes, handle


def models():
    tok = tiny_tokenizer(128)
    for name in ("qwen2", "llama"):
        yield pytest.param(lambda name=name: tiny(name)[0], True, id=name)
    for family, shares in (("mistral", True), ("gemma2", True), ("mamba", False), ("falcon_h1", False)):
        yield pytest.param(lambda family=family: tiny_family(family, tok), shares, id=family)


@pytest.mark.parametrize(("build", "shares"), list(models()))
def test_the_shared_prompt_forward_equals_the_full_forward(build, shares):
    """Llama and Qwen2, Mistral (a sliding window of 6 < the prompts), Gemma 2 (sliding and full layers alternate):
    each distinct prompt forwarded once (4 of 12 rows), then the 9 rows with more than one token; Mamba and
    Falcon-H1 (their cache cannot be shared) fall back to the full forward. Equal within fp32 rounding."""
    model = build()
    assert cache_shares_rows(model) is shares
    prompts, completions = rows()
    want = _full_forward_hidden(model, prompts, completions)
    shapes, handle = forward_shapes(model)
    try:
        got = checkpoint_hidden(model, prompts, completions)
    finally:
        handle.remove()
    assert got.shape == (len(prompts), model.config.hidden_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    longest = max(len(p) for p, _ in GROUPS)
    if shares:
        tails = [n for n in LENGTHS if n > 1]
        assert shapes == [(len(GROUPS) - 1, longest), (len(tails), max(tails) - 1)]
    else:
        assert shapes == [(len(prompts), max(len(p) + n - 1 for p, n in zip(prompts, LENGTHS)))]


@pytest.mark.parametrize(("build", "shares"), [p for p in models() if p.id in ("qwen2", "mamba")])
def test_rows_left_out_are_zeros_and_not_forwarded(build, shares):
    """``rows``: only those rows forwarded (their states as computed alone), the others zeros; no row, no forward."""
    model = build()
    prompts, completions = rows()
    chosen = [0, 2, 3, 5, 11]  # a group's rows but one, a group's one row, the first prompt again
    assert cache_shares_rows(model) is shares  # (its probe is a forward of its own: run before the count)
    want = _full_forward_hidden(model, [prompts[i] for i in chosen], [completions[i] for i in chosen])
    shapes, handle = forward_shapes(model)
    try:
        got = checkpoint_hidden(model, prompts, completions, rows=chosen)
        none = checkpoint_hidden(model, prompts, completions, rows=[])
    finally:
        handle.remove()
    assert got.shape == none.shape == (len(prompts), model.config.hidden_size)
    torch.testing.assert_close(got[chosen], want, atol=1e-5, rtol=1e-4)
    skipped = [i for i in range(len(prompts)) if i not in chosen]
    assert not got[skipped].any() and not none.any() and got[chosen].abs().sum(-1).gt(0).all()
    if shares:  # the 3 distinct prompts once (7, 1 and 19 tokens), then the 3 completions of more than one token
        assert shapes == [(3, 19), (3, 8)]
    else:
        assert len(shapes) == 1 and shapes[0][0] == len(chosen)


def test_the_model_keeps_its_modes():
    """The forwards run in eval mode; each module's training flag is as it was after."""
    model, _ = tiny("qwen2")
    assert cache_shares_rows(model)  # (its probe first: a forward of its own)
    model.train()
    model.model.layers[0].eval()
    before = [m.training for m in model.modules()]
    seen = []
    handle = model.register_forward_pre_hook(lambda m, args: seen.append(m.training))
    try:
        checkpoint_hidden(model, *rows())
    finally:
        handle.remove()
    assert seen == [False, False] and [m.training for m in model.modules()] == before
