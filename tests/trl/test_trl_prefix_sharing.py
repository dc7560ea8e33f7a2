"""Prefix sharing in the TRL drop-in: the old-policy / reference log-probs, the policy loss and its gradients, and a
whole training step on rows that hold each prompt once equal those on TRL's padded rows (tiny Qwen2 with tied
embeddings and tiny Llama with its own head; prompts of different lengths and padding, completions of 0, 1 and the
full 8 tokens); the metrics count the packed tokens; a model whose attention cannot take the mask falls back with
one warning naming prefix_sharing and still trains."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from peft import LoraConfig
from trl_tiny import TINY, PassCounter, digit_reward, losses, make_config, tiny_dataset, weights

import cppo.step.models
from cppo.trl import CPPOConfig, CPPOTrainer
from cppo.trl.loss import fused_policy_loss
from cppo.trl.packing import shared_hidden, shared_rows

#: fp32 tolerances of shared against padded rows, about 5-10x what these models measure: log-probs (about -5.7)
#: differ by <= 9.5e-7 (1.8e-7 relative; the rotary positions differ by the row's left padding: equal attention in
#: exact arithmetic, rounding in fp32), the loss not at all, the gradients by <= 1.2e-7 (1.8e-6 of the largest).
LOGP = dict(atol=1e-6, rtol=1e-5)
LOSS = dict(atol=1e-6, rtol=1e-5)
GRAD = dict(atol=1e-6, rtol=1e-5)
#: Parameters after one AdamW step of lr 1e-2: its first update is about lr * g / |g| per entry, so an entry with a
#: tiny gradient carries that gradient's rounding into the update (measured <= 4.5e-6, 0.05% of a step).
STEP = dict(atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory) -> str:
    """A tiny Llama (untied LM head) saved to disk, with the tiny Qwen2's tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from cppo.step.models import tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = tiny_tokenizer(TINY["vocab_size"])
    config = LlamaConfig(
        **TINY, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def trainer(request, tiny_model, llama_model, tmp_path_factory) -> CPPOTrainer:
    """A CPPOTrainer with a reference model (beta > 0) and temperature != 1 (TRL divides the logits by it)."""
    path = {"qwen2": tiny_model, "llama": llama_model}[request.param]
    args = make_config(CPPOConfig, tmp_path_factory.mktemp("sharing"), temperature=0.7, beta=0.04, epsilon_high=0.15)
    trainer = CPPOTrainer(model=path, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset())
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    assert trainer.prefix_sharing and trainer.ref_model is not None
    return trainer


@pytest.fixture(scope="module")
def inputs(trainer) -> dict:
    """A TRL batch of 8 rows in 3 questions (prompts of 6, 2 and 4 tokens, left-padded to 6), interleaved as
    pruning leaves them; completions of 8 (the full width), 1 and 0 tokens among them; old / reference log-probs
    off the policy's (so that ratios are clipped)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 300, (n,), generator=g) for n in (6, 2, 4)]
    question, completion_lengths = [0, 1, 0, 2, 1, 2, 0, 1], [8, 1, 3, 5, 0, 1, 6, 2]
    prompt_ids = torch.zeros(8, 6, dtype=torch.long)  # the pad id: masked anyway
    prompt_mask = torch.zeros(8, 6, dtype=torch.long)
    for r, q in enumerate(question):
        prompt_ids[r, 6 - len(prompts[q]) :], prompt_mask[r, 6 - len(prompts[q]) :] = prompts[q], 1
    completion_ids = torch.randint(4, 300, (8, 8), generator=g)
    completion_mask = (torch.arange(8) < torch.tensor(completion_lengths)[:, None]).long()
    logps = torch.randn(8, 8, generator=g) * 0.3 - 5.7
    return {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": torch.randn(8, generator=g),
        "old_per_token_logps": logps, "ref_per_token_logps": logps + 0.2 * torch.randn(8, 8, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }  # fmt: skip


def test_the_rows_hold_each_prompt_once(inputs):
    rows = shared_rows(inputs, rows_per_forward=8)
    (b,) = rows.batches  # the batch's own padded tokens (8 x 14) hold it in one packed row
    assert rows.num_input_tokens == (6 + 2 + 4) + sum(c - 1 for c in [8, 1, 3, 5, 1, 6, 2])
    assert rows.num_input_tokens < inputs["prompt_ids"].numel() + inputs["completion_ids"].numel()
    assert torch.equal(inputs["completion_ids"].flatten()[rows.dest[0]], b.targets)
    assert len(shared_rows(inputs, rows_per_forward=2).batches) > 1  # budget 2 x 14: several packed rows
    none = {**inputs, "completion_mask": torch.zeros_like(inputs["completion_mask"])}
    assert shared_rows(none, rows_per_forward=8) is None  # nothing to compute: the padded path runs


@pytest.mark.parametrize("rows_per_forward", [8, 3])
def test_old_and_reference_logprobs_equal_trls(trainer, inputs, rows_per_forward):
    rows = shared_rows(inputs, rows_per_forward=rows_per_forward)
    with torch.no_grad():
        for compute in (
            lambda r: trainer._logps(trainer.model, inputs, r),
            lambda r: trainer._reference_logps(inputs, r),
        ):
            want, got = compute(None), compute(rows)  # TRL's pass on the padded rows, then the shared rows
            torch.testing.assert_close(got, want, **LOGP)
            masked = inputs["completion_mask"] == 0
            assert (got[masked] == 0).all() and (want[masked] == 0).all() and (want != 0).sum() == 26


def loss_and_grads(trainer, inputs, shared: bool):
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    hidden = shared_hidden(trainer, trainer.model, shared_rows(inputs, rows_per_forward=8)) if shared else None
    loss = fused_policy_loss(trainer, trainer.model, inputs, hidden)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type, level", [("dapo", "token"), ("grpo", "sequence"), ("dr_grpo", "token")])
def test_policy_loss_and_gradients_equal_the_padded_rows(trainer, inputs, monkeypatch, loss_type, level):
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "importance_sampling_level", level)
    want, want_grads, want_metrics = loss_and_grads(trainer, inputs, shared=False)
    got, got_grads, got_metrics = loss_and_grads(trainer, inputs, shared=True)
    assert want != 0.0
    torch.testing.assert_close(got, want, **LOSS)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **GRAD, msg=name)
    torch.testing.assert_close(got_metrics, want_metrics, atol=1e-5, rtol=1e-5)


def train(model: str, out, *, lora: bool = False, counter: PassCounter | None = None, **options) -> CPPOTrainer:
    """One optimizer step of a pruned CPPO run with the old-policy and reference passes (the reference model's
    forwards counted by ``counter``; with ``lora`` the reference is the policy with its adapter disabled)."""
    args = make_config(
        CPPOConfig, out, max_steps=1, pruning_rate=0.5, beta=0.04, num_iterations=2, per_device_train_batch_size=16,
        **options,
    )  # fmt: skip
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") if lora else None
    trainer = CPPOTrainer(
        model=model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset(), peft_config=peft
    )
    with contextlib.ExitStack() as stack:
        if counter is not None:
            stack.enter_context(counter.hook("reference", trainer.ref_model))
        trainer.train()
    return trainer


@pytest.mark.parametrize("lora", [False, True])
def test_a_training_step_with_sharing_equals_one_without(tiny_model, tmp_path, lora):
    padded = train(tiny_model, tmp_path / "padded", lora=lora, prefix_sharing=False)
    counter = None if lora else PassCounter()
    shared = train(tiny_model, tmp_path / "shared", lora=lora, counter=counter)
    torch.testing.assert_close(losses(shared), losses(padded), **LOSS)
    for name, value in weights(padded).items():
        torch.testing.assert_close(weights(shared)[name], value, **STEP, msg=name)
    mine, theirs = shared.state.log_history[0], padded.state.log_history[0]
    assert (mine["cppo/prefix_shared"], theirs["cppo/prefix_shared"]) == (1.0, 0.0)
    full = theirs["cppo/pass_tokens"] + theirs["cppo/pass_tokens_saved"]
    assert mine["cppo/pass_tokens"] + mine["cppo/pass_tokens_saved"] == full  # stock TRL's padded rows
    assert mine["cppo/pass_tokens"] < theirs["cppo/pass_tokens"]  # 8 kept rows of 2 questions: 2 prompts, not 8
    assert lora == any("lora_" in name for name in weights(shared))  # the adapters were compared above
    if counter is not None:  # the reference pass ran one packed row of exactly the tokens the metric counts
        passes = counter.passes["reference"]
        assert [(p.rows, p.positions) for p in passes] == [(1, mine["cppo/pass_tokens"])]


def test_attention_without_the_mask_falls_back_with_one_warning_and_trains(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(cppo.step.models, "prefix_sharing_blocker", lambda model: "its attention takes no 4-D mask")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(tiny_model, tmp_path)
    named = [w for w in caught if "prefix_sharing" in str(w.message)]
    assert len(named) == 1 and "takes no 4-D mask" in str(named[0].message), [str(w.message) for w in caught]
    assert not trainer.prefix_sharing and trainer.state.log_history[0]["cppo/prefix_shared"] == 0.0
    assert torch.isfinite(torch.tensor(losses(trainer))).all() and len(losses(trainer)) == 1


def test_the_setting_is_a_bool_and_off_with_trls_own_loss(tiny_model, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="prefix_sharing must be true or false"):
        make_config(CPPOConfig, tmp_path, prefix_sharing="yes")
    monkeypatch.setattr("cppo.trl.loss._fsdp_version", lambda trainer: 1)  # FSDP version 1, simulated
    with pytest.warns(UserWarning, match="FSDP version 1 .* is not expressed .* no prefix_sharing"):
        args = make_config(CPPOConfig, tmp_path)
        trainer = CPPOTrainer(model=tiny_model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset())
    assert not trainer.prefix_sharing
