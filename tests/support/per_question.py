"""A rollout for multi-process equality tests: each prompt's completions are sampled with a seed of (step, prompt)
alone, so they do not depend on which process draws the question."""

from __future__ import annotations

import zlib

import torch

from cppo.engines import Rollout, RolloutEngine


class PerQuestionRollout(RolloutEngine):
    """Samples each prompt's completions with a seed of (step, prompt) alone, through the trainer's own rollout."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer.rollout.model, trainer.rollout.tokenizer, trainer.rollout.settings)
        self.trainer, self.inner = trainer, trainer.rollout

    def generate(self, prompts: list[str], num_per_prompt: int, *, greedy: bool = False) -> Rollout:
        parts = []
        for p in prompts:
            torch.manual_seed(zlib.crc32(f"{self.trainer.step}|{p}".encode()))
            parts.append(self.inner.generate([p], num_per_prompt, greedy=greedy))
        return Rollout(*(sum((getattr(r, f) for r in parts), []) for f in ("prompt_ids", "completion_ids", "texts")))

    def sync_weights(self) -> None:
        self.inner.sync_weights()
