"""A toy rollout engine for the engine tests (``from toy_engine import FixedEngine``): it returns fixed completions
instead of decoding, so a test knows every text a step trains on."""

from __future__ import annotations

import itertools

from cppo.engines import EngineSettings, Rollout, RolloutEngine, encode_prompts

#: The completions the engine returns, in turn: their digit shares differ, so the digits reward spreads.
TEXTS = ("12", "a1", "bb", "7x7", "999", "q")


class FixedEngine(RolloutEngine):
    """Cycles through :data:`TEXTS` (each encoded and closed with the tokenizer's EOS, cut to the completion length);
    records every ``generate`` call as ``(prompts, num_per_prompt, greedy)`` and counts ``sync_weights`` calls."""

    def __init__(self, model, tokenizer, settings: EngineSettings) -> None:
        super().__init__(model, tokenizer, settings)
        self.texts, self.calls, self.syncs = itertools.cycle(TEXTS), [], 0

    def generate(self, prompts: list[str], num_per_prompt: int, *, greedy: bool = False) -> Rollout:
        self.calls.append((list(prompts), num_per_prompt, greedy))
        encoded = encode_prompts(self.tokenizer, prompts, self.settings.max_prompt_length)
        prompt_ids = [p for p in encoded for _ in range(num_per_prompt)]
        texts = [next(self.texts) for _ in prompt_ids]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        eos, limit = self.tokenizer.eos_token_id, self.settings.max_completion_length
        completions = [(c + [eos])[:limit] for c in ids]
        return Rollout(prompt_ids, completions, self.tokenizer.batch_decode(completions, skip_special_tokens=True))

    def sync_weights(self) -> None:
        self.syncs += 1
