"""Which settings keep CPPOTrainer's loss fused (``unsupported_setting`` None): vLLM's importance-sampling correction
(once ``fused_cppo_loss`` takes ``importance_weights``), FSDP2, DeepSpeed ZeRO-3; FSDP version 1 is named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from trl_tiny import digit_reward, make_config, tiny_dataset

import cppo.trl.loss as trl_loss
from cppo.trl import CPPOConfig, CPPOTrainer


@pytest.fixture(scope="module")
def trainer(tiny_model, tmp_path_factory) -> CPPOTrainer:
    args = make_config(CPPOConfig, tmp_path_factory.mktemp("settings"), pruning_rate=0.5, beta=0.04)
    return CPPOTrainer(model=tiny_model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset())


def test_vllm_correction_is_fused(trainer, monkeypatch):
    monkeypatch.setattr(trainer, "use_vllm", True)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", mode)
        refused = trl_loss.unsupported_setting(trainer)
        assert refused is None, refused
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", False)
    assert trl_loss.unsupported_setting(trainer) is None


def test_sharded_engines_keep_the_loss_fused(trainer, monkeypatch):
    state = SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=2), deepspeed_plugin=None)
    monkeypatch.setattr(trainer, "accelerator", SimpleNamespace(state=state))
    monkeypatch.setattr(trainer, "is_fsdp_enabled", True)
    assert trl_loss.unsupported_setting(trainer) is None  # FSDP2
    state.fsdp_plugin.fsdp_version = 1
    assert trl_loss.unsupported_setting(trainer).startswith("FSDP version 1")
    monkeypatch.setattr(trainer, "is_fsdp_enabled", False)
    monkeypatch.setattr(trainer, "is_deepspeed_enabled", True)
    state.deepspeed_plugin = SimpleNamespace(zero_stage=3)
    assert trl_loss.unsupported_setting(trainer) is None  # ZeRO-3
