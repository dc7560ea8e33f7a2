"""Evaluation under the official CPPO protocol (``cppo eval`` and :meth:`cppo.trainer.Trainer.evaluate`), in one
process or with the problems split over the ranks of a torchrun job.

Per problem kind (see :func:`cppo.tasks.rewards.eval_correct`): GSM8K is right when the tagged answer, or else the whole
text, matches the gold (exact, single number, then last number: ``GRPOTrainer.evaluate`` in ``grpo_trainer_gsm.py``);
MATH-style sets (MATH-500, AIME, AMC) are checked by math-verify against the gold parsed from the full solution
(``grpo_trainer_math.py``). The official runs decode MATH-500 and GSM8K greedily (1,024 new tokens) and AMC23 /
AIME24 with 4 samples at temperature 0.6, top_p 0.95 and 3,072 new tokens, averaging the accuracy over samples.
"""

from __future__ import annotations

import torch

from .distributed import DistInfo, all_gather_varlen, question_slice
from .engines import RolloutEngine
from .tasks import build_prompt, eval_correct, has_official_format, question_id

#: The columns of a per-problem record (one per graded completion, problem after problem).
PER_PROBLEM_KEYS = ("index", "id", "sample", "correct", "format_ok", "completion_tokens")


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
        ``{"accuracy": correct / total, "correct", "total" (completions graded), "problems", "format_rate",
        "per_problem"}``; the format rate is the share of completions the official format reward accepts;
        ``per_problem``: one record per completion (:data:`PER_PROBLEM_KEYS`: the problem's position in
        ``problems`` and its :func:`~cppo.tasks.question_id`, the sample's index, whether it is correct and in the
        official format, its length in tokens), problem after problem.
    """
    from tqdm.auto import tqdm

    rows: list[tuple[int, int, int]] = []  # (correct, format ok, completion tokens) per completion
    bar = tqdm(total=len(problems), desc="eval", disable=not progress, dynamic_ncols=True)
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        prompts = [build_prompt(tokenizer, p, system_prompt=system_prompt) for p in chunk]
        out = rollout(prompts, num_samples, greedy=greedy)  # problem after problem (contract checked)
        graded = [p for p in chunk for _ in range(num_samples)]
        right = eval_correct(
            out.texts,
            answer=[p["answer"] for p in graded],
            kind=[p["kind"] for p in graded],
            solution=[p.get("solution") for p in graded],
        )
        rows += [(int(c), int(has_official_format(t)), n) for c, t, n in zip(right, out.texts, out.lengths)]
        bar.update(len(chunk))
        bar.set_postfix(acc=f"{sum(r[0] for r in rows) / len(rows):.3f}")
    bar.close()
    return _result(problems, rows, num_samples)


def _result(problems: list[dict], rows: list[tuple[int, int, int]], num_samples: int) -> dict:
    """:func:`evaluate_model`'s result from the graded ``rows`` of ``problems`` (``num_samples`` each, in order)."""
    total = len(problems) * num_samples
    if len(rows) != total:
        raise RuntimeError(f"evaluation graded {len(rows)} completions, expected {total}")
    per_problem = [
        dict(zip(PER_PROBLEM_KEYS, (k // num_samples, question_id(problems[k // num_samples]), k % num_samples,
                                    bool(c), bool(f), int(n))))
        for k, (c, f, n) in enumerate(rows)
    ]  # fmt: skip
    correct, formatted = sum(r[0] for r in rows), sum(r[1] for r in rows)
    return {
        "accuracy": correct / total,
        "correct": correct,
        "total": total,
        "problems": len(problems),
        "format_rate": formatted / total,
        "per_problem": per_problem,
    }


def evaluate_split(
    rollout: RolloutEngine, tokenizer, problems: list[dict], *, info: DistInfo, system_prompt: str | None = None
) -> dict:
    """:func:`evaluate_model` (greedy, one completion each) over all ranks: each decodes its contiguous block of
    ``problems`` and the graded completions are gathered in rank order (every rank gets the whole result, per-problem
    records included). A single process evaluates them all."""
    if not info.distributed:
        return evaluate_model(rollout, tokenizer, problems, system_prompt=system_prompt)
    mine = problems[question_slice(len(problems), info=info)]
    local = torch.zeros(0, 3, dtype=torch.long)
    if mine:
        res = evaluate_model(rollout, tokenizer, mine, system_prompt=system_prompt)
        graded = [(r["correct"], r["format_ok"], r["completion_tokens"]) for r in res["per_problem"]]
        local = torch.tensor(graded, dtype=torch.long).reshape(-1, 3)
    gathered, _ = all_gather_varlen(local, info=info)  # rank after rank: the problems in order
    return _result(problems, [tuple(r) for r in gathered.tolist()], 1)
