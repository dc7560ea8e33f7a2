"""Rollouts: the completion mask (cut after the first EOS), seeded sampling, and the lazy vLLM backend."""

import importlib.util

import pytest
import torch
from tiny_model import TINY
from toy_engine import FixedEngine

from cppo.engines import EngineSettings, HFEngine, cut_after_eos, make_engine
from cppo.step.models import load_model_and_tokenizer


def settings(prompt: int, completion: int, **options) -> EngineSettings:
    return EngineSettings(model_name="x", max_prompt_length=prompt, max_completion_length=completion, **options)


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
    r = HFEngine(model, tok, settings(6, 12, temperature=1.0))
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
        make_engine("vllm", model, tok, settings(4, 4))
    assert isinstance(make_engine("auto", model, tok, settings(4, 4)), HFEngine)


def test_evaluation_decodes_with_transformers():
    """Evaluation reuses a transformers engine and builds one on the same model, tokenizer and lengths beside
    another engine (vLLM, or any engine that keeps the default ``for_evaluation``)."""
    model, tok = load_model_and_tokenizer("tiny-qwen2", model_config=TINY)
    hf = HFEngine(model, tok, settings(5, 7))
    assert hf.for_evaluation() is hf
    built = FixedEngine(model, tok, settings(5, 7)).for_evaluation()
    assert isinstance(built, HFEngine) and built.model is model and built.tokenizer is tok
    assert (built.settings.max_prompt_length, built.settings.max_completion_length) == (5, 7)
