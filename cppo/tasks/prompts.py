"""The system prompts of the official CPPO recipes and the chat prompt built from a problem.

The two prompts are the ``system_prompt`` values of ``recipes/gsm8k/Qwen2.5-1.5B-Instruct.yaml`` and
``recipes/math/Qwen2.5-7B-Instruct.yaml`` in lzhxmu/CPPO, character for character as YAML reads them (``\\n`` is a
newline; the MATH prompt keeps its doubled braces ``{{ANSWER}}`` and its trailing space).
"""

from __future__ import annotations

from .registry import SystemPrompts, task_kind

GSM8K_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning "
    "process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think>\n<answer> answer here </answer>."
)
MATH_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer. And the answer "
    "should be of the following format: 'Therefore, the final answer is: $\\boxed{{ANSWER}}$. I hope it is correct' "
    "(without quotes) where ANSWER is just the final number or expression that solves the problem. The reasoning "
    "process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think>\n<answer> answer here </answer>. "
)
#: The default system prompt of each problem kind, registered kinds included (``arith`` uses the GSM8K recipe's).
SYSTEM_PROMPTS = SystemPrompts()


def system_prompt_for(kind: str, system_prompt: str | None = None) -> str:
    """``system_prompt`` when given, else the default prompt of problem ``kind`` (its
    :class:`~cppo.tasks.registry.TaskKind`'s: the official recipe's for the built-in kinds)."""
    if system_prompt is not None:
        return system_prompt
    return task_kind(kind).system_prompt


def build_prompt(tokenizer, problem: dict, *, system_prompt: str | None = None) -> str:
    """The chat prompt as text: the system prompt (:func:`system_prompt_for`), then the question as the user turn,
    then the assistant's generation prompt (the tokenizer's chat template; a plain layout without one)."""
    system = system_prompt_for(problem["kind"], system_prompt)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": problem["question"]}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system}\n\nUser: {problem['question']}\nAssistant:"
