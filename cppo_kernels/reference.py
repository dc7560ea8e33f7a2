"""Plain-PyTorch semantics of every public op: the test oracle and the CPU path.

Readable first, fast second. Every function here validates its input the same way the public
ops do, computes in float64 internally where that is cheap, and states its semantics in full.
The loss reference materialises the ``[tokens x vocab]`` logits on purpose: it is the oracle
the fused kernels are checked against, not something to train with.
"""

from __future__ import annotations

import torch

from ._validate import check_grouped_vector
from .config import METRICS, SCALES, SCOPES, LossConfig, check_choice, check_float, check_int

__all__ = [
    "group_advantages",
    "select_completions",
    "cppo_select",
    "check_advantage_args",
    "check_selection_args",
    "check_selection_options",
    "selection_scores",
    "token_logprobs",
    "packed_from_padded",
    "policy_loss",
    "fused_cppo_loss",
]


# --------------------------------------------------------------------------------------------
# Group-normalised advantages
# --------------------------------------------------------------------------------------------


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: str = "group", unbiased: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std + eps) for rewards laid out group after group; fp32 ``[N]``.

    ``scale="group"`` uses each group's std, ``"batch"`` one std over all N rewards (group means
    still per group), ``"none"`` divides by nothing (Dr. GRPO). ``unbiased`` applies Bessel's
    correction; a std over fewer than two values is 0. A group whose rewards are all equal gets
    exactly 0 (not a rounding residue of the mean).
    """
    num_groups = check_advantage_args(rewards, group_size, scale=scale, unbiased=unbiased, eps=eps)
    r = rewards.detach().to(torch.float64).reshape(num_groups, group_size)  # [Q, G]
    mean = r.mean(dim=1, keepdim=True)  # [Q, 1]
    centered = r - mean
    constant = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)  # [Q, 1]
    if scale == "group":
        adv = centered / (_std(r, dim=1, unbiased=unbiased) + eps)  # std [Q, 1]
    elif scale == "batch":
        adv = centered / (_std(r.reshape(1, -1), dim=1, unbiased=unbiased) + eps)  # std [1, 1]
    else:
        adv = centered
    adv = torch.where(constant, torch.zeros_like(adv), adv)  # exact 0, also when eps=0 makes it 0/0
    return adv.reshape(-1).to(torch.float32)


def check_advantage_args(rewards: torch.Tensor, group_size: int, *, scale: str, unbiased: bool, eps: float) -> int:
    """Validates the arguments of :func:`group_advantages`; returns the number of groups."""
    num_groups = check_grouped_vector("rewards", rewards, group_size)
    check_choice("scale", scale, SCALES)
    if not isinstance(unbiased, bool):
        raise ValueError(f"unbiased must be a bool, got {type(unbiased).__name__}")
    check_float("eps", eps, low=0.0)
    return num_groups


def _std(x: torch.Tensor, *, dim: int, unbiased: bool) -> torch.Tensor:
    n = x.shape[dim]
    if n == 0:
        return x.new_zeros(x.shape[:dim] + (1,) + x.shape[dim + 1 :])
    mean = x.mean(dim=dim, keepdim=True)
    ss = ((x - mean) ** 2).sum(dim=dim, keepdim=True)
    denom = n - 1 if unbiased else n
    if denom <= 0:
        return torch.zeros_like(ss)
    return (ss / denom).sqrt()


# --------------------------------------------------------------------------------------------
# Completion selection
# --------------------------------------------------------------------------------------------


def check_selection_args(
    advantages: torch.Tensor, group_size: int, keep: int, scope: str, metric: str, generator
) -> int:
    """Validates the arguments of :func:`select_completions`; returns the number of groups."""
    num_groups = check_grouped_vector("advantages", advantages, group_size)
    check_selection_options(group_size, keep, scope, metric, generator)
    return num_groups


def check_selection_options(group_size: int, keep: int, scope: str, metric: str, generator) -> None:
    """Validates the options of :func:`select_completions` (``group_size`` already checked)."""
    check_int("keep", keep, low=0, high=group_size)
    check_choice("scope", scope, SCOPES)
    check_choice("metric", metric, METRICS)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def selection_scores(advantages: torch.Tensor, metric: str, generator: torch.Generator | None) -> torch.Tensor:
    """The score each completion is kept by (larger is kept first), fp32 ``[N]``.

    ``smallest`` (prune the smallest |A|) scores |A|; ``largest`` scores -|A|; ``random`` scores
    uniform draws from ``generator`` on the advantages' device, so both backends agree.
    """
    if metric == "random":
        return torch.rand(advantages.shape, generator=generator, device=advantages.device, dtype=torch.float32)
    mag = advantages.detach().abs().to(torch.float32)
    return mag if metric == "smallest" else -mag


def select_completions(
    advantages: torch.Tensor,
    group_size: int,
    keep: int,
    *,
    scope: str = "group",
    metric: str = "smallest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Ascending int64 indices of the retained completions.

    The score is |A| for ``metric="smallest"`` (prune the smallest: CPPO's default), -|A| for
    ``"largest"``, a uniform draw for ``"random"``; the highest scores are kept, ties going to
    the lower index. ``scope="group"`` keeps exactly ``keep`` per group; ``"batch"`` keeps
    ``keep * num_groups`` pooled over the whole batch.
    """
    num_groups = check_selection_args(advantages, group_size, keep, scope, metric, generator)
    score = selection_scores(advantages, metric, generator).to(torch.float64)  # [N]
    device = advantages.device
    if keep == 0 or num_groups == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    if scope == "group":
        order = torch.sort(-score.reshape(num_groups, group_size), dim=1, stable=True).indices  # [Q, G]
        offsets = torch.arange(num_groups, device=device).unsqueeze(1) * group_size
        kept = (order[:, :keep] + offsets).reshape(-1)
    else:
        order = torch.sort(-score, stable=True).indices  # [N]
        kept = order[: keep * num_groups]
    return torch.sort(kept).values.to(torch.long)


