"""The loss options have one carrier, :class:`cppo_kernels.LossConfig` (issue 39): every public loss function and
the float64 reference take ``config=LossConfig(...)``, or the same options as keywords (``**options``), which build
the same LossConfig through ``cppo_kernels.config.loss_config``; no signature restates a field or its default.

Each field as a keyword gives the bit-identical loss, metrics and gradients of ``config=LossConfig(field=value)``; an
unknown keyword is a ``TypeError`` naming it and the valid names; an option both in ``config`` and as a keyword (away
from its default) a ``ValueError`` naming it; and a number that reaches a compiled op as data is checked there."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from loss_cases import cu_seqlens, grads, problem

import cppo_kernels
from cppo_kernels import (
    FusedCPPOLoss,
    LossConfig,
    cppo_loss_from_logits,
    fused_cppo_loss,
    fused_logprobs,
    reference,
)
from cppo_kernels.config import LOSS_OPTIONS

#: One value of each field away from its default, valid on its own (every other field at its default).
VALUES = dict(
    temperature=0.8, epsilon_low=0.1, epsilon_high=0.05, dual_clip=1.1, beta=0.04, kl_estimator="k2",
    importance_sampling="sequence", loss_agg="seq-mean-token-mean", max_completion_length=9, compute_entropy=True,
    surrogate="cispo", delta=1.1, sapo_temperature_pos=0.9, sapo_temperature_neg=1.2, vespo_k_pos=1.5,
    vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5, use_bias_correction_kl=True,
    off_policy_mask_threshold=-0.1, top_entropy_quantile=0.8, entropy_coef=0.01,
)  # fmt: skip
#: Fields that only act with another option: the pair makes the field change the loss, so a keyword that were
#: dropped on its way into the LossConfig would show.
PARTNERS = dict(
    kl_estimator=dict(beta=0.04),
    use_bias_correction_kl=dict(beta=0.04),
    max_completion_length=dict(loss_agg="seq-mean-token-sum-norm"),
    sapo_temperature_pos=dict(surrogate="sapo"),
    sapo_temperature_neg=dict(surrogate="sapo"),
    vespo_k_pos=dict(surrogate="vespo"),
    vespo_lambda_pos=dict(surrogate="vespo"),
    vespo_k_neg=dict(surrogate="vespo"),
    vespo_lambda_neg=dict(surrogate="vespo"),
)
LENGTHS = [4, 0, 5]


def test_values_cover_every_field():
    """A new LossConfig field joins VALUES (and so every test below)."""
    assert tuple(VALUES) == LOSS_OPTIONS
    defaults = LossConfig()
    assert all(VALUES[name] != getattr(defaults, name) for name in LOSS_OPTIONS)


def _options(field: str) -> dict:
    return {**PARTNERS.get(field, {}), field: VALUES[field]}


def _inputs():
    """A tiny packed problem: params (hidden, weight, bias: fp32, requiring grad), targets, advantages, and the
    per-token tensors (old, reference and sampling log-probs near the current ones, importance weights)."""
    hidden, weight, bias, targets, adv, g = problem(3, LENGTHS, 8, 24, torch.float32, logit_scale=2.0, bias=True)
    with torch.no_grad():
        logp, _ = reference.token_logprobs(hidden.double(), weight.double(), targets, bias=bias.double())
    T = sum(LENGTHS)
    old, ref, sampling = ((logp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)).float() for _ in range(3))
    adv = torch.tensor([0.7, -0.4, -1.1])
    tensors = dict(
        cu_seqlens=cu_seqlens(LENGTHS), old_logprobs=old, ref_logprobs=ref, sampling_logprobs=sampling,
        importance_weights=0.5 + torch.rand(T, generator=g),
    )  # fmt: skip
    params = [hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()]
    return params, targets, adv, tensors


def _run(fn, params, *args, **kwargs):
    loss, metrics = fn(*args, **kwargs)
    return loss, metrics, grads(loss, params, 0.7)


def _assert_identical(got, want) -> None:
    """Bit-identical losses, metrics (same names) and gradients."""
    assert torch.equal(got[0], want[0])
    assert list(got[1]) == list(want[1]) and all(torch.equal(got[1][k], want[1][k]) for k in got[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2], strict=True))


@pytest.mark.parametrize("field", list(VALUES))
def test_a_keyword_equals_the_config_field(field):
    """fused_cppo_loss, cppo_loss_from_logits, the reference (fused_cppo_loss and policy_loss) and FusedCPPOLoss:
    the option as a keyword gives bit for bit what ``config=LossConfig(option)`` gives, and what the default config
    gives differs (the option took effect)."""
    options, config = _options(field), LossConfig(**_options(field))
    params, targets, adv, tensors = _inputs()
    args = (*params[:2], targets, adv)
    fused = dict(tensors, bias=params[2])
    want = _run(fused_cppo_loss, params, *args, **fused, config=config)
    _assert_identical(_run(fused_cppo_loss, params, *args, **fused, **options), want)
    if field != "max_completion_length":  # (its partner needs it: no valid config without it)
        plain = _run(fused_cppo_loss, params, *args, **fused, **PARTNERS.get(field, {}))
        with pytest.raises(AssertionError):
            _assert_identical(plain, want)  # the option changes the loss, a metric or a gradient
    module = {k: v for k, v in fused.items() if k in ("cu_seqlens", "old_logprobs", "ref_logprobs", "bias")}
    want_module = _run(fused_cppo_loss, params, *args, **module, config=config)
    _assert_identical(_run(FusedCPPOLoss(**options), params, *args, **module), want_module)

    logits = (params[0].detach() @ params[1].detach().t() + params[2].detach()).requires_grad_()  # [T, V]
    want = _run(cppo_loss_from_logits, [logits], logits, targets, adv, **tensors, config=config)
    _assert_identical(_run(cppo_loss_from_logits, [logits], logits, targets, adv, **tensors, **options), want)

    params64 = [p.detach().double().requires_grad_() for p in params]
    tensors64 = {k: v if k == "cu_seqlens" else v.double() for k, v in tensors.items()}
    args64 = (*params64[:2], targets, adv.double())
    want = _run(reference.fused_cppo_loss, params64, *args64, bias=params64[2], **tensors64, config=config)
    got = _run(reference.fused_cppo_loss, params64, *args64, bias=params64[2], **tensors64, **options)
    _assert_identical(got, want)

    def policy_loss(**kwargs):  # the reference's policy term on the log-probs of the config's temperature
        logp, entropy = reference.token_logprobs(*params64[:2], targets, bias=params64[2], config=config)
        return reference.policy_loss(logp, adv.double(), **tensors64, entropy=entropy, **kwargs)

    _assert_identical(_run(policy_loss, params64, **options), _run(policy_loss, params64, config=config))


@pytest.mark.parametrize("options", [dict(temperature=0.7), dict(compute_entropy=True), {}])
def test_logprobs_take_their_two_fields_as_keywords_or_config(options):
    """fused_logprobs reads temperature and compute_entropy, as keywords or from a LossConfig (whose other fields
    change nothing); the reference's token_logprobs reads the temperature the same way."""
    (hidden, weight, bias), targets, _, _ = _inputs()
    hidden, weight, bias = hidden.detach(), weight.detach(), bias.detach()
    want = fused_logprobs(hidden, weight, targets, bias=bias, config=LossConfig(**options))
    got = fused_logprobs(hidden, weight, targets, bias=bias, **options)
    loss_config = LossConfig(**options, beta=0.04, surrogate="vespo", entropy_coef=0.1)
    other = fused_logprobs(hidden, weight, targets, bias=bias, config=loss_config)
    for out in (got, other):
        assert type(out) is type(want)
        assert all(torch.equal(a, b) for a, b in zip(*((x,) if torch.is_tensor(x) else x for x in (out, want))))
    if "temperature" in options:
        h64, w64 = hidden.double(), weight.double()
        want = reference.token_logprobs(h64, w64, targets, config=LossConfig(**options))
        got = reference.token_logprobs(h64, w64, targets, **options)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def _calls():
    """Every public loss entry point as ``name -> call(**options)`` on the tiny problem."""
    params, targets, adv, tensors = _inputs()
    h, w, b = (p.detach() for p in params)
    logits = h @ w.t()
    p64 = [p.detach().double() for p in params]
    t64 = {k: v if k == "cu_seqlens" else v.double() for k, v in tensors.items()}
    return {
        "fused_cppo_loss": lambda **o: fused_cppo_loss(h, w, targets, adv, bias=b, **tensors, **o),
        "cppo_loss_from_logits": lambda **o: cppo_loss_from_logits(logits, targets, adv, **tensors, **o),
        "fused_logprobs": lambda **o: fused_logprobs(h, w, targets, bias=b, **o),
        "FusedCPPOLoss": lambda **o: FusedCPPOLoss(**o),
        "token_logprobs": lambda **o: reference.token_logprobs(*p64[:2], targets, **o),
        "policy_loss": lambda **o: reference.policy_loss(p64[0][:, 0], adv.double(), **t64, **o),
        "reference.fused_cppo_loss": lambda **o: reference.fused_cppo_loss(*p64[:2], targets, adv, **t64, **o),
    }


