"""Evaluation under the official CPPO protocol (``cppo eval`` and :meth:`cppo.Trainer.evaluate`), in one process or
with the problems split over the ranks of a torchrun job.

Per problem kind (see :func:`cppo.tasks.rewards.eval_correct`): GSM8K is right when the tagged answer, or else the whole
text, matches the gold (exact, single number, then last number: ``GRPOTrainer.evaluate`` in ``grpo_trainer_gsm.py``);
MATH-style sets (MATH-500, AIME, AMC) are checked by math-verify against the gold parsed from the full solution
(``grpo_trainer_math.py``). The official runs decode MATH-500 and GSM8K greedily (1,024 new tokens) and AMC23 /
AIME24 with 4 samples at temperature 0.6, top_p 0.95 and 3,072 new tokens, averaging the accuracy over samples.
"""

from __future__ import annotations

from .distributed import DistInfo, question_slice, reduce_metrics
from .engines import RolloutEngine
from .tasks import build_prompt, eval_correct, has_official_format


def evaluate_model(
    rollout: RolloutEngine,
    tokenizer,
    problems: list[dict],
    *,
    system_prompt: str | None = None,
    batch_size: int = 32,
    num_samples: int = 1,
    greedy: bool = True,
    progress: bool = False,
) -> dict:
    """Decodes ``num_samples`` completions per problem with the engine ``rollout`` (greedy, or sampled with its
    temperature and top_p), ``batch_size`` prompts at a time, and grades each one.

    Returns:
        ``{"accuracy": correct / total, "correct", "total" (completions graded), "problems", "format_rate"}``; the
        format rate is the share of completions the official format reward accepts.
    """
    from tqdm.auto import tqdm

    correct = formatted = 0
    bar = tqdm(total=len(problems), desc="eval", disable=not progress, dynamic_ncols=True)
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        prompts = [build_prompt(tokenizer, p, system_prompt=system_prompt) for p in chunk]
        texts = rollout(prompts, num_samples, greedy=greedy).texts  # problem after problem (contract checked)
        rows = [p for p in chunk for _ in range(num_samples)]
        correct += sum(
            eval_correct(
                texts,
                answer=[p["answer"] for p in rows],
                kind=[p["kind"] for p in rows],
                solution=[p.get("solution") for p in rows],
            )
        )
        formatted += sum(has_official_format(t) for t in texts)
        bar.update(len(chunk))
        bar.set_postfix(acc=f"{correct / ((i + len(chunk)) * num_samples):.3f}")
    bar.close()
    total = len(problems) * num_samples
    return {
        "accuracy": correct / total,
        "correct": correct,
        "total": total,
        "problems": len(problems),
        "format_rate": formatted / total,
    }


def evaluate_split(
    rollout: RolloutEngine, tokenizer, problems: list[dict], *, info: DistInfo, system_prompt: str | None = None
) -> dict:
    """:func:`evaluate_model` (greedy, one completion each) over all ranks: each decodes its contiguous block of
    ``problems`` and the counts are summed (every rank gets the result). A single process evaluates them all."""
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
        "problems": n,
        "format_rate": out["formatted"] / n,
    }
