"""The result files the accuracy runs combine (``accuracy_seeds.py``): reading one, and what every file combined must
agree on (the trainer settings, the questions per seed, the evaluation, each seed's question ids), refused in one line
naming the file and the first mismatch."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

from seeds_report import method

from cppo.config import TINY_MODELS

#: What the summary reads of every row.
ROW_KEYS = ("pruning_rate", "selection_metric", "accuracy_after", "total_seconds", "train_seconds", "eval_problems")
#: The trainer settings (in every result's ``meta``) that must agree between every file combined: the model, the
#: data, sampling, the loss, the optimiser, the back-ends and the threads. They may differ by arm and seed only in
#: the pruning settings, ``seed``, ``num_steps`` and ``max_questions`` (which ``meta.questions`` replaces).
AGREE_KEYS = (
    "model", "model_config", "dtype", "device", "dataset", "dataset_path", "system_prompt", "max_prompt_length",
    "max_completion_length", "group_size", "temperature", "top_p", "questions_per_step", "micro_batch_tokens",
    "prefix_sharing", "gradient_checkpointing", "use_peft", "lora_r", "lora_alpha", "lora_dropout",
    "lora_target_modules", "mu", "beta", "kl_estimator", "epsilon_low", "epsilon_high", "loss_agg", "lr",
    "lr_schedule", "warmup_ratio", "weight_decay", "max_grad_norm", "num_epochs", "rewards", "rollout_backend",
    "kernel_backend", "torch_threads",
)  # fmt: skip
#: Besides :data:`AGREE_KEYS`: the questions per seed and the evaluation (``meta.questions``, ``meta.eval``'s
#: problems and points), and in every row its questions, G, evaluated and distinct problems; for a model read from a
#: file also the untrained model's accuracy (every seed starts from the same weights).
ROW_AGREE_KEYS = ("questions", "group_size", "eval_problems", "eval_problems_scored")


def read_result(path: pathlib.Path, what: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(meta, rows)`` of a result JSON; ValueError naming the file when it is not ``what`` (or its rows lack
    :data:`ROW_KEYS`)."""
    try:
        data = json.loads(path.read_text())
        meta, rows = data["meta"], list(data["rows"])
        if not isinstance(meta, dict) or not all(isinstance(r, dict) for r in rows):
            raise TypeError("meta must be an object and rows a list of objects")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not {what} ({type(e).__name__}: {e})") from None
    missing = sorted({k for r in rows for k in ROW_KEYS if r.get(k) is None})
    if missing or not rows:
        raise ValueError(f"{path}: its rows lack {missing or 'rows'} (not {what} with --eval)")
    return meta, rows


def agreed_values(meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What must agree (:data:`AGREE_KEYS`, :data:`ROW_AGREE_KEYS`) as one file holds it; ValueError when its rows
    disagree among themselves on a row key."""
    values = {k: meta.get(k) for k in AGREE_KEYS}
    values["questions (per seed)"] = meta.get("questions")
    values["eval problems"] = (meta.get("eval") or {}).get("problems")
    values["eval points"] = (meta.get("eval") or {}).get("points")
    keys = ROW_AGREE_KEYS + (() if meta.get("model") in TINY_MODELS else ("accuracy_before",))
    for key in keys:
        found = sorted({json.dumps(r.get(key)) for r in rows})
        if len(found) > 1:
            raise ValueError(f"its rows disagree on {key}: {', '.join(found)}")
        values[f"rows' {key}"] = json.loads(found[0])
    return values


def check_agree(sources: Sequence[tuple[pathlib.Path, dict[str, Any], Sequence[dict[str, Any]]]]) -> None:
    """Every ``(file, meta, rows)`` agrees with the first on :func:`agreed_values`, and every seed's rows (across
    files) trained the same question ids; ValueError in one line naming the file and the first mismatch."""
    first_path, reference = None, None
    ids: dict[int, tuple[pathlib.Path, list[str]]] = {}
    for path, meta, rows in sources:
        try:
            values = agreed_values(meta, rows)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if reference is None:
            first_path, reference = path, values
        wrong = next((k for k in reference if values[k] != reference[k]), None)
        if wrong is not None:
            raise ValueError(
                f"{path}: {wrong} is {values[wrong]!r}, but {reference[wrong]!r} in {first_path} (the runs would not "
                "compare)"
            )
        for r in rows:
            seen = ids.setdefault(int(r["seed"]), (path, sorted(r.get("train_question_ids") or [])))
            if sorted(r.get("train_question_ids") or []) != seen[1]:
                raise ValueError(
                    f"{path}: seed {r['seed']}'s {method(r)} trained other questions than the seed's rows in {seen[0]}"
                )
