"""CPPO on GSM8K from TRL: the paper's recipe (Qwen2.5-1.5B-Instruct, G = 16, P = 0.875 with allocation) as a TRL user
writes it, with ``cppo.trl.CPPOTrainer`` in place of ``trl.GRPOTrainer``.

The settings are the official CPPO run's (``recipes/gsm8k/Qwen2.5-1.5B-Instruct.yaml`` and ``scripts/CPPO_gsm.sh`` in
lzhxmu/CPPO): the official system prompt and rewards (format 1.0 + accuracy 2.0 / 1.5 / 0, from
:mod:`cppo.tasks.rewards`), 16 completions per question and 16 trained per step, mu = 2, beta = 0.04 (k3, no importance
weight on the KL), clip 0.2, token-mean loss, lr 1e-6 cosine with 10% warm-up, bf16 with gradient checkpointing, seed
42.

    .venv/bin/python examples/trl_cppo.py                                   # GPU: the paper's run (GSM8K: ../shared)
    .venv/bin/python examples/trl_cppo.py --pruning-rate 0 --no-allocation  # the GRPO baseline
    .venv/bin/python examples/trl_cppo.py --tiny --max-steps 2              # CPU smoke run: a tiny model built in code
    .venv/bin/accelerate launch examples/trl_cppo.py --pruning-rate 0.75    # several GPUs (each prunes its share)
"""

from __future__ import annotations

import argparse
import os
import pathlib

from datasets import Dataset

from cppo.tasks import GSM8K_SYSTEM_PROMPT, accuracy_reward, format_reward, load_problems
from cppo.trl import CPPOConfig, CPPOTrainer

SHARED_GSM8K = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def texts(completions: list) -> list[str]:
    """TRL passes conversational completions as ``[{"role": "assistant", "content": ...}]``: their text."""
    return [c[-1]["content"] if isinstance(c, list) else c for c in completions]


def gsm8k_format(prompts, completions, **row) -> list[float]:
    """The official format reward: 1.0 for ``<think>...</think>\\n<answer>...</answer>``."""
    return format_reward(prompts, texts(completions))


def gsm8k_accuracy(prompts, completions, answer, kind, **row) -> list[float]:
    """The official GSM8K accuracy reward: 2.0 exact, 1.5 the same number, else 0."""
    return accuracy_reward(prompts, texts(completions), answer=answer, kind=kind)


def gsm8k_dataset(path: str | None, limit: int | None) -> Dataset:
    """GSM8K's training questions as TRL conversational prompts (the official system prompt), with the gold answer
    and kind as columns for the rewards; from ``path`` (a .jsonl file or a folder), ../shared, or the hub."""
    if path is None and SHARED_GSM8K.is_dir():
        path = str(SHARED_GSM8K)
    problems = load_problems("gsm8k", dataset_path=path, max_questions=limit)
    return Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": GSM8K_SYSTEM_PROMPT},
                    {"role": "user", "content": p["question"]},
                ],
                "answer": p["answer"],
                "kind": p["kind"],
            }
            for p in problems
        ]
    )


def tiny_model(folder: str) -> str:
    """A tiny Qwen2 with a character tokenizer, built in code and saved (TRL reloads the reference from the path)."""
    from cppo.step import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-qwen2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


#: The official run's settings (the CPPO fields, then TRL's).
PAPER = dict(
    selection_scope="batch", pruning_metric="smallest",
    num_generations=16, per_device_train_batch_size=16, gradient_accumulation_steps=1, num_iterations=2,
    max_completion_length=1024, temperature=1.0, top_p=1.0,
    beta=0.04, epsilon=0.2, loss_type="dapo", use_bias_correction_kl=False, scale_rewards="group",
    learning_rate=1e-6, lr_scheduler_type="cosine", warmup_steps=0.1, weight_decay=0.0, max_grad_norm=1.0,
    num_train_epochs=1, seed=42, bf16=True, gradient_checkpointing=True, logging_steps=1, save_steps=100,
)  # fmt: skip
#: ``--tiny``: a CPU, a small group, short completions, no checkpoints.
TINY = dict(
    num_generations=4, per_device_train_batch_size=4, max_completion_length=16, bf16=False,
    gradient_checkpointing=False, use_cpu=True, save_strategy="no",
)  # fmt: skip


def config(args: argparse.Namespace) -> CPPOConfig:
    """The official run's settings (:data:`PAPER`; :data:`TINY` on top with ``--tiny``)."""
    return CPPOConfig(
        output_dir=args.output_dir, pruning_rate=args.pruning_rate, allocation=args.allocation,
        max_steps=args.max_steps, report_to=args.report_to, **{**PAPER, **(TINY if args.tiny else {})},
    )  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B-Instruct", help="hub name or local folder")
    p.add_argument("--data", default=None, help="GSM8K .jsonl file or folder (default: ../shared, else the hub)")
    p.add_argument("--limit", type=int, default=None, help="train on the first LIMIT questions")
    p.add_argument("--pruning-rate", type=float, default=0.875, help="P: share of completions pruned (0 = GRPO)")
    p.add_argument("--no-allocation", dest="allocation", action="store_false", help="draw as many prompts as GRPO")
    p.add_argument("--output-dir", default="runs/trl-cppo-gsm8k")
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps (-1: 1 epoch)")
    p.add_argument("--report-to", default="none", help="TRL's report_to: none, tensorboard, wandb, ...")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny model built in code, short lengths")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> CPPOTrainer:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    model = tiny_model(os.path.join(args.output_dir, "tiny-model")) if args.tiny else args.model
    dataset = gsm8k_dataset(args.data, args.limit if args.limit or not args.tiny else 64)
    trainer = CPPOTrainer(
        model=model, reward_funcs=[gsm8k_format, gsm8k_accuracy], args=config(args), train_dataset=dataset
    )
    trainer.train()
    if args.tiny:
        print(tiny_summary(trainer.state.log_history, steps=trainer.state.global_step))
    return trainer


def tiny_summary(history: list[dict], *, steps: int) -> str:
    """What a ``--tiny`` run shows, and why its rewards and loss are zero: the random model built in code never writes
    the official format or a GSM8K answer, so every reward, every advantage and the loss are 0; the pruning and the
    pipeline ran (the kept completions per step)."""
    logged = [h for h in history if "cppo/kept_completions" in h]
    if not logged:
        return f"trl_cppo --tiny: {steps} optimizer steps ran and none was logged"
    last = logged[-1]
    rewards = sorted({h.get("reward", 0.0) for h in logged})
    return (
        f"trl_cppo --tiny: {steps} optimizer steps ran, the last generation keeping {last['cppo/kept_completions']:g} "
        f"completions (cppo/kept_fraction {last['cppo/kept_fraction']:g}); rewards {rewards}: the tiny model is random "
        "and built in code, so it never writes the official <think>/<answer> format nor a GSM8K answer, and with every "
        "reward 0 every advantage and the loss are 0. A smoke run of the pipeline, not of learning: drop --tiny to "
        "train Qwen2.5-1.5B-Instruct on a GPU."
    )


if __name__ == "__main__":
    main()
