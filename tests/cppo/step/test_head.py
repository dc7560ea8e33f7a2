"""The model's own logit transform (issue 26, :mod:`cppo.step.head`): over every causal-LM family of transformers that
builds tiny from its config, the fused log-probs of the trainer's path (``completion_hidden`` + ``fused_logprobs``
with the transform read from the config) and of ``CPPOTrainer``'s (its hidden-state forward on TRL's padded rows,
:func:`cppo.trl.loss.model_logit_transform`) equal ``log_softmax(model(ids).logits / temperature)``; a family whose
head does anything else is refused in one line naming its class. The families that do not build tiny are skipped
with the reason."""

from __future__ import annotations

import contextlib
import importlib.util
import types
import warnings

import pytest
import torch

from cppo.step import LogitTransform, check_logit_transform, completion_hidden, lm_head, logit_transform
from cppo.step.head import CAP_NAMES
from cppo_kernels import fused_logprobs

#: The families issue 26 names: each must build and run fused, never be refused.
REQUIRED = {"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "cohere", "granite"}
#: Small sizes every family takes (those its config has; the transformer basics always).
TINY = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16, moe_intermediate_size=32,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, num_experts_per_token=2, n_group=1,
    topk_group=1, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=16,
    linear_head_dim=16, linear_num_heads=2, d_model=32, decoder_layers=1, decoder_attention_heads=2,
    decoder_ffn_dim=64, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
)  # fmt: skip
ALWAYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
#: Away from their defaults, where a family's config has them, so that each transform is exercised.
TRANSFORMS = dict(
    final_logit_softcapping=5.0, logits_soft_cap=5.0, output_logit_soft_cap=5.0, logit_scale=0.25,
    logits_scaling=4.0, lm_head_multiplier=2.0, output_multiplier=2.0,
)  # fmt: skip
TEMPERATURE = 0.7
TRL = importlib.util.find_spec("trl") is not None


def _families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _tiny_model(model_type: str):
    """A tiny fp32 model of the family in eval mode, its raw logits of order 10 (so a cap at 5 bends them), or a
    skip naming why it does not build."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        base = AutoConfig.for_model(model_type)
        if base.sub_configs:
            pytest.skip(f"{model_type}: a composite config ({', '.join(base.sub_configs)}), not a tiny text model")
        fields = base.to_dict()  # settable fields (not derived properties)
        options = {k: v for k, v in TINY.items() if k in ALWAYS or k in fields}
        options.update({k: v for k, v in TRANSFORMS.items() if fields.get(k) is not None})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.for_model(model_type, **options)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).float().eval()
            weight, bias = lm_head(model)
            with torch.no_grad():
                logits = model(input_ids=torch.arange(3, 9).unsqueeze(0), use_cache=False).logits
    except pytest.skip.Exception:
        raise
    except Exception as err:  # noqa: BLE001  (the skip names the reason)
        pytest.skip(f"{model_type} does not build tiny: {type(err).__name__}: {str(err).strip()[:150]}")
    spread = float(logits.float().std())
    if 0 < spread < 3.0:
        with torch.no_grad():
            weight.mul_(10.0 / spread)
            if bias is not None:
                bias.mul_(10.0 / spread)
    return model


def _model_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """TRL's and the user's reference: ``log_softmax(logits / temperature)`` at the targets."""
    return torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _assert_logprobs(name: str, got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor) -> None:
    scale = 1.0 + float(logits.abs().max()) / TEMPERATURE
    torch.testing.assert_close(got, want, atol=2e-5 * scale, rtol=0, msg=lambda m: f"{name}: {m}")


def _trainer_path(model, t: LogitTransform) -> None:
    """The trainer's path: the packed forward's hidden states of one sequence, then ``fused_logprobs`` with the
    model's transform (``Trainer._logprobs``)."""
    ids = torch.tensor([[5, 17, 3, 44, 9, 90, 31, 8, 62, 11, 70]])  # [1, L]
    targets = ids[0, 1:]
    with torch.no_grad():
        hidden = completion_hidden(model, ids, torch.arange(ids.shape[1]).unsqueeze(0), torch.arange(10))  # [10, H]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]  # [10, V]
    weight, bias = lm_head(model)
    got = fused_logprobs(hidden, weight, targets, bias=bias, temperature=TEMPERATURE, **t.kwargs())
    _assert_logprobs("trainer", got, _model_logprobs(logits, targets), logits)
    if t != LogitTransform():  # not vacuous: without the transform the log-probs would be off
        plain = fused_logprobs(hidden, weight, targets, bias=bias, temperature=TEMPERATURE)
        assert float((plain - _model_logprobs(logits, targets)).abs().max()) > 0.05


