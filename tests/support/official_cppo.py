"""Test oracle: a literal transcription of the official CPPO scoring (lzhxmu/CPPO at 52faeb3, ``src/open_r1``).

Only the data plumbing is adapted (a completion is passed as its text instead of ``[{"content": text}]``, one item
at a time); every regular expression, comparison and math-verify call is the official one, with math-verify's
default (signal-based, 5 s) timeouts, so the oracle runs on the main thread only. Never import this from ``cppo``.
"""

import re

# ---- rewards_gsm.py (rewards_math.py holds identical copies of the helpers) ---------------------------------------


def extract_answer_from_dataset(text):
    if "####" not in text:
        return None
    return text.split("####")[1].strip().replace(",", "")


def extract_answer_from_model_output(text):
    # Split on <answer> and take everything after the last occurrence
    parts = text.split("<answer>")
    if len(parts) < 2:  # No <answer> tag found
        return None
    last_part = parts[-1]

    # Extract content up to </answer>
    if "</answer>" not in last_part:
        return None
    answer = last_part.split("</answer>")[0].strip().replace(",", "")
    return None if answer == "..." else answer


def extract_single_number(text):
    numbers = re.findall(r"-?\d*\.?\d+", text)
    return float(numbers[0]) if len(numbers) == 1 else None


def extract_last_number(text):
    if text is None:
        return None
    text = text.replace("$", "").replace("%", "").replace(",", "")
    pattern = r".*?(\d+\.?\d*)"
    matches = re.findall(pattern, text)
    return float(matches[-1]) if matches else None


def gsm8k_accuracy_reward(completion, solution):
    """``accuracy_reward([[{"content": completion}]], [solution])[0]``; ``solution`` is the raw GSM8K answer."""
    r = extract_answer_from_model_output(completion)
    a = extract_answer_from_dataset(solution)
    if r == a:  # Exact match case
        return 2.0
    # Try numeric equivalence
    r_num = extract_single_number(str(r))
    a_num = extract_single_number(str(a))
    if r_num is not None and a_num is not None and r_num == a_num:
        return 1.5
    return 0.0


def format_reward(completion):
    pattern = r"^<think>.*?</think>\n<answer>.*?</answer>$"
    match = re.match(pattern, completion, re.DOTALL | re.MULTILINE)
    return 1.0 if match else 0.0


# ---- grpo_trainer_gsm.py, GRPOTrainer.evaluate (the loop body for one prediction) ----------------------------------


def gsm8k_eval_is_correct(predicted, solution):
    """``solution`` is the extracted gold (``extract_answer_from_dataset`` of the raw answer)."""
    # Try different matching methods
    if predicted == solution:  # Exact match
        is_correct = True
    else:
        # Try single number matching
        pred_num = extract_single_number(predicted)
        exp_num = float(solution)
        if pred_num is not None and exp_num is not None and pred_num == exp_num:
            is_correct = True
        else:
            # Try last number matching
            pred_num = extract_last_number(predicted)
            exp_num = extract_last_number(solution)
            is_correct = pred_num is not None and exp_num is not None and pred_num == exp_num

    predicted2 = extract_answer_from_model_output(predicted)
    if predicted2 is not None:
        if predicted2 == solution:  # Exact match
            is_correct = True
        else:
            # Try single number matching
            pred_num = extract_single_number(predicted2)
            exp_num = float(solution)
            if pred_num is not None and exp_num is not None and pred_num == exp_num:
                is_correct = True
            else:
                # Try last number matching
                pred_num = extract_last_number(predicted2)
                exp_num = extract_last_number(solution)
                is_correct = pred_num is not None and exp_num is not None and pred_num == exp_num
    return is_correct


# ---- rewards_math.py accuracy_reward and grpo_trainer_math.py evaluate (math500 / aime24) -------------------------


def _answer_config():
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    return [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(
                nits=False,
                malformed_operators=False,
                basic_latex=True,
                equations=True,
                boxed="all",
                units=True,
            ),
            # Ensures that boxed is tried first
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]


def math_accuracy_reward(content, sol):
    from math_verify import LatexExtractionConfig, parse, verify

    gold_parsed = parse(
        sol,
        extraction_mode="first_match",
        extraction_config=[LatexExtractionConfig()],
    )
    if len(gold_parsed) != 0:
        # We require the answer to be provided in correct latex (no malformed operators)
        answer_parsed = parse(content, extraction_config=_answer_config(), extraction_mode="first_match")
        # Reward 1 if the content is the same as the ground truth, 0 otherwise
        try:
            reward = float(verify(answer_parsed, gold_parsed)) * 2
        except Exception:
            reward = 0.0
    else:
        # If the gold solution is not parseable, we reward 1 to skip this example
        reward = 1.0
    return reward


def math_eval_is_correct(predicted, solution_text):
    from math_verify import LatexExtractionConfig, parse, verify

    solution = parse(solution_text, extraction_mode="first_match", extraction_config=[LatexExtractionConfig()])
    answer_parsed = parse(predicted, extraction_config=_answer_config(), extraction_mode="first_match")
    return bool(float(verify(solution, answer_parsed)))
