"""Shared set-up of the TRL drop-in tests (``from trl_tiny import ...``): a tiny Qwen2 saved to disk (TRL rebuilds
the reference model from its path), a tiny prompt dataset, a reward with spread, CPU configs (bf16 and gradient
checkpointing off), a counter of what each forward pass of a model sees, and a stand-in for vLLM's sampling
log-probs."""

from __future__ import annotations

import contextlib
import pathlib
from dataclasses import dataclass, field

import torch
from tiny_model import TINY

#: What every test config sets: CPU, fp32, no checkpointing, no logging integrations, no checkpoints.
CPU = dict(
    bf16=False, gradient_checkpointing=False, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
    seed=0, learning_rate=1e-2, max_completion_length=8, num_generations=4, per_device_train_batch_size=8,
    max_steps=3, use_bias_correction_kl=False, dataloader_num_workers=0,
)  # fmt: skip


def save_tiny_model(folder: pathlib.Path, *, seed: int = 0) -> str:
    """A tiny Qwen2 and its character tokenizer saved to ``folder``; returns the path as a string."""
    from cppo.step.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def save_tiny_moe(folder: pathlib.Path, *, seed: int = 0) -> str:
    """A tiny Qwen2-MoE (4 experts, 2 per token, ``router_aux_loss_coef`` 0.01) with the tiny Qwen2's tokenizer."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from cppo.step.models import load_model_and_tokenizer

    _, tokenizer = load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=seed)
    torch.manual_seed(seed)
    config = Qwen2MoeConfig(
        **TINY, num_hidden_layers=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.01, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    Qwen2MoeForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def tiny_dataset(n: int = 64):
    """``n`` short text prompts of different lengths (so padding differs between rows)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{i} + {i * 7} =" for i in range(n)]})


def digit_reward(completions, **kwargs) -> list[float]:
    """The share of digits in each completion: spread within every group of a random tiny model."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def make_config(cls, output_dir: pathlib.Path, **overrides):
    """``cls`` (GRPOConfig or CPPOConfig) with :data:`CPU` and ``overrides``."""
    return cls(output_dir=str(output_dir), **{**CPU, **overrides})


def losses(trainer) -> list[float]:
    """The loss TRL logged at each step."""
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@dataclass
class Pass:
    """One forward of a backbone: rows, positions (rows x width) and whether autograd was recording."""

    rows: int
    positions: int
    grad: bool


@dataclass
class PassCounter:
    """Records every training-pass forward (no KV cache) of the backbones hooked with :meth:`hook`."""

    passes: dict[str, list[Pass]] = field(default_factory=dict)

    @contextlib.contextmanager
    def hook(self, name: str, model):
        """Counts ``model``'s backbone forwards under ``name`` while the block runs; generation (which runs with a
        cache) is left out."""
        backbone = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
        self.passes.setdefault(name, [])

        def record(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if kwargs.get("use_cache") is False and ids is not None:
                self.passes[name].append(Pass(ids.size(0), ids.numel(), torch.is_grad_enabled()))

        handle = backbone.register_forward_pre_hook(record, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()

    def rows(self, name: str, *, grad: bool) -> list[int]:
        return [p.rows for p in self.passes[name] if p.grad == grad]

    def positions(self, name: str, *, grad: bool) -> int:
        return sum(p.positions for p in self.passes[name] if p.grad == grad)


def fake_vllm(trainer) -> None:
    """Makes ``trainer`` behave as if vLLM generated: ``use_vllm`` on, and generation (still HF ``generate``)
    returning deterministic sampling log-probs near the tiny model's (about -log V), so that TRL's importance-
    sampling correction runs. Call it on stock and CPPO trainers alike before ``train()``."""
    generate = trainer._generate_single_turn

    def generate_with_logprobs(*args, **kwargs):
        trainer.use_vllm = False
        try:
            completion_ids, _ = generate(*args, **kwargs)
        finally:
            trainer.use_vllm = True
        logprobs = [[-5.7 + 0.05 * (t % 5) for t in ids] for ids in completion_ids]
        return completion_ids, logprobs

    trainer.use_vllm = True
    trainer._generate_single_turn = generate_with_logprobs
    if hasattr(trainer, "fused_loss_refused"):  # a CPPOTrainer decides its loss path from use_vllm when built
        from cppo.trl.loss import unsupported_setting

        trainer.fused_loss_refused = unsupported_setting(trainer)
