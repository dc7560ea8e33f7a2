"""The paper presets against the official CPPO runs (lzhxmu/CPPO at 52faeb3: the recipes, the launch scripts, the
DeepSpeed config and the trainer's defaults), setting by setting, and the official system prompts."""

import pathlib

import pytest
import yaml

from cppo import load_config
from cppo.config import PRESET_DIR, available_presets
from cppo.tasks.prompts import GSM8K_SYSTEM_PROMPT, MATH_SYSTEM_PROMPT

ROOT = pathlib.Path(__file__).resolve().parents[3]

#: What the official runs use, in TrainConfig's terms (source in the comment); the values both presets share.
OFFICIAL = {
    "dtype": "bfloat16",  # torch_dtype / bf16: true (zero3.yaml mixed_precision: bf16)
    "max_prompt_length": 512,  # recipe
    "group_size": 16,  # num_generations 16 (recipe and script)
    "temperature": 1.0,  # recipe
    "top_p": 1.0,  # vLLM SamplingParams default
    "selection_scope": "batch",  # grpo_trainer_*.py: k = int(N * P) over the process's step, torch.topk
    "selection_metric": "smallest",  # script --metric='smallest'
    "allocation": True,  # script --allocation
    "filter_groups": False,  # no dynamic sampling: every drawn question's group is pruned and trained
    "greso": False,  # no question skipped before rollout
    "gradient_checkpointing": True,  # recipe, use_reentrant: false
    "mu": 2,  # num_iterations 2
    "beta": 0.04,  # recipe
    "kl_estimator": "k3",  # compute_loss: exp(ref - logp) - (ref - logp) - 1
    "epsilon_low": 0.2,  # trl GRPOConfig.epsilon default
    "epsilon_high": None,  # symmetric clip
    "loss_agg": "token-mean",  # (per_token_loss * mask).sum() / mask.sum()
    "lr": 1e-6,  # learning_rate
    "lr_schedule": "cosine",  # lr_scheduler_type
    "warmup_ratio": 0.1,  # recipe
    "weight_decay": 0.0,  # TrainingArguments default
    "max_grad_norm": 1.0,  # TrainingArguments default
    "num_epochs": 1,  # num_train_epochs
    "num_steps": None,  # max_steps: -1
    "rewards": ["accuracy", "format"],  # reward_funcs, reward_weights 1.0 / 1.0 (summed)
    "seed": 42,  # recipe seed
    "system_prompt": None,  # the recipe's system_prompt: cppo.tasks.prompts' default for the dataset
    "eval_every": 50,  # eval_steps 100 optimizer steps = 50 steps of mu = 2 updates
    "eval_limit": None,  # the whole test split
}
PER_PRESET = {
    "gsm8k-qwen2.5-1.5b": {
        "model": "Qwen/Qwen2.5-1.5B-Instruct",
        "dataset": "gsm8k",  # openai/gsm8k main
        "max_completion_length": 1024,  # recipe
        "questions_per_step": 1,  # 1 process x per_device_train_batch_size 16 / G 16, grad accumulation 1
    },
    "math-qwen2.5-7b": {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "dataset": "math",  # DigitalLearningGmbH/MATH-lighteval; evaluation on MATH-500
        "max_completion_length": 1024,  # CPPO_math.sh --max_completion_length=1024 (the recipe says 3072)
        "questions_per_step": 3,  # 3 processes x 16 / G 16
    },
}


@pytest.mark.parametrize("preset", sorted(PER_PRESET))
def test_paper_presets_equal_the_official_runs(preset):
    cfg = load_config(preset)
    want = {**OFFICIAL, **PER_PRESET[preset]}
    assert {k: getattr(cfg, k) for k in want} == want
    # trained completions per optimizer step: 16 per process, at each of the paper's pruning rates
    for p in (0.5, 0.75, 0.875, 0.9375):
        rate = load_config(preset, [f"pruning_rate={p}"])
        assert rate.pruning.kept_per_step == 16 * cfg.questions_per_step
        assert rate.pruning.questions_drawn == cfg.questions_per_step * 16 // int(16 * (1 - p))  # 16 / num_generations


def test_every_preset_pools_the_step():
    for name in available_presets():  # read as YAML: smollm2-arith-cpu's model file may be absent
        assert yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())["selection_scope"] == "batch", name


def test_the_fidelity_table_names_every_setting():
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    table = text[text.index("## Fidelity to the official CPPO runs") :]
    for name in [*OFFICIAL, *PER_PRESET["gsm8k-qwen2.5-1.5b"], "pruning_rate"]:
        assert f"| `{name}` |" in table, name


# The recipes' system_prompt lines, verbatim (recipes/gsm8k/Qwen2.5-1.5B-Instruct.yaml, recipes/math/...-7B-...yaml)
GSM8K_RECIPE_LINE = r"""system_prompt: "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant first thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think>\n<answer> answer here </answer>."
"""  # noqa: E501
MATH_RECIPE_LINE = r"""system_prompt: "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant first thinks about the reasoning process in the mind and then provides the user with the answer. And the answer should be of the following format: 'Therefore, the final answer is: $\\boxed{{ANSWER}}$. I hope it is correct' (without quotes) where ANSWER is just the final number or expression that solves the problem. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think>\n<answer> answer here </answer>. "
"""  # noqa: E501


def test_system_prompts_are_the_recipes():
    assert GSM8K_SYSTEM_PROMPT == yaml.safe_load(GSM8K_RECIPE_LINE)["system_prompt"]
    assert MATH_SYSTEM_PROMPT == yaml.safe_load(MATH_RECIPE_LINE)["system_prompt"]
    assert "</think>\n<answer>" in GSM8K_SYSTEM_PROMPT  # the layout the official format reward accepts
