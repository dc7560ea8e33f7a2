"""``prefill_once`` in CPPOTrainer: TRL's transformers ``generate`` over the prompts its sampler repeats
``num_generations`` times runs each distinct prompt's forward once (:mod:`cppo.engines.prefill`), and at P = 0 the
trainer still trains exactly as stock TRL (the same losses, weights and global RNG state); off where a dropout
would fire in the training-mode forward, or when set false."""

from __future__ import annotations

import contextlib

import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer
from trl_tiny import digit_reward, losses, make_config, tiny_dataset, weights

from cppo.engines.prefill import cache_shares_rows
from cppo.trl import CPPOConfig, CPPOTrainer

OPTIONS = dict(beta=0.04, num_iterations=2)  # 8 completions of 2 prompts (4 each) per generation


@contextlib.contextmanager
def generation_rows(model):
    """The rows of every forward of ``model``'s backbone with a KV cache (generation), in the yielded list."""
    backbone = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    rows = []
    handle = backbone.register_forward_pre_hook(
        lambda m, args, kwargs: rows.append(kwargs["input_ids"].size(0)) if kwargs.get("use_cache") else None,
        with_kwargs=True,
    )
    try:
        yield rows
    finally:
        handle.remove()


def train(cls, config_cls, model: str, out, **options):
    trainer = cls(
        model=model, reward_funcs=digit_reward, args=make_config(config_cls, out, **{**OPTIONS, **options}),
        train_dataset=tiny_dataset(),
    )  # fmt: skip
    cache_shares_rows(trainer.model)  # its one probe of the model's cache, before the rows are counted
    with generation_rows(trainer.model) as rows:
        trainer.train()
    return trainer, rows, torch.get_rng_state()


def test_each_prompt_is_prefilled_once_and_trains_as_stock_trl(tiny_model, tmp_path):
    stock, stock_rows, stock_rng = train(GRPOTrainer, GRPOConfig, tiny_model, tmp_path / "stock")
    cppo, rows, rng = train(CPPOTrainer, CPPOConfig, tiny_model, tmp_path / "cppo", pruning_rate=0.0)
    assert set(stock_rows) == {8}  # TRL: 8 rows in every forward, the prompt 4 times
    # one prefill of the 2 prompts per generation (3 steps, num_iterations 2: two generations), then 8 rows each
    assert rows[0] == 2 and rows.count(2) == 2 and set(rows) == {2, 8}
    torch.testing.assert_close(losses(cppo), losses(stock), atol=1e-6, rtol=1e-5)
    for name, value in weights(stock).items():
        torch.testing.assert_close(weights(cppo)[name], value, atol=1e-4, rtol=1e-4, msg=name)
    assert torch.equal(rng, stock_rng), "prefill_once drew random numbers stock TRL does not"


def test_off_when_set_false_or_when_a_dropout_fires(tiny_model, tmp_path):
    _, rows, _ = train(CPPOTrainer, CPPOConfig, tiny_model, tmp_path / "off", prefill_once=False, max_steps=1)
    assert set(rows) == {8}
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.1, task_type="CAUSAL_LM")
    trainer = CPPOTrainer(
        model=tiny_model, reward_funcs=digit_reward, train_dataset=tiny_dataset(), peft_config=lora,
        args=make_config(CPPOConfig, tmp_path / "lora", **OPTIONS, max_steps=1),
    )  # fmt: skip
    with generation_rows(trainer.model) as rows:
        trainer.train()  # TRL generates in training mode: LoRA's dropout draws per row, so each row is prefilled
    assert set(rows) == {8}


def test_a_recurrent_model_trains_as_stock_trl_with_prefill_once_declined(tmp_path):
    """A tiny Mamba: its cache's recurrent layers cannot be copied to a prompt's rows (issue 40), so prefill-once
    declines (:func:`cppo.engines.prefill.cache_shares_rows`) and CPPOTrainer, with ``prefill_once`` on, trains as
    stock TRL (the same losses, weights and RNG state) instead of crashing in its generation."""
    from transformers import MambaConfig, MambaForCausalLM

    from cppo.engines import prefill_once_applies
    from cppo.step import tiny_tokenizer

    tok = tiny_tokenizer(300)
    torch.manual_seed(0)
    config = MambaConfig(
        vocab_size=300, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    MambaForCausalLM(config).save_pretrained(tmp_path / "mamba")
    tok.save_pretrained(tmp_path / "mamba")
    runs = {}
    for name, cls, config_cls, options in (
        ("stock", GRPOTrainer, GRPOConfig, {}),
        ("cppo", CPPOTrainer, CPPOConfig, dict(pruning_rate=0.0)),
    ):
        trainer = cls(
            model=str(tmp_path / "mamba"), reward_funcs=digit_reward, train_dataset=tiny_dataset(),
            args=make_config(config_cls, tmp_path / name, **OPTIONS, **options),
        )  # fmt: skip
        trainer.train()
        runs[name] = trainer, torch.get_rng_state()
    (stock, stock_rng), (cppo, rng) = runs["stock"], runs["cppo"]
    assert cppo.args.prefill_once and not prefill_once_applies(cppo.model, cppo.generation_config)
    torch.testing.assert_close(losses(cppo), losses(stock), atol=1e-6, rtol=1e-5)
    for name, value in weights(stock).items():
        torch.testing.assert_close(weights(cppo)[name], value, atol=1e-4, rtol=1e-4, msg=name)
    assert torch.equal(rng, stock_rng)


def test_the_only_forward_beyond_generation_and_training_is_one_cache_probe_per_model(tiny_model, tmp_path):
    """Issue 49: CPPOTrainer at P = 0.75 (4 prompts x 4, 3 steps, ``num_iterations=2``, beta 0.04) forwarded 15
    positions more than f0d423a for the same rows: ``cache_shares_rows``'s probe (3 distinct 5-token prompts, with a
    KV cache), which decides whether ``prefill_once`` may share a prompt's cache over its completions. Something
    needs it (a recurrent model's cache cannot be shared), so it stays: once per model, never once per step."""
    trainer = CPPOTrainer(
        model=tiny_model, reward_funcs=digit_reward, train_dataset=tiny_dataset(),
        args=make_config(CPPOConfig, tmp_path, pruning_rate=0.75, per_device_train_batch_size=16, **OPTIONS),
    )  # fmt: skip
    shapes = []
    forward = trainer.model.forward
    trainer.model.forward = lambda *a, **k: shapes.append(tuple(k["input_ids"].shape)) or forward(*a, **k)
    trainer.train()
    assert shapes.count((3, 5)) == 1 and shapes[0] == (3, 5)  # the probe, first
    assert cache_shares_rows(trainer.model)  # its verdict, kept: asking again runs no forward
    assert shapes.count((3, 5)) == 1
    generations = [s for s in shapes[1:] if s[1] > 1 and s[0] == 4]  # each generation's prefill of 4 prompts
    assert len(generations) == 2  # 3 steps, num_iterations=2: two generations, one probe for both
