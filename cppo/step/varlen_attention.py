"""torch's own varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10) as a transformers
attention implementation, :data:`VARLEN_ATTENTION`: the packed forward's attention on CUDA when the flash-attn
wheel is absent (:func:`cppo.step.models.attn_implementation`).

A packed row (sequences one after another, ``position_ids`` restarting) runs as flash_attention_2 runs it: the
sequence boundaries ``cu_seqlens`` come from ``position_ids`` (a sequence starts wherever the position is the
smallest of them, transformers' ``prepare_fa_kwargs_from_position_ids`` rule, and at each row's start), each sequence
causal within itself (and within its sliding window), grouped KV heads passed natively. Everything else is sdpa's:
a padded batch (a 2-D mask with zeros), decoding with a cache (fewer queries than keys) or a 4-D mask go through
transformers' sdpa mask and ``sdpa_attention_forward``, as under ``attn_implementation="sdpa"``. A call the kernel
cannot run (float32 outside autocast, attention dropout, a window the installed torch cannot pass, a CPU tensor)
runs sdpa with the same block-diagonal causal mask and a warning naming why. What neither can compute (logit
softcapping, attention sinks, non-causal or chunked attention) is refused: at load the model falls back to sdpa with
one warning (:func:`fall_back_if_unsupported`), and a call is a ``ValueError``; never a silently wrong mask.

The kernel is a seam (:class:`VarlenKernel`): :func:`register_varlen_attention` takes another one under another
name, as the CPU tests and the GPU kit's dry run do with :data:`REFERENCE_KERNEL` (varlen_attn's semantics by
per-sequence sdpa: varlen_attn's FlashAttention kernel runs on CUDA only).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable

import torch

#: The attention implementation's name in transformers' registries (``config._attn_implementation``).
VARLEN_ATTENTION = "torch_varlen"
#: FlashAttention's limits in torch: half precision, head dims up to 256 (multiples of 8), compute capability 8.0
#: (Ampere) or newer.
HALF = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MIN_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class VarlenKernel:
    """A varlen attention kernel: ``fn(query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D], cu_seq_q, cu_seq_k
    (int32 [S + 1]), max_q, max_k, *, scale, window_size, enable_gqa) -> [T, Hq, D]`` (varlen_attn's signature in
    torch 2.13; ``window_size`` ``(left, right)``, -1 unbounded, ``(-1, 0)`` causal). ``windows``: it takes a left
    window other than -1. ``flash``: FlashAttention's limits hold (CUDA, fp16/bf16, head dims <= 256 in 8s)."""

    fn: Callable
    windows: bool
    flash: bool

    def refusal(self, query: torch.Tensor, value: torch.Tensor, *, sliding_window, dropout: float) -> str | None:
        """Why this kernel cannot run a call (sdpa runs it instead), or None."""
        if dropout:
            return f"attention dropout {dropout} (varlen_attn has none)"
        if sliding_window is not None and not self.windows:
            return f"a sliding window of {sliding_window} (this torch's varlen_attn takes no window_size)"
        if not self.flash:
            return None
        if query.dtype not in HALF:
            return f"{query.dtype} (FlashAttention takes float16/bfloat16: run under autocast)"
        d = query.shape[-1]
        if value.shape[-1] != d or d > MAX_HEAD_DIM or d % 8:
            return f"head dims {d}/{value.shape[-1]} (FlashAttention: equal, a multiple of 8, at most {MAX_HEAD_DIM})"
        if not query.is_cuda:
            return f"a {query.device.type} tensor (varlen_attn's FlashAttention kernel runs on CUDA only)"
        return None


def adapt_kernel(varlen_attn: Callable) -> VarlenKernel:
    """``varlen_attn`` behind torch 2.13's keywords (``scale``, ``window_size``, ``enable_gqa``), whatever the
    installed version takes of them (read from its signature): torch 2.10's takes ``is_causal`` instead of
    ``window_size`` (no window then), 2.11's has no ``enable_gqa``; a keyword it lacks is done around it (grouped KV
    heads repeated, the query pre-scaled)."""
    params = inspect.signature(varlen_attn).parameters

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
               enable_gqa=False):  # fmt: skip
        window, kwargs = tuple(window_size), {}
        if "window_size" in params:
            kwargs["window_size"] = window
        elif window[0] == -1 and window[1] in (-1, 0):
            kwargs["is_causal"] = window[1] == 0
        else:
            raise ValueError(f"this torch's varlen_attn takes no window_size (asked for {window})")
        if enable_gqa and "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif enable_gqa:  # query head h reads KV head h // n, as transformers' repeat_kv
            n = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(n, dim=1), value.repeat_interleave(n, dim=1)  # [T, Hq, D]
        if "scale" in params:
            kwargs["scale"] = scale
        elif scale is not None and scale != query.shape[-1] ** -0.5:
            query = query * (scale * query.shape[-1] ** 0.5)  # [T, Hq, D]: the kernel's own 1/sqrt(D) on top
        return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)

    return VarlenKernel(fn=kernel, windows="window_size" in params, flash=True)


