"""Naive oracles of every public op, for the tests: written from the stated semantics, apart from the production code.

Nothing here is on a production path and nothing here is imported by one: an oracle that shares code with what it
checks cannot catch that code's bugs. Plain loops over groups and sequences, statistics in exact rational arithmetic
(``fractions``), the loss from the full ``[T, V]`` logits. No input validation (that is the public ops' job): the
inputs are assumed valid. The loss oracles compute in the dtype of their inputs, so pass float64 tensors. Shared
with the production code: declarations, no logic (the loss's tensors and the selection's options, of
``cppo_kernels._carriers``).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._carriers import (
    ADVANTAGE_FIELDS,
    SELECT_FIELDS,
    LossInputs,
    SelectOptions,
    takes_advantage_options,
    takes_cppo_select_options,
    takes_loss_inputs,
    takes_select_options,
)
from .config import MAX_VARIANCE_RTOL, LossConfig, loss_config

__all__ = [
    "group_advantages",
    "select_completions",
    "cppo_select",
    "max_variance_subset",
    "token_logprobs",
    "policy_loss",
    "fused_cppo_loss",
]


# --------------------------------------------------------------------------------------------
# Advantages and selection
# --------------------------------------------------------------------------------------------


def _pow2(values: list[float]) -> float:
    """The power of two at or below the largest magnitude in ``values`` (1.0 for all zeros)."""
    top = max(abs(v) for v in values)
    return math.ldexp(1.0, math.frexp(top)[1] - 1) if top > 0 else 1.0


def _std(values: list[Fraction], ddof: int) -> float:
    """Std of ``values`` with ``ddof`` (0 over at most ``ddof`` values): exact variance, one rounding."""
    if len(values) <= ddof:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(float(sum((v - mean) ** 2 for v in values) / (len(values) - ddof)))


@takes_advantage_options
def group_advantages(rewards: Tensor, group_size: int, *, options: SelectOptions) -> Tensor:
    """fp32 ``[N]``: ``(r - mean_g) / (std + eps)`` group by group.

    ``std`` is the group's (``scale="group"``), the whole batch's (``"batch"``), or the division is skipped
    (``"none"``: values beyond fp32's range saturate at its largest finite value); Bessel's correction with
    ``unbiased``. A group of equal rewards gets exactly 0. Exact rational arithmetic (``fractions``), in units of a
    power of two (the group's largest magnitude, the batch's for ``"batch"``) so that every float conversion fits.
    """
    scale, eps, ddof = options.scale, options.eps, 1 if options.unbiased else 0
    values = rewards.detach().to(torch.float64).tolist()
    fp32_max = float(torch.finfo(torch.float32).max)
    if scale == "batch" and values:
        unit = _pow2(values)
        batch_std = _std([Fraction(v) / Fraction(unit) for v in values], ddof)
    out = []
    for start in range(0, len(values), group_size):
        group = values[start : start + group_size]
        if max(group) == min(group):
            out += [0.0] * len(group)
            continue
        if scale != "batch":
            unit = _pow2(group)
        exact = [Fraction(v) / Fraction(unit) for v in group]
        mean = sum(exact) / len(exact)
        if scale == "none":
            out += [min(max(float(r - mean) * unit, -fp32_max), fp32_max) for r in exact]
        else:
            std = _std(exact, ddof) if scale == "group" else batch_std
            out += [float(r - mean) / (std + eps / unit) for r in exact]
    return torch.tensor(out, dtype=torch.float64).to(torch.float32).to(rewards.device)


@takes_select_options
def select_completions(advantages: Tensor, group_size: int, options: SelectOptions) -> Tensor:
    """Ascending int64 indices of the ``keep`` best completions of each group (``scope="group"``) or the
    ``keep * num_groups`` (else ``num_kept``) best of the batch (``"batch"``); best = highest score, then lowest
    index.

    Scores: ``|A|`` rounded to fp32 (``"smallest"``), ``-|A|`` (``"largest"``), or one fp32 uniform draw per
    completion from ``generator`` on the advantages' device (``"random"``, drawn even when nothing is kept).
    ``"max-variance"`` (``scope="group"``): :func:`max_variance_subset` of each group's advantages.
    """
    n, keep, metric = advantages.numel(), options.keep, options.metric
    if metric == "max-variance":
        values = _fp32_values(advantages)
        starts = range(0, n, group_size)
        kept = [q + i for q in starts for i in max_variance_subset(values[q : q + group_size], keep)]
        return torch.tensor(kept, dtype=torch.long, device=advantages.device)
    if metric == "random":
        scores = torch.rand(n, generator=options.generator, device=advantages.device, dtype=torch.float32).tolist()
    else:
        sign = 1.0 if metric == "smallest" else -1.0
        scores = [sign * abs(a) for a in advantages.detach().to(torch.float32).tolist()]

    def best(indices: range) -> list[int]:
        return sorted(indices, key=lambda i: (-scores[i], i))

    num_groups = n // group_size
    if options.scope == "group":
        kept = [i for q in range(num_groups) for i in best(range(q * group_size, (q + 1) * group_size))[:keep]]
    else:
        kept = best(range(n))[: keep * num_groups if options.num_kept is None else options.num_kept]
    return torch.tensor(sorted(kept), dtype=torch.long, device=advantages.device)


def _fp32_values(x: Tensor) -> list[float]:
    """``x`` rounded to fp32, saturating at its largest finite value, with -0.0 read as 0.0."""
    top = float(torch.finfo(torch.float32).max)
    return [v + 0.0 for v in x.detach().to(torch.float64).clamp(-top, top).to(torch.float32).tolist()]


def _ssd(values: list[float]) -> Fraction:
    """Exact sum of squared deviations from the mean (``len * variance``)."""
    exact = [Fraction(v) for v in values]
    mean = sum(exact, Fraction(0)) / max(len(exact), 1)
    return sum(((v - mean) ** 2 for v in exact), Fraction(0))


def max_variance_subset(values: list[float], keep: int, *, exhaustive: bool = False) -> list[int]:
    """Ascending indices of the ``keep`` of ``values`` whose variance is largest (PODS' max-variance down-sampling).

    The scan: with the values sorted (highest first), candidate ``i`` (0..keep) takes the ``i`` highest and the
    ``keep - i`` lowest values; the smallest ``i`` whose variance is within :data:`MAX_VARIANCE_RTOL` (relative) of
    the largest wins, and of equal values the lowest indices are taken. ``exhaustive=True`` searches every
    ``keep``-subset instead (small inputs only): among those within the tolerance of the largest variance, the
    smallest sum of values, then the lexicographically smallest indices; the two agree when the tolerance separates
    no values (the optimum always has the scan's form).
    """
    n = len(values)
    if exhaustive:
        subsets = list(itertools.combinations(range(n), keep))
        ssd = [_ssd([values[p] for p in s]) for s in subsets]
        top = max(ssd)
        tied = [s for s, v in zip(subsets, ssd, strict=True) if v >= top * (1 - Fraction(MAX_VARIANCE_RTOL))]
        return list(min(tied, key=lambda s: (sum(Fraction(values[p]) for p in s), s)))
    order = sorted(range(n), key=lambda p: (-values[p], p))
    candidates = [order[:i] + order[n - keep + i :] for i in range(keep + 1)]
    ssd = [_ssd([values[p] for p in c]) for c in candidates]
    top = max(ssd)
    best = next(c for c, v in zip(candidates, ssd, strict=True) if v >= top * (1 - Fraction(MAX_VARIANCE_RTOL)))
    taken = Counter(values[p] for p in best)  # how many of each value; of equal values the lowest indices
    kept = []
    for p in range(n):
        if taken[values[p]] > 0:
            taken[values[p]] -= 1
            kept.append(p)
    return kept


@takes_cppo_select_options
def cppo_select(rewards: Tensor, group_size: int, options: SelectOptions) -> tuple[Tensor, Tensor]:
    """``(group_advantages(rewards, ...), select_completions(those fp32 advantages, ...))``."""
    adv = group_advantages(rewards, group_size, **{name: getattr(options, name) for name in ADVANTAGE_FIELDS})
    return adv, select_completions(adv, group_size, **{name: getattr(options, name) for name in SELECT_FIELDS})


# --------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------


def token_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None, logit_scale: float = 1.0,
    logit_softcap: float | None = None, config: LossConfig | None = None, **options: Any,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(logp, entropy)`` of each target under ``softmax(logits / temperature)``, the model's logits
    ``logit_softcap * tanh((hidden @ weight^T + bias) * logit_scale / logit_softcap)`` (no tanh without a cap):
    Gemma 2's forward, the scale first, then the cap; TRL divides the model's logits by the temperature.

    ``hidden [..., H]``, ``weight [V, H]``, ``targets [...]``, from the full logits ``[..., V]``. Differentiable.
    ``temperature``: of ``config`` (a :class:`LossConfig`), or as a keyword (``**options``).
    """
    temperature = loss_config("token_logprobs", config, options, ("temperature",)).temperature
    logits = hidden @ weight.t()  # [..., V]
    if bias is not None:
        logits = logits + bias
    logits = logits * logit_scale
    if logit_softcap is not None:
        logits = torch.tanh(logits / logit_softcap) * logit_softcap
    logp_all = torch.log_softmax(logits / temperature, dim=-1)  # [..., V]
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [...]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [...]
    return logp, entropy


#: The clamp of the log-ratio before its exp and of the k3 exponent (verl's bound, as the production loss).
LOG_RATIO_BOUND = 20.0
#: The bound of each token's policy and KL terms (as the production loss: it keeps fp32 sums finite).
TERM_BOUND = 1e30


def _bound(x: Tensor) -> Tensor:
    return torch.clamp(x, -TERM_BOUND, TERM_BOUND)


def _kl(logp: Tensor, ref: Tensor, estimator: str) -> Tensor:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return (logp - ref) ** 2 / 2
    d = torch.clamp(ref - logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(d) - d - 1


def _gamma_weight(log_ratio: Tensor, log_is: float, adv: float, cfg: LossConfig) -> float:
    """VESPO's weight of one sequence: w = prod_t r_t (each log r_t clamped to +-20) times its importance weights,
    log w clamped to [log 1e-8, 20]; phi(w) = w^k e^{lambda (1 - w)}, (k, lambda) by the sign of A; 0 if it
    overflows."""
    log_w = float(torch.clamp(log_ratio.detach(), -LOG_RATIO_BOUND, LOG_RATIO_BOUND).sum()) + log_is
    log_w = min(max(log_w, math.log(1e-8)), LOG_RATIO_BOUND)
    k, lam = (cfg.vespo_k_pos, cfg.vespo_lambda_pos) if adv >= 0 else (cfg.vespo_k_neg, cfg.vespo_lambda_neg)
    lam = max(lam, 1e-4)
    log_phi = k * log_w + lam * (1 - math.exp(log_w))
    phi = math.exp(log_phi) if log_phi < 88.7 else 0.0  # past fp32's range: 0, as the production loss
    return phi


def _policy_term(lp: Tensor, ratio: Tensor, adv: float, cfg: LossConfig, phi: float) -> Tensor:
    """The surrogate of one sequence's tokens, before masks and weights."""
    if cfg.surrogate == "cispo":
        coef = torch.clamp(ratio.detach(), max=cfg.eps_high) * adv
        return -_bound(coef) * lp
    if cfg.surrogate == "sapo":
        tau = cfg.sapo_temperature_pos if adv > 0 else cfg.sapo_temperature_neg
        return -4 / tau * torch.sigmoid(tau * (ratio - 1)) * adv
    if cfg.surrogate == "vespo":
        return -_bound(torch.tensor(phi * adv, dtype=lp.dtype, device=lp.device)) * lp
    capped = ratio if cfg.delta is None else torch.clamp(ratio, max=cfg.delta)
    loss = -torch.minimum(capped * adv, torch.clamp(ratio, 1 - cfg.epsilon_low, 1 + cfg.eps_high) * adv)
    if cfg.dual_clip is not None and adv < 0:
        loss = torch.minimum(loss, torch.full_like(loss, -cfg.dual_clip * adv))
    return loss


def _sequence_loss(
    lp: Tensor, adv: float, old: Tensor | None, ref: Tensor | None, cfg: LossConfig, factor: Tensor, phi: float
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(per-token loss, ratio, kl or None) of one non-empty sequence: log-probs ``lp``, advantage ``adv``; ``old`` and
    ``ref`` are constants (detached); ``factor``: the tokens' masks times importance weights; ``phi``: VESPO's
    weight."""
    log_ratio = lp - (lp if old is None else old).detach().to(lp.dtype)
    if cfg.importance_sampling == "sequence":
        log_ratio = log_ratio.mean() * torch.ones_like(lp)
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    loss = _bound(_bound(_policy_term(lp, ratio, adv, cfg, phi)) * factor)
    kl = None if ref is None else _kl(lp, ref.detach().to(lp.dtype), cfg.kl_estimator)
    if kl is not None and cfg.use_bias_correction_kl:
        kl = kl * ratio
    if kl is not None and cfg.beta > 0:
        loss = loss + _bound(cfg.beta * kl)
    return loss, ratio.detach(), kl


def _interpolated_quantile(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` by linear interpolation between the order statistics."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class _Inputs(NamedTuple):
    """The per-token and per-sequence tensors of :func:`policy_loss`."""

    logp: Tensor
    advantages: Tensor
    old_logprobs: Tensor | None
    ref_logprobs: Tensor | None
    sampling_logprobs: Tensor | None
    importance_weights: Tensor | None
    weights_per_seq: bool


@dataclass
class _Sums:
    """What the sequences of :func:`policy_loss` add up to, in their order: loss terms, ratios, metric counts."""

    terms: list[Tensor]
    seq_terms: list[Tensor] = field(default_factory=list)
    ratios: list[Tensor] = field(default_factory=list)
    kls: list[Tensor] = field(default_factory=list)
    phis: list[float] = field(default_factory=list)
    seq_ratios: list[float] = field(default_factory=list)
    clipped_low: int = 0
    clipped_high: int = 0
    cispo_clipped: int = 0


def _entropy_flags(logp: Tensor, entropy: Tensor | None, cfg: LossConfig, cut: float | None) -> Tensor:
    """``[T]``: 1 where a token's entropy is at least ``cut`` (default: the (1 - q)-quantile of the call's
    entropies), else 0; all 1 with ``top_entropy_quantile = 1`` or no tokens."""
    ent_flag = torch.ones(logp.numel(), dtype=logp.dtype, device=logp.device)
    if cfg.top_entropy_quantile < 1.0 and logp.numel():
        if cut is None:
            cut = _interpolated_quantile(entropy.detach().double().tolist(), 1.0 - cfg.top_entropy_quantile)
        ent_flag = (entropy.detach().double() >= cut).to(logp.dtype)
    return ent_flag


def _importance(x: _Inputs, s: int, rows: slice, lp: Tensor) -> tuple[Tensor | None, float]:
    """(sequence ``s``'s importance weights per token in ``lp``'s dtype, or None; VESPO's sum of its clamped log
    weights: one per sequence, an empty one's too, as TRL's (B, 1) ratio of an all-masked row)."""
    if x.importance_weights is None:
        return None, 0.0
    weights = x.importance_weights[s].expand(lp.shape) if x.weights_per_seq else x.importance_weights[rows]
    own = (x.importance_weights[s : s + 1] if x.weights_per_seq else x.importance_weights[rows]).detach()
    log_is = float(torch.clamp(torch.log(own.to(lp.dtype)), math.log(1e-8), LOG_RATIO_BOUND).sum())
    return weights.detach().to(lp.dtype), log_is


def _add_sequence(sums: _Sums, x: _Inputs, s: int, rows: slice, ent_flag: Tensor, cfg: LossConfig) -> None:
    """Adds sequence ``s`` (its tokens at ``rows``) to ``sums``."""
    adv = float(x.advantages[s])
    old, ref, sampled = (None if t is None else t[rows] for t in (x.old_logprobs, x.ref_logprobs, x.sampling_logprobs))
    lp = x.logp[rows]
    weights, log_is = _importance(x, s, rows, lp)
    base = (lp if old is None else old).detach().to(lp.dtype)
    phi = _gamma_weight(lp - base, log_is, adv, cfg) if cfg.surrogate == "vespo" else 0.0
    sums.phis.append(phi)
    if rows.start == rows.stop:
        sums.seq_ratios.append(1.0)  # exp(0): an empty sequence's mean log-ratio is 0
        return
    factor = ent_flag[rows].clone()
    if cfg.off_policy_mask_threshold is not None and adv < 0:
        sampler = base if sampled is None else sampled.detach().to(lp.dtype)
        gap = torch.nan_to_num(sampler - lp.detach(), nan=0.0)
        factor = factor * float(gap.mean() <= cfg.off_policy_mask_threshold)
    if weights is not None and cfg.surrogate != "vespo":
        factor = factor * weights
    loss, ratio, kl = _sequence_loss(lp, adv, old, ref, cfg, factor, phi)
    sums.seq_ratios.append(float(ratio[0]))
    sums.terms.append(loss)
    sums.seq_terms.append(loss.sum() / (lp.numel() if cfg.loss_agg == "seq-mean-token-mean" else 1))
    sums.ratios.append(ratio)
    sums.kls += [] if kl is None else [kl.detach()]
    sums.clipped_low += int((ratio < 1 - cfg.epsilon_low).sum()) if adv < 0 else 0  # where the clip is active
    sums.clipped_high += int((ratio > 1 + cfg.eps_high).sum()) if adv > 0 else 0
    sums.cispo_clipped += int((ratio > cfg.eps_high).sum()) if adv > 0 else 0


def _aggregate(sums: _Sums, num_tokens: int, num_seqs: int, cfg: LossConfig) -> Tensor:
    """The loss of the sequences' terms by ``loss_agg`` (before the entropy bonus)."""
    total = torch.cat(sums.terms).sum()
    if cfg.loss_agg == "token-mean":
        return total / max(num_tokens, 1)
    if cfg.loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return (torch.stack(sums.seq_terms).sum() if sums.seq_terms else total) / max(num_seqs, 1)
    return total / (max(num_seqs, 1) * cfg.max_completion_length)


def _metrics(
    sums: _Sums, x: _Inputs, entropy: Tensor | None, ent_flag: Tensor, policy: Tensor, cfg: LossConfig
) -> dict[str, Tensor]:
    """The metrics of :func:`policy_loss` (``policy``: the loss without the entropy bonus, detached)."""
    num_tokens, num_seqs = x.logp.numel(), x.advantages.numel()
    r = torch.cat(sums.ratios) if sums.ratios else x.logp.new_ones(1).detach()
    one = x.logp.new_ones(()).detach()
    metrics = {
        "kl": torch.cat(sums.kls).sum() / max(num_tokens, 1) if sums.kls else 0 * one,
        "clip_fraction_low": sums.clipped_low / max(num_tokens, 1) * one,
        "clip_fraction_high": sums.clipped_high / max(num_tokens, 1) * one,
        "ratio_mean": r.mean(),
        "ratio_min": r.min(),
        "ratio_max": r.max(),
        "num_tokens": num_tokens * one,
        "policy_loss": policy,
    }
    if cfg.needs_entropy:
        metrics["entropy"] = entropy.detach().sum() / max(num_tokens, 1)
    if cfg.surrogate == "cispo":
        metrics["cispo_clip_fraction"] = sums.cispo_clipped / max(num_tokens, 1) * one
    if cfg.surrogate == "vespo":
        metrics["vespo_phi_mean"] = sum(sums.phis) / max(num_seqs, 1) * one
    if cfg.importance_sampling == "sequence":  # the clip fractions over the sequences' ratios
        seq_adv = [float(a) for a in x.advantages]
        pairs, seqs = list(zip(sums.seq_ratios, seq_adv)), max(num_seqs, 1)
        metrics["seq_clip_fraction_low"] = sum(r < 1 - cfg.epsilon_low and a < 0 for r, a in pairs) / seqs * one
        metrics["seq_clip_fraction_high"] = sum(r > 1 + cfg.eps_high and a > 0 for r, a in pairs) / seqs * one
        if cfg.surrogate == "cispo":
            metrics["seq_cispo_clip_fraction"] = sum(r > cfg.eps_high and a > 0 for r, a in pairs) / seqs * one
    if cfg.top_entropy_quantile < 1.0:
        count = float(ent_flag.sum())
        metrics["entropy_mask_fraction"] = count / max(num_tokens, 1) * one
        metrics["entropy_masked_mean"] = (entropy.detach() * ent_flag).sum() / max(count, 1.0)
    return metrics


def policy_loss(
    logp: Tensor, advantages: Tensor, cu_seqlens: Tensor, *, old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None, entropy: Tensor | None = None, config: LossConfig | None = None,
    importance_weights: Tensor | None = None, weights_per_seq: bool = False, sampling_logprobs: Tensor | None = None,
    entropy_threshold: float | None = None, **options: Any,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """The CPPO/GRPO loss and metrics from packed per-token log-probs, one sequence at a time.

    ``logp [T]`` (differentiable), ``advantages [S]``, ``cu_seqlens [S+1]``, ``old_logprobs`` / ``ref_logprobs``
    / ``sampling_logprobs`` / ``entropy [T]`` (``entropy`` differentiable for the entropy bonus),
    ``importance_weights [T]`` (``[S]`` with ``weights_per_seq``). Per token of sequence s: ``d = logp - old``
    (``old = logp.detach()`` when absent; the sequence's mean d for ``importance_sampling="sequence"``),
    ``r = exp(clamp(d, -20, 20))``, the surrogate (clip: ``-min(r' A_s, clip(r) A_s)`` with ``r' = min(r, delta)``,
    at most ``-dual_clip * A_s`` when ``A_s < 0``; cispo: ``-min(r, epsilon_high) A_s logp`` with the coefficient
    constant; sapo: ``-(4 / tau) sigmoid(tau (r - 1)) A_s``; vespo: ``-phi_s A_s logp``), bounded to +-1e30, times
    the sequence's off-policy keep flag (A_s >= 0, or its mean of ``sampling - logp`` at most the threshold), the
    token's entropy flag (entropy at least the (1 - q)-quantile of the call's entropies) and importance weight (not
    for vespo, which multiplies them into w), bounded again; plus ``beta * kl`` (times r with the bias correction),
    bounded. Aggregated over the tokens (token-mean), over each sequence then the sequences (seq-mean-token-mean),
    summed and divided by ``S * max_completion_length`` (seq-mean-token-sum-norm) or by ``S``
    (seq-mean-token-sum); minus ``entropy_coef`` times the mean entropy of the flagged tokens. An empty sequence or
    batch gives 0. ``entropy_threshold``: the entropy flag's cut itself instead of the call's quantile (what a
    caller's ``entropy_threshold_fn`` returned, e.g. the quantile over every process's tokens). ``config``: the
    loss options as a :class:`LossConfig`, or ``**options``: any of its fields by name (as the public loss takes
    them).
    """
    cfg = loss_config("policy_loss", config, options)
    x = _Inputs(logp, advantages, old_logprobs, ref_logprobs, sampling_logprobs, importance_weights, weights_per_seq)
    bounds = cu_seqlens.tolist()
    ent_flag = _entropy_flags(logp, entropy, cfg, entropy_threshold)
    sums = _Sums(terms=[logp[:0]])
    for s in range(advantages.numel()):
        _add_sequence(sums, x, s, slice(bounds[s], bounds[s + 1]), ent_flag, cfg)
    loss = _aggregate(sums, logp.numel(), advantages.numel(), cfg)
    policy = loss.detach()
    if cfg.entropy_coef != 0.0:
        count = float(ent_flag.sum())
        mean_entropy = (entropy * ent_flag).sum() / max(count, 1.0)
        loss = loss - _bound(cfg.entropy_coef * mean_entropy)
    return loss, _metrics(sums, x, entropy, ent_flag, policy, cfg)


def _packed(mask: Tensor, *per_position: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
    """``cu_seqlens [B+1]`` of the set positions of ``mask [B, L]``, and each ``[B, L, ...]`` tensor's rows at them."""
    rows = [mask[b].nonzero().squeeze(-1) for b in range(mask.shape[0])]
    cu = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    packed = [None if x is None else torch.cat([x[b, r] for b, r in enumerate(rows)]) for x in per_position]
    return cu, packed


@takes_loss_inputs
def fused_cppo_loss(
    hidden: Tensor, weight: Tensor, inputs: LossInputs, *, bias: Tensor | None = None, weights_per_seq: bool = False,
    logit_scale: float = 1.0, logit_softcap: float | None = None, config: LossConfig | None = None,
    entropy_threshold: float | None = None, **options: Any,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """:func:`token_logprobs` (full logits, the model's ``logit_scale`` and ``logit_softcap``) then
    :func:`policy_loss`, in the packed (``cu_seqlens``) or padded (``mask [B, L]``) layout of
    :func:`cppo_kernels.fused_cppo_loss`, whose tensors it takes (``importance_weights`` per token, or per sequence
    with ``weights_per_seq``); the loss options as ``config`` (a :class:`LossConfig`) or ``**options``, as there."""
    config = loss_config("fused_cppo_loss", config, options)
    targets, cu_seqlens, weights = inputs.targets, inputs.cu_seqlens, inputs.importance_weights
    per_token = (inputs.old_logprobs, inputs.ref_logprobs, inputs.sampling_logprobs)
    if inputs.mask is not None:  # each per-token tensor (the weights too when per token) at the mask's positions
        token_weights = None if weights_per_seq else weights
        packed = _packed(inputs.mask.bool(), hidden, targets, *per_token, token_weights)
        cu_seqlens, (hidden, targets, *per_token, token_weights) = packed
        weights = weights if weights_per_seq else token_weights
    old, ref, sampling = per_token
    head = dict(bias=bias, logit_scale=logit_scale, logit_softcap=logit_softcap)
    logp, entropy = token_logprobs(hidden, weight, targets, config=config, **head)
    return policy_loss(
        logp, inputs.advantages, cu_seqlens, old_logprobs=old, ref_logprobs=ref, entropy=entropy, config=config,
        importance_weights=weights, weights_per_seq=weights_per_seq, sampling_logprobs=sampling,
        entropy_threshold=entropy_threshold,
    )  # fmt: skip
