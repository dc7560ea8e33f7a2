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
import warnings

import torch

from .packing import SharedPrefix
from .varlen_attention import fall_back_if_unsupported, register_varlen_attention, varlen_available

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


def attn_implementation(device: torch.device, *, prefix_sharing: bool = False) -> str:
    """The attention of the packed forward: on CUDA flex_attention with ``prefix_sharing`` (a block mask that skips
    the masked tiles), else flash_attention_2 (varlen over packed position_ids) when flash-attn is installed, else
    torch's own varlen FlashAttention where it runs (:mod:`cppo.step.varlen_attention`, registered here: torch >=
    2.10, compute capability >= 8.0); sdpa otherwise (on CPU, with prefix sharing, a dense bool mask: the fastest
    path measured, docs/results.md "Prefix sharing")."""
    if device.type == "cuda" and prefix_sharing:
        return "flex_attention"
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if varlen_available(device):
        return register_varlen_attention()
    return "sdpa"


#: The models :func:`load_model_and_tokenizer` builds in code from their name (whatever the file system holds).
BUILT_IN_MODELS = ("tiny-qwen2",)


def model_source(name: str) -> str:
    """What :func:`load_model_and_tokenizer` loads for ``name``, as another process in another folder must name it:
    a model built in code as its name (even where a folder of that name exists: the built-in is what loads), a local
    folder or file as its absolute path, a hub name as itself."""
    if name in BUILT_IN_MODELS:
        return name
    return os.path.abspath(name) if os.path.exists(name) else name


def load_model_and_tokenizer(
    name: str,
    *,
    model_config: dict | None = None,
    dtype: str = "float32",
    device: torch.device | str = "cpu",
    seed: int = 0,
    prefix_sharing: bool = False,
):
    """``(model, tokenizer)`` from a tiny-model name (built from a config, seeded by ``seed``), a local
    directory, a hub name or a ``.gguf`` file, its attention chosen by :func:`attn_implementation`. The tokenizer
    pads on the left and always has a pad token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    attn = attn_implementation(device, prefix_sharing=prefix_sharing)
    if name in BUILT_IN_MODELS:  # "tiny-qwen2"
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
    fall_back_if_unsupported(model)  # torch_varlen: to sdpa, with a warning, for a model it cannot run
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


#: The attention implementations that take the block-causal mask of prefix sharing (as a dense bool mask, an additive
#: float mask and a flex_attention BlockMask); flash_attention_2 and torch_varlen derive their own masks from
#: position_ids and cannot.
PREFIX_MASK_ATTENTION = ("sdpa", "eager", "flex_attention")


def prefix_sharing_blocker(model) -> str | None:
    """Why ``model`` cannot run prefix-shared rows (:class:`cppo.step.packing.SharedPrefix`), or None when it can: its
    attention must take a 4-D mask and every layer must be full (causal) attention, which the mask replaces."""
    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in PREFIX_MASK_ATTENTION:
        return f"its attention {impl!r} takes no 4-D mask (needs one of {PREFIX_MASK_ATTENTION})"
    other = sorted(set(getattr(cfg, "layer_types", None) or ()) - {"full_attention"})
    if other:
        return f"it has {other} layers, not only full attention"
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return f"it attends through a sliding window of {cfg.sliding_window}"
    return None


def use_prefix_sharing(model, requested: bool) -> bool:
    """Whether to pack with prefix sharing: ``requested`` and the model can (:func:`prefix_sharing_blocker`); a model
    that cannot falls back to one prompt per completion, with a warning naming ``prefix_sharing``."""
    why = prefix_sharing_blocker(model) if requested else None
    if why is not None:
        warnings.warn(
            f"prefix_sharing: {type(model).__name__} cannot share prompts ({why}); each completion is packed with its "
            "own prompt (set prefix_sharing=false to silence this)",
            stacklevel=2,
        )
    return requested and why is None


def prefix_attention_mask(model, prefix: SharedPrefix, *, device: torch.device):
    """The block-causal mask of ``prefix`` in the form the model's attention takes: sdpa a dense bool ``[1, 1, L,
    L]`` (True: attend), eager an additive float mask (0 / dtype min) of the same shape, flex_attention a BlockMask.
    ``ValueError`` naming ``prefix_sharing`` when the model cannot take it."""
    why = prefix_sharing_blocker(model)
    if why is not None:
        raise ValueError(f"prefix_sharing: {type(model).__name__} cannot run prompt-shared rows: {why}")
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl == "flex_attention":
        return _flex_block_mask(prefix, device=device)
    allowed = prefix.dense_mask(device)  # [1, 1, L, L]
    if impl == "sdpa":
        return allowed
    dtype = model.get_input_embeddings().weight.dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _flex_block_mask(prefix: SharedPrefix, *, device: torch.device):
    """flex_attention's BlockMask of ``prefix`` (memory O((L / 128)^2); fully masked tiles are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    group, branch = prefix.row_ids(device)  # [L], [L]

    def allowed(b, h, q, kv):
        return (group[q] == group[kv]) & (kv <= q) & ((branch[kv] == 0) | (branch[kv] == branch[q]))

    return create_block_mask(allowed, None, None, prefix.length, prefix.length, device=device)


def packed_hidden(
    model, input_ids: torch.Tensor, position_ids: torch.Tensor, prefix: SharedPrefix | None = None
) -> torch.Tensor:
    """Final hidden states ``[L, H]`` of one packed row ``input_ids [1, L]``.

    Without ``prefix``, ``position_ids [1, L]`` restart at 0 for each sequence; with no attention mask and no cache,
    transformers (>= 4.53) derives a block-diagonal causal mask from them (sdpa/eager) or cu_seqlens
    (flash_attention_2, torch_varlen), so packed sequences do not attend to each other
    (tests/cppo/step/test_packing.py and test_varlen_attention.py check this against separate forwards). With a
    ``prefix`` (prompt-shared rows) the mask of :func:`prefix_attention_mask` is passed instead, and transformers uses
    it as given (tests/cppo/step/test_prefix_sharing.py).
    """
    mask = None if prefix is None else prefix_attention_mask(model, prefix, device=input_ids.device)
    out = decoder(model)(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False)
    return out.last_hidden_state[0]  # [L, H]


def completion_hidden(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    predict_index: torch.Tensor,
    prefix: SharedPrefix | None = None,
) -> torch.Tensor:
    """Final hidden states ``[T, H]`` of the rows of a packed row that predict completion tokens (``predict_index
    [T]``; with prefix sharing a prompt's last row predicts the first token of each of its completions): the
    forward that DDP / FSDP2 wrap (see :func:`cppo.distributed.parallel.wrap_model`)."""
    return packed_hidden(model, input_ids, position_ids, prefix)[predict_index]
