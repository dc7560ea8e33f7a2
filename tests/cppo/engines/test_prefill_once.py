"""Each prompt prefilled once (``prefill_once``): one forward of each distinct prompt, its KV cache copied to its G
rows, then transformers' decoding, gives the tokens of the plain ``generate`` over G copies of every prompt (greedy
and sampled from the same seed, with the same random draws) and its per-step logits within fp32 rounding, on Qwen2
and Llama, with many questions of different lengths per call (different left padding), duplicate and one-token
prompts. The FSDP2 case (``synced_gpus``) is a check of tests/trainer/test_distributed_multiproc.py."""

from __future__ import annotations

import pytest
import torch
from tiny_generation import ARCHS, PROMPTS, G, engine, tiny
from tiny_run import tiny_config

from cppo.engines import generate_prefilled_once, prefill, prefill_once_applies
from cppo.trainer import Trainer


def first_forward_shapes(model) -> list[tuple[int, int]]:
    """The ``input_ids`` shape of every forward ``model`` runs from now on (after the one probe of its cache,
    :func:`cppo.engines.prefill.cache_shares_rows`, which runs once per model)."""
    assert prefill.cache_shares_rows(model)
    shapes = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return shapes


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_the_engine_gives_the_tokens_and_draws_of_g_prefills(arch, greedy):
    model, tok = tiny(arch, eos_bias=0.0 if greedy else 3.0)  # (greedy would pick a favoured EOS at once)
    shapes = first_forward_shapes(model)
    width = max(len(tok(p)["input_ids"]) for p in PROMPTS)
    runs = {}
    for on in (True, False):
        shapes.clear()
        torch.manual_seed(7)
        rollout = engine(model, tok, prefill_once=on).generate(PROMPTS, G, greedy=greedy)
        runs[on] = rollout, torch.get_rng_state(), shapes[0]
    (shared, rng, first), (plain, plain_rng, plain_first) = runs[True], runs[False]
    assert first == (len(set(PROMPTS)), width - 1)  # one prefill of the 5 distinct prompts: the path that ran
    assert plain_first == (len(PROMPTS) * G, width)  # G copies of every prompt
    # the prompt positions each path forwarded, as the rollout reports them (the tokens/generate_prompt metric)
    assert shared.prefill_tokens == len(set(PROMPTS)) * (width - 1) + len(PROMPTS) * G
    assert plain.prefill_tokens == len(PROMPTS) * G * width and plain.prefill_positions == plain.prefill_tokens
    assert shared.completion_ids == plain.completion_ids and shared.prompt_ids == plain.prompt_ids
    assert torch.equal(rng, plain_rng)  # not one random number more or less
    if not greedy:
        lengths = {len(c) for c in plain.completion_ids}
        assert min(lengths) < 10 and max(lengths) == 10  # rows that finished early beside rows that decode on
        assert len({tuple(c) for c in plain.completion_ids[:G]}) > 1  # the G samples of a prompt differ