def _cppo_trainer_path(model, t: LogitTransform) -> None:
    """CPPOTrainer's path: its hidden-state forward on TRL's rows ``[prompt | completion]``, the head inputs and the
    transform it reads (a stand-in for the trainer: one process, no autocast, the head in the model's dtype)."""
    from cppo.trl.loss import head_inputs, install_hidden_forward, model_logit_transform, padded_hidden

    state = types.SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=None)  # one process, nothing sharded
    accelerator = types.SimpleNamespace(unwrap_model=lambda m: m, autocast=contextlib.nullcontext, state=state)
    trainer = types.SimpleNamespace(
        accelerator=accelerator,
        model=model,
        args=types.SimpleNamespace(cast_lm_head_to_fp32=False),
        aux_loss_enabled=False,
    )
    install_hidden_forward(model)
    assert model_logit_transform(trainer) == t
    prompt, completion = torch.tensor([[4, 8, 15, 16], [23, 42, 7, 9]]), torch.tensor([[3, 60, 2, 71, 5, 6]] * 2)
    inputs = dict(
        prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion,
        completion_mask=torch.ones_like(completion),
    )  # fmt: skip
    with torch.no_grad():
        padded, aux = padded_hidden(trainer, model, inputs)  # [B, C, H], no aux loss
        assert aux is None
        hidden, weight, bias = head_inputs(trainer, padded, model)
        rows = torch.cat([prompt, completion], 1)
        logits = model(input_ids=rows, attention_mask=torch.ones_like(rows), use_cache=False).logits[:, 3:-1]
    got = fused_logprobs(hidden, weight, completion, bias=bias, temperature=TEMPERATURE, **t.kwargs())
    _assert_logprobs("CPPOTrainer", got, _model_logprobs(logits, completion), logits)


@pytest.mark.parametrize("model_type", _families())
def test_fused_logprobs_are_the_models_own(model_type):
    model = _tiny_model(model_type)
    try:
        t = check_logit_transform(model)
    except ValueError as err:  # refused: one line naming the class, and never one of the families issue 26 names
        assert model_type not in REQUIRED, str(err)
        assert "\n" not in str(err) and str(err).startswith(type(model).__name__ + ":"), str(err)
        return
    assert t == logit_transform(model)
    _trainer_path(model, t)
    if TRL:
        _cppo_trainer_path(model, t)


@pytest.mark.parametrize(
    "config, want",
    [
        (dict(), LogitTransform(1.0, None)),
        (dict(final_logit_softcapping=30.0), LogitTransform(1.0, 30.0)),
        (dict(logits_soft_cap=15.0), LogitTransform(1.0, 15.0)),
        (dict(output_logit_soft_cap=15.0), LogitTransform(1.0, 15.0)),
        (dict(logit_scale=0.0625), LogitTransform(0.0625, None)),
        (dict(logit_scale=None, output_multiplier=2.0, final_logit_softcapping=30.0), LogitTransform(2.0, 30.0)),
        (dict(lm_head_multiplier=0.5), LogitTransform(0.5, None)),
        (dict(logits_scaling=8.0), LogitTransform(0.125, None)),
        (dict(logits_scaling=8.0, model_type="hyperclovax"), LogitTransform(8.0, None)),
        (dict(logit_scale=3.0, logits_scaling=8.0), LogitTransform(3.0, None)),
    ],
)
def test_transform_read_as_trl_reads_it(config, want):
    """TRL's ``add_fused_lm_head`` reading: the first of logit_scale, output_multiplier, lm_head_multiplier, then
    1 / logits_scaling (HyperCLOVA X multiplies); final_logit_softcapping is the cap."""
    model = types.SimpleNamespace(config=types.SimpleNamespace(**config))
    assert logit_transform(model) == want


