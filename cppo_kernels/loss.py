"""Fused log-prob + clipped-ratio + KL policy loss from hidden states and the LM-head weight: the public layer.

The public functions validate their input once and convert the padded layout to the packed one
(:mod:`cppo_kernels._loss_inputs`: shape and dtype checks on the host, value checks read back with one host sync;
after the forward, one more on the per-token log-sum-exp, which catches NaN/inf in hidden, weight or bias without
scanning them), then run one of two modes (``MODES``, chosen per call by ``mode=`` or, for ``"auto"``, by the
per-shape-class rule table :data:`MODE_RULES`), each an autograd Function of :mod:`cppo_kernels._loss_autograd`
over the backend module the dispatcher gives for that mode (:func:`cppo_kernels._dispatch.backend_module`):

- two-pass: the per-token log-probs (``_loss_triton``, Triton kernels; ``_loss_torch``, chunked PyTorch; neither
  validates again nor materialises ``[T, V]`` logits), then the O(T) policy math of :mod:`cppo_kernels._policy`
  under autograd; the backward recomputes the logits (4 matmuls in all);
- gradient-in-forward (gradients wanted, no option needing the whole call): the forward computes the gradients
  too, chunk by chunk while the logits are in memory (3 matmuls); ``_loss_torch`` runs it whatever the backend.

The options are the fields of :class:`cppo_kernels.LossConfig` (their one definition, with the defaults): each
public function takes ``config=LossConfig(...)`` or the same options as keywords (``**options``), builds the one
LossConfig of the call with :func:`cppo_kernels.config.loss_config` (validated there, once) and hands it down as it
is; no signature restates a field (tests/kernels/test_loss_options.py checks it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ._carriers import LossInputs, takes_loss_inputs
from ._dispatch import backend_module
from ._loss_autograd import FusedLogProbs, GradInForward
from ._loss_inputs import (
    Checks,
    HeadTransform,
    Packed,
    check_head,
    check_logit_transform,
    check_logits,
    check_targets,
    check_tensor,
    pack,
)
from ._loss_modes import (
    MODE_RULES,
    MODES,
    call_mode,
    check_mode,
    resolve_mode,
    wants_grad,
    whole_sequence_tokens,
)
from ._ops import compiled_logprobs, compiled_loss, implements
from ._policy import ThresholdFn, check_threshold_fn, metrics, policy_loss
from .config import LossConfig, loss_config

__all__ = [
    "fused_cppo_loss",
    "fused_logprobs",
    "cppo_loss_from_logits",
    "FusedCPPOLoss",
    "MODES",
    "MODE_RULES",
    "whole_sequence_tokens",
]


def _policy_loss(p: Packed, logp: Tensor, entropy: Tensor | None, cfg: LossConfig, threshold_fn=None):
    """:func:`cppo_kernels._policy.policy_loss` on the packed per-token log-probs."""
    return policy_loss(logp, p.batch(logp.numel()), entropy=entropy, config=cfg, entropy_threshold_fn=threshold_fn)


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


@takes_loss_inputs
def fused_cppo_loss(
    hidden: Tensor,
    weight: Tensor,
    inputs: LossInputs,
    *,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    entropy_threshold_fn: ThresholdFn | None = None,
    config: LossConfig | None = None,
    mode: str = "auto",
    **options: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CPPO/GRPO policy loss straight from hidden states, never materialising ``[T, V]`` logits.

    Per token t of sequence s: ``logp = log_softmax(z / temperature)[target]`` with the model's own logits
    ``z = logit_softcap * tanh((h W^T + b) * logit_scale / logit_softcap)`` (``(h W^T + b) * logit_scale``
    without a cap: TRL's order, the temperature dividing the model's logits); ratio
    ``r = exp(clamp(logp - old, -20, 20))`` (``old = logp.detach()`` without ``old_logprobs``);
    ``pg = -min(r A_s, clip(r, 1 - epsilon_low, 1 + epsilon_high) A_s)``, capped at ``-dual_clip * A_s`` where
    ``A_s < 0`` (the ``surrogate`` option gives CISPO, SAPO and VESPO instead; ``delta`` caps the unclipped ratio),
    times the off-policy and entropy masks and ``importance_weights`` where set; plus ``beta`` times the KL estimate
    against ``ref_logprobs`` (k3's exponent ``ref - logp`` clamped to ``[-20, 20]`` too; times ``r`` with
    ``use_bias_correction_kl``); aggregated by ``loss_agg``; minus ``entropy_coef`` times the mean entropy. The
    clamps are verl's: in-range values are exact; each token's policy and KL terms are bounded to ``+-1e30``; the
    loss stays finite for any finite input, advantages of 1e38 included (a clamped or bounded term has the bound's
    value and no gradient through it; see :mod:`cppo_kernels._policy`). ``advantages``, ``old_logprobs``,
    ``ref_logprobs``, ``importance_weights`` and ``sampling_logprobs`` are constants: detached, no gradient flows
    into them. Deterministic, and a token's log-prob does not depend on the other tokens of the batch.

    Modes (same results within fp32 rounding): ``"two-pass"`` computes the log-probs in the forward and the
    gradients in the backward, recomputing the logits (4 matmuls); ``"grad-in-forward"`` computes the gradients in
    the forward, chunk by chunk while the logits are in memory, and the backward only scales them (3 matmuls; the
    ``[V, H]`` gradient is then held from the forward on). Gradient-in-forward runs options that need a whole
    sequence (:attr:`LossConfig.sequence_rule`) on the CPU in chunks of whole sequences, none that needs the whole
    call (:attr:`LossConfig.call_rule`), and only when gradients are wanted (grad mode on and hidden, weight or bias
    requiring grad): otherwise nothing beyond the log-probs is computed. On the Triton backend it runs cuBLAS GEMMs
    around one Triton row pass per chunk (:mod:`cppo_kernels._loss_gemm`), on the PyTorch backend the chunked
    PyTorch code (CPU BLAS, or cuBLAS on CUDA). It supports a scaled loss, gradient
    accumulation over micro-batches, a loss used several times in one graph and a second backward through a retained
    graph (recomputed); neither mode supports double backward (``create_graph=True`` raises).

    Layouts (exactly one of ``cu_seqlens`` / ``mask``): packed ``[T, ...]`` or padded ``[B, L, ...]`` (TRL,
    Liger-Kernel), where only positions with ``mask`` set count (padding content is never read into the loss).

    Args:
        hidden: ``[T, H]`` (packed) or ``[B, L, H]`` (padded), fp32 / bf16 / fp16, finite; row t predicts
            ``targets[t]``.
        weight: ``[V, H]`` LM-head weight, hidden's dtype, finite (checked through the log-sum-exp of each token's
            logits: non-finite logits raise a ``ValueError`` naming hidden, weight or bias, or saying they overflow).
        targets: ``[T]`` or ``[B, L]`` integer token ids in ``[0, V)``.
        advantages: ``[S]`` (packed) or ``[B]`` (padded), one per sequence, finite.
        cu_seqlens: ``[S+1]`` integer offsets of the packed sequences (0, non-decreasing, ending at T).
        mask: ``[B, L]`` bool, or integer / floating holding only 0 and 1: the positions that count (padded layout).
        old_logprobs: ``[T]`` or ``[B, L]`` log-probs of the policy that sampled (finite where counted).
        ref_logprobs: ``[T]`` or ``[B, L]`` log-probs of the reference model (required when ``beta > 0``).
        bias: ``[V]`` LM-head bias, weight's dtype.
        importance_weights: per token (``[T]`` / ``[B, L]``) or per sequence (``[S]`` / ``[B]``; packed with
            ``T == S``: per token), finite and >= 0: multiplied into each token's policy term (TRL's vLLM
            importance-sampling ratio, in whichever mode the caller computed it); VESPO takes them into its gamma
            weights instead, as TRL does. No gradient flows into them.
        sampling_logprobs: ``[T]`` or ``[B, L]`` log-probs of the sampler (vLLM), for the off-policy mask (default:
            ``old_logprobs``); NaN marks a token the sampler did not score (no evidence, as in TRL).
        logit_scale: the model's multiplier of its head output (finite, > 0): Cohere's ``logit_scale``, Granite's
            ``1 / logits_scaling``, Falcon-H1's ``lm_head_multiplier``.
        logit_softcap: the model's final tanh cap (finite, > 0), Gemma 2/3's ``final_logit_softcapping``; None:
            no cap. Gradients flow through it.
        entropy_threshold_fn: with ``top_entropy_quantile < 1``, the entropy mask's cut from the call's detached
            fp32 token entropies ``[T]`` (a finite float or 1-element tensor), called once per call, an empty one
            included; default: their ``1 - top_entropy_quantile`` quantile. A caller on several processes passes one
            that gathers every process's entropies first (TRL's ``get_high_entropy_mask``). Eager only:
            ``torch.compile`` breaks the graph there (``fullgraph=True`` stops, naming this option).
        config: the loss options as one :class:`LossConfig` (default: ``LossConfig(**options)``).
        mode: ``"auto"`` (the :data:`MODE_RULES` entry of the inputs' shape class: gradient-in-forward for the
            PyTorch backend and on CUDA, two-pass under the CPU interpreter; two-pass whatever the rule for the
            options of :attr:`LossConfig.call_rule`), ``"two-pass"`` (on CUDA the memory-minimal mode) or
            ``"grad-in-forward"`` (a
            ``ValueError`` with those options, or with a sequence longer than a chunk for a sequence rule).
        **options: any :class:`LossConfig` field by name (``temperature``, ``epsilon_low``, ``beta``,
            ``kl_estimator``, ``loss_agg``, ``surrogate``, ``entropy_coef``, ...: LossConfig documents every one, its
            meaning and its default), a shortcut for ``config=LossConfig(**options)``. Another name is a
            ``TypeError``; next to ``config``, an option away from its default is a ``ValueError`` (it would be
            overridden).

    Returns:
        ``(loss, metrics)``: the fp32 scalar loss, with gradients to ``hidden``, ``weight`` and ``bias`` (in their
        dtypes), and detached fp32 scalars: ``kl`` (mean over tokens, 0 without ``ref_logprobs``),
        ``clip_fraction_low`` / ``clip_fraction_high`` (fraction of tokens whose ratio is clipped below with
        ``A < 0`` / above with ``A > 0``), ``ratio_mean``, ``ratio_min``, ``ratio_max`` (1 without tokens),
        ``num_tokens``, ``policy_loss`` (the loss without the entropy bonus), ``entropy`` (mean) when the loss
        computes it (``compute_entropy``, ``top_entropy_quantile``, ``entropy_coef``), ``cispo_clip_fraction``
        with CISPO, ``vespo_phi_mean`` with VESPO, ``seq_`` + the clip fractions per sequence (sequence-level ratios),
        with ``top_entropy_quantile < 1`` the entropy mask's share of tokens (``entropy_mask_fraction``) and their
        mean entropy (``entropy_masked_mean``). Empty sequences and empty batches give 0, never NaN.
    """
    cfg = loss_config("fused_cppo_loss", config, options)
    check_mode(mode, cfg)
    check_threshold_fn(entropy_threshold_fn, cfg)
    head = check_logit_transform(logit_scale, logit_softcap, cfg.temperature)
    return _loss(hidden, weight, inputs, bias=bias, cfg=cfg, mode=mode, head=head, threshold_fn=entropy_threshold_fn)