def torch_kernel() -> VarlenKernel | None:
    """torch's ``varlen_attn`` (:func:`adapt_kernel`), or None where this torch has none (< 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return adapt_kernel(varlen_attn)


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False) -> torch.Tensor:  # fmt: skip
    """varlen_attn's result by plain sdpa, one sequence at a time, on any device and dtype (a test oracle): query
    ``i`` of a sequence attends to its keys ``j`` with ``i' - left <= j <= i' + right`` (``i' = i + keys - queries``:
    aligned at the bottom right, as FlashAttention); ``max_q`` / ``max_k`` are not needed."""
    left, right = window_size
    outs = []
    for a, b, c, d in zip(cu_seq_q.tolist(), cu_seq_q[1:].tolist(), cu_seq_k.tolist(), cu_seq_k[1:].tolist()):
        q, k, v = (x.transpose(0, 1) for x in (query[a:b], key[c:d], value[c:d]))  # [H, n, D], [Hkv, m, D] x 2
        i = torch.arange(b - a, device=query.device)[:, None] + (d - c) - (b - a)  # [n, 1]
        j = torch.arange(d - c, device=query.device)[None]  # [1, m]
        allowed = torch.ones(b - a, d - c, dtype=torch.bool, device=query.device)  # [n, m]
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                                               enable_gqa=enable_gqa)  # fmt: skip
        outs.append(out.transpose(0, 1))  # [n, H, D]
    return torch.cat(outs)  # [T, H, D]


#: varlen_attn's semantics on any device (:func:`reference_varlen_attn`): the seam's CPU stand-in.
REFERENCE_KERNEL = VarlenKernel(fn=reference_varlen_attn, windows=True, flash=False)


def sequence_starts(position_ids: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """``[B, L]`` bool, True where a sequence starts: each row's first token and every token whose position is the
    smallest of ``position_ids`` (``[L]``, ``[1, L]`` or ``[B, L]``; None: one sequence per row). flash_attention_2's
    rule for one row (``prepare_fa_kwargs_from_position_ids``: packed sequences restart at the same first position,
    0 for most models); padding positions of 0 (padding-free collators) become 1-token sequences."""
    if position_ids is None:
        starts = torch.zeros(batch, length, dtype=torch.bool, device=device)  # [B, L]
    else:
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids.dim() != 2 or position_ids.shape[-1] != length or position_ids.shape[0] not in (1, batch):
            shape = tuple(position_ids.shape)
            raise ValueError(f"position_ids must be [{length}] or [1 or {batch}, {length}], got {shape}")
        starts = (position_ids == position_ids.min()).expand(batch, length).clone()  # [B, L]
    starts[:, 0] = True
    return starts


def cu_seqlens(starts: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32 [S + 1], longest)`` of the sequences that ``starts [B, L]`` marks, the rows one after
    another (as the kernel sees the tokens: ``[B * L, H, D]``)."""
    flat = starts.reshape(-1)  # [B * L]
    end = torch.tensor([flat.numel()], device=flat.device)
    cu = torch.cat([flat.nonzero().view(-1), end]).to(torch.int32)  # [S + 1]
    return cu, int(cu.diff().max())


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32 [S + 1], longest)`` of a packed ``position_ids [B, L]`` (or ``[L]``): what the attention
    passes the kernel (:func:`sequence_starts`)."""
    shape = position_ids.shape if position_ids.dim() == 2 else (1, position_ids.shape[0])
    return cu_seqlens(sequence_starts(position_ids, shape[0], shape[1], position_ids.device))


def block_causal_mask(starts: torch.Tensor, *, sliding_window: int | None = None) -> torch.Tensor:
    """``[B, 1, L, L]`` bool (True: attend) of the sequences ``starts [B, L]`` marks: a token sees its own sequence's
    tokens up to itself (the last ``sliding_window`` of them): the mask sdpa runs a refused call with."""
    seq = starts.cumsum(-1)  # [B, L]
    i = torch.arange(starts.shape[-1], device=starts.device)  # [L]
    allowed = (seq[:, :, None] == seq[:, None, :]) & (i[:, None] >= i[None, :])  # [B, L, L]
    if sliding_window is not None:
        allowed &= (i[:, None] - i[None, :]) < sliding_window
    return allowed[:, None]


def config_refusal(config) -> str | None:
    """What in a model's config neither the kernel nor sdpa's packed mask computes, or None."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"attention logit softcapping ({config.attn_logit_softcapping})"
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(config, "attention_chunk_size", None) is not None:
        return f"chunked attention ({config.attention_chunk_size})"
    return None


def _call_refusal(module, softcap, s_aux, is_causal) -> str | None:
    if softcap is not None:
        return f"attention logit softcapping ({softcap})"
    if s_aux is not None:
        return "attention sinks"
    if not is_causal:
        return "non-causal attention"
    return config_refusal(getattr(module, "config", None))


