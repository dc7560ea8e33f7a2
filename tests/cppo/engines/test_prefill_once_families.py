"""Prefill-once across model families (issue 40): the ``hf`` engine on a tiny model of each family, with
``prefill_once`` on and off, gives the same completions (greedy, and sampled from one seed with the same RNG state
after it). Where the cache the family's forward returns can be shared, the prompts were prefilled once (the first
forward is the distinct prompts', the rollout counts those positions); where it cannot (a recurrent layer that
``Cache.batch_select_indices`` cannot copy, a hybrid layer whose selection leaves its SSM state behind, a cache that
counts no positions), ``prefill_once_applies`` declines and the engine runs the plain ``generate``.

The committed set is a representative few: full attention (Qwen2, Llama), Gemma's families, sliding windows
(Mistral; Gemma 2 and 3 alternate them), MoE (Qwen2-MoE; MiniMax, whose linear-attention states its cache keeps
and selects itself: served), recurrent (Mamba), convolution + attention (LFM2), attention + SSM (Falcon-H1) and
DeepSeek V4 (compressor buffers its cache layers do not select). ``CPPO_PREFILL_FAMILIES=all`` runs every
causal-LM family of transformers that builds and generates tiny from its config (the others skip, naming why); a
comma-separated list runs those."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_families import VOCAB, tiny_family

from cppo.engines import EngineSettings, HFEngine
from cppo.engines.prefill import cache_shares_rows, prefill_once_applies
from cppo.step import tiny_tokenizer

#: family -> whether prefill-once serves it (True) or must decline (False).
SUBSET = {
    "qwen2": True, "llama": True, "gemma": True, "gemma2": True, "gemma3_text": True, "mistral": True,
    "qwen2_moe": True, "minimax": True, "mamba": False, "lfm2": False, "falcon_h1": False, "deepseek_v4": False,
}  # fmt: skip
#: Prompts of 1 to 17 characters (different left padding), one asked twice; G completions each.
PROMPTS = ["What is 12 + 7?", "7", "Hi there", "What is 12 + 7?", "A longer one: 3 4", "12*3"]
G = 3


def _families() -> list[str]:
    chosen = os.environ.get("CPPO_PREFILL_FAMILIES", "")
    if chosen == "all":
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return chosen.split(",") if chosen else list(SUBSET)


def _generate(model, tok, *, prefill_once: bool, greedy: bool):
    """The engine's rollout, the RNG state after it, and the ``input_ids`` shape of the first forward it ran."""
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    settings = EngineSettings(model_name="x", max_prompt_length=64, max_completion_length=8, prefill_once=prefill_once)
    torch.manual_seed(7)
    try:
        rollout = HFEngine(model, tok, settings).generate(PROMPTS, G, greedy=greedy)
    finally:
        hook.remove()
    return rollout, torch.get_rng_state(), shapes[0]


@pytest.mark.parametrize("model_type", _families())
def test_prefill_once_gives_the_plain_tokens_or_declines(model_type):
    tok = tiny_tokenizer(VOCAB)
    model = tiny_family(model_type, tok)
    serves = cache_shares_rows(model)
    if model_type in SUBSET:
        assert serves is SUBSET[model_type], f"{model_type}: prefill-once {'serves' if serves else 'declines'} it"
    width = max(len(tok(p)["input_ids"]) for p in PROMPTS)
    rows, distinct = len(PROMPTS) * G, len(set(PROMPTS))
    for greedy in (True, False):
        (shared, rng, first), (plain, plain_rng, plain_first) = (
            _generate(model, tok, prefill_once=on, greedy=greedy) for on in (True, False)
        )
        assert plain_first[0] == rows and plain.prefill_tokens == rows * width  # (XLM's generate adds a column)
        if serves:  # one prefill of the distinct prompts' first width - 1 positions, then every row's last
            assert first == (distinct, width - 1)
            assert shared.prefill_tokens == distinct * (width - 1) + rows
        else:  # declined: the plain generate, and its count
            assert first == plain_first and shared.prefill_tokens == plain.prefill_tokens
        assert shared.completion_ids == plain.completion_ids, f"{model_type}, greedy={greedy}"
        assert torch.equal(rng, plain_rng), f"{model_type}, greedy={greedy}: other random draws"


def test_the_verdict_follows_what_the_cache_layers_do(monkeypatch):
    """Decided from the cache, not from a family's name: a Llama whose cache layers lose their
    ``batch_select_indices`` is declined (and the engine's tokens are the plain ones); a Mamba whose recurrent
    layers gain one that copies every state still declines, since a cache of recurrent layers only counts no
    positions for ``generate`` to continue after."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    from cppo.engines import prefill

    tok = tiny_tokenizer(VOCAB)
    llama = tiny_family("llama", tok)
    assert prefill_once_applies(llama, llama.generation_config)
    prefill._VERDICTS.clear()
    monkeypatch.delattr(DynamicLayer, "batch_select_indices")
    assert not prefill_once_applies(llama, llama.generation_config)
    shared, _, first = _generate(llama, tok, prefill_once=True, greedy=True)
    plain, _, plain_first = _generate(llama, tok, prefill_once=False, greedy=True)
    assert first == plain_first and shared.completion_ids == plain.completion_ids
    monkeypatch.undo()

    def select(layer, indices):
        for states in (layer.conv_states, layer.recurrent_states):
            for i, state in states.items():
                states[i] = None if state is None else state[indices]

    monkeypatch.setattr(LinearAttentionLayer, "batch_select_indices", select, raising=False)
    assert not cache_shares_rows(tiny_family("mamba", tok))