def test_a_non_positive_transform_is_refused_in_one_line():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in TINY.items() if k in ("vocab_size", "hidden_size", *ALWAYS)})
    model = LlamaForCausalLM(config)
    model.config.logit_scale = 0.0
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM: its config's logit_scale is 0.0; .*> 0$"):
        check_logit_transform(model)


@pytest.mark.parametrize("value", [0, 0.0, -4.0, float("nan"), float("inf"), 5e-324])
def test_granite_logits_scaling_that_is_no_positive_number_is_refused_in_one_line(value):
    """Issue 40: Granite's ``logits_scaling=0`` (its scale is ``1 / logits_scaling``) raised a raw
    ``ZeroDivisionError``; every field the transform reads is checked before any arithmetic on it (5e-324: its
    inverse overflows to inf)."""
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(**{k: v for k, v in TINY.items() if k in ("vocab_size", "hidden_size", *ALWAYS)})
    model = GraniteForCausalLM(config)
    model.config.logits_scaling = value
    with pytest.raises(ValueError, match=r"^GraniteForCausalLM: its config's (1 / )?logits_scaling is .*> 0$") as err:
        check_logit_transform(model)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="logits_scaling"):
        logit_transform(model)


@pytest.mark.parametrize(
    "field", ["logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling", *CAP_NAMES]
)
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("-inf"), "2.0", True])
def test_every_transform_field_read_is_checked(field, value):
    """Each config field :func:`logit_transform` reads, whatever the family: a value that is not a finite number > 0
    is refused naming the field."""
    model = types.SimpleNamespace(config=types.SimpleNamespace(**{field: value}))
    with pytest.raises(ValueError, match=rf"^SimpleNamespace: its config's {field} is .*> 0$"):
        logit_transform(model)


def test_a_head_that_does_something_else_is_refused():
    """A model whose forward does more than its config says (here: a Llama that multiplies its logits by 3 with no
    word in its config) is refused, naming its class; with the scale stated in its config it is accepted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class ShiftedLlama(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    config = LlamaConfig(**{k: v for k, v in TINY.items() if k in ("vocab_size", "hidden_size", *ALWAYS)})
    torch.manual_seed(0)
    model = ShiftedLlama(config)
    with pytest.raises(ValueError, match=r"^ShiftedLlama: its logits are not softcap \* tanh") as err:
        check_logit_transform(model)
    assert "\n" not in str(err.value)
    model.config.logit_scale = 3.0  # now the config states what the forward does
    assert check_logit_transform(model) == LogitTransform(3.0, None)


def test_the_trainer_passes_the_models_transform_to_the_fused_ops(tmp_path, monkeypatch):
    """``Trainer`` on a tiny Cohere saved to disk (logit scale 0.25; Gemma 2 does not take the trainer's sdpa
    attention): the transform is read when the model loads and every ``fused_logprobs`` (old-policy and reference
    passes) and ``fused_cppo_loss`` call of a step gets it."""
    from tiny_run import tiny_config
    from transformers import CohereConfig, CohereForCausalLM

    import cppo.trainer
    from cppo.step import tiny_tokenizer
    from cppo.trainer import Trainer

    tokenizer = tiny_tokenizer(300)
    config = CohereConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, logit_scale=0.25, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    CohereForCausalLM(config).save_pretrained(tmp_path / "cohere")
    tokenizer.save_pretrained(tmp_path / "cohere")
    trainer = Trainer(tiny_config(tmp_path / "run", model=str(tmp_path / "cohere"), model_config=None, num_steps=1))
    assert trainer.logit_transform == LogitTransform(0.25, None)
    seen = []
    for name in ("fused_logprobs", "fused_cppo_loss"):
        real = getattr(cppo.trainer, name)
        spy = lambda *a, _real=real, _name=name, **k: seen.append((_name, k.get("logit_scale"))) or _real(*a, **k)  # noqa: E731
        monkeypatch.setattr(cppo.trainer, name, spy)
    trainer.train_step()
    assert {name for name, _ in seen} == {"fused_logprobs", "fused_cppo_loss"}
    assert all(scale == 0.25 for _, scale in seen), seen