def _loss(
    hidden, weight, inputs: LossInputs, *, bias, cfg: LossConfig, mode: str, head: HeadTransform,
    threshold_fn: ThresholdFn | None,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """:func:`fused_cppo_loss` with its options checked: the eager body, or the one custom-op node when compiling."""
    if torch.compiler.is_compiling():  # one cppo_kernels::fused_cppo_loss node, validated inside (cppo_kernels._ops)
        if threshold_fn is not None:
            raise ValueError(
                "entropy_threshold_fn is not supported under torch.compile (a Python callable cannot enter the "
                "cppo_kernels::fused_cppo_loss op): call the loss eagerly, or leave the cut to the call's quantile"
            )
        return compiled_loss(hidden, weight, inputs, bias=bias, cfg=cfg, mode=mode, **head._asdict())
    return eager_loss(
        hidden, weight, inputs, bias=bias, cfg=cfg, mode=mode, entropy_threshold_fn=threshold_fn, **head._asdict()
    )


@implements("loss")
def eager_loss(
    hidden, weight, inputs: LossInputs, *, bias, cfg: LossConfig, mode: str, logit_scale: float = 1.0,
    logit_softcap: float | None = None, entropy_threshold_fn: ThresholdFn | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """The body of :func:`fused_cppo_loss` after its options are checked (``cfg``, ``mode``, the head's transform
    ``logit_scale`` / ``logit_softcap``): validation, packing, the mode's autograd Function. Also the real
    implementation of the ``cppo_kernels::fused_cppo_loss`` op."""
    transform = (logit_scale, logit_softcap)
    p, checks = pack("hidden", hidden, inputs, cfg=cfg, gather_rows=True)
    check_head(p.x, weight, bias)
    checks.in_range(p.inputs.targets, weight.shape[0])
    checks.raise_first()
    h = p.x.contiguous()  # [T, H]
    head = (weight.contiguous(), None if bias is None else bias.contiguous())  # [V, H], [V]
    tgt = p.inputs.targets.to(torch.int64).contiguous()  # [T]
    cu = p.inputs.cu_seqlens  # [S+1]
    run = call_mode(mode, cfg, h, head, cu[1:] - cu[:-1])
    backend = backend_module("loss", h, mode=run)
    if run == "grad-in-forward":
        batch = p.batch(h.shape[0])
        loss, logp, ratio, kl, entropy, phi = GradInForward.apply(h, *head, tgt, batch, cfg, backend, transform)
        return loss, metrics(logp, ratio, batch, kl, entropy, cfg, policy=loss, phi=phi)
    entropy_grad = cfg.entropy_coef != 0.0 and wants_grad(h, *head)
    logp, entropy = FusedLogProbs.apply(
        h, *head, tgt, cfg.temperature, cfg.needs_entropy, backend, transform, entropy_grad
    )  # fmt: skip
    return _policy_loss(p, logp, entropy, cfg, entropy_threshold_fn)


@torch.no_grad()
def fused_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    config: LossConfig | None = None,
    **options: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probs (and entropies) without autograd: the old-policy and reference passes.

    Args:
        hidden: ``[T, H]`` or ``[B, L, H]``, fp32 / bf16 / fp16, finite.
        weight: ``[V, H]`` LM-head weight, hidden's dtype.
        targets: integer token ids in ``[0, V)`` of hidden's leading shape (``[T]`` or ``[B, L]``).
        bias: ``[V]`` LM-head bias, weight's dtype.
        logit_scale, logit_softcap: the model's own logit transform, as in :func:`fused_cppo_loss`.
        config: a :class:`LossConfig` of which two fields apply here: ``temperature`` (divides the transformed
            logits) and ``compute_entropy`` (also return each token distribution's entropy); the loss's own config
            may be passed as it is (its other fields change nothing).
        **options: ``temperature`` and ``compute_entropy`` by name (:class:`LossConfig` documents them and holds
            their defaults): a shortcut for ``config=LossConfig(**options)``; another name is a ``TypeError``.

    Returns:
        fp32 ``logp`` of the leading shape, or ``(logp, entropy)`` with ``compute_entropy=True``. Deterministic,
        and a token's values do not depend on the other tokens of the batch.
    """
    cfg = loss_config("fused_logprobs", config, options, LOGPROBS_OPTIONS)
    head = check_logit_transform(logit_scale, logit_softcap, cfg.temperature)._asdict()
    if torch.compiler.is_compiling():  # one cppo_kernels::fused_logprobs node, validated inside (cppo_kernels._ops)
        return compiled_logprobs(hidden, weight, targets, bias=bias, cfg=cfg, **head)
    return eager_logprobs(hidden, weight, targets, bias=bias, cfg=cfg, **head)


#: The :class:`LossConfig` fields that :func:`fused_logprobs` reads (and takes as keywords).
LOGPROBS_OPTIONS = ("temperature", "compute_entropy")


@implements("logprobs")
def eager_logprobs(
    hidden, weight, targets, *, bias, cfg: LossConfig, logit_scale: float = 1.0, logit_softcap: float | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """The body of :func:`fused_logprobs` after its options are checked (``cfg``, the head's transform ``logit_scale``
    / ``logit_softcap``; call it under ``torch.no_grad``); also the real implementation of the
    ``cppo_kernels::fused_logprobs`` op."""
    hidden = check_tensor("hidden", hidden)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [T, H] or [B, L, H], got shape {list(hidden.shape)}")
    check_head(hidden, weight, bias)
    lead = tuple(hidden.shape[:-1])
    targets = check_targets(targets, lead, hidden.device, "[T]" if len(lead) == 1 else "[B, L]")
    checks = Checks()
    checks.in_range(targets, weight.shape[0])
    checks.raise_first()
    h = hidden.reshape(-1, hidden.shape[-1]).contiguous()  # [T, H]
    logp, lse, entropy = backend_module("loss", h, mode=resolve_mode("auto", h)).logprobs_fwd(
        h,
        weight.contiguous(),
        targets.reshape(-1).to(torch.int64).contiguous(),
        bias,
        temperature=cfg.temperature,
        compute_entropy=cfg.compute_entropy,
        logit_scale=logit_scale,
        softcap=logit_softcap,
    )
    check_logits(lse, logp, h, weight, bias)
    logp = logp.reshape(lead)
    return (logp, entropy.reshape(lead)) if cfg.compute_entropy else logp


@takes_loss_inputs
def cppo_loss_from_logits(
    logits: Tensor,
    inputs: LossInputs,
    *,
    entropy_threshold_fn: ThresholdFn | None = None,
    config: LossConfig | None = None,
    **options: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`fused_cppo_loss` for callers that already hold the logits: same layouts, options and results.

    Computes in fp32 (one fp32 ``[T, V]`` copy when the logits are bf16/fp16 or temperature != 1).

    Args:
        logits: ``[T, V]`` (packed) or ``[B, L, V]`` (padded), floating, finite where counted.
        targets, advantages, cu_seqlens, mask, old_logprobs, ref_logprobs: as in :func:`fused_cppo_loss`.
        entropy_threshold_fn, config: as in :func:`fused_cppo_loss`.
        **options: any :class:`LossConfig` field by name, as in :func:`fused_cppo_loss`.

    Returns:
        ``(loss, metrics)`` as :func:`fused_cppo_loss`, the loss with gradients to ``logits``.
    """
    cfg = loss_config("cppo_loss_from_logits", config, options)
    p, checks = pack("logits", logits, inputs, cfg=cfg, gather_rows=False)
    check_threshold_fn(entropy_threshold_fn, cfg)
    logp, entropy = _logits_logprobs(p, checks, cfg)
    return _policy_loss(p, logp, entropy, cfg, entropy_threshold_fn)


def _logits_logprobs(p: Packed, checks: Checks, cfg: LossConfig) -> tuple[Tensor, Tensor | None]:
    """The packed per-token log-probs ``[T]`` (fp32, under autograd) and entropies (``[T]``, or None without
    ``compute_entropy``) of the logits rows ``p.x`` (``[T, V]``, or ``[B*L, V]`` padded), after the value checks
    (``checks``, targets in range, a finite log-sum-exp where counted) have been raised."""
    vocab = p.x.shape[-1]
    if vocab == 0:
        raise ValueError("logits must have a non-empty last dimension (V >= 1)")
    targets = p.inputs.targets  # [T] or [B*L]
    checks.in_range(targets if p.flat is None else targets[p.flat], vocab)
    z = p.x.float()  # [N, V]
    if cfg.temperature != 1.0:
        z = z / cfg.temperature
    lse = torch.logsumexp(z, dim=-1)  # [N]
    checks.finite_lse((lse if p.flat is None else lse[p.flat]).detach(), p.x, cfg.temperature)
    checks.raise_first()
    # Targets at padding (any value) are clamped into range; their rows are dropped below.
    targets = targets if p.flat is None else targets.clamp(0, vocab - 1)
    logp = z.gather(-1, targets.to(torch.int64).unsqueeze(-1)).squeeze(-1) - lse  # [N]
    counted = logp.detach() if p.flat is None else logp.detach()[p.flat]
    if not torch.isfinite(counted).all():  # a target at a -inf logit: probability 0, log-prob -inf
        row = int((~torch.isfinite(counted)).nonzero()[0])
        raise ValueError(
            f"logits: the target token of counted position {row} has logit -inf (probability 0), so its log-prob is "
            "-inf and the loss undefined: mask that position out, or do not mask the target's logit"
        )
    entropy = None
    if cfg.needs_entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.entropy_coef != 0.0):
            entropy = torch.special.entr(torch.softmax(z, dim=-1)).sum(-1)  # [N]
    if p.flat is not None:
        logp = logp[p.flat]
        entropy = None if entropy is None else entropy[p.flat]
    return logp, entropy


class FusedCPPOLoss(nn.Module):
    """:func:`fused_cppo_loss` as a module that holds the options (the Liger-Kernel habit): the constructor takes
    every option of :func:`fused_cppo_loss`, ``forward`` every tensor (tests/kernels/test_carriers.py checks
    that the two together take what the function takes).

    Args:
        config: the loss options as a :class:`LossConfig` (default: ``LossConfig(**options)``).
        mode: the execution mode of :func:`fused_cppo_loss` (``"auto"``, ``"two-pass"``, ``"grad-in-forward"``).
        logit_scale, logit_softcap: the model's own logit transform (:func:`fused_cppo_loss`), held with the
            options.
        entropy_threshold_fn: the entropy mask's cut from the call's entropies, as in :func:`fused_cppo_loss`.
        **options: any :class:`LossConfig` field by name (``beta=0.04, ...``), as in :func:`fused_cppo_loss`:
            another name is a ``TypeError``; next to ``config``, one away from its default a ``ValueError``.

    ``forward(hidden, weight, targets, advantages, *, cu_seqlens=None, mask=None, old_logprobs=None,
    ref_logprobs=None, importance_weights=None, sampling_logprobs=None, bias=None)`` takes the tensors of
    :func:`fused_cppo_loss` (same shapes and layouts) and returns its ``(loss, metrics)``.
    """

    def __init__(
        self,
        config: LossConfig | None = None,
        *,
        mode: str = "auto",
        logit_scale: float = 1.0,
        logit_softcap: float | None = None,
        entropy_threshold_fn: ThresholdFn | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        cfg = self.config = loss_config("FusedCPPOLoss", config, options)
        check_mode(mode, cfg)
        check_threshold_fn(entropy_threshold_fn, cfg)
        self.mode = mode
        self.logit_scale, self.logit_softcap = check_logit_transform(logit_scale, logit_softcap, cfg.temperature)
        self.entropy_threshold_fn = entropy_threshold_fn

    @takes_loss_inputs
    def forward(
        self, hidden: Tensor, weight: Tensor, inputs: LossInputs, *, bias: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        head = HeadTransform(self.logit_scale, self.logit_softcap)
        return _loss(
            hidden, weight, inputs, bias=bias, cfg=self.config, mode=self.mode, head=head,
            threshold_fn=self.entropy_threshold_fn,
        )  # fmt: skip

    def extra_repr(self) -> str:
        head = f", logit_scale={self.logit_scale!r}, logit_softcap={self.logit_softcap!r}"
        plain = (self.logit_scale, self.logit_softcap) == (1.0, None)
        fn = "" if self.entropy_threshold_fn is None else f", entropy_threshold_fn={self.entropy_threshold_fn!r}"
        return f"{self.config!r}, mode={self.mode!r}" + ("" if plain else head) + fn
