"""The two-process worker of tests/trl/test_trl_fsdp.py: stock GRPOTrainer and CPPOTrainer on a policy sharded with
FSDP2 on CPU (gloo), run by ``accelerate launch --multi_gpu --num_processes 2``.

Accelerate 1.15 maps CPU processes to ``MULTI_CPU`` and does not apply its FSDP plugin there (it would wrap the
model in DDP), so each trainer's model is sharded here *by accelerate's own FSDP2 code*: ``fsdp2_prepare_model``
with an FSDP2 plugin (``fully_shard`` per decoder layer, the final norm with the LM head, then the root), and the
reference model by TRL's ``prepare_fsdp`` (``fully_shard`` on its root, resharding after forward); accelerate's
``prepare_model`` then leaves the sharded policy as it is. Generation is a ``rollout_func`` (fixed completions, no
model call: HF ``generate`` on a sharded model is not what is tested). Usage: ``trl_fsdp_worker.py OUT CHECK...``.
"""

from __future__ import annotations

import pathlib
import random
import sys

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torchrun_harness import RankRecorder
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import prepare_fsdp
from trl_tiny import digit_reward, losses, make_config, save_tiny_model, tiny_dataset

import cppo.trl.loss
from cppo.distributed import is_fsdp2
from cppo.trl import CPPOConfig, CPPOTrainer

#: One group of 4 per process, two steps, the reference pass and the old-policy pass (num_iterations=2).
LAYOUT = dict(per_device_train_batch_size=4, num_generations=4, max_steps=2, beta=0.04, num_iterations=2)
CHARS = "0123456789abc +="


def rollout(prompts: list[str], trainer) -> dict:
    """Fixed completions of 3 to 8 characters, drawn from a generator seeded by the prompt and the row (the same for
    stock and CPPO, and on every run); no sampling log-probs."""
    tokenizer = trainer.processing_class
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completions = []
    for row, prompt in enumerate(prompts):
        rng = random.Random(f"{prompt}/{row % trainer.num_generations}/{trainer._step}")
        text = "".join(rng.choice(CHARS) for _ in range(rng.randint(3, 8)))
        completions.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}


def shard(trainer) -> None:
    """The policy and reference model sharded as accelerate's FSDP2 plugin and TRL do (see the module's note)."""
    accelerator = trainer.accelerator
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Qwen2DecoderLayer"],
        reshard_after_forward=True,
    )  # fmt: skip
    accelerator.state.fsdp_plugin = plugin
    try:
        trainer.model = trainer.model_wrapped = fsdp2_prepare_model(accelerator, trainer.model)
        if trainer.ref_model is not None:
            trainer.ref_model = prepare_fsdp(trainer.ref_model, accelerator)
    finally:
        accelerator.state.fsdp_plugin = None
    assert is_fsdp2(trainer.model) and is_fsdp2(trainer.model.lm_head), "accelerate did not shard the policy"
    prepare_model = accelerator.prepare_model
    accelerator.prepare_model = lambda model, *a, **k: model if is_fsdp2(model) else prepare_model(model, *a, **k)


def train(cls, config_cls, model: str, out: pathlib.Path, **overrides):
    args = make_config(config_cls, out, **{**LAYOUT, **overrides})
    data = tiny_dataset(32)
    trainer = cls(model=model, reward_funcs=digit_reward, args=args, train_dataset=data, rollout_func=rollout)
    shard(trainer)
    trainer.train()
    return trainer


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """Every parameter as a whole tensor (the shards gathered)."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()}


def p0_equals_stock(model: str, out: pathlib.Path) -> None:
    stock = train(GRPOTrainer, GRPOConfig, model, out / "stock")
    calls = []
    fused = cppo.trl.loss.fused_cppo_loss
    cppo.trl.loss.fused_cppo_loss = lambda *a, **k: (calls.append(a[1]), fused(*a, **k))[1]
    try:
        ours = train(CPPOTrainer, CPPOConfig, model, out / "cppo")
    finally:
        cppo.trl.loss.fused_cppo_loss = fused
    assert ours.fused_loss_refused is None and len(calls) == 2, (ours.fused_loss_refused, len(calls))
    vocab, hidden = ours.model.config.vocab_size, ours.model.config.hidden_size
    assert all(w.shape == (vocab, hidden) and not hasattr(w, "full_tensor") for w in calls), "the head was not whole"
    assert len(losses(ours)) == 2 and losses(ours)[0] != 0.0, losses(ours)
    torch.testing.assert_close(losses(ours), losses(stock), atol=1e-6, rtol=1e-5)
    theirs = full_weights(stock)
    changed = 0
    for name, value in full_weights(ours).items():
        torch.testing.assert_close(value, theirs[name], atol=1e-4, rtol=1e-4, msg=name)
        changed += int(not torch.equal(value, full_weights_initial[name]))
    assert changed > 0, "no weight moved"


def pruned_trains(model: str, out: pathlib.Path) -> None:
    trainer = train(CPPOTrainer, CPPOConfig, model, out / "p05", pruning_rate=0.5)
    kept = [h["cppo/kept_completions"] for h in trainer.state.log_history if "cppo/kept_completions" in h]
    assert kept == [4], kept  # 2 of each process's 4
    final = full_weights(trainer)
    assert any(not torch.equal(final[k], full_weights_initial[k]) for k in final), "no weight moved"
    for value in final.values():  # FSDP2 kept one model: every rank gathers the same whole tensors
        gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, value.contiguous())
        assert all(torch.equal(g, gathered[0]) for g in gathered)
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses(trainer)), losses(trainer)


CHECKS = {"p0_equals_stock": p0_equals_stock, "pruned_trains": pruned_trains}
full_weights_initial: dict[str, torch.Tensor] = {}


def main(out: pathlib.Path, checks: list[str]) -> None:
    state = PartialState(cpu=True)
    rank = state.process_index
    recorder = RankRecorder(out, rank)
    model = str(out / "model")
    if state.is_main_process:  # transformers saves from the main process only
        save_tiny_model(out / "model")
    state.wait_for_everyone()
    from transformers import AutoModelForCausalLM

    full_weights_initial.update(AutoModelForCausalLM.from_pretrained(model).state_dict())
    for name in checks:
        recorder.record(name, lambda check=CHECKS[name]: check(model, out / f"rank{rank}"))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), sys.argv[2:])
