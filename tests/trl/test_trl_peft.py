"""LoRA through ``peft_config``: the reference pass is the policy with its adapter disabled (TRL keeps no reference
copy), at P = 0 as stock TRL trains, and pruned: the adapter trains, the base weights do not move."""

from __future__ import annotations

import torch
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer
from trl_tiny import PassCounter, digit_reward, losses, make_config, tiny_dataset, weights

from cppo.trl import CPPOConfig, CPPOTrainer

OPTIONS = dict(beta=0.04, per_device_train_batch_size=16, max_steps=2)


def lora_trainer(cls, config_cls, model: str, out, **options):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    args = make_config(config_cls, out, **{**OPTIONS, **options})
    return cls(model=model, reward_funcs=digit_reward, args=args, train_dataset=tiny_dataset(), peft_config=lora)


def test_lora_at_p0_trains_as_stock_trl(tiny_model, tmp_path):
    stock = lora_trainer(GRPOTrainer, GRPOConfig, tiny_model, tmp_path / "stock")
    stock.train()  # built then trained, each in turn: a trainer seeds the global RNG when it is built
    cppo = lora_trainer(CPPOTrainer, CPPOConfig, tiny_model, tmp_path / "cppo")
    cppo.train()
    torch.testing.assert_close(losses(cppo), losses(stock), atol=1e-6, rtol=1e-5)
    for name, value in weights(stock).items():
        torch.testing.assert_close(weights(cppo)[name], value, atol=1e-4, rtol=1e-4, msg=name)


def test_lora_pruned_trains_the_adapter_only(tiny_model, tmp_path):
    trainer = lora_trainer(CPPOTrainer, CPPOConfig, tiny_model, tmp_path, pruning_rate=0.75, prefix_sharing=False)
    assert trainer.ref_model is None and trainer.fused_loss_refused is None
    before = weights(trainer)
    counter = PassCounter()
    with counter.hook("policy", trainer.model):
        trainer.train()
    after = weights(trainer)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all("lora_" in name for name in changed), sorted(changed)
    # the reference pass (no old-policy pass here) ran on the policy with the adapter off, over the 4 kept rows
    assert counter.rows("policy", grad=False) == [4, 4] and counter.rows("policy", grad=True) == [4, 4]
    kl = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert kl[0] == 0.0 and kl[-1] > 0.0  # LoRA starts as the base model; then the policy moves away from it
