"""torch's varlen FlashAttention as a transformers attention implementation (``cppo/step/varlen_attention.py``), on
the CPU: its registration and choice, ``cu_seqlens`` from ``position_ids`` (transformers' flash_attention_2 rule),
the mask logic against sdpa's block-diagonal causal mask, and tiny Qwen2 / Llama packed forwards through the
registered implementation against separate forwards, with a negative control. varlen_attn's FlashAttention kernel
runs on CUDA only, so the kernel is replaced through the module's seam (``register_varlen_attention(name, kernel)``)
by ``REFERENCE_KERNEL`` (per-sequence sdpa, itself checked against transformers' sdpa mask here), wrapped to count
its calls: a forward that never reached it could not pass. The kernel itself runs in the GPU kit (``e2e`` part) and
tests/cppo/step/test_cuda_models.py."""

from __future__ import annotations

import importlib.util
import inspect
import itertools

import pytest
import torch
from tiny_model import TINY

from cppo.step import models
from cppo.step import varlen_attention as va
from cppo.step.models import load_model_and_tokenizer, packed_hidden, prefix_sharing_blocker


def counting(kernel: va.VarlenKernel) -> tuple[va.VarlenKernel, list]:
    """``kernel`` recording each call's ``cu_seq_q`` (a list), and the list."""
    calls = []

    def fn(*args, **kwargs):
        calls.append(args[3].tolist())
        return kernel.fn(*args, **kwargs)

    return va.VarlenKernel(fn=fn, windows=kernel.windows, flash=kernel.flash), calls


def reference_model(model, name: str):
    """``model`` switched to the registered implementation over a counting :data:`REFERENCE_KERNEL`, and its calls."""
    kernel, calls = counting(va.REFERENCE_KERNEL)
    model.set_attn_implementation(va.register_varlen_attention(name, kernel))
    assert model.config._attn_implementation == name
    return model, calls


# --------------------------------------------------------------------------------------------
# Registration and choice
# --------------------------------------------------------------------------------------------


def test_the_attention_is_registered_under_its_name():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert va.register_varlen_attention() == va.VARLEN_ATTENTION == "torch_varlen"
    assert va.VARLEN_ATTENTION in AttentionInterface().valid_keys()
    assert AttentionMaskInterface._global_mapping[va.VARLEN_ATTENTION] is va.varlen_mask
    # a model loads under the name (transformers checks it against its registry)
    from transformers import AutoModelForCausalLM, Qwen2Config

    model = AutoModelForCausalLM.from_config(
        Qwen2Config(**TINY, num_hidden_layers=1), attn_implementation="torch_varlen"
    )
    assert model.config._attn_implementation == "torch_varlen"


