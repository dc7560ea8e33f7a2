"""Stopping completions mid-generation (issue 38, pruning while generating), what every engine shares: the engine
decodes every row to a checkpoint, a :class:`Stopper` looks at the unfinished rows there (a
:class:`PartialRollout`: their tokens so far and the policy's last hidden state) and names the rows to stop; only the
others are decoded further. A stopped completion is its tokens up to the checkpoint, marked in
:attr:`Rollout.stopped`.

How an engine continues is its own: the ``hf`` engine resumes transformers' ``generate`` from the checkpoint's KV
cache with the survivors alone (:mod:`.resume`); the ``vllm`` engine continues each survivor as a request of its
prompt and partial completion, the hidden states computed by one policy forward (:mod:`.hidden`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["PartialRollout", "Stopper", "check_choice", "checkpoint_tokens"]


@dataclass
class PartialRollout:
    """The rows at the checkpoint: every row's prompt and completion ids so far (``at`` tokens, or fewer for a row
    that ended with EOS), which rows have ended, and the policy's final hidden state ``[N, H]`` at each row's last
    forwarded position (None where the engine has none; zeros for the rows that ended where the engine computes them
    after the fact, :func:`.hidden.checkpoint_hidden`: the vllm engine)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    finished: list[bool]
    hidden: torch.Tensor | None
    at: int


@dataclass
class Stopper:
    """When and whom to stop: ``at``, the checkpoint in new tokens (>= 1); ``choose(partial)``, a boolean per row
    (True: stop it). Rows that already ended are never stopped (whatever ``choose`` says of them). ``needs_hidden``:
    whether ``choose`` reads :attr:`PartialRollout.hidden`; when not, an engine that would compute them with an
    extra policy forward (``vllm``, the fallback for recurrent caches) passes None instead."""

    at: int
    choose: Callable[[PartialRollout], list[bool]]
    needs_hidden: bool = True


def checkpoint_tokens(at: float | int, max_completion_length: int) -> int:
    """The checkpoint in tokens: ``at`` >= 1 is a token count, 0 < ``at`` < 1 a fraction of ``max_completion_length``
    (rounded, at least 1). ValueError naming the setting otherwise, or when it is not before the last token."""
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not at > 0:
        raise ValueError(f"rollout_stop.at must be a token count >= 1 or a fraction in (0, 1), got {at!r}")
    if at < 1:
        tokens = max(1, round(at * max_completion_length))
    elif float(at).is_integer():
        tokens = int(at)
    else:
        raise ValueError(f"rollout_stop.at must be a token count >= 1 or a fraction in (0, 1), got {at!r}")
    if tokens >= max_completion_length:
        raise ValueError(
            f"rollout_stop.at={at!r} is {tokens} tokens, not before max_completion_length={max_completion_length}: "
            "nothing would be left to stop"
        )
    return tokens


def check_choice(chosen, finished: list[bool]) -> list[bool]:
    """A stopper's answer as the rows stopped: one bool per row (ValueError otherwise), never a row that ended."""
    chosen = list(chosen)
    if len(chosen) != len(finished):
        raise ValueError(f"the stopper chose for {len(chosen)} rows, the checkpoint holds {len(finished)}")
    return [bool(c) and not f for c, f in zip(chosen, finished)]
