"""Tiny causal LMs and the hf engine over them, for the generation tests (prefill-once, stopping
mid-generation): Qwen2 with tied embeddings and Llama with its own head, EOS favoured so rows end at different
lengths; the prompts of a step under allocation (lengths 1 to 26 characters, one asked twice)."""

from __future__ import annotations

import torch
from tiny_model import TINY

from cppo.engines import EngineSettings, HFEngine
from cppo.step import tiny_tokenizer

ARCHS = ("qwen2", "llama")
#: A step's questions under allocation: lengths 1 to 26 tokens (character-level), one asked twice.
PROMPTS = ["What is 12 + 7?", "7", "Hi there", "What is 12 + 7?", "A longer one: 3 4 5 6 7 8", "12*3"]
G = 4


def tiny(arch: str, *, eos_bias: float = 3.0):
    """A 2-layer ``arch`` model from a config (Qwen2 with tied embeddings, Llama with its own head), EOS favoured
    (at 3.0, ~10% of sampled tokens) so that some rows finish early and are padded while others decode on."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tok = tiny_tokenizer(TINY["vocab_size"])
    config = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch](
        **TINY, num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=arch == "qwen2",
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()

    def favour_eos(module, args, logits):
        logits[..., tok.eos_token_id] += eos_bias
        return logits

    model.lm_head.register_forward_hook(favour_eos)
    return model, tok


def engine(model, tok, *, prefill_once: bool, completion: int = 10) -> HFEngine:
    settings = EngineSettings(
        model_name="x", max_prompt_length=64, max_completion_length=completion, prefill_once=prefill_once
    )
    return HFEngine(model, tok, settings)