def test_the_packed_forward_picks_it_on_cuda_without_flash_attn(monkeypatch):
    find_spec = importlib.util.find_spec
    cuda = torch.device("cuda")
    assert models.attn_implementation(torch.device("cpu")) == "sdpa"  # not available on a CPU
    assert not va.varlen_available(torch.device("cpu"))
    monkeypatch.setattr(models, "varlen_available", lambda device: device.type == "cuda")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else find_spec(name))
    assert models.attn_implementation(cuda) == "torch_varlen"
    assert models.attn_implementation(cuda, prefix_sharing=True) == "flex_attention"
    assert models.attn_implementation(torch.device("cpu")) == "sdpa"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else None)
    assert models.attn_implementation(cuda) == "flash_attention_2"  # with flash-attn, as before
    monkeypatch.setattr(models, "varlen_available", lambda device: False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert models.attn_implementation(cuda) == "sdpa"  # torch < 2.10 or a GPU older than Ampere


def test_it_cannot_take_the_prefix_sharing_mask_as_flash_attention_2_cannot():
    model, _ = load_model_and_tokenizer("tiny-qwen2", model_config={**TINY, "num_hidden_layers": 1})
    model.set_attn_implementation(va.register_varlen_attention())
    assert "takes no 4-D mask" in prefix_sharing_blocker(model)


# --------------------------------------------------------------------------------------------
# cu_seqlens from position_ids
# --------------------------------------------------------------------------------------------


def flash_rule(position_ids: torch.Tensor) -> tuple[list[int], int]:
    """transformers' own derivation for flash_attention_2 (one row)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    (cu, cu_k), (longest, _) = prepare_fa_kwargs_from_position_ids(position_ids)
    assert torch.equal(cu, cu_k)
    return cu.tolist(), int(longest)


@pytest.mark.parametrize(
    ("positions", "cu", "longest"),
    [
        ([0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 3, 5, 9], 4),  # several packed sequences
        ([0, 1, 2, 3, 4], [0, 5], 5),  # a single one
        ([0, 0, 1, 0, 0], [0, 1, 3, 4, 5], 2),  # 1-token sequences, first, middle and last
        ([0], [0, 1], 1),  # one token
        ([0, 1, 2, 0, 1, 0, 0, 0], [0, 3, 5, 6, 7, 8], 3),  # padding-free padding: position 0 each, 1-token sequences
        ([2, 3, 4, 2, 3], [0, 3, 5], 3),  # sequences restarting at another first position (RoBERTa-like)
    ],
)
def test_cu_seqlens_from_position_ids_follow_flash_attention_2(positions, cu, longest):
    position_ids = torch.tensor([positions])  # [1, L]
    got, got_longest = va.cu_seqlens_from_position_ids(position_ids)
    assert got.dtype == torch.int32 and got.tolist() == cu and got_longest == longest
    assert flash_rule(position_ids) == (cu, longest)
    assert va.cu_seqlens_from_position_ids(position_ids[0])[0].tolist() == cu  # [L] as well


def test_rows_of_a_batch_are_sequences_of_their_own():
    position_ids = torch.tensor([[0, 1, 2, 3], [5, 6, 0, 1]])  # [2, 4]: the second row starts mid-sequence
    cu, longest = va.cu_seqlens_from_position_ids(position_ids)
    assert cu.tolist() == [0, 4, 6, 8] and longest == 4
    starts = va.sequence_starts(None, 2, 3, "cpu")  # no position_ids: one sequence per row
    assert va.cu_seqlens(starts)[0].tolist() == [0, 3, 6]
    assert va.sequence_starts(torch.tensor([[0, 1, 0]]), 2, 3, "cpu").tolist() == [[True, False, True]] * 2
    with pytest.raises(ValueError, match=r"position_ids must be \[3\]"):
        va.sequence_starts(torch.zeros(1, 4, dtype=torch.long), 1, 3, "cpu")


# --------------------------------------------------------------------------------------------
# The mask logic against sdpa's block-diagonal causal mask
# --------------------------------------------------------------------------------------------


def sdpa_packed_mask(position_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """transformers' own sdpa mask of a packed row ``[1, 1, L, L]`` (the mask sdpa runs a packed forward with)."""
    from transformers import masking_utils as mu

    base = mu.causal_mask_function if sliding_window is None else mu.sliding_window_causal_mask_function(sliding_window)
    fn = mu.and_masks(base, mu.packed_sequence_mask_function(mu.find_packed_sequence_indices(position_ids)))
    n = position_ids.shape[-1]
    return mu.sdpa_mask(batch_size=1, q_length=n, kv_length=n, mask_function=fn, allow_is_causal_skip=False)


POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 0, 1]])  # [1, 13]: sequences of 4, 1, 6, 2 tokens


@pytest.mark.parametrize("window", [None, 3])
def test_the_block_mask_is_sdpas(window):
    starts = va.sequence_starts(POSITIONS, 1, POSITIONS.shape[1], "cpu")
    assert torch.equal(va.block_causal_mask(starts, sliding_window=window), sdpa_packed_mask(POSITIONS, window))


class Attention(torch.nn.Module):
    """What transformers' attention functions read from their module."""

    is_causal = True

    def __init__(self, kv_groups: int):
        super().__init__()
        self.num_key_value_groups = kv_groups


