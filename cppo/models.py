"""Models: loading them and their tokenizers on the resolved device, and the packed forward that gives final hidden
states without logits.

Any ``AutoModelForCausalLM`` works: the decoder (``model.get_decoder()``) gives the final, normalised hidden
states and ``model.get_output_embeddings()`` the LM head. With tied embeddings that head's weight *is* the
embedding Parameter, so gradients through the fused loss reach it once, as in the plain model.
"""

from __future__ import annotations

import importlib.util
import os
import string

import torch

DEFAULT_TINY = {
    "vocab_size": 2048,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
}
TINY_SPECIALS = ["<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(vocab_size: int):
    """A character-level tokenizer built in code (no download): specials, printable ASCII, then filler tokens up
    to ``vocab_size`` so that the LM head has a realistic width. EOS is ``<|im_end|>``; a ChatML template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = TINY_SPECIALS + chars
    if vocab_size < len(vocab):
        raise ValueError(f"model_config.vocab_size must be >= {len(vocab)} for the tiny tokenizer, got {vocab_size}")
    vocab += [f"<|extra_{i}|>" for i in range(vocab_size - len(vocab))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[], unk_token="<|unk|>"))
    tok.add_special_tokens(TINY_SPECIALS)
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        eos_token="<|im_end|>",
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def attn_implementation(device: torch.device) -> str:
    """flash_attention_2 (varlen over packed position_ids) on CUDA when flash-attn is installed, sdpa otherwise."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_model_and_tokenizer(
    name: str,
    *,
    model_config: dict | None = None,
    dtype: str = "float32",
    device: torch.device | str = "cpu",
    seed: int = 0,
):
    """``(model, tokenizer)`` from a tiny-model name (built from a config, seeded by ``seed``), a local
    directory, a hub name or a ``.gguf`` file. The tokenizer pads on the left and always has a pad token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    attn = attn_implementation(device)
    if name == "tiny-qwen2":
        from transformers import Qwen2Config

        overrides = {**DEFAULT_TINY, **(model_config or {})}
        tokenizer = tiny_tokenizer(overrides["vocab_size"])
        cfg = Qwen2Config(
            **overrides,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch_dtype)
    elif name.endswith(".gguf"):
        folder, file = os.path.split(os.path.abspath(name))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=file, dtype=torch_dtype, attn_implementation=attn
        )
        # the GGUF weights are de-quantised on load: the model is a plain one, and save_pretrained must accept it
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    else:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, attn_implementation=attn)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    lm_head(model)  # rejects a model without an LM head before any work
    return model.to(device), tokenizer


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant, as the official runs'
    ``gradient_checkpointing_kwargs``); only while training: ``generate`` runs the model in eval mode."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5 (the old name warns)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def lm_head(model) -> tuple[torch.nn.Parameter, torch.Tensor | None]:
    """``(weight [V, H], bias [V] or None)`` of the model's LM head; ``ValueError`` when there is none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"model {type(model).__name__} has no LM head (get_output_embeddings() gave {type(head).__name__}); "
            "CPPO needs an AutoModelForCausalLM"
        )
    return weight, getattr(head, "bias", None)


def decoder(model) -> torch.nn.Module:
    """The base model that returns the final (normalised) hidden states."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    if base is None:
        base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None:
        raise ValueError(f"cannot find the decoder of {type(model).__name__} (get_decoder() returned None)")
    return base


def packed_hidden(model, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[L, H]`` of one packed row ``input_ids [1, L]``.

    ``position_ids [1, L]`` restart at 0 for each sequence; with no attention mask and no cache, transformers
    (>= 4.53) derives a block-diagonal causal mask from them (sdpa/eager) or cu_seqlens (flash_attention_2), so
    packed sequences do not attend to each other (tests/test_packing.py checks this against separate forwards).
    """
    out = decoder(model)(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state[0]  # [L, H]


def completion_hidden(
    model, input_ids: torch.Tensor, position_ids: torch.Tensor, predict_index: torch.Tensor
) -> torch.Tensor:
    """Final hidden states ``[T, H]`` of the rows of a packed row that predict completion tokens (``predict_index
    [T]``): the forward that DDP / FSDP2 wrap (see :func:`cppo.parallel.wrap_model`)."""
    return packed_hidden(model, input_ids, position_ids)[predict_index]