#: The keywords each entry point takes: every field, but the log-prob functions' own.
ACCEPTED = {"fused_logprobs": ("temperature", "compute_entropy"), "token_logprobs": ("temperature",)}


@pytest.mark.parametrize("name", list(_calls()))
def test_an_unknown_keyword_is_a_type_error_naming_it(name):
    """Python's own wording for an unexpected keyword, with the valid names (and the closest one); a field that
    the log-prob functions do not read is unknown to them."""
    call = _calls()[name]
    accepted = ACCEPTED.get(name, LOSS_OPTIONS)
    caller = name.rsplit(".", 1)[-1]
    with pytest.raises(TypeError) as info:
        call(temprature=0.7)
    text = str(info.value)
    assert f"{caller}() got an unexpected keyword argument 'temprature' (did you mean 'temperature'?)" in text
    assert text.endswith(", ".join(accepted))
    with pytest.raises(TypeError, match="unexpected keyword arguments 'gamma', 'alpha'"):
        call(gamma=1.0, alpha=2.0)
    if name in ACCEPTED:
        with pytest.raises(TypeError, match="unexpected keyword argument 'beta'"):
            call(beta=0.04)


@pytest.mark.parametrize("name", list(_calls()))
def test_an_option_in_config_and_as_a_keyword_is_a_value_error_naming_it(name):
    """Next to ``config``, a keyword with another value than config's would be ignored: a ValueError naming it, its
    default included (``config=LossConfig(beta=0.5), beta=0.0``); one repeating config's value is allowed; a config
    that is not a LossConfig is a ValueError."""
    call = _calls()[name]
    option = "temperature" if name in ACCEPTED else "beta"
    config = LossConfig(**{option: 0.5})
    with pytest.raises(ValueError, match=f"^{option}=0.25 conflicts with config="):
        call(config=config, **{option: 0.25})
    default = getattr(LossConfig(), option)
    with pytest.raises(ValueError, match=f"^{option}={default!r} conflicts with config="):
        call(config=config, **{option: default})
    call(config=config, **{option: 0.5})
    with pytest.raises(ValueError, match="config must be a LossConfig"):
        call(config={option: 0.5})


