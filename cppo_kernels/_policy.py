"""The per-token policy math of the loss, shared by every loss path: ratio, the surrogate (clip, CISPO, SAPO,
VESPO), dual clip and ``delta``, the KL estimators (optionally bias-corrected), the off-policy and entropy masks,
importance weights, aggregation, the entropy bonus and metrics, elementwise on the packed fp32 per-token log-probs
(O(T), no vocabulary dimension), and the per-token gradient that lets the gradient-in-forward path of
:func:`cppo_kernels.fused_cppo_loss` compute ``d loss / d logp_t`` before the loss exists.

Two exponentials are clamped, as verl does (``core_algos.compute_policy_loss`` and its ``low_var_kl``): the
log-ratio ``logp - old`` (the sequence's mean for GSPO) before ``exp`` and the k3 exponent ``ref - logp``, both to
``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND] = [-20, 20]``. In-range values are bit-identical to the unclamped formulas
(TRL clamps nothing); beyond, ``exp`` would reach fp32's overflow at 88.7 and ``0 * inf`` would turn a clipped
token's zero gradient, or the whole loss of an ``A = 0`` group, into NaN. A clamped token has the loss of the bound
and a zero gradient through the clamped term (the gradient of ``torch.clamp``); verl also clamps the k3 value
itself to ``[-10, 10]``; we do not: with its exponent bounded k3 stays below ``e^20`` and in-range values stay exact.

Each token's policy term and its KL term are bounded to ``[-TERM_BOUND, TERM_BOUND] = [-1e30, 1e30]``, and the
aggregation weighs each term before summing (weights that sum to at most 1): the loss stays finite for any finite
input, advantages of 1e38 included (``ratio * A`` would overflow fp32 there). Terms inside the bound are exact; a
bounded term has the bound's value and no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ._carriers import LossInputs
from .config import LossConfig

#: ``entropy_threshold_fn``: the call's detached fp32 token entropies ``[T]`` -> the entropy mask's cut.
ThresholdFn = Callable[[Tensor], "Tensor | float"]

__all__ = [
    "LOG_RATIO_BOUND",
    "TERM_BOUND",
    "Batch",
    "batch_constants",
    "token_terms",
    "token_grad",
    "token_weights",
    "aggregate",
    "policy_terms",
    "sequence_slice",
    "policy_loss",
    "metrics",
]

#: Bound of the clamped log-ratio and of the k3 exponent (verl's; see the module docstring).
LOG_RATIO_BOUND = 20.0
#: Bound of each token's policy term and KL term (see the module docstring).
TERM_BOUND = 1e30
#: VESPO's lower clamp of a sequence's log-ratio and of a log importance weight: log(1e-8), as TRL's.
VESPO_LOG_W_MIN = math.log(1e-8)


class Batch(NamedTuple):
    """The per-token constants of a packed batch, detached: the policy loss treats them as data, never as
    something to differentiate (``advantages``, ``old_logprobs``, ``ref_logprobs``, the importance weights and the
    sampling log-probs get no gradient)."""

    adv: Tensor  # [T] the advantage of each token's sequence
    seq_adv: Tensor  # [S]
    old: Tensor | None  # [T]
    ref: Tensor | None  # [T]
    seq_of: Tensor  # [T] int64 sequence index of each token
    lengths: Tensor  # [S] int64 tokens per sequence
    num_seqs: int
    weight: Tensor | None = None  # [T] importance weight of each token (a sequence's, repeated, when per sequence)
    log_weight_sums: Tensor | None = None  # [S] VESPO: each sequence's sum of clamped log importance weights
    sampling: Tensor | None = None  # [T] log-probs of the sampler (the off-policy mask; default: old)


def batch_constants(inputs: LossInputs, num_tokens: int, *, weights_per_seq: bool = False) -> Batch:
    """The :class:`Batch` of the packed ``inputs`` (:class:`cppo_kernels._carriers.LossInputs`: per-sequence
    ``advantages [S]`` / ``cu_seqlens [S+1]``, per-token ``old_logprobs`` / ``ref_logprobs`` / ``sampling_logprobs
    [T]`` and ``importance_weights``, ``[T]`` per token or ``[S]`` per sequence with ``weights_per_seq``; the targets
    are not read), in fp32."""
    num_seqs = inputs.advantages.numel()
    lengths = (inputs.cu_seqlens[1:] - inputs.cu_seqlens[:-1]).to(torch.long)  # [S]
    # output_size: no device sync to size the result (this runs on the training hot path).
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=lengths.device), lengths, output_size=num_tokens)

    def fp32(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.detach().to(torch.float32)

    weight = log_sums = None
    if inputs.importance_weights is not None:
        w = fp32(inputs.importance_weights)  # [T] or [S]
        log_w = torch.log(w).clamp(VESPO_LOG_W_MIN, LOG_RATIO_BOUND)
        if not weights_per_seq:
            weight = w
            log_sums = torch.zeros(num_seqs, device=w.device).index_add(0, seq_of, log_w)  # [S]
        else:
            weight, log_sums = w[seq_of], log_w
    adv = fp32(inputs.advantages)  # [S]
    return Batch(
        adv[seq_of], adv, fp32(inputs.old_logprobs), fp32(inputs.ref_logprobs), seq_of, lengths, num_seqs,
        weight, log_sums, fp32(inputs.sampling_logprobs),
    )  # fmt: skip


def _seq_sum(x: Tensor, batch: Batch) -> Tensor:
    """``[T] -> [S]``: each sequence's sum of ``x``."""
    return torch.zeros(batch.num_seqs, dtype=x.dtype, device=x.device).index_add(0, batch.seq_of, x)  # [S]


