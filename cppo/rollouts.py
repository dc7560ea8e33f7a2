"""The step's questions and their scored completions, a part of :class:`cppo.trainer.Trainer` (a mixin): draw this
rank's share of the questions (GRESO's skips passed over, :mod:`cppo.tasks.greso`), generate G completions of each
through the rollout engine, reward them, and with ``filter_groups`` / ``greso`` the step's generation calls
(:func:`cppo.step.fill_step`) concatenated, the selection made, the skip history updated on every rank."""

from __future__ import annotations

import torch

from . import distributed, step
from .engines import Rollout
from .run import PhaseTimer
from .tasks import build_prompt, score_all, training_correct


class StepRollouts:
    """The generation and reward stages of a step; the :class:`cppo.trainer.Trainer` that inherits them holds
    ``config``, ``sampler``, ``greso``, ``problems``, ``tokenizer``, ``policy``, ``rollout``, ``reward_fns``,
    ``pruning``, ``info``, ``device``, ``step``, ``num_steps`` and ``rank``."""

    def _step_seed(self, rank: int | None = None) -> int:
        """This step's seed for ``rank`` (default: this rank's)."""
        return (self.config.seed * 1_000_003 + self.step) * 64 + (self.rank if rank is None else rank)

    def _generate(self, num_questions: int | None = None) -> tuple[list[dict], list[str], Rollout]:
        """This rank's share of the step's questions (``num_questions`` over all ranks, default the step's; GRESO's
        skips passed over), their prompts, and G sampled completions of each."""
        cfg = self.config
        skip = self.greso.skips if self.greso is not None else None
        self.drawn = self.sampler.draw(num_questions or self.pruning.questions_drawn, skip)  # this rank's share
        if self.greso is not None:
            self.greso.adapt(len(self.sampler.skipped), self.sampler.considered)
        problems = [self.problems[i] for i in self.drawn]
        prompts = [build_prompt(self.tokenizer, p, system_prompt=cfg.system_prompt) for p in problems]
        stopping = getattr(self, "stopping", None)  # pruning while generating (cppo.step.quality)
        stopper = {} if stopping is None else {"stopper": stopping.stopper(self.step, self._step_seed())}
        with distributed.root_unsharded(self.policy):
            rollout = self.rollout(prompts, cfg.group_size, **stopper)  # generate, checked against the contract
        return problems, prompts, rollout

    def _reward(self, problems: list[dict], prompts: list[str], rollout: Rollout):
        """``(rewards [Q * G] fp32: the sum of the reward functions, their scores by name, correct per completion)``."""
        G = self.config.group_size
        rows = {key: [p.get(key) for p in problems for _ in range(G)] for key in ("answer", "kind", "solution")}
        scores = score_all(self.reward_fns, [p for p in prompts for _ in range(G)], rollout.texts, **rows)
        rewards = torch.tensor([sum(s) for s in zip(*scores.values())], dtype=torch.float32)  # [Q * G]
        correct = training_correct(rollout.texts, **rows)  # MATH: the reward's math-verify verdicts, memoised
        return rewards, scores, correct

    def _draw_step(self, timer: PhaseTimer):
        """The step's generation calls (:func:`cppo.step.fill_step` with ``filter_groups``, else one), each drawing
        questions (GRESO's skips passed over), generating and rewarding; what ``train_step`` reads, concatenated,
        dynamic sampling's selection (``filled``; ``None``: the plain rule's to make) and both features' metrics."""
        cfg, parts, skipped = self.config, [], []

        def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            with timer("generate"):
                problems, prompts, rollout = self._generate(n)
            skipped.append(len(self.sampler.skipped))
            with timer("reward"):
                parts.append((self.drawn, problems, prompts, rollout, *self._reward(problems, prompts, rollout)))
            stopped = rollout.stopped or [False] * len(rollout.texts)  # pruning while generating: no final reward
            return parts[-1][4], torch.tensor(stopped, dtype=torch.bool)

        if cfg.filter_groups:
            seed, calls = self._step_seed(rank=0), cfg.max_num_gen_batches
            filled = step.fill_step(self.pruning, draw, max_calls=calls, seed=seed, info=self.info)
            zero, extra = filled.zero_variance, filled.metrics()
        else:  # GRESO alone: one call, selected by the plain rule (train_step's select stage)
            filled, extra = None, {}
            first, stopped = draw(self.pruning.questions_drawn)
            zero = step.zero_variance_groups(first, cfg.group_size, stopped)
        drawn, problems, prompts, rollouts, rewards, scores, correct = (list(x) for x in zip(*parts))
        rollout = concatenate(rollouts)
        scores = {name: sum((s[name] for s in scores), []) for name in scores[0]}
        if self.greso is not None:  # every rank's groups, in rank order: the same history on every rank
            pairs = torch.tensor([[q, z] for q, z in zip(sum(drawn, []), zero.tolist())])
            gathered, _ = distributed.all_gather_varlen(pairs.reshape(-1, 2).to(self.device), info=self.info)
            if len(gathered):
                self.greso.observe(*zip(*gathered.tolist()))
            extra.update({"greso/questions_skipped": sum(skipped), "greso/explore": self.greso.explore})
        problems, prompts, rewards, correct = sum(problems, []), sum(prompts, []), torch.cat(rewards), sum(correct, [])
        if getattr(self, "stopping", None) is not None:  # the head's metrics and update over every call's rows
            extra.update(self.stopping.observe(rollout, correct, rewards))
        return problems, prompts, rollout, rewards, scores, correct, filled, extra

    def stop_reason(self) -> str | None:
        """Why the run ends after this step (None: it goes on). ``num_steps`` set: after that many steps. Otherwise
        after the planned ``num_epochs`` passes' steps (``num_steps``, which the learning-rate schedule spans) or as
        soon as the question sampler has passed ``num_epochs`` epochs (GRESO's skips count as passed), whichever
        comes first: verl's epochs of the data. A plain step draws its fixed count, so the two agree; with
        ``filter_groups`` / ``greso`` a step passes more questions, the run ends early and the schedule is cut short
        (a truncated cosine). The sampler's position is the same on every rank, so every rank stops together."""
        cfg, n = self.config, self.sampler.num_questions
        if self.step >= self.num_steps:
            return f"{self.step} of {self.num_steps} planned steps done"
        if cfg.num_steps is None and self.sampler.passed >= cfg.num_epochs * n:
            return (
                f"num_epochs={cfg.num_epochs} epochs of the {n} questions used up after step {self.step} (planned "
                f"{self.num_steps} steps; the learning-rate schedule is cut short there)"
            )
        return None


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
