"""The packed forward on a CUDA device; skipped without one (the GPU kit's ``tests`` part runs it, ``-m cuda``).

Sequences packed in one row with position_ids restarting at 0 must give each sequence's final hidden states as a
forward of that sequence alone does, with the attention CUDA runs (flash-attention 2 when importable, sdpa
otherwise). A negative control runs the same row with position_ids running on (one long causal sequence), whose
later sequences do see the earlier ones: its error must be far above the tolerance, or the check could not fail.
tests/cppo/step/test_packing.py checks the same on the CPU (sdpa, float32).

Prefix sharing (a question's completions after one copy of its prompt, a block mask) runs through flex_attention on
CUDA (:func:`cppo.step.models.attn_implementation`): its log-probs and hidden states must equal those of a prompt copy
per completion (the attention picked without sharing), with a negative control (the shared row without its mask, where
sibling completions see each other). tests/cppo/step/test_prefix_sharing.py checks the same on the CPU (sdpa, eager).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cppo.step.models import completion_hidden, lm_head, load_model_and_tokenizer, packed_hidden
from cppo.step.packing import Sample, pack_all, pack_shared

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


#: Prompts of 1, 130 and 200 tokens; completions of 1 to 300 tokens, on and off multiples of 128 (flex_attention's
#: blocks), interleaved as pruning leaves them: (question, completion length).
PROMPTS = (1, 130, 200)
COMPLETIONS = ((1, 127), (0, 1), (2, 300), (1, 128), (0, 40), (2, 129), (1, 2), (2, 64))


def completion_rows(model, batches, *, masked: bool = True) -> torch.Tensor:
    """fp64 final hidden states ``[T, H]`` of the rows predicting each sample's completion tokens, in sample order
    over ``batches``; ``masked=False`` drops the prefix-sharing mask (the negative control)."""
    rows = {}
    for b in batches:
        hidden = completion_hidden(model, b.input_ids, b.position_ids, b.predict_index, b.prefix if masked else None)
        rows.update(zip(b.sample_index, hidden.double().split((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist())))
    return torch.cat([rows[i] for i in range(len(rows))])


def test_prefix_shared_logprobs_equal_unshared_with_flex_attention():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, MODEL["vocab_size"], (n,), generator=g).tolist() for n in PROMPTS]
    samples = [
        Sample(prompts[q], torch.randint(5, MODEL["vocab_size"], (c,), generator=g).tolist(), 0.0)
        for q, c in COMPLETIONS
    ]
    models = [
        load_model_and_tokenizer("tiny-qwen2", model_config=MODEL, device="cuda", prefix_sharing=sharing)[0].eval()
        for sharing in (True, False)
    ]  # the same seeded weights, the attention the trainer picks with and without prefix sharing
    attention = [getattr(m.config, "_attn_implementation", None) for m in models]
    assert attention[0] == "flex_attention", attention
    shared, unshared = pack_shared(samples, 4096, device="cuda"), pack_all(samples, 4096, device="cuda")
    assert len(shared) == 1 and sum(b.num_input_tokens for b in shared) < sum(b.num_input_tokens for b in unshared)
    with torch.no_grad():
        got, want = completion_rows(models[0], shared), completion_rows(models[1], unshared)  # [T, H]
        leak = completion_rows(models[0], shared, masked=False)  # [T, H]
    error = ((got - want).norm() / want.norm()).item()
    assert error <= TOLERANCE["float32"], f"{attention}: relative error {error}"
    control = ((leak - want).norm() / want.norm()).item()
    assert control > 10 * TOLERANCE["float32"], f"{attention}: no leak without the mask: {control}"
    weight = lm_head(models[0])[0].double()  # [V, H], tied to the embeddings
    targets = torch.tensor([t for s in samples for t in s.completion_ids], device="cuda")  # [T]
    logp = [torch.log_softmax(h @ weight.T, -1).gather(1, targets[:, None])[:, 0] for h in (got, want)]  # [T] each
    # fp32 on the CPU (sdpa both ways, the GPU kit's sizes): 5e-7
    torch.testing.assert_close(logp[0], logp[1], atol=1e-4, rtol=1e-5)
