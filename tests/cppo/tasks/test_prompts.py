"""The official system prompts and the chat prompt of a problem."""

import pytest

from cppo.step import tiny_tokenizer
from cppo.tasks import GSM8K_SYSTEM_PROMPT, MATH_SYSTEM_PROMPT, SYSTEM_PROMPTS, build_prompt, system_prompt_for

PROBLEM = {"question": "What is 2 + 3?", "answer": "5", "kind": "arith"}


def test_each_kind_has_its_recipes_system_prompt():
    assert system_prompt_for("gsm8k") == GSM8K_SYSTEM_PROMPT == system_prompt_for("arith")
    assert system_prompt_for("math") == MATH_SYSTEM_PROMPT and set(SYSTEM_PROMPTS) == {"gsm8k", "math", "arith"}
    assert system_prompt_for("math", "Answer.") == "Answer."  # system_prompt replaces it, whatever the kind
    assert "$\\boxed{{ANSWER}}$" in MATH_SYSTEM_PROMPT and MATH_SYSTEM_PROMPT.endswith(" ")  # as YAML reads the recipe


def test_an_unknown_kind_is_refused_naming_the_kinds():
    with pytest.raises(ValueError, match=r"unknown problem kind 'mmlu'; kinds: \['arith', 'gsm8k', 'math'\]"):
        system_prompt_for("mmlu")


def test_the_chat_prompt_goes_through_the_tokenizers_template():
    text = build_prompt(tiny_tokenizer(300), PROBLEM)
    want = f"<|im_start|>system\n{GSM8K_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
    assert text == want + "<|im_start|>assistant\n"  # ends with the assistant's generation prompt


def test_a_tokenizer_without_a_template_gets_a_plain_layout():
    class Plain:
        chat_template = None

    assert build_prompt(Plain(), PROBLEM, system_prompt="Sys.") == "Sys.\n\nUser: What is 2 + 3?\nAssistant:"
