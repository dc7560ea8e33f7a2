"""A step's micro-batch weights: how much of the step's loss each fused loss call is, so that the calls' scaled
losses, over the micro-batches and the ranks, sum to the loss of the whole step's batch however the step is cut.

- The policy term of a call is aggregated by the loss's own ``loss_agg`` (``LossConfig.loss_agg``: ``loss.loss_type``
  sets it, the flat ``loss_agg`` gives way), a mean over tokens or over sequences
  (:data:`cppo_kernels.config.LOSS_AGG_UNITS`): a call weighs its share of the step's tokens or sequences.
- The entropy mask (``top_entropy_quantile < 1``) cuts at the quantile of the step's tokens (every micro-batch of
  every rank, under the policy of the update: :meth:`StepWeights.with_entropy_cut`), not at each call's own.
- The entropy bonus (``entropy_coef``) is a mean over the step's (masked) tokens whatever the aggregation: each call's
  coefficient is rescaled so that its bonus, times the call's weight, is its share of the step's mean.
- The metrics that are token means (kl, clip fraction, entropy) weigh each call's share of the tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from cppo_kernels import LossConfig

from ..distributed import DistInfo, all_gather_varlen, global_counts, sum_across_ranks
from .packing import PackedBatch, loss_weight

__all__ = ["StepWeights", "step_weights", "quantile"]


@dataclass(frozen=True)
class StepWeights:
    """Per pass (the micro-batches, then the weight-0 fillers that keep the ranks in step): ``loss``, its share of
    the step's loss; per micro-batch: ``metrics``, its share of the token-mean metrics of one of the ``mu`` updates,
    and ``bonus``, its share of the tokens the entropy bonus averages. ``cut``: the entropy mask's cut (None: each
    call's own, or no mask). ``config``: the run's loss options (:meth:`config_of` gives a call's)."""

    config: LossConfig
    loss: list[float]
    metrics: list[float]
    bonus: list[float]
    cut: float | None = None

    def config_of(self, k: int) -> LossConfig:
        """The loss options of pass ``k``: the entropy bonus's coefficient times the micro-batch's share of the
        bonus's tokens over its share of the loss (the call's bonus is a mean over its own tokens); the run's options
        without a bonus, for a filler, or where the two shares agree."""
        cfg = self.config
        if cfg.entropy_coef == 0.0 or k >= len(self.bonus) or not self.loss[k] or self.bonus[k] == self.loss[k]:
            return cfg
        return dataclasses.replace(cfg, entropy_coef=cfg.entropy_coef * self.bonus[k] / self.loss[k])

    def threshold_fn(self):
        """The fused loss's ``entropy_threshold_fn``: the step's cut, or None (each call's quantile)."""
        return None if self.cut is None else (lambda _entropy, cut=self.cut: cut)

    def with_entropy_cut(self, entropies: list[torch.Tensor], *, info: DistInfo) -> StepWeights:
        """These weights with the entropy mask's cut at the ``1 - top_entropy_quantile`` quantile of the step's token
        entropies (``entropies``: this rank's, one ``[T]`` per micro-batch, under the policy of the update; gathered
        from every rank: call it on every rank), and the bonus shares of the tokens the cut keeps."""
        local = torch.cat([e.detach().float().reshape(-1) for e in entropies])  # [T] of this rank
        every, _ = all_gather_varlen(local, info=info)  # [T over all ranks]
        cut = quantile(every, 1.0 - self.config.top_entropy_quantile) if every.numel() else 0.0
        at = torch.tensor(cut, dtype=torch.float32)  # compared in fp32, as the loss compares
        kept = [int((e.detach().float() >= at).sum()) for e in entropies]
        total = sum_across_ranks([sum(kept)], info=info)[0]
        return dataclasses.replace(self, cut=cut, bonus=[n / total if total else 0.0 for n in kept])


def step_weights(
    config: LossConfig, batches: list[PackedBatch], *, num_passes: int, mu: int, info: DistInfo
) -> StepWeights:
    """The weights of this rank's ``batches`` (then ``num_passes - len(batches)`` fillers) in a step of ``mu``
    updates under the loss options ``config``, from the step's token and sequence counts over every rank
    (all-reduced: call it on every rank)."""
    counts = global_counts(
        num_tokens=sum(b.num_tokens for b in batches), num_seqs=sum(b.num_seqs for b in batches), info=info
    )
    loss = [
        loss_weight(
            config.loss_agg,
            num_tokens=b.num_tokens,
            num_seqs=b.num_seqs,
            total_tokens=counts.tokens,
            total_seqs=counts.seqs,
        )  # fmt: skip
        for b in batches
    ]
    tokens = [b.num_tokens / counts.tokens if counts.tokens else 0.0 for b in batches]
    fillers = [0.0] * (num_passes - len(batches))
    return StepWeights(config, loss + fillers, [t / mu for t in tokens], tokens)


def quantile(x: torch.Tensor, q: float) -> float:
    """``torch.quantile(x, q)`` (linear interpolation) of a non-empty ``x [n]``, in float64, for any ``n`` (torch's
    stops at 2^24 elements) and independent of the order of ``x``."""
    values = x.detach().double().sort().values  # [n]
    pos = q * (values.numel() - 1)
    low, high = math.floor(pos), math.ceil(pos)
    return float(values[low] + (values[high] - values[low]) * (pos - low))
