"""Tiny models of any causal-LM family of transformers, built from its config's defaults (for the generation tests
across families: prefill-once, stopping mid-generation), or a skip naming why the family does not build tiny."""

from __future__ import annotations

import warnings

import pytest
import torch

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