def _seq_mean(x: Tensor, batch: Batch) -> Tensor:
    """``[T] -> [S]``: each sequence's mean of ``x`` (0 for an empty sequence)."""
    return _seq_sum(x, batch) / batch.lengths.clamp(min=1).to(x.dtype)


def _clamp(x: Tensor) -> Tensor:
    return x.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _bounded(x: Tensor) -> Tensor:
    return x.clamp(-TERM_BOUND, TERM_BOUND)


def _inside(x: Tensor) -> Tensor:
    """Where the gradient passes :func:`_clamp` (``torch.clamp`` passes it at the bounds themselves)."""
    return (x >= -LOG_RATIO_BOUND) & (x <= LOG_RATIO_BOUND)


def _kl(logp: Tensor, ref: Tensor, estimator: str) -> Tensor:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    d = _clamp(ref - logp)
    return torch.exp(d) - d - 1.0


def _surrogate(logp: Tensor, ratio: Tensor, adv: Tensor, cfg: LossConfig, phi: Tensor | None) -> Tensor:
    """The policy term of each token (before its bound): see ``surrogate`` in :class:`LossConfig`."""
    if cfg.surrogate == "cispo":
        return -_bounded(torch.clamp(ratio, max=cfg.eps_high).detach() * adv) * logp
    if cfg.surrogate == "sapo":
        tau = torch.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)  # [n]
        return -(torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau) * adv
    if cfg.surrogate == "vespo":
        return -_bounded(phi * adv) * logp
    unclipped = ratio if cfg.delta is None else torch.clamp(ratio, max=cfg.delta)
    clipped = torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.eps_high)
    pg = -torch.minimum(unclipped * adv, clipped * adv)  # [n]
    if cfg.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -cfg.dual_clip * adv), pg)
    return pg


