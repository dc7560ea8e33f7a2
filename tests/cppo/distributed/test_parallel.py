"""Data parallelism of the model in one process: the packed forward put on the model, nothing wrapped or synchronised
alone, the gradient scale, FSDP2's mixed precision and the blocks it shards, and the settings it refuses. (Under
torchrun with DDP and FSDP2: tests/cppo/distributed/test_multiproc.py.)"""

import pytest
import torch
from tiny_model import TINY

from cppo.distributed import (
    PARALLELISMS,
    DistInfo,
    ForwardModule,
    grad_scale,
    gradient_sync,
    is_fsdp2,
    mixed_precision,
    root_unsharded,
    unwrap_model,
    wrap_model,
)
from cppo.distributed.parallel import _fsdp_blocks
from cppo.step import load_model_and_tokenizer

ALONE, PAIR = DistInfo(), DistInfo(rank=1, world_size=2)


def test_the_packed_forward_is_put_on_the_model_and_nothing_is_wrapped_alone():
    model = torch.nn.Linear(3, 2)
    calls = []

    def forward(m, x, *, scale):
        calls.append(m)
        return m(x) * scale

    for parallelism in PARALLELISMS:
        wrapped = wrap_model(model, parallelism=parallelism, info=ALONE, forward=forward)
        assert isinstance(wrapped, ForwardModule) and unwrap_model(wrapped) is model and not is_fsdp2(wrapped)
        x = torch.ones(1, 3)
        assert torch.equal(wrapped(x, scale=2.0), model(x) * 2.0) and calls[-1] is model
    assert wrap_model(model, parallelism="ddp", info=ALONE) is model


def test_alone_the_sync_and_unshard_contexts_do_nothing():
    model = torch.nn.Linear(3, 2)
    for enabled in (True, False):
        with gradient_sync(model, enabled), root_unsharded(model):
            model(torch.ones(1, 3)).sum().backward()
    assert model.weight.grad is not None  # both backward passes accumulated locally


def test_the_gradient_scale_turns_the_ranks_average_into_a_sum():
    assert grad_scale(parallelism="ddp", info=PAIR) == 2.0 and grad_scale(parallelism="fsdp2", info=PAIR) == 2.0
    assert grad_scale(parallelism="none", info=ALONE) == 1.0 and grad_scale(parallelism="ddp", info=ALONE) == 1.0


def test_bad_parallelism_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match="parallelism"):
        grad_scale(parallelism="zero3", info=ALONE)
    with pytest.raises(ValueError, match=r"parallelism='none' with world_size=2: use 'ddp' or 'fsdp2'"):
        wrap_model(torch.nn.Linear(1, 1), parallelism="none", info=PAIR)


def test_fsdp2_gathers_in_the_compute_dtype_and_reduces_in_fp32():
    plain = mixed_precision(None)
    assert plain.param_dtype is None and plain.reduce_dtype is None and mixed_precision(torch.float32) == plain
    bf16 = mixed_precision(torch.bfloat16)
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_fsdp2_shards_the_decoder_layers_one_by_one():
    model, _ = load_model_and_tokenizer("tiny-qwen2", model_config=TINY)
    blocks = _fsdp_blocks(model)
    assert len(blocks) == 2 and all(type(b).__name__ == "Qwen2DecoderLayer" for b in blocks)
    stack = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]))
    assert len(_fsdp_blocks(stack)) == 2  # without _no_split_modules: the children of every ModuleList