def cppo_select(
    rewards: torch.Tensor,
    group_size: int,
    keep: int,
    *,
    scale: str = "group",
    unbiased: bool = True,
    eps: float = 1e-4,
    scope: str = "group",
    metric: str = "smallest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(group_advantages(rewards, ...), select_completions(those advantages, ...))`` in one call.

    The advantages are returned for all N completions (fp32 ``[N]``); index them with the
    returned indices to get the retained completions' advantages.
    """
    adv = group_advantages(rewards, group_size, scale=scale, unbiased=unbiased, eps=eps)
    idx = select_completions(adv, group_size, keep, scope=scope, metric=metric, generator=generator)
    return adv, idx


# --------------------------------------------------------------------------------------------
# Policy loss (materialises logits: the oracle for the fused kernels)
# --------------------------------------------------------------------------------------------


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and the entropy of each token's distribution, from full logits.

    ``hidden [T, H]``, ``weight [V, H]``, ``targets [T]``; computed in the promoted dtype of the
    inputs (pass float64 for an oracle). Differentiable.
    """
    logits = hidden @ weight.t()  # [T, V]
    if bias is not None:
        logits = logits + bias
    logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [T, V]
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [T]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [T]
    return logp, entropy


def packed_from_padded(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Maps a padded ``mask [B, L]`` to (flat indices of its valid positions ``[T]``, ``cu_seqlens [B+1]``)."""
    flat = mask.reshape(-1).nonzero().squeeze(-1)  # [T]
    lengths = mask.to(torch.int64).sum(dim=1)  # [B]
    cu = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=mask.device)
    cu[1:] = lengths.cumsum(0)
    return flat, cu


def _kl(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    d = ref - logp
    return torch.exp(d) - d - 1.0


def policy_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    config: LossConfig = LossConfig(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The CPPO/GRPO policy loss from per-token log-probs in the packed layout.

    ``logp [T]`` (differentiable), ``advantages [S]``, ``cu_seqlens [S+1]``, ``old_logprobs`` and
    ``ref_logprobs [T]``. Per token t of sequence s:

    - log-ratio ``d = logp - old`` (``old = logp.detach()`` when absent); with
      ``importance_sampling="sequence"`` every token of s uses the mean of d over s instead;
    - ``r = exp(d)``; ``pg = -min(r*A_s, clip(r, 1-eps_low, 1+eps_high)*A_s)``; with ``dual_clip=c``
      ``pg = min(pg, -c*A_s)`` where ``A_s < 0``;
    - plus ``beta * kl`` with kl the k1/k2/k3 estimator of logp against ``ref``;
    - aggregated ``token-mean`` (sum over all tokens / T), ``seq-mean-token-mean`` (mean over
      sequences of each sequence's token mean) or ``seq-mean-token-sum-norm`` (sum over all
      tokens / (S * max_completion_length)). Empty sequences and empty batches give 0, never NaN.
    """
    cfg = config
    dtype = logp.dtype
    num_seqs = advantages.numel()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)  # [S]
    # output_size: no device sync to size the result (this runs on the training hot path).
    seq_of = torch.repeat_interleave(torch.arange(num_seqs, device=logp.device), lengths, output_size=logp.numel())
    seq_len = lengths.clamp(min=1).to(dtype)  # [S]

    def seq_mean(x: torch.Tensor) -> torch.Tensor:  # [T] -> [S], 0 for an empty sequence
        return torch.zeros(num_seqs, dtype=dtype, device=logp.device).index_add(0, seq_of, x) / seq_len

    adv_t = advantages.to(dtype)[seq_of]  # [T]
    old = logp.detach() if old_logprobs is None else old_logprobs.to(dtype)
    log_ratio = logp - old  # [T]
    if cfg.importance_sampling == "sequence":
        log_ratio = seq_mean(log_ratio)[seq_of]
    ratio = torch.exp(log_ratio)  # [T]
    clipped = torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.eps_high)
    pg = -torch.minimum(ratio * adv_t, clipped * adv_t)
    if cfg.dual_clip is not None:
        pg = torch.where(adv_t < 0, torch.minimum(pg, -cfg.dual_clip * adv_t), pg)
    per_token = pg
    kl = None
    if ref_logprobs is not None:
        kl = _kl(logp, ref_logprobs.to(dtype), cfg.kl_estimator)
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * kl
    num_tokens = logp.numel()
    if cfg.loss_agg == "token-mean":
        loss = per_token.sum() / max(num_tokens, 1)
    elif cfg.loss_agg == "seq-mean-token-mean":
        loss = seq_mean(per_token).sum() / max(num_seqs, 1)
    else:
        loss = per_token.sum() / (max(num_seqs, 1) * cfg.max_completion_length)

    with torch.no_grad():
        denom = max(num_tokens, 1)
        r = ratio.detach()
        metrics = {
            "kl": (kl.detach().sum() / denom) if kl is not None else logp.new_zeros(()),
            "clip_fraction_low": ((r < 1.0 - cfg.epsilon_low) & (adv_t < 0)).sum() / denom,
            "clip_fraction_high": ((r > 1.0 + cfg.eps_high) & (adv_t > 0)).sum() / denom,
            "ratio_mean": r.sum() / denom if num_tokens else logp.new_ones(()),
            "ratio_min": r.min() if num_tokens else logp.new_ones(()),
            "ratio_max": r.max() if num_tokens else logp.new_ones(()),
            "num_tokens": logp.new_tensor(float(num_tokens)),
        }
        if cfg.compute_entropy:
            if entropy is None:
                raise ValueError("compute_entropy=True needs the per-token entropy")
            metrics["entropy"] = entropy.detach().sum() / denom
        metrics = {k: v.to(torch.float32) for k, v in metrics.items()}
    return loss.to(torch.float32) if loss.dtype != torch.float64 else loss, metrics


def fused_cppo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: LossConfig = LossConfig(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Naive oracle of :func:`cppo_kernels.fused_cppo_loss`: full logits, then :func:`policy_loss`.

    Accepts the packed (``cu_seqlens``) or padded (``mask``) layout. Computes in the promoted
    dtype of its inputs: pass float64 tensors for an oracle. Validation is the public op's job.
    """
    if mask is not None:
        flat, cu_seqlens = packed_from_padded(mask)
        hidden = hidden.reshape(-1, hidden.shape[-1])[flat]
        targets = targets.reshape(-1)[flat]
        old_logprobs = None if old_logprobs is None else old_logprobs.reshape(-1)[flat]
        ref_logprobs = None if ref_logprobs is None else ref_logprobs.reshape(-1)[flat]
    logp, entropy = token_logprobs(hidden, weight, targets, bias=bias, temperature=config.temperature)
    return policy_loss(
        logp,
        advantages,
        cu_seqlens,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        config=config,
    )
