"""Rollouts: the completion mask (cut after the first EOS), seeded sampling, and the lazy vLLM backend."""

import importlib.util
import types

import pytest
import torch

from cppo.evaluate import greedy_rollout
from cppo.models import load_model_and_tokenizer
from cppo.rollout import HFRollout, cut_after_eos, make_rollout

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


def test_cut_after_eos():
    assert cut_after_eos([5, 6, 2, 7, 2], {2}, 10) == [5, 6, 2]
    assert cut_after_eos([5, 6, 7], {2}, 2) == [5, 6]
    assert cut_after_eos([2, 0, 0], {2, 3}, 3) == [2]
    assert cut_after_eos([5, 3], {2, 3}, 3) == [5, 3]


def test_hf_generate_is_seeded_and_cut_at_eos():
    model, tok = load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=0)
    eos = tok.eos_token_id

    def favour_eos(module, args, logits):  # EOS ~15 % per token: some completions stop early, some run to the limit
        logits[..., eos] += 4.0
        return logits

    model.lm_head.register_forward_hook(favour_eos)
    r = HFRollout(model, tok, max_prompt_length=6, max_completion_length=12, temperature=1.0)
    prompts = ["What is 1 + 1?", "Hi"]
    torch.manual_seed(0)
    a = r.generate(prompts, 3)
    torch.manual_seed(0)
    b = r.generate(prompts, 3)
    assert a.completion_ids == b.completion_ids and len(a.completion_ids) == 6
    assert a.prompt_ids[0] == tok("What is 1 + 1?")["input_ids"][-6:] and a.prompt_ids[3] == tok("Hi")["input_ids"]
    for ids in a.completion_ids:
        assert 1 <= len(ids) <= 12
        assert eos not in ids[:-1]  # nothing after the first EOS
        assert len(ids) == 12 or ids[-1] == eos
    assert any(ids[-1] == eos for ids in a.completion_ids) and any(len(ids) == 12 for ids in a.completion_ids)
    greedy = r.generate(prompts, 1, greedy=True)
    assert greedy.completion_ids == r.generate(prompts, 1, greedy=True).completion_ids


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_backend_missing_gives_a_clear_error():
    model, tok = load_model_and_tokenizer("tiny-qwen2", model_config=TINY)
    with pytest.raises(ImportError, match="pip install vllm"):
        make_rollout("vllm", model, tok, model_name="x", max_prompt_length=4, max_completion_length=4)
    assert isinstance(make_rollout("auto", model, tok, model_name="x", max_prompt_length=4, max_completion_length=4),
                      HFRollout)  # fmt: skip


def test_evaluation_decodes_with_transformers():
    """Evaluation reuses a transformers rollout and builds one on the same model, tokenizer and lengths beside
    another engine (vLLM)."""
    model, tok = load_model_and_tokenizer("tiny-qwen2", model_config=TINY)
    hf = HFRollout(model, tok, max_prompt_length=5, max_completion_length=7)
    assert greedy_rollout(hf) is hf
    engine = types.SimpleNamespace(model=model, tokenizer=tok, max_prompt_length=5, max_completion_length=7)
    built = greedy_rollout(engine)
    assert isinstance(built, HFRollout) and built.model is model and built.tokenizer is tok
    assert (built.max_prompt_length, built.max_completion_length) == (5, 7)
