"""The tasks a run trains on: the problem kinds (registry.py: what a ``kind`` means, one :class:`TaskKind` each; the
built-in GSM8K, MATH and arithmetic registered in kinds.py), problems and the question sampler (data.py), GRESO's
skipping of questions that cannot teach (greso.py), the official system prompts (prompts.py), the rewards and
correctness checks (rewards.py), math-verify in a worker process with a hard deadline (math_grading.py,
_math_verify_worker.py)."""

from .registry import (  # noqa: I001  (the registry first, the built-in kinds last)
    CHECKS, DATASETS, KINDS, TASK_KINDS, Dataset, TaskKind, dataset_source, register_task_kind, task_kind,
)  # fmt: skip
from .data import (
    ARITH_TEST_SIZE, QuestionSampler, arithmetic_problems, check_arith_eval_limit, check_eval_limit,
    count_local_problems, load_problems, normalise_row, question_id,
)  # fmt: skip
from .greso import INITIAL_EXPLORE, SelectiveRollout, check_greso
from .math_grading import MathVerifier, check_timeout, verifier
from .prompts import GSM8K_SYSTEM_PROMPT, MATH_SYSTEM_PROMPT, SYSTEM_PROMPTS, build_prompt, system_prompt_for
from .rewards import (
    REWARDS, RewardFn, accuracy01_reward, accuracy_reward, digits_reward, eval_correct, format_reward, get_rewards,
    has_official_format, last_boxed, register_reward, score_all, tag_count_reward, training_correct,
)  # fmt: skip
from .kinds import gsm8k_gold, math_grade  # importing it registers the built-in kinds (after the modules it uses)

__all__ = [
    "CHECKS", "DATASETS", "KINDS", "TASK_KINDS", "Dataset", "TaskKind", "dataset_source", "register_task_kind",
    "task_kind",
    "ARITH_TEST_SIZE", "QuestionSampler", "arithmetic_problems", "check_arith_eval_limit", "check_eval_limit",
    "count_local_problems", "load_problems", "normalise_row", "question_id", "INITIAL_EXPLORE", "SelectiveRollout",
    "check_greso", "MathVerifier", "check_timeout",
    "verifier", "GSM8K_SYSTEM_PROMPT", "MATH_SYSTEM_PROMPT", "SYSTEM_PROMPTS", "build_prompt", "system_prompt_for",
    "REWARDS", "RewardFn", "accuracy01_reward", "accuracy_reward", "digits_reward", "eval_correct", "format_reward",
    "get_rewards", "has_official_format", "last_boxed", "register_reward", "score_all", "tag_count_reward",
    "training_correct", "gsm8k_gold", "math_grade",
]  # fmt: skip