def _public_callables() -> dict[str, object]:
    """Every public function of cppo_kernels and of the reference, and the methods of its public classes but
    LossConfig (whose constructor is the fields)."""
    found = {}
    for module in (cppo_kernels, reference):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) and obj is not LossConfig:
                found |= {f"{name}.{m}": f for m, f in vars(obj).items() if inspect.isfunction(f) and m[0] != "_"}
                found[f"{name}.__init__"] = obj.__init__
            elif inspect.isfunction(obj):
                found[f"{module.__name__}.{name}"] = obj
    return found


PUBLIC = _public_callables()
#: The loss entry points: they take ``config`` and ``**options``.
ENTRY_POINTS = [fused_cppo_loss, cppo_loss_from_logits, fused_logprobs, FusedCPPOLoss.__init__]
ENTRY_POINTS += [reference.token_logprobs, reference.policy_loss, reference.fused_cppo_loss]


def test_the_public_callables_are_found():
    assert {"cppo_kernels.fused_cppo_loss", "FusedCPPOLoss.forward", "cppo_kernels.reference.policy_loss"} <= set(
        PUBLIC
    )
    assert all(fn in PUBLIC.values() for fn in ENTRY_POINTS)


@pytest.mark.parametrize("name", list(PUBLIC))
def test_no_public_signature_restates_a_loss_option(name):
    """The duplication cannot come back: no public signature has a parameter named as a LossConfig field (each
    field and its default live in LossConfig alone)."""
    params = inspect.signature(PUBLIC[name]).parameters
    assert not set(params) & {f.name for f in dataclasses.fields(LossConfig)}, name


@pytest.mark.parametrize("fn", ENTRY_POINTS, ids=lambda fn: fn.__qualname__)
def test_every_loss_entry_point_takes_config_and_options(fn):
    """``config: LossConfig | None = None`` and ``**options``, documented as LossConfig's fields."""
    params = inspect.signature(fn).parameters
    assert params["config"].default is None
    assert [p.name for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD] == ["options"]
    doc = inspect.getdoc(FusedCPPOLoss if fn is FusedCPPOLoss.__init__ else fn)
    assert "LossConfig" in doc and "options" in doc


def test_a_compiled_number_is_checked_where_it_arrives():
    """Under dynamic=True a new number runs the traced graph without the public function running again, and dynamo
    does not guard every check (an infinite beta passes them): the op checks the LossConfig it rebuilds, so the bad
    value is the eager one-line ValueError, from inside the graph (cppo_kernels._ops._config)."""
    params, targets, adv, tensors = _inputs()
    tensors = {k: tensors[k] for k in ("cu_seqlens", "old_logprobs", "ref_logprobs")}

    def step(hidden, weight, beta):
        return fused_cppo_loss(hidden, weight, targets, adv, beta=beta, **tensors)[0]

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for beta in (0.01, 0.02):
        assert torch.allclose(compiled(*params[:2], beta), step(*params[:2], beta))
    with pytest.raises(ValueError, match="^beta must be finite, got inf$"):
        compiled(*params[:2], float("inf"))

    logprobs = torch.compile(
        lambda h, w, t: fused_logprobs(h, w, targets, temperature=t), backend="aot_eager", fullgraph=True, dynamic=True
    )
    h, w = (p.detach() for p in params[:2])
    for t in (0.7, 0.9):
        assert torch.equal(logprobs(h, w, t), fused_logprobs(h, w, targets, temperature=t))
    with pytest.raises(ValueError, match="^temperature must be finite, got inf$"):
        logprobs(h, w, float("inf"))
