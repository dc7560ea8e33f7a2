"""The packed forward on a CUDA device; skipped without one (the GPU kit's ``tests`` part runs it, ``-m cuda``).

Sequences packed in one row with position_ids restarting at 0 must give each sequence's final hidden states as a
forward of that sequence alone does, with the attention CUDA runs (flash-attention 2 when importable, sdpa
otherwise). A negative control runs the same row with position_ids running on (one long causal sequence), whose
later sequences do see the earlier ones: its error must be far above the tolerance, or the check could not fail.
tests/trainer/test_packing.py checks the same on the CPU (sdpa, float32).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cppo.models import load_model_and_tokenizer, packed_hidden

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

#: Head dim 64 (within flash-attention's), 2 layers, grouped KV heads.
MODEL = {
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2,
}  # fmt: skip
#: Ragged, a 1-token sequence first, lengths on and off multiples of 16 (flash-attention's tiles).
LENGTHS = (1, 37, 64, 129, 200, 300)
#: ||packed - alone|| / ||alone|| allowed per dtype: one rounding per op, different attention kernels either side (a
#: leak between sequences gives O(0.1-1)).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_packed_forward_equals_separate_forwards(dtype):
    model, _ = load_model_and_tokenizer("tiny-qwen2", model_config=MODEL, dtype=dtype, device="cuda")
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, MODEL["vocab_size"], (1, sum(LENGTHS)), generator=g).cuda()  # [1, L]
    restart = torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda()  # [1, L]
    running = torch.arange(sum(LENGTHS), device="cuda")[None]  # [1, L]
    bounds = list(itertools.accumulate(LENGTHS, initial=0))
    spans = list(zip(bounds, bounds[1:]))
    with torch.no_grad():
        packed = packed_hidden(model, ids, restart).double()  # [L, H]
        control = packed_hidden(model, ids, running).double()  # [L, H]
        alone = [packed_hidden(model, ids[:, a:b], restart[:, a:b]).double() for a, b in spans]  # [n, H] each
    errors = [((packed[a:b] - x).norm() / x.norm()).item() for (a, b), x in zip(spans, alone)]
    leaks = [((control[a:b] - x).norm() / x.norm()).item() for (a, b), x in zip(spans, alone)]
    attention = getattr(model.config, "_attn_implementation", None)
    assert max(errors) <= TOLERANCE[dtype], f"{attention}, {dtype}: relative errors {errors}"
    # the first sequence sees nothing before it either way
    assert max(leaks[1:]) > 10 * TOLERANCE[dtype], f"{attention}, {dtype}: no leak in the negative control: {leaks}"
