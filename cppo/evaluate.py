"""Evaluation: greedy accuracy and format rate of one decoded completion per test problem, in one process or with
the problems split over the ranks of a torchrun job (``cppo eval`` and :meth:`cppo.Trainer.evaluate`)."""

from __future__ import annotations

from .data import build_prompt
from .distributed import DistInfo, question_slice, reduce_metrics
from .rewards import FORMAT_RE, is_correct
from .rollout import HFRollout


def evaluate_model(
    rollout: HFRollout, tokenizer, problems: list[dict], *, system_prompt: str | None = None, batch_size: int = 32
) -> dict:
    """Greedy decoding of one completion per problem, ``batch_size`` prompts at a time.

    Returns:
        ``{"accuracy": correct / total, "correct", "total", "format_rate"}`` (format: the ``<think>/<answer>`` tags).
    """
    correct = formatted = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        out = rollout.generate([build_prompt(tokenizer, p, system_prompt=system_prompt) for p in chunk], 1, greedy=True)
        for p, text in zip(chunk, out.texts):
            correct += is_correct(p["kind"], text, p["answer"])
            formatted += bool(FORMAT_RE.match(text))
    n = len(problems)
    return {"accuracy": correct / n, "correct": correct, "total": n, "format_rate": formatted / n}


def evaluate_split(
    rollout: HFRollout, tokenizer, problems: list[dict], *, info: DistInfo, system_prompt: str | None = None
) -> dict:
    """:func:`evaluate_model` over all ranks: each decodes its contiguous block of ``problems`` and the counts are
    summed (every rank gets the result). A single process evaluates them all."""
    if not info.distributed:
        return evaluate_model(rollout, tokenizer, problems, system_prompt=system_prompt)
    mine = problems[question_slice(len(problems), info=info)]
    out = {"correct": 0, "total": 0, "formatted": 0.0}
    if mine:
        res = evaluate_model(rollout, tokenizer, mine, system_prompt=system_prompt)
        out = {"correct": res["correct"], "total": res["total"], "formatted": res["format_rate"] * res["total"]}
    out = reduce_metrics(out, info=info, reductions=lambda name: "sum")
    n = int(out["total"])
    return {
        "accuracy": out["correct"] / n,
        "correct": int(out["correct"]),
        "total": n,
        "format_rate": out["formatted"] / n,
    }


def greedy_rollout(rollout) -> HFRollout:
    """The rollout evaluation decodes with: the training ``rollout`` when it runs transformers ``generate``, else an
    :class:`HFRollout` on the same model, tokenizer and lengths (e.g. beside a vLLM engine)."""
    if isinstance(rollout, HFRollout):
        return rollout
    return HFRollout(
        rollout.model,
        rollout.tokenizer,
        max_prompt_length=rollout.max_prompt_length,
        max_completion_length=rollout.max_completion_length,
    )
