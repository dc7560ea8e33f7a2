"""CPPOTrainer on a model whose logits are capped (issue 26): a tiny Gemma 2 with ``final_logit_softcapping=5``,
its head's weights scaled so that the cap bends its logits. Before the fix the fused loss ignored the cap and, at
``pruning_rate=0``, logged a step-1 loss of 0.444 where stock ``GRPOTrainer`` logs 0.000; now it trains as stock
TRL does (losses and weights), on the fused path. Gemma 2's sliding-window layers rule out prefix sharing (TRL's
padded rows); a tiny Cohere (logit scale 0.25) covers the prefix-shared passes, whose old-policy and reference
log-probs go through ``fused_logprobs`` too."""

from __future__ import annotations

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl_tiny import digit_reward, losses, make_config, tiny_dataset, weights

from cppo.step import LogitTransform, logit_transform
from cppo.trl import CPPOConfig, CPPOTrainer

CAP = 5.0


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory) -> str:
    """A tiny Gemma 2 (cap 5) with the tests' character tokenizer, saved to disk (TRL loads it by path)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from cppo.step import tiny_tokenizer

    tokenizer = tiny_tokenizer(300)
    config = Gemma2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=CAP, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():  # raw logits of order 10: the cap at 5 bends them
        model.get_output_embeddings().weight.mul_(30.0)
    folder = tmp_path_factory.mktemp("tiny-gemma2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_cohere(tmp_path_factory) -> str:
    """A tiny Cohere (logit scale 0.25, full attention: prefix sharing runs) with the tests' tokenizer, on disk."""
    from transformers import CohereConfig, CohereForCausalLM

    from cppo.step import tiny_tokenizer

    tokenizer = tiny_tokenizer(300)
    config = CohereConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, logit_scale=0.25, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = CohereForCausalLM(config)
    with torch.no_grad():  # logits of order 1 after the scale
        model.get_output_embeddings().weight.mul_(20.0)
    folder = tmp_path_factory.mktemp("tiny-cohere")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _run(cls, config_cls, model: str, out, **options):
    args = make_config(config_cls, out, **options)
    trainer = cls(model=model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset())
    trainer.train()
    return trainer


def test_the_cap_bends_the_tiny_models_logits(tiny_gemma2):
    """The fixture is not vacuous: without its cap, the model's log-probs would be far from its own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma2)
    assert logit_transform(model) == LogitTransform(1.0, CAP)
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        capped = torch.log_softmax(model(ids).logits, -1)
        hidden = model.model(ids).last_hidden_state
        plain = torch.log_softmax(hidden @ model.lm_head.weight.t(), -1)
    assert float((capped - plain).abs().max()) > 2.0


@pytest.mark.parametrize("options", [dict(loss_type="dapo", beta=0.04), dict(loss_type="grpo", num_iterations=2)])
def test_capped_model_trains_as_stock_trl(tiny_gemma2, tmp_path, options):
    stock = _run(GRPOTrainer, GRPOConfig, tiny_gemma2, tmp_path / "stock", **options)
    cppo = _run(CPPOTrainer, CPPOConfig, tiny_gemma2, tmp_path / "cppo", pruning_rate=0.0, **options)
    assert cppo.fused_loss_refused is None and cppo.logit_transform == LogitTransform(1.0, CAP)  # the fused path
    assert len(losses(cppo)) == 3
    torch.testing.assert_close(losses(cppo), losses(stock), atol=1e-6, rtol=1e-5)
    if options["loss_type"] == "grpo":  # step 1: the ratio is 1 and the advantages of a group sum to 0
        assert losses(cppo)[0] == pytest.approx(0.0, abs=1e-6)
    for name, value in weights(stock).items():
        torch.testing.assert_close(weights(cppo)[name], value, atol=1e-4, rtol=1e-4)


def test_scaled_model_with_prefix_sharing_trains_as_stock_trl(tiny_cohere, tmp_path):
    options = dict(loss_type="grpo", beta=0.04, num_iterations=2)
    stock = _run(GRPOTrainer, GRPOConfig, tiny_cohere, tmp_path / "stock", **options)
    cppo = _run(CPPOTrainer, CPPOConfig, tiny_cohere, tmp_path / "cppo", pruning_rate=0.0, **options)
    assert cppo.fused_loss_refused is None and cppo.prefix_sharing  # the packed, fused passes
    assert cppo.logit_transform == LogitTransform(0.25, None)
    torch.testing.assert_close(losses(cppo), losses(stock), atol=1e-6, rtol=1e-5)
    assert losses(cppo)[0] == pytest.approx(0.0, abs=1e-6)
    for name, value in weights(stock).items():
        torch.testing.assert_close(weights(cppo)[name], value, atol=1e-4, rtol=1e-4)


def test_granite_with_logits_scaling_zero_is_refused_in_one_line(tmp_path):
    """Issue 40: a Granite whose ``logits_scaling`` is 0 (its logit scale is ``1 / logits_scaling``) made
    ``CPPOTrainer`` raise a raw ``ZeroDivisionError``; now one line naming the model's class and the field."""
    from transformers import GraniteConfig, GraniteForCausalLM

    from cppo.step import tiny_tokenizer

    tokenizer = tiny_tokenizer(300)
    config = GraniteConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, logits_scaling=0.0, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    GraniteForCausalLM(config).save_pretrained(tmp_path / "granite")
    tokenizer.save_pretrained(tmp_path / "granite")
    args = make_config(CPPOConfig, tmp_path / "out", pruning_rate=0.0)
    with pytest.raises(ValueError, match=r"^GraniteForCausalLM: its config's logits_scaling is 0.0; .*> 0$") as err:
        CPPOTrainer(model=str(tmp_path / "granite"), reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset())
    assert "\n" not in str(err.value)