def _kernel_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype the kernel runs in: autocast's for fp32 inputs under autocast (RoPE promotes q and k to fp32 from
    fp32 cos/sin), as flash_attention_2 casts them; else the query's."""
    device = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def make_attention(kernel: VarlenKernel) -> Callable:
    """transformers' attention function over ``kernel``: ``(module, query [B, Hq, L, D], key / value [B, Hkv, S, D],
    attention_mask, scaling=None, dropout=0.0, **kwargs) -> (output [B, L, Hq, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        sliding_window, is_causal = kwargs.pop("sliding_window", None), kwargs.pop("is_causal", None)
        softcap, s_aux = kwargs.pop("softcap", None), kwargs.pop("s_aux", None)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        why = _call_refusal(module, softcap, s_aux, causal)
        if why is not None:
            raise ValueError(f"attn_implementation={VARLEN_ATTENTION!r} cannot compute {type(module).__name__}'s "
                             f"{why}; load the model with attn_implementation='eager'")  # fmt: skip
        if attention_mask is not None or query.shape[2] != key.shape[2]:  # padding, a cache, a 4-D mask: sdpa's
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          is_causal=is_causal, **kwargs)  # fmt: skip
        batch, heads, length, _ = query.shape
        starts = sequence_starts(kwargs.get("position_ids"), batch, length, query.device)  # [B, L]
        dtype = _kernel_dtype(query)
        query, key, value = (x.to(dtype) for x in (query, key, value))
        why = kernel.refusal(query, value, sliding_window=sliding_window, dropout=dropout)
        if why is not None:
            warnings.warn(
                f"{VARLEN_ATTENTION}: {why}: this attention runs sdpa with the same block-diagonal mask", stacklevel=2
            )
            mask = block_causal_mask(starts, sliding_window=sliding_window)  # [B, 1, L, L]
            return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
        cu, longest = cu_seqlens(starts)  # [S + 1]
        q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], x.shape[3]) for x in (query, key, value))
        window = (-1 if sliding_window is None else sliding_window - 1, 0)
        out = kernel.fn(q, k, v, cu, cu, longest, longest, scale=scaling, window_size=window,
                        enable_gqa=k.shape[1] != heads)  # fmt: skip
        return out.reshape(batch, length, heads, -1), None  # [B, L, Hq, D]

    return varlen_attention_forward


def varlen_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                **kwargs):  # fmt: skip
    """transformers' mask for this implementation: None where the kernel runs (no padding, no cache, no overlay on
    the causal mask: the sequences come from position_ids, as flash_attention_2's), else sdpa's mask, and sdpa runs."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    unpadded = attention_mask is None or (attention_mask.shape[-1] == kv_length and bool(attention_mask.all()))
    offsets = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0
    if unpadded and offsets and q_length == kv_length and not kwargs.get("use_vmap", False):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function or causal_mask_function,
                     attention_mask, **kwargs)  # fmt: skip


def register_varlen_attention(name: str = VARLEN_ATTENTION, kernel: VarlenKernel | None = None) -> str:
    """Registers the attention over ``kernel`` (torch's by default) and its mask under ``name`` in transformers'
    ``AttentionInterface`` and ``AttentionMaskInterface``; returns ``name``. ``ValueError`` where torch has no
    varlen_attn and no kernel is given."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    kernel = kernel or torch_kernel()
    if kernel is None:
        raise ValueError(f"attn_implementation={name!r} needs torch >= 2.10 (varlen_attn), got {torch.__version__}")
    AttentionInterface.register(name, make_attention(kernel))
    AttentionMaskInterface.register(name, varlen_mask)
    return name


def varlen_available(device: torch.device) -> bool:
    """Whether torch's varlen_attn runs on ``device``: a CUDA device of compute capability 8.0 or more, a torch that
    has it."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY and torch_kernel() is not None


def model_refusal(model) -> str | None:
    """Why ``model`` cannot run on this implementation (:func:`config_refusal`, attention sinks, a sliding window this
    torch cannot pass), or None."""
    cfg = model.config
    why = config_refusal(cfg)
    if why is None and any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        why = "attention sinks"
    windowed = "sliding_attention" in (getattr(cfg, "layer_types", None) or ()) or (
        getattr(cfg, "layer_types", None) is None and getattr(cfg, "sliding_window", None) is not None
        and getattr(cfg, "use_sliding_window", True)
    )  # fmt: skip
    kernel = torch_kernel()
    if why is None and windowed and not (kernel is not None and kernel.windows):
        why = f"a sliding window of {cfg.sliding_window} (this torch's varlen_attn takes no window_size)"
    return why


def fall_back_if_unsupported(model) -> None:
    """A model loaded with this implementation that cannot run on it (:func:`model_refusal`) switches to sdpa, with
    one warning naming the model and the reason."""
    if getattr(model.config, "_attn_implementation", None) != VARLEN_ATTENTION:
        return
    why = model_refusal(model)
    if why is not None:
        warnings.warn(
            f"attn_implementation={VARLEN_ATTENTION!r}: {type(model).__name__} has {why}; it runs sdpa", stacklevel=2
        )
        model.set_attn_implementation("sdpa")