def token_terms(
    logp: Tensor,
    adv: Tensor,
    old: Tensor | None,
    ref: Tensor | None,
    cfg: LossConfig,
    log_ratio: Tensor | None = None,
    *,
    weight: Tensor | None = None,
    phi: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(per-token loss, ratio, kl or None)`` of the tokens ``logp [n]`` (differentiable or not) with advantages
    ``adv [n]`` and ``old`` / ``ref [n]`` (``old = logp.detach()`` when None; ``kl`` needs ``ref``).

    ``log_ratio``: the tokens' log-ratios when not ``logp - old`` (GSPO: the sequence's mean). Per token:
    ``r = exp(clamp(log_ratio))``, the ``surrogate``'s policy term (``phi [n]``: VESPO's weights), bounded, times
    ``weight [n]`` (masks and importance weights, detached) and bounded again, plus ``beta * kl`` (k3 with its
    exponent clamped; times ``r`` with ``use_bias_correction_kl``), bounded.
    """
    if log_ratio is None:
        log_ratio = logp - (logp.detach() if old is None else old)  # [n]
    ratio = torch.exp(_clamp(log_ratio))  # [n]
    pg = _bounded(_surrogate(logp, ratio, adv, cfg, phi))  # [n]
    if weight is not None:
        pg = _bounded(pg * weight)
    kl = None if ref is None else _kl(logp, ref, cfg.kl_estimator)  # [n]
    if kl is not None and cfg.use_bias_correction_kl:
        kl = kl * ratio
    per_token = pg + _bounded(cfg.beta * kl) if kl is not None and cfg.beta > 0 else pg
    return per_token, ratio, kl


def _min_share(x: Tensor, y: Tensor) -> Tensor:
    """The share of ``torch.minimum(x, y)``'s gradient that goes to ``x``: 1, 0, or 1/2 on a tie (torch's rule)."""
    return torch.where(x < y, 1.0, torch.where(x == y, 0.5, 0.0))


def _within(x: Tensor) -> Tensor:
    """Where the gradient passes :func:`_bounded`."""
    return (x >= -TERM_BOUND) & (x <= TERM_BOUND)


def token_grad(logp: Tensor, adv: Tensor, old: Tensor | None, ref: Tensor | None, cfg: LossConfig) -> Tensor:
    """``d per-token loss / d logp`` of :func:`token_terms` with token-level importance sampling and the options of
    ``cfg.plain`` (no weight), analytically and elementwise: what autograd gives through :func:`token_terms`,
    torch's subgradient conventions included (a clamp passes the gradient at its bounds, ``minimum`` splits it on
    ties)."""
    log_ratio = torch.zeros_like(logp) if old is None else logp - old  # [n]
    ratio = torch.exp(_clamp(log_ratio))  # [n]
    lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.eps_high
    a, b = ratio * adv, torch.clamp(ratio, lo, hi) * adv  # the two surrogates
    passes = ((ratio >= lo) & (ratio <= hi)).to(ratio.dtype)  # the clip's own gradient
    d_min = adv * (_min_share(a, b) + _min_share(b, a) * passes)  # d min(a, b) / d ratio
    pg = -torch.minimum(a, b)  # [n]
    grad = -d_min * torch.where(_inside(log_ratio), ratio, 0.0)  # [n] d pg / d logp
    if cfg.dual_clip is not None:
        cap = -cfg.dual_clip * adv
        grad = torch.where(adv < 0, grad * _min_share(pg, cap), grad)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    grad = torch.where(_within(pg), grad, 0.0)
    if ref is not None and cfg.beta > 0:
        if cfg.kl_estimator == "k1":
            d_kl = torch.ones_like(logp)
        elif cfg.kl_estimator == "k2":
            d_kl = logp - ref
        else:
            d = ref - logp
            d_kl = torch.where(_inside(d), 1.0 - torch.exp(_clamp(d)), 0.0)
        grad = grad + torch.where(_within(cfg.beta * _kl(logp, ref, cfg.kl_estimator)), cfg.beta * d_kl, 0.0)
    return grad


def token_weights(batch: Batch, cfg: LossConfig) -> Tensor:
    """``[T]``: ``d loss / d per-token loss`` of :func:`aggregate` (counts known before any log-prob)."""
    num_tokens, num_seqs = batch.seq_of.numel(), max(batch.num_seqs, 1)
    device = batch.seq_of.device
    if cfg.loss_agg == "token-mean":
        return torch.full((num_tokens,), 1.0 / max(num_tokens, 1), device=device)
    if cfg.loss_agg == "seq-mean-token-mean":
        return (1.0 / num_seqs) / batch.lengths.clamp(min=1).to(torch.float32)[batch.seq_of]
    if cfg.loss_agg == "seq-mean-token-sum":
        return torch.full((num_tokens,), 1.0 / num_seqs, device=device)
    return torch.full((num_tokens,), 1.0 / (num_seqs * cfg.max_completion_length), device=device)


def aggregate(per_token: Tensor, batch: Batch, cfg: LossConfig) -> Tensor:
    """The scalar loss of ``per_token [T]``: ``token-mean`` (sum / T), ``seq-mean-token-mean`` (mean over sequences
    of each sequence's token mean), ``seq-mean-token-sum-norm`` (sum / (S * max_completion_length)) or
    ``seq-mean-token-sum`` (sum / S), each token weighed before the sum (:func:`token_weights`), so that the sum
    of bounded terms stays finite; 0 for empty sequences and batches, never NaN."""
    return (per_token * token_weights(batch, cfg)).sum()


def _quantile(x: Tensor, q: float) -> Tensor:
    """``torch.quantile(x, q)`` (linear interpolation) of a non-empty ``x [n]``, also beyond its 2^24 elements."""
    if x.numel() <= 2**24:
        return torch.quantile(x, q)
    ordered = torch.sort(x).values
    pos = q * (x.numel() - 1)
    low = int(math.floor(pos))
    high = min(low + 1, x.numel() - 1)
    return torch.lerp(ordered[low], ordered[high], pos - low)


def entropy_mask(entropy: Tensor, cfg: LossConfig, threshold_fn: ThresholdFn | None = None) -> Tensor | None:
    """``[T]`` float 0/1: the tokens whose entropy is at least the ``1 - top_entropy_quantile`` quantile of the
    call's tokens (TRL's ``get_high_entropy_mask``), or at least what ``threshold_fn`` returns for them (e.g. that
    quantile over every process's tokens); None with ``top_entropy_quantile=1``."""
    if cfg.top_entropy_quantile >= 1.0:
        return None
    h = entropy.detach().float()  # [T]
    if threshold_fn is not None:  # called on every call, an empty one included: a gathering caller stays in step
        return (h >= _threshold(threshold_fn(h))).to(torch.float32)
    if h.numel() == 0:
        return h
    return (h >= _quantile(h, 1.0 - cfg.top_entropy_quantile)).to(torch.float32)


def _threshold(cut) -> Tensor:
    """An ``entropy_threshold_fn``'s result as an fp32 scalar, or a ValueError saying what came back."""
    message = "entropy_threshold_fn must return one finite number (a float, a 1-element tensor), got"
    try:
        value = torch.as_tensor(cut.detach() if isinstance(cut, Tensor) else cut, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{message} {type(cut).__name__} {cut!r:.60}") from None
    if value.numel() != 1 or not bool(torch.isfinite(value).all()):
        shown = tuple(value.shape) if value.numel() != 1 else float(value)
        raise ValueError(f"{message} {shown}")
    return value.reshape(())


def check_threshold_fn(fn, cfg: LossConfig) -> None:
    """``entropy_threshold_fn`` is None, or a callable given with ``top_entropy_quantile < 1`` (else it would
    change nothing: a ValueError, not a silent no-op)."""
    if fn is None:
        return
    if not callable(fn):
        raise ValueError(f"entropy_threshold_fn must be callable (entropies [T] -> cut), got {type(fn).__name__}")
    if cfg.top_entropy_quantile >= 1.0:
        raise ValueError(
            "entropy_threshold_fn sets the cut of the entropy mask, which top_entropy_quantile=1.0 turns off: give "
            "top_entropy_quantile < 1, or no entropy_threshold_fn"
        )


def off_policy_mask(logp: Tensor, batch: Batch, cfg: LossConfig) -> Tensor | None:
    """``[T]`` float 0/1: 0 on the tokens of every sequence with ``A < 0`` whose mean of ``sampling - logp`` (NaN
    counted as 0; sampling: ``sampling_logprobs``, else ``old_logprobs``, else ``logp``) exceeds
    ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence mask); None when the mask is off."""
    if cfg.off_policy_mask_threshold is None:
        return None
    lp = logp.detach()
    sampling = batch.sampling if batch.sampling is not None else batch.old if batch.old is not None else lp
    kl = torch.nan_to_num(sampling - lp, nan=0.0)  # [T]
    keep_seq = _seq_mean(kl, batch) <= cfg.off_policy_mask_threshold  # [S]
    return ((batch.adv >= 0) | keep_seq[batch.seq_of]).to(torch.float32)


def vespo_weights(log_ratio: Tensor, batch: Batch, cfg: LossConfig) -> Tensor:
    """``[S]``: VESPO's detached gamma weight ``phi = exp(lambda + k log w - lambda w)`` of each sequence,
    ``log w`` the sequence's sum of the tokens' log-ratios (each clamped to [-20, 20]) plus its log importance
    weights, clamped to ``[log 1e-8, 20]``; ``(k, lambda)`` by the sign of A (``>= 0``: the ``_pos`` pair);
    ``lambda >= 1e-4``; an overflowing or undefined ``phi`` is 0 (TRL's ``get_gamma_weights``)."""
    with torch.no_grad():
        log_w = _seq_sum(_clamp(log_ratio.detach()), batch)  # [S]
        if batch.log_weight_sums is not None:
            log_w = log_w + batch.log_weight_sums
        log_w = log_w.clamp(VESPO_LOG_W_MIN, LOG_RATIO_BOUND)  # [S]
        pos = batch.seq_adv >= 0  # [S]
        k = torch.where(pos, cfg.vespo_k_pos, cfg.vespo_k_neg)
        lam = torch.where(pos, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def token_mask(
    logp: Tensor, entropy: Tensor | None, batch: Batch, cfg: LossConfig, threshold_fn: ThresholdFn | None = None
) -> tuple[Tensor | None, ...]:
    """``(weight, entropy_mask)``: the detached ``[T]`` factor of the policy terms (off-policy mask, entropy mask,
    and the importance weights but for VESPO, which takes them into its gamma weights), or None when it is 1; and
    the entropy mask alone (None without ``top_entropy_quantile``)."""
    ent = None if entropy is None else entropy_mask(entropy, cfg, threshold_fn)
    factors = [off_policy_mask(logp, batch, cfg), ent]
    if cfg.surrogate != "vespo":
        factors.append(batch.weight)
    weight = None
    for f in factors:
        if f is not None:
            weight = f if weight is None else weight * f
    return weight, ent


def entropy_bonus(entropy: Tensor, ent_mask: Tensor | None, cfg: LossConfig) -> Tensor:
    """``entropy_coef`` times the mean entropy of the tokens of ``ent_mask`` (all tokens when None), bounded;
    differentiable through ``entropy``. 0 without tokens."""
    num = entropy.numel()
    if ent_mask is None:
        mean = (entropy * (1.0 / max(num, 1))).sum()
    else:
        mean = (entropy * (ent_mask / ent_mask.sum().clamp(min=1.0))).sum()
    return _bounded(cfg.entropy_coef * mean)


def policy_terms(
    logp: Tensor, batch: Batch, cfg: LossConfig, entropy: Tensor | None = None, threshold_fn: ThresholdFn | None = None
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """``(per_token, ratio, kl, phi, entropy_mask)`` of :func:`policy_loss` before its aggregation: each token's
    term (differentiable in ``logp [T]``) after the sequence's log-ratio (``importance_sampling="sequence"``), VESPO's
    gamma weight ``phi [S]`` and the masks, from the sequences of ``batch`` alone (gradient-in-forward calls it on
    chunks of whole sequences)."""
    token_log_ratio = logp - (logp.detach() if batch.old is None else batch.old)  # [T]
    log_ratio = None
    if cfg.importance_sampling == "sequence":
        log_ratio = _seq_mean(token_log_ratio, batch)[batch.seq_of]
    phi = vespo_weights(token_log_ratio, batch, cfg) if cfg.surrogate == "vespo" else None  # [S]
    weight, ent_mask = token_mask(logp, entropy, batch, cfg, threshold_fn)
    per_token, ratio, kl = token_terms(
        logp, batch.adv, batch.old, batch.ref, cfg, log_ratio, weight=weight,
        phi=None if phi is None else phi[batch.seq_of],
    )  # fmt: skip
    return per_token, ratio, kl, phi, ent_mask


def sequence_slice(batch: Batch, s0: int, s1: int, start: int, stop: int) -> Batch:
    """The :class:`Batch` of sequences ``s0:s1``, which hold exactly the tokens ``start:stop``."""
    rows = slice(start, stop)

    def part(x: Tensor | None, r) -> Tensor | None:
        return None if x is None else x[r]

    return Batch(
        batch.adv[rows], batch.seq_adv[s0:s1], part(batch.old, rows), part(batch.ref, rows), batch.seq_of[rows] - s0,
        batch.lengths[s0:s1], s1 - s0, part(batch.weight, rows), part(batch.log_weight_sums, slice(s0, s1)),
        part(batch.sampling, rows),
    )  # fmt: skip


def policy_loss(
    logp: Tensor,
    batch: Batch,
    *,
    entropy: Tensor | None,
    config: LossConfig,
    entropy_threshold_fn: ThresholdFn | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The CPPO/GRPO policy loss from per-token log-probs in the packed layout (inputs already validated), with
    gradients by autograd to ``logp`` (and to ``entropy`` with ``entropy_coef``) only.

    ``logp [T]`` fp32 (differentiable), ``batch`` the per-token constants of :func:`batch_constants`, ``entropy
    [T]`` (given when ``config.needs_entropy``): the per-token terms of :func:`token_terms` (with
    ``importance_sampling="sequence"`` every token of s uses the mean log-ratio of s) times the masks and weights of
    :func:`token_mask`, aggregated by :func:`aggregate`, minus the :func:`entropy_bonus`.

    Returns ``(loss, metrics)``: the fp32 scalar loss and the detached fp32 scalars of :func:`metrics`.
    """
    cfg = config
    per_token, ratio, kl, phi, ent_mask = policy_terms(logp, batch, cfg, entropy, entropy_threshold_fn)
    loss = aggregate(per_token, batch, cfg)
    out = metrics(logp, ratio, batch, kl, entropy, cfg, policy=loss, phi=phi, ent_mask=ent_mask)
    if cfg.entropy_coef != 0.0:
        loss = loss - entropy_bonus(entropy, ent_mask, cfg)
    return loss, out


@torch.no_grad()
def metrics(
    logp: Tensor,
    ratio: Tensor,
    batch: Batch,
    kl: Tensor | None,
    entropy: Tensor | None,
    cfg: LossConfig,
    *,
    policy: Tensor,
    phi: Tensor | None = None,
    ent_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Detached fp32 scalars: the mean ``kl`` (0 without reference log-probs; bias-corrected with
    ``use_bias_correction_kl``), the fractions of tokens whose ratio is clipped below (``A < 0``) and above
    (``A > 0``), ``ratio_mean/min/max`` (1 when there are no tokens), ``num_tokens``, ``policy_loss`` (the loss
    without the entropy bonus), the mean ``entropy`` when the loss computes it, ``cispo_clip_fraction`` (ratio
    above ``epsilon_high`` with ``A > 0``) for CISPO, ``vespo_phi_mean`` (mean over sequences) for VESPO; with
    ``importance_sampling="sequence"`` the same clip fractions over the sequences of ``batch`` (one ratio each, an
    empty sequence's ``exp(0) = 1``): ``seq_clip_fraction_low`` / ``_high`` and for CISPO ``seq_cispo_clip_fraction``;
    with the entropy mask ``ent_mask`` (``top_entropy_quantile < 1``) the fraction of tokens it keeps,
    ``entropy_mask_fraction``, and their mean entropy, ``entropy_masked_mean`` (0 without such tokens: what the
    entropy bonus rewards, and TRL's adaptive entropy controller measures)."""
    num_tokens = logp.numel()
    denom = max(num_tokens, 1)
    r, adv = ratio.detach(), batch.adv  # [T]
    out = {
        "kl": (kl.detach().sum() / denom) if kl is not None else logp.new_zeros(()),
        "clip_fraction_low": ((r < 1.0 - cfg.epsilon_low) & (adv < 0)).sum() / denom,
        "clip_fraction_high": ((r > 1.0 + cfg.eps_high) & (adv > 0)).sum() / denom,
        "ratio_mean": r.sum() / denom if num_tokens else logp.new_ones(()),
        "ratio_min": r.min() if num_tokens else logp.new_ones(()),
        "ratio_max": r.max() if num_tokens else logp.new_ones(()),
        "num_tokens": logp.new_tensor(float(num_tokens)),
        "policy_loss": policy.detach(),
    }
    if cfg.needs_entropy:
        out["entropy"] = entropy.detach().sum() / denom
    if cfg.surrogate == "cispo":
        out["cispo_clip_fraction"] = ((r > cfg.eps_high) & (adv > 0)).sum() / denom
    if phi is not None:  # [S]
        out["vespo_phi_mean"] = phi.sum() / max(phi.numel(), 1)
    if cfg.importance_sampling == "sequence":  # each sequence's one ratio (its tokens all carry it)
        seq_r = torch.ones(batch.num_seqs, dtype=r.dtype, device=r.device).scatter(0, batch.seq_of, r)  # [S]
        seq_adv, seqs = batch.seq_adv, max(batch.num_seqs, 1)
        out["seq_clip_fraction_low"] = ((seq_r < 1.0 - cfg.epsilon_low) & (seq_adv < 0)).sum() / seqs
        out["seq_clip_fraction_high"] = ((seq_r > 1.0 + cfg.eps_high) & (seq_adv > 0)).sum() / seqs
        if cfg.surrogate == "cispo":
            out["seq_cispo_clip_fraction"] = ((seq_r > cfg.eps_high) & (seq_adv > 0)).sum() / seqs
    if ent_mask is not None:  # [T]
        kept = ent_mask.sum()
        out["entropy_mask_fraction"] = kept / denom
        out["entropy_masked_mean"] = (entropy.detach() * ent_mask).sum() / kept.clamp(min=1.0)
    return {k: v.to(torch.float32) for k, v in out.items()}
