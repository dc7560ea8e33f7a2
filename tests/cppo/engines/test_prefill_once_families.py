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
import warnings

import pytest
import torch

from cppo.engines import EngineSettings, HFEngine
from cppo.engines.prefill import cache_shares_rows, prefill_once_applies
from cppo.step import tiny_tokenizer

#: family -> whether prefill-once serves it (True) or must decline (False).
SUBSET = {
    "qwen2": True, "llama": True, "gemma": True, "gemma2": True, "gemma3_text": True, "mistral": True,
    "qwen2_moe": True, "minimax": True, "mamba": False, "lfm2": False, "falcon_h1": False, "deepseek_v4": False,
}  # fmt: skip
VOCAB = 128  # the tiny character tokenizer's 101 tokens and filler
#: Small sizes every family takes (those its config has; the transformer basics always).
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
    head_dim=16, max_position_embeddings=256, qk_rope_head_dim=8, qk_nope_head_dim=8,
    v_head_dim=16, kv_lora_rank=16, q_lora_rank=16, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
    n_routed_experts=4, num_experts_per_tok=2, num_experts_per_token=2, n_group=1, topk_group=1, mamba_d_ssm=64,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16, linear_head_dim=16, linear_num_heads=2,
    sliding_window=6, state_size=8, expand=2, full_attn_idxs=[1, 3], d_model=32, decoder_layers=4, encoder_layers=4,
    decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=64, encoder_ffn_dim=64, attn_layer_period=2,
    attn_layer_offset=1, attn_layer_indices=[1, 3],
)  # fmt: skip
ALWAYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
#: Prompts of 1 to 17 characters (different left padding), one asked twice; G completions each.
PROMPTS = ["What is 12 + 7?", "7", "Hi there", "What is 12 + 7?", "A longer one: 3 4", "12*3"]
G = 3


def _families() -> list[str]:
    chosen = os.environ.get("CPPO_PREFILL_FAMILIES", "")
    if chosen == "all":
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return chosen.split(",") if chosen else list(SUBSET)


def tiny_family(model_type: str, tok):
    """A tiny fp32 model of the family in eval mode with 4 layers, each kind of layer its config lays out by
    default among them (Falcon-H1 hybrid ones, Gemma 2 sliding ones; LFM2 convolution layers at 0 and 2); or a
    skip naming why it does not build."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        base = AutoConfig.for_model(model_type)
    except Exception as err:  # noqa: BLE001  (the skip names the reason)
        pytest.skip(f"{model_type}: no config from defaults: {type(err).__name__}: {str(err).strip()[:150]}")
    if base.sub_configs:
        pytest.skip(f"{model_type}: a composite config ({', '.join(base.sub_configs)}), not a tiny text model")
    fields = base.to_dict()  # settable fields (not derived properties)
    options = {k: v for k, v in TINY.items() if k in ALWAYS or k in fields}
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    options.update({k: v for k, v in ids.items() if k in fields})
    kinds = list(dict.fromkeys(getattr(base, "layer_types", None) or []))  # each kind, in order
    if len(kinds) > 1 and "layer_types" in fields:
        options["layer_types"] = [kinds[i % len(kinds)] for i in range(TINY["num_hidden_layers"])]
    kv_heads = [{"num_key_value_heads": n} for n in (1, 2)] if "num_key_value_heads" in fields else [{}]
    for heads in kv_heads:  # (multi-head latent attention wants as many key/value heads as heads)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = AutoConfig.for_model(model_type, **options, **heads)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(1)
                    model = AutoModelForCausalLM.from_config(config).float().eval()
                ids, mask = torch.arange(3, 11).view(2, 4), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])  # [2, 4]
                with torch.no_grad():  # a generate of 2 tokens on left-padded rows (with its cache)
                    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
            return model
        except Exception as err:  # noqa: BLE001  (the skip names the reason)
            error = err
    pytest.skip(f"{model_type} does not build tiny: {type(error).__name__}: {str(error).strip()[:150]}")


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
