"""The tasks a run trains on: problems (GSM8K, MATH, arithmetic) and the question sampler (data.py), GRESO's skipping
of questions that cannot teach (greso.py), the official system prompts (prompts.py), the rewards and correctness
checks (rewards.py), math-verify in a worker process with a hard deadline (math_grading.py, _math_verify_worker.py)."""

from .data import (  # noqa: I001  (grouped, as __all__)
    ARITH_TEST_SIZE, KINDS, QuestionSampler, arithmetic_problems, check_arith_eval_limit, count_local_problems,
    load_problems, normalise_row, question_id,
)  # fmt: skip
from .greso import INITIAL_EXPLORE, SelectiveRollout, check_greso
from .math_grading import MathVerifier, check_timeout, verifier
from .prompts import GSM8K_SYSTEM_PROMPT, MATH_SYSTEM_PROMPT, SYSTEM_PROMPTS, build_prompt, system_prompt_for
from .rewards import (
    REWARDS, RewardFn, accuracy01_reward, accuracy_reward, digits_reward, eval_correct, format_reward, get_rewards,
    has_official_format, last_boxed, register_reward, score_all, tag_count_reward, training_correct,
)  # fmt: skip

__all__ = [
    "ARITH_TEST_SIZE", "KINDS", "QuestionSampler", "arithmetic_problems", "check_arith_eval_limit",
    "count_local_problems", "load_problems", "normalise_row", "question_id", "INITIAL_EXPLORE", "SelectiveRollout",
    "check_greso", "MathVerifier", "check_timeout",
    "verifier", "GSM8K_SYSTEM_PROMPT", "MATH_SYSTEM_PROMPT", "SYSTEM_PROMPTS", "build_prompt", "system_prompt_for",
    "REWARDS", "RewardFn", "accuracy01_reward", "accuracy_reward", "digits_reward", "eval_correct", "format_reward",
    "get_rewards", "has_official_format", "last_boxed", "register_reward", "score_all", "tag_count_reward",
    "training_correct",
]  # fmt: skip