def _padded(tok, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    encoded = [tok(p)["input_ids"] for p in prompts]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), tok.pad_token_id)  # [N, L]
    mask = torch.zeros_like(ids)  # [N, L]
    for i, e in enumerate(encoded):
        ids[i, width - len(e) :], mask[i, width - len(e) :] = torch.tensor(e), 1
    return ids, mask


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_every_step_has_the_logits_of_g_prefills(arch, greedy):
    """Rows in TRL's order (each prompt's G copies together, a prompt asked twice), or any order: every row's
    per-step log-probabilities within fp32 rounding of the plain call's, the same tokens from the same seed."""
    from transformers import GenerationConfig

    model, tok = tiny(arch, eos_bias=0.0 if greedy else 3.0)
    ids, mask = _padded(tok, [p for p in PROMPTS for _ in range(G)] + PROMPTS[::-1])  # [N, L]
    config = GenerationConfig(
        max_new_tokens=6, do_sample=not greedy, top_k=None if greedy else 0, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    assert prefill_once_applies(model, config)
    torch.manual_seed(3)
    shared = generate_prefilled_once(model, input_ids=ids, attention_mask=mask, generation_config=config)
    torch.manual_seed(3)
    plain = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(shared.sequences, plain.sequences)
    assert len(shared.logits) == len(plain.logits) == 6
    for got, want in zip(shared.logits, plain.logits, strict=True):  # [N, V] each step
        torch.testing.assert_close(got.log_softmax(-1), want.log_softmax(-1), atol=2e-6, rtol=0)


def test_one_token_prompts_prefill_a_masked_column():
    """Prompts of one token leave no position to prefill: a masked column goes in front and comes off again."""
    model, tok = tiny("qwen2")
    for prompts in (["7", "8"], ["7", "8", "9"]):
        runs = []
        for on in (True, False):
            torch.manual_seed(1)
            runs.append(engine(model, tok, prefill_once=on, completion=5).generate(prompts, 3))
        assert runs[0].completion_ids == runs[1].completion_ids
        assert [len(p) for p in runs[0].prompt_ids] == [1] * 3 * len(prompts)


def test_off_with_one_completion_per_prompt_and_when_it_cannot_apply():
    """``prefill_once: false``, one completion per prompt (greedy evaluation: nothing to share) and generation
    settings whose cache it cannot share run the plain ``generate``."""
    from transformers import GenerationConfig

    model, tok = tiny("qwen2")
    shapes = first_forward_shapes(model)
    width = max(len(tok(p)["input_ids"]) for p in PROMPTS)
    for on, n in ((False, G), (True, 1)):
        shapes.clear()
        engine(model, tok, prefill_once=on).generate(PROMPTS, n, greedy=True)
        assert shapes[0] == (len(PROMPTS) * n, width)
    sampled = dict(do_sample=True, top_k=0)
    assert prefill_once_applies(model, GenerationConfig(**sampled))
    for refused in (dict(cache_implementation="static"), dict(num_beams=2), dict(num_return_sequences=2)):
        assert not prefill_once_applies(model, GenerationConfig(**sampled, **refused)), refused
    model.generation_config.cache_implementation = "static"  # the model's own default counts too
    assert not prefill_once_applies(model, GenerationConfig(**sampled))
    model.generation_config.cache_implementation = None
    model.train()  # a training-mode forward with dropout: one prefill would share its dropout draw
    assert prefill_once_applies(model, GenerationConfig(**sampled))  # attention_dropout 0: nothing random
    model.config.attention_dropout = 0.1
    assert not prefill_once_applies(model, GenerationConfig(**sampled))


def test_a_forward_without_a_cache_is_declined_and_one_error_if_forced(monkeypatch):
    """A forward that returns no cache: prefill-once declines it (the engine runs the plain ``generate``, the same
    completions), and ``generate_prefilled_once`` called anyway is one error line naming the setting."""
    model, tok = tiny("qwen2")
    plain = engine(model, tok, prefill_once=False).generate(PROMPTS, G, greedy=True)
    forward = model.forward

    def no_cache(*args, **kwargs):
        out = forward(*args, **kwargs)
        out[prefill.cache_name()] = None  # "cache" from transformers 5.20, "past_key_values" before
        return out

    monkeypatch.setattr(model, "forward", no_cache)
    shared = engine(model, tok, prefill_once=True).generate(PROMPTS, G, greedy=True)
    assert shared.completion_ids == plain.completion_ids
    assert not prefill_once_applies(model, model.generation_config)
    ids, mask = _padded(tok, PROMPTS)
    with pytest.raises(ValueError, match="^prefill_once: Qwen2ForCausalLM's forward returned no KV cache"):
        generate_prefilled_once(model, input_ids=ids, attention_mask=mask, max_new_tokens=2)


def test_the_trainer_setting_reaches_the_engine(tmp_path):
    assert Trainer(tiny_config(tmp_path / "on")).rollout.settings.prefill_once is True
    assert Trainer(tiny_config(tmp_path / "off", prefill_once=False)).rollout.settings.prefill_once is False
