"""Public options of the ops: the choices each option accepts, the scalar checks every layer shares (also used by
the ``cppo`` trainer), and the loss hyper-parameters as one frozen dataclass (:class:`LossConfig`): its fields are
the one definition of the loss options and their defaults. The public loss functions take ``config=LossConfig(...)``
or the same options as keywords (``**options``), from which :func:`loss_config` builds the one LossConfig of the
call; no signature restates a field or its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from difflib import get_close_matches

#: ``scale`` of :func:`cppo_kernels.group_advantages`.
SCALES = ("group", "batch", "none")
#: ``scope`` of :func:`cppo_kernels.select_completions`.
SCOPES = ("group", "batch")
#: ``metric`` of :func:`cppo_kernels.select_completions`: which completions are pruned.
METRICS = ("smallest", "largest", "random", "max-variance")
#: ``metric="max-variance"``: candidate subsets whose variances lie within this relative distance of the largest
#: (below the fp32 resolution of the scores) are tied, and the tie goes to the one with the fewest highest scores.
MAX_VARIANCE_RTOL = 2.0**-24


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    """``value`` when it is one of ``choices``, else a ``ValueError`` naming ``name`` and the choices."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` when it is an int (not a bool) in ``[low, high]``, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def check_float(name: str, value, *, low: float | None = None, low_open: bool = False) -> float:
    """``float(value)`` when it is a finite real number >= ``low`` (> with ``low_open``), else a ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    return value


#: ``kl_estimator`` of :func:`cppo_kernels.fused_cppo_loss`.
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING = ("token", "sequence")
#: ``loss_agg``, each with what its loss is a mean over: ``"tokens"`` (the batch's token count divides it) or
#: ``"sequences"``; a trainer that splits a batch into micro-batches weighs each one by its share of that count.
LOSS_AGG_UNITS = {
    "token-mean": "tokens",
    "seq-mean-token-mean": "sequences",
    "seq-mean-token-sum-norm": "sequences",
    "seq-mean-token-sum": "sequences",
}
LOSS_AGGS = tuple(LOSS_AGG_UNITS)
#: ``surrogate``: the per-token policy term (TRL 1.16's ``loss_type`` names where they differ from the clip).
SURROGATES = ("clip", "cispo", "sapo", "vespo")
#: The surrogates that weigh each sequence by one detached number of its tokens (LossConfig.sequence_weighted).
SEQUENCE_WEIGHTED = ("vespo",)


#: TRL 1.16's ``loss_type`` -> ``(surrogate, loss_agg)`` of :class:`LossConfig` (``dr_grpo`` also needs
#: ``max_completion_length``): the one table CPPOTrainer and ``cppo train``'s ``loss.loss_type`` read.
LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("clip", "seq-mean-token-mean"),
    "bnpo": ("clip", "token-mean"),
    "dr_grpo": ("clip", "seq-mean-token-sum-norm"),
    "dapo": ("clip", "token-mean"),
    "cispo": ("cispo", "token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"),
    "luspo": ("clip", "seq-mean-token-sum"),
    "vespo": ("vespo", "token-mean"),
}


@dataclass(frozen=True)
class LossConfig:
    """Options of :func:`cppo_kernels.fused_cppo_loss` and :func:`cppo_kernels.cppo_loss_from_logits`, validated
    on construction. Every field is a runtime value for the kernels: changing one never recompiles.

    Args:
        temperature: divides the logits (> 0).
        epsilon_low, epsilon_high: the clip range ``[1 - epsilon_low, 1 + epsilon_high]`` of the ratio
            (``0 <= epsilon_low < 1``, ``epsilon_high >= 0``, defaulting to ``epsilon_low``).
        dual_clip: the constant ``c > 1`` of dual-clip PPO: a token with ``A < 0`` loses at most ``-c A``.
        beta: weight (>= 0) of the KL penalty to the reference log-probs (``> 0`` needs them).
        kl_estimator: ``"k1"`` (``logp - ref``), ``"k2"`` (``(logp - ref)^2 / 2``) or ``"k3"``
            (``exp(ref - logp) - (ref - logp) - 1``).
        importance_sampling: ``"token"`` (a ratio per token) or ``"sequence"`` (every token of a sequence uses the
            exponentiated mean log-ratio of the sequence: GSPO).
        loss_agg: ``"token-mean"`` (DAPO / CPPO: sum over all tokens / T), ``"seq-mean-token-mean"`` (GRPO: mean
            over sequences of each one's token mean) or ``"seq-mean-token-sum-norm"`` (Dr. GRPO: sum over all
            tokens / (S * max_completion_length)). TRL's ``loss_type`` grpo / dapo / dr_grpo.
            ``"seq-mean-token-sum"`` (LUSPO: mean over sequences of each one's token sum).
        max_completion_length: the normaliser of ``"seq-mean-token-sum-norm"`` (an int >= 1, required there).
        compute_entropy: also report the mean entropy of the token distributions as a metric.
        surrogate: the policy term per token, with ``r`` the ratio and ``A`` the advantage: ``"clip"`` (PPO's
            ``-min(r A, clip(r) A)``), ``"cispo"`` (``-min(r, epsilon_high).detach() * A * logp``: here
            ``epsilon_high`` is the cap of the ratio itself, as in TRL), ``"sapo"`` (the soft gate
            ``-sigmoid(tau (r - 1)) * 4 / tau * A``, ``tau`` = ``sapo_temperature_pos`` where ``A > 0``, else
            ``sapo_temperature_neg``) or ``"vespo"`` (``-phi_s * A * logp`` with the detached gamma weight
            ``phi_s = exp(lambda + k log w - lambda w)`` of the sequence's ratio ``w = exp(sum_t log-ratio)``,
            ``k, lambda`` = ``vespo_k_pos, vespo_lambda_pos`` where ``A >= 0``, else the ``_neg`` pair).
        delta: the two-sided clip of ``"clip"``: the unclipped ratio is capped at ``delta`` (INTELLECT-2; > 0).
        sapo_temperature_pos, sapo_temperature_neg: the temperatures (> 0) of ``"sapo"``.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: the gamma shape and rate (>= 0) of ``"vespo"``.
        use_bias_correction_kl: multiply the KL term by the ratio ``r`` (DeepSeek-V3.2's importance-sampled KL;
            the gradient flows through ``r`` too).
        off_policy_mask_threshold: drop the policy term of every sequence with ``A < 0`` whose mean of
            ``sampling_logprobs - logp`` exceeds this (DeepSeek-V3.2's off-policy sequence mask); None: off.
        top_entropy_quantile: keep the policy term only on the tokens whose entropy is at least the
            ``1 - top_entropy_quantile`` quantile of the call's tokens (in ``[0, 1]``; 1: every token).
        entropy_coef: subtract ``entropy_coef`` times the mean entropy of the kept tokens (all, or those of
            ``top_entropy_quantile``) from the loss; its gradient flows through the entropy.
    """

    temperature: float = 1.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    dual_clip: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    importance_sampling: str = "token"
    loss_agg: str = "token-mean"
    max_completion_length: int | None = None
    compute_entropy: bool = False
    surrogate: str = "clip"
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = False
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        check_float("temperature", self.temperature, low=0.0, low_open=True)
        if check_float("epsilon_low", self.epsilon_low, low=0.0) >= 1.0:
            raise ValueError(
                f"epsilon_low must be < 1, got {self.epsilon_low}: the clip's lower bound 1 - epsilon_low must stay "
                "> 0 (a ratio is positive, so a bound <= 0 never clips and the clip would mean nothing)"
            )
        if self.epsilon_high is not None:
            check_float("epsilon_high", self.epsilon_high, low=0.0)
        if self.dual_clip is not None:
            c = check_float("dual_clip", self.dual_clip)
            if c <= 1.0:
                raise ValueError(f"dual_clip must be > 1 (the constant c of dual-clip PPO), got {c}")
        check_float("beta", self.beta, low=0.0)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("importance_sampling", self.importance_sampling, IMPORTANCE_SAMPLING)
        check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        if self.max_completion_length is not None:
            check_int("max_completion_length", self.max_completion_length, low=1)
        elif self.loss_agg == "seq-mean-token-sum-norm":
            raise ValueError("loss_agg='seq-mean-token-sum-norm' needs max_completion_length (an int >= 1)")
        for name in ("compute_entropy", "use_bias_correction_kl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        check_choice("surrogate", self.surrogate, SURROGATES)
        if self.delta is not None:
            check_float("delta", self.delta, low=0.0, low_open=True)
            if self.surrogate != "clip":
                raise ValueError(f"delta caps the ratio of surrogate='clip'; surrogate={self.surrogate!r} has no clip")
        if self.dual_clip is not None and self.surrogate != "clip":
            raise ValueError(f"dual_clip applies to surrogate='clip'; surrogate={self.surrogate!r} has no clip")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            check_float(name, getattr(self, name), low=0.0, low_open=True)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check_float(name, getattr(self, name), low=0.0)
        if self.off_policy_mask_threshold is not None:
            check_float("off_policy_mask_threshold", self.off_policy_mask_threshold)
        if check_float("top_entropy_quantile", self.top_entropy_quantile, low=0.0) > 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        check_float("entropy_coef", self.entropy_coef)

    @property
    def eps_high(self) -> float:
        """``epsilon_high``, defaulting to ``epsilon_low``."""
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss needs the token entropies (reported, masked on, or in the loss)."""
        return self.compute_entropy or self.top_entropy_quantile < 1.0 or self.entropy_coef != 0.0

    @property
    def two_pass_rule(self) -> str | None:
        """The option that needs a whole sequence or the whole call before any token's gradient is known, as its
        condition (:attr:`sequence_rule`, then :attr:`call_rule`); None when every token's gradient is its own."""
        return self.sequence_rule or self.call_rule

    # The rules name a numeric option by its condition (``entropy_coef != 0``), never by its value: under
    # torch.compile the value may be a dynamo symbol, which a string cannot hold.

    @property
    def sequence_rule(self) -> str | None:
        """The option whose token gradients need their whole sequence (the sequence's mean log-ratio, VESPO's gamma
        weight, the off-policy mask's mean), as its condition (``name=value`` for a choice); None if none.
        Gradient-in-forward runs them in chunks of whole sequences."""
        if self.importance_sampling == "sequence":
            return "importance_sampling='sequence'"
        if self.sequence_weighted:
            return f"surrogate={self.surrogate!r}"
        if self.off_policy_mask_threshold is not None:
            return "off_policy_mask_threshold (set)"
        return None

    @property
    def sequence_weighted(self) -> bool:
        """Whether the surrogate weighs each sequence by one detached number computed from all its tokens (VESPO's
        gamma weight, :func:`cppo_kernels._policy.vespo_weights`), which the kernels then hold per sequence."""
        return self.surrogate in SEQUENCE_WEIGHTED

    @property
    def call_rule(self) -> str | None:
        """The option whose token gradients need every token of the call (the entropy mask's quantile, the entropy
        bonus's mean), as its condition; None if none: those run two-pass."""
        if self.top_entropy_quantile < 1.0:
            return "top_entropy_quantile < 1"
        if self.entropy_coef != 0.0:
            return "entropy_coef != 0"
        return None

    @property
    def plain(self) -> bool:
        """The options of the analytic per-token gradient (:func:`cppo_kernels._policy.token_grad`): the clip
        surrogate without ``delta`` or the bias-corrected KL."""
        return self.surrogate == "clip" and self.delta is None and not self.use_bias_correction_kl


#: The loss options: the names of :class:`LossConfig`'s fields, in order.
LOSS_OPTIONS = tuple(f.name for f in fields(LossConfig))
_LOSS_DEFAULTS = {f.name: f.default for f in fields(LossConfig)}


def loss_config(
    caller: str, config: LossConfig | None, options: Mapping[str, object], accepted: tuple[str, ...] = LOSS_OPTIONS
) -> LossConfig:
    """The one :class:`LossConfig` of a call of the public function ``caller``: ``config`` when given, else
    ``LossConfig(**options)`` (validated there, once: the layers below take it as it is).

    ``options``: the call's ``**options``, loss options by field name. A name not in ``accepted`` (the LossConfig
    fields, or the few a function reads) is a ``TypeError`` naming it and the valid names, as Python's own for an
    unexpected keyword. Next to ``config``, an option passed with another value than ``config``'s is a ``ValueError``
    (one of the two would be silently ignored otherwise), an option repeating ``config``'s value is allowed.
    ``config`` that is not a LossConfig is a ``ValueError``.
    """
    unknown = [name for name in options if name not in accepted]
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        close = [m for name in unknown for m in get_close_matches(name, accepted, n=1)]
        hint = f" (did you mean {', '.join(repr(m) for m in close)}?)" if close else ""
        got = "an unexpected keyword argument" if len(unknown) == 1 else "unexpected keyword arguments"
        raise TypeError(f"{caller}() got {got} {names}{hint}; its options are LossConfig fields: {', '.join(accepted)}")
    if config is None:
        return LossConfig(**options)
    if not isinstance(config, LossConfig):
        raise ValueError(f"config must be a LossConfig or None, got {type(config).__name__}")
    for name, value in options.items():
        if value != getattr(config, name):
            raise ValueError(
                f"{name}={value!r} conflicts with config=LossConfig(..., {name}={getattr(config, name)!r}): pass "
                f"{name} inside the LossConfig only"
            )
    return config