@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(4, 4, None), (4, 2, None), (4, 1, 3)])
def test_the_attention_with_the_reference_kernel_equals_sdpa_under_the_block_mask(heads, kv_heads, window):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    n, d = POSITIONS.shape[1], 8
    q = torch.randn(1, heads, n, d, generator=g)  # [B, H, L, D]
    k, v = (torch.randn(1, kv_heads, n, d, generator=g) for _ in range(2))  # [B, Hkv, L, D]
    kernel, calls = counting(va.REFERENCE_KERNEL)
    module, scale = Attention(heads // kv_heads), 0.3  # a scale other than 1/sqrt(D) must reach the kernel
    got, _ = va.make_attention(kernel)(module, q, k, v, None, scaling=scale, position_ids=POSITIONS,
                                       sliding_window=window)  # fmt: skip
    want, _ = sdpa_attention_forward(module, q, k, v, sdpa_packed_mask(POSITIONS, window), scaling=scale)
    assert calls == [[0, 4, 5, 11, 13]]
    assert got.shape == want.shape == (1, n, heads, d)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # the negative control: one causal sequence (position_ids running on) is not the packed result
    leak, _ = va.make_attention(kernel)(module, q, k, v, None, scaling=scale, position_ids=torch.arange(n)[None],
                                        sliding_window=window)  # fmt: skip
    assert (leak[0, 4:] - want[0, 4:]).abs().max() > 0.1


def test_padding_and_a_cache_take_sdpas_mask_and_sdpa():
    kwargs = dict(batch_size=2, q_length=4, kv_length=4)
    assert va.varlen_mask(**kwargs) is None  # the kernel's case: no padding, no cache
    assert va.varlen_mask(**kwargs, attention_mask=torch.ones(2, 4, dtype=torch.bool)) is None
    padded = torch.tensor([[False, True, True, True], [True] * 4])
    mask = va.varlen_mask(**kwargs, attention_mask=padded)  # [2, 1, 4, 4]
    assert mask.shape == (2, 1, 4, 4) and not mask[0, 0, :, 0].any()
    assert torch.equal(mask[1, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    decode = va.varlen_mask(batch_size=1, q_length=1, kv_length=5, q_offset=4, allow_is_causal_skip=False)
    assert decode.shape == (1, 1, 1, 5) and decode.all()
    overlay = va.varlen_mask(**kwargs, use_vmap=True, allow_is_causal_skip=False)  # an or/and mask function
    assert overlay is not None and overlay.shape == (2, 1, 4, 4)


# --------------------------------------------------------------------------------------------
# Whole models: packed through the registered implementation against separate forwards
# --------------------------------------------------------------------------------------------

LENGTHS = (1, 9, 5, 13, 2)  # ragged, a 1-token sequence first


def tiny(family: str, **extra):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config = {"qwen2": Qwen2Config, "llama": LlamaConfig}[family](**TINY, num_hidden_layers=2, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def packed_against_alone(model) -> tuple[float, float]:
    """The largest ``|packed - alone|`` of the final hidden states over the sequences of :data:`LENGTHS`, and of the
    negative control (the row with position_ids running on, one causal sequence) past the first sequence."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, TINY["vocab_size"], (1, sum(LENGTHS)), generator=g)  # [1, L]
    restart = torch.cat([torch.arange(n) for n in LENGTHS])[None]  # [1, L]
    bounds = list(itertools.accumulate(LENGTHS, initial=0))
    with torch.no_grad():
        packed = packed_hidden(model, ids, restart)  # [L, H]
        control = packed_hidden(model, ids, torch.arange(sum(LENGTHS))[None])  # [L, H]
        alone = torch.cat([packed_hidden(model, ids[:, a:b], restart[:, a:b]) for a, b in zip(bounds, bounds[1:])])
    return (packed - alone).abs().max().item(), (control - alone)[LENGTHS[0] :].abs().max().item()


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_packed_forward_through_it_equals_separate_forwards(family):
    model, calls = reference_model(tiny(family), f"torch_varlen_test_{family}")
    error, control = packed_against_alone(model)
    assert error < 1e-5, error
    assert control > 1e-2, control  # the leak the packing prevents
    cu = [0, *itertools.accumulate(LENGTHS)]
    assert calls[:2] == [cu, cu]  # the packed row's two layers ran the kernel, on its sequences
    assert len(calls) == 2 * (2 + len(LENGTHS))  # packed, control, each sequence alone: every layer


def test_gradients_through_it_equal_sdpas():
    model = tiny("qwen2")
    restart = torch.cat([torch.arange(n) for n in LENGTHS])[None]  # [1, L]
    ids = torch.randint(5, TINY["vocab_size"], restart.shape, generator=torch.Generator().manual_seed(2))  # [1, L]
    upstream = torch.randn(restart.shape[1], TINY["hidden_size"], generator=torch.Generator().manual_seed(3))

    def grads():
        model.zero_grad(set_to_none=True)
        (packed_hidden(model, ids, restart) * upstream).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}  # not the LM head

    want = grads()  # sdpa: transformers' block-diagonal mask
    model, calls = reference_model(model, "torch_varlen_test_grads")
    got = grads()
    assert got.keys() == want.keys() and "model.layers.0.self_attn.q_proj.weight" in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4)
    assert len(calls) == 2


def test_sliding_window_layers_pass_their_window():
    model = tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert model.config.layer_types == ["sliding_attention"] * 2
    g = torch.Generator().manual_seed(4)
    restart = torch.cat([torch.arange(n) for n in LENGTHS])[None]  # [1, L]
    ids = torch.randint(5, TINY["vocab_size"], restart.shape, generator=g)  # [1, L]
    with torch.no_grad():
        want = packed_hidden(model, ids, restart)  # sdpa with transformers' sliding packed mask
        model, calls = reference_model(model, "torch_varlen_test_window")
        got = packed_hidden(model, ids, restart)
        for layer in model.model.layers:  # the negative control: the same layers without their window
            layer.self_attn.sliding_window = None
        unwindowed = packed_hidden(model, ids, restart)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(calls) == 4 and (unwindowed - want).abs().max() > 1e-2


def test_padded_generation_runs_sdpa_where_the_kernel_cannot():
    model = tiny("qwen2")
    ids = torch.randint(5, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(5))  # [2, 6]
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    args = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(**args)
        model, calls = reference_model(model, "torch_varlen_test_generate")
        got = model.generate(**args)
        assert torch.equal(got, want) and calls == []  # padded prefill, then decoding with a cache: sdpa's
        unpadded = model.generate(**{**args, "attention_mask": torch.ones_like(ids)})
    assert len(calls) == 2 and calls[0] == [0, 6, 12]  # the unpadded prefill runs the kernel, one row a sequence
    model.set_attn_implementation("sdpa")
    assert torch.equal(unpadded, model.generate(**{**args, "attention_mask": torch.ones_like(ids)}))


# --------------------------------------------------------------------------------------------
# torch versions, and what it refuses
# --------------------------------------------------------------------------------------------


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's varlen_attn signature (no window, scale or GQA), computed by the reference."""
    window = (-1, 0) if is_causal else (-1, -1)
    return va.reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):  # fmt: skip
    """The signature between (window_size and scale, no enable_gqa: torch 2.11's, the lent GPUs'), by the reference."""
    assert key.shape[1] == query.shape[1], "no GQA in this signature: the adapter repeats the KV heads"
    return va.reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                    window_size=window_size)  # fmt: skip


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
    """torch 2.13's varlen_attn signature, computed by the reference."""
    assert isinstance(window_size, tuple) and isinstance(max_q, int)
    return va.reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                    window_size=window_size, enable_gqa=enable_gqa)  # fmt: skip


def test_the_installed_torch_has_the_2_13_signature_or_none():
    from torch.nn.attention import varlen

    assert set(inspect.signature(varlen_2_13).parameters) == set(inspect.signature(varlen.varlen_attn).parameters)
    kernel = va.torch_kernel()
    assert kernel is not None and kernel.windows and kernel.flash


@pytest.mark.parametrize("fn", [varlen_2_10, varlen_2_11, varlen_2_13])
def test_every_torch_signature_gives_the_same_attention(fn):
    kernel = va.adapt_kernel(fn)
    assert kernel.windows == (fn is not varlen_2_10)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(13, 4, 8, generator=g)  # [T, Hq, D]
    k, v = (torch.randn(13, 2, 8, generator=g) for _ in range(2))  # [T, Hkv, D]
    cu = torch.tensor([0, 4, 5, 11, 13], dtype=torch.int32)
    options = dict(scale=0.3, window_size=(-1, 0), enable_gqa=True)
    want = va.reference_varlen_attn(q, k, v, cu, cu, 6, 6, **options)
    torch.testing.assert_close(kernel.fn(q, k, v, cu, cu, 6, 6, **options), want, atol=1e-6, rtol=1e-6)
    if kernel.windows:
        window = {**options, "window_size": (2, 0)}
        torch.testing.assert_close(kernel.fn(q, k, v, cu, cu, 6, 6, **window),
                                   va.reference_varlen_attn(q, k, v, cu, cu, 6, 6, **window))  # fmt: skip
    if not kernel.windows:
        with pytest.raises(ValueError, match="takes no window_size"):
            kernel.fn(q, k, v, cu, cu, 6, 6, **{**options, "window_size": (2, 0)})
        assert "sliding window" in kernel.refusal(q, v, sliding_window=3, dropout=0.0)


def test_a_call_the_kernel_cannot_run_runs_sdpa_with_a_warning():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kernel, calls = counting(va.adapt_kernel(varlen_2_13))  # FlashAttention's limits: half precision, CUDA
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, POSITIONS.shape[1], 8, generator=g) for _ in range(3))  # [B, H, L, D]
    attention = va.make_attention(kernel)
    want, _ = sdpa_attention_forward(Attention(1), q, k, v, sdpa_packed_mask(POSITIONS))
    for options, reason in [({}, "torch.float32"), ({"dropout": 0.5}, "attention dropout 0.5")]:
        with pytest.warns(UserWarning, match=f"torch_varlen: {reason}.*runs sdpa with the same block-diagonal mask"):
            got, _ = attention(Attention(1), q, k, v, None, position_ids=POSITIONS, **options)
        if not options:
            torch.testing.assert_close(got, want)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 inputs under autocast run in its dtype (as FA2's)
        with pytest.warns(UserWarning, match="torch_varlen: a cpu tensor"):
            got, _ = attention(Attention(1), q, k, v, None, position_ids=POSITIONS)
    assert got.dtype == torch.bfloat16 and calls == []
    half = q.bfloat16()
    assert "head dims 512/512" in kernel.refusal(torch.zeros(3, 1, 512).bfloat16(), torch.zeros(3, 1, 512),
                                                 sliding_window=None, dropout=0.0)  # fmt: skip
    assert "head dims 12/12" in kernel.refusal(torch.zeros(3, 1, 12).bfloat16(), torch.zeros(3, 1, 12),
                                               sliding_window=None, dropout=0.0)  # fmt: skip
    assert "cpu tensor" in kernel.refusal(half, half, sliding_window=None, dropout=0.0)
    assert va.REFERENCE_KERNEL.refusal(q, v, sliding_window=3, dropout=0.0) is None


def test_what_neither_computes_is_refused_in_the_call():
    q = torch.randn(1, 2, 3, 8)  # [B, H, L, D]
    attention = va.make_attention(va.REFERENCE_KERNEL)
    with pytest.raises(ValueError, match="torch_varlen.*cannot compute Attention's attention logit softcapping"):
        attention(Attention(1), q, q, q, None, softcap=30.0)
    with pytest.raises(ValueError, match="attention sinks"):
        attention(Attention(1), q, q, q, None, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="non-causal attention"):
        attention(Attention(1), q, q, q, None, is_causal=False)


def test_a_model_it_cannot_run_falls_back_to_sdpa_at_load_with_one_warning():
    from transformers import AutoModelForCausalLM, Gemma2Config

    va.register_varlen_attention()
    config = Gemma2Config(**TINY, num_hidden_layers=1, head_dim=16)  # attention logit softcapping 50
    model = AutoModelForCausalLM.from_config(config, attn_implementation="torch_varlen")
    assert "softcapping" in va.model_refusal(model)
    with pytest.warns(UserWarning, match="torch_varlen.*Gemma2ForCausalLM has attention logit softcapping.*sdpa"):
        va.fall_back_if_unsupported(model)
    assert model.config._attn_implementation == "sdpa"
    qwen = tiny("qwen2")
    qwen.set_attn_implementation("torch_varlen")
    assert va.model_refusal(qwen) is None
    va.fall_back_if_unsupported(qwen)
    assert qwen.config._attn_implementation == "torch_varlen"
