"""The step's questions and their scored completions (:class:`StepRollouts`, built once by the trainer from what it
reads): draw this rank's share of the questions (GRESO's skips passed over, :mod:`cppo.tasks.greso`), generate G
completions of each through the rollout engine, reward them, and with ``filter_groups`` / ``greso`` the step's
generation calls (:func:`cppo.step.fill_step`) concatenated, the selection made, the skip history updated on every
rank."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import distributed, step
from .engines import Rollout, RolloutEngine
from .run import PhaseTimer
from .tasks import build_prompt, score_all, training_correct


class StepRollouts:
    """The generation and reward stages of a step over ``problems`` (the training split): ``sampler`` draws this
    rank's questions, ``greso`` (a :class:`cppo.tasks.SelectiveRollout`, or None) skips some, ``tokenizer`` and
    ``system_prompt`` make the prompts, ``reward_fns`` score ``group_size`` completions of each; ``info`` and
    ``device`` place this rank. What changes over a run (the engine, the policy, the pruning, the step's seed and
    stopper) comes with each call. :attr:`drawn`: the question indices of the last generation call."""

    def __init__(
        self, problems: list[dict], *, sampler, greso, tokenizer, system_prompt: str | None, reward_fns: dict,
        group_size: int, info: distributed.DistInfo, device: torch.device,
    ) -> None:  # fmt: skip
        self.problems, self.sampler, self.greso, self.tokenizer = problems, sampler, greso, tokenizer
        self.system_prompt, self.reward_fns, self.group_size = system_prompt, reward_fns, group_size
        self.info, self.device = info, device
        self.drawn: list[int] = []

    def generate(
        self, engine: RolloutEngine, num_questions: int, *, policy, stopper=None
    ) -> tuple[list[dict], list[str], Rollout]:
        """This rank's share of ``num_questions`` questions over all ranks (GRESO's skips passed over), their prompts,
        and ``group_size`` completions of each sampled by ``engine`` (``policy``: the module it generates from, its
        root gathered under FSDP2; ``stopper``: pruning while generating, :mod:`cppo.step.quality`)."""
        skip = self.greso.skips if self.greso is not None else None
        self.drawn = self.sampler.draw(num_questions, skip)  # this rank's share
        if self.greso is not None:
            self.greso.adapt(len(self.sampler.skipped), self.sampler.considered)
        problems = [self.problems[i] for i in self.drawn]
        prompts = [build_prompt(self.tokenizer, p, system_prompt=self.system_prompt) for p in problems]
        kwargs = {} if stopper is None else {"stopper": stopper}
        with distributed.root_unsharded(policy):
            rollout = engine(prompts, self.group_size, **kwargs)  # generate, checked against the contract
        return problems, prompts, rollout

    def reward(self, problems: list[dict], prompts: list[str], rollout: Rollout):
        """``(rewards [Q * G] fp32: the sum of the reward functions, their scores by name, correct per completion)``."""
        G = self.group_size
        rows = {key: [p.get(key) for p in problems for _ in range(G)] for key in ("answer", "kind", "solution")}
        scores = score_all(self.reward_fns, [p for p in prompts for _ in range(G)], rollout.texts, **rows)
        rewards = torch.tensor([sum(s) for s in zip(*scores.values())], dtype=torch.float32)  # [Q * G]
        correct = training_correct(rollout.texts, **rows)  # MATH: the reward's math-verify verdicts, memoised
        return rewards, scores, correct

    def draw_step(
        self, timer: PhaseTimer, generate: Callable, reward: Callable, *, pruning, stopping, filter_groups: bool,
        max_calls: int, seed: int, questions: int | None = None,
    ):  # fmt: skip
        """The step's generation calls, each through ``generate(num_questions)`` and ``reward(problems, prompts,
        rollout)`` (the trainer's stages: :meth:`generate`, :meth:`reward`): one call of ``generate()`` without
        ``filter_groups`` or GRESO; else :func:`cppo.step.fill_step` (with ``filter_groups``, at most ``max_calls``,
        ``pruning``'s budget, ``seed`` the same on every rank) or one call of ``questions`` (default ``pruning``'s
        question count: a step's; several steps' with ``steps_per_generation``). Returns
        what ``train_step`` reads, concatenated: problems, prompts, rollout, rewards, scores, correct, dynamic
        sampling's selection (``filled``; ``None``: the plain rule's to make) and both features' and ``stopping``'s
        metrics."""
        if not (filter_groups or self.greso is not None):
            with timer("generate"):
                problems, prompts, rollout = generate() if questions is None else generate(questions)
            with timer("reward"):
                rewards, scores, correct = reward(problems, prompts, rollout)  # rewards [Q * G]
            extra = stopping.observe(rollout, correct, rewards) if stopping is not None else {}
            return problems, prompts, rollout, rewards, scores, correct, None, extra
        parts, skipped = [], []

        def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            with timer("generate"):
                problems, prompts, rollout = generate(n)
            skipped.append(len(self.sampler.skipped))
            with timer("reward"):
                parts.append((self.drawn, problems, prompts, rollout, *reward(problems, prompts, rollout)))
            stopped = rollout.stopped or [False] * len(rollout.texts)  # pruning while generating: no final reward
            return parts[-1][4], torch.tensor(stopped, dtype=torch.bool)

        if filter_groups:
            filled = step.fill_step(pruning, draw, max_calls=max_calls, seed=seed, info=self.info)
            zero, extra = filled.zero_variance, filled.metrics()
        else:  # GRESO alone: one call, selected by the plain rule (train_step's select stage)
            filled, extra = None, {}
            first, stopped = draw(questions or pruning.questions_drawn)
            zero = step.zero_variance_groups(first, self.group_size, stopped)
        drawn, problems, prompts, rollouts, rewards, scores, correct = (list(x) for x in zip(*parts))
        rollout = concatenate(rollouts)
        scores = {name: sum((s[name] for s in scores), []) for name in scores[0]}
        if self.greso is not None:
            extra.update(self._observe_greso(sum(drawn, []), zero, sum(skipped)))
        problems, prompts, rewards, correct = sum(problems, []), sum(prompts, []), torch.cat(rewards), sum(correct, [])
        if stopping is not None:  # the head's metrics and update over every call's rows
            extra.update(stopping.observe(rollout, correct, rewards))
        return problems, prompts, rollout, rewards, scores, correct, filled, extra

    def _observe_greso(self, drawn: list[int], zero: torch.Tensor, skipped: int) -> dict:
        """GRESO's history updated with every rank's groups (``drawn`` questions, ``zero`` variance flags), in rank
        order: the same history on every rank; its metrics."""
        pairs = torch.tensor([[q, z] for q, z in zip(drawn, zero.tolist())])
        gathered, _ = distributed.all_gather_varlen(pairs.reshape(-1, 2).to(self.device), info=self.info)
        if len(gathered):
            self.greso.observe(*zip(*gathered.tolist()))
        return {"greso/questions_skipped": skipped, "greso/explore": self.greso.explore}


def concatenate(rollouts: list[Rollout]) -> Rollout:
    """One :class:`Rollout` of a step's generation calls, call after call: the engine's log-probs where every call
    has them, the prefill positions summed, the stopped flags where any call ran with a stopper."""
    fields = ("prompt_ids", "completion_ids", "texts")
    rollout = Rollout(*(sum((getattr(r, k) for r in rollouts), []) for k in fields))
    if all(r.sampling_logprobs is not None for r in rollouts):  # the engine's log-probs, call after call
        rollout.sampling_logprobs = sum((r.sampling_logprobs for r in rollouts), [])
    rollout.prefill_tokens = sum(r.prefill_positions for r in rollouts)
    if any(r.stopped is not None for r in rollouts):
        rollout.stopped = sum((r.stopped or [False] * len(r.texts) for r in rollouts), [])
    return rollout
