"""What the ops take is declared once (issue 50, part 2), in :mod:`cppo_kernels._carriers`: the loss's tensors
(:class:`LossInputs`: the public loss functions, the module, the float64 oracle and the custom op take its fields, so
the copies cannot drift again: ``FusedCPPOLoss.forward`` once lacked ``importance_weights`` and
``sampling_logprobs``, its constructor ``entropy_threshold_fn``), and the selection's options (:class:`SelectOptions`:
the public selection functions and their oracles take its fields, the backends one SelectOptions)."""

from __future__ import annotations

import inspect

import pytest
import torch
from loss_cases import cu_seqlens, grads, problem

import cppo_kernels
from cppo_kernels import FusedCPPOLoss, cppo_loss_from_logits, fused_cppo_loss, reference
from cppo_kernels._carriers import ADVANTAGE_FIELDS, SELECT_FIELDS, LossInputs, SelectOptions

FIELDS = LossInputs._fields
LENGTHS = [4, 0, 5]


def _parameters(fn, skip: int = 0) -> dict[str, inspect.Parameter]:
    return dict(list(inspect.signature(fn).parameters.items())[skip:])


def test_the_module_takes_what_the_function_takes():
    """``FusedCPPOLoss(options).forward(tensors)`` takes exactly the parameters of ``fused_cppo_loss``: its options
    (the constructor's, with the same defaults) and its tensors (forward's, with the same kinds and defaults)."""
    function = _parameters(fused_cppo_loss)
    init, forward = _parameters(FusedCPPOLoss.__init__, 1), _parameters(FusedCPPOLoss.forward, 1)
    assert not set(init) & set(forward)
    assert set(init) | set(forward) == set(function)
    for name, p in init.items():
        assert p.default == function[name].default, name
    assert list(forward.values()) == [function[name] for name in forward]  # same kind, default and annotation
    assert set(forward) == {"hidden", "weight", "bias", *FIELDS}


@pytest.mark.parametrize(
    "fn", [fused_cppo_loss, cppo_loss_from_logits, FusedCPPOLoss.forward, reference.fused_cppo_loss],
    ids=lambda fn: fn.__qualname__,
)  # fmt: skip
def test_every_loss_takes_the_fields_of_loss_inputs(fn):
    """Each field, as declared: those without a default positional right after the rows (``hidden, weight`` or
    ``logits``), the others keyword-only with default None; the one declaration, shown by ``inspect.signature``."""
    params = _parameters(fn)
    names = list(params)
    start = names.index("targets")
    positional = [n for n in FIELDS if n not in LossInputs._field_defaults]
    assert names[start : start + len(positional)] == positional
    assert all(params[n].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for n in names[: start + len(positional)])
    for name in FIELDS[len(positional) :]:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and params[name].default is None, name


def test_the_op_schema_holds_the_fields():
    """The custom op's arguments are the LM head's tensors and the fields, in their order (a new field is a new
    ``Tensor?`` argument without a schema written by hand)."""
    schema = torch.ops.cppo_kernels.fused_cppo_loss.default._schema
    names = [a.name for a in schema.arguments]
    assert names == ["hidden", "weight", "bias", *FIELDS, "options", "numbers"]


def _problem():
    hidden, weight, bias, targets, adv, g = problem(3, LENGTHS, 8, 24, torch.float32, logit_scale=1.0, bias=True)
    with torch.no_grad():
        logp, _ = reference.token_logprobs(hidden.double(), weight.double(), targets, bias=bias.double())
    T = sum(LENGTHS)
    old, ref, sampling = ((logp + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)).float() for _ in range(3))
    sampling[1] = float("nan")  # a token the sampler did not score
    tensors = dict(
        cu_seqlens=cu_seqlens(LENGTHS), old_logprobs=old, ref_logprobs=ref, sampling_logprobs=sampling,
        importance_weights=0.5 + torch.rand(T, generator=g),
    )  # fmt: skip
    params = [hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()]
    return params, targets, torch.tensor([0.7, -0.4, -1.1]), tensors


def test_the_module_runs_the_vllm_correction_and_the_entropy_mask():
    """The module with importance weights, sampling log-probs (the off-policy mask) and a caller's entropy cut gives
    bit for bit what the function gives, and the inputs take effect."""
    params, targets, adv, tensors = _problem()
    calls = []

    def cut(entropies):
        calls.append(entropies.numel())
        return entropies.median()

    options = dict(beta=0.04, off_policy_mask_threshold=0.05, top_entropy_quantile=0.5)
    module = FusedCPPOLoss(**options, entropy_threshold_fn=cut)
    got_loss, got = module(*params[:2], targets, adv, bias=params[2], **tensors)
    got_grads = grads(got_loss, params, 0.7)
    want_loss, want = fused_cppo_loss(*params[:2], targets, adv, bias=params[2], **tensors, **options,
                                      entropy_threshold_fn=cut)  # fmt: skip
    assert calls == [sum(LENGTHS)] * 2
    assert torch.equal(got_loss, want_loss) and list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in got)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, grads(want_loss, params, 0.7), strict=True))
    plain = {k: v for k, v in tensors.items() if k in ("cu_seqlens", "old_logprobs", "ref_logprobs")}
    without, _ = FusedCPPOLoss(**options)(*params[:2], targets, adv, bias=params[2], **plain)
    assert not torch.equal(without, got_loss)


def test_the_tensors_bind_as_the_signature_says():
    """Python's rules of the expanded signature: the keyword tensors are keyword-only, the positional ones
    required; the tensors may also come by name."""
    params, targets, adv, tensors = _problem()
    h, w, b = (p.detach() for p in params)
    with pytest.raises(TypeError, match=r"fused_cppo_loss\(\) takes 4 positional arguments but 5 were given"):
        fused_cppo_loss(h, w, targets, adv, tensors["cu_seqlens"])
    with pytest.raises(TypeError, match=r"fused_cppo_loss\(\) missing required arguments: 'advantages'"):
        fused_cppo_loss(h, w, targets, cu_seqlens=tensors["cu_seqlens"])
    by_name, _ = fused_cppo_loss(hidden=h, weight=w, targets=targets, advantages=adv, bias=b, **tensors)
    assert torch.equal(by_name, fused_cppo_loss(h, w, targets, adv, bias=b, **tensors)[0])


SELECTION = {"group_advantages": ADVANTAGE_FIELDS, "select_completions": SELECT_FIELDS}
SELECTION["cppo_select"] = SelectOptions._fields


@pytest.mark.parametrize("name", list(SELECTION))
def test_the_selection_functions_take_the_fields_of_select_options(name):
    """Each public selection function and its oracle: the input and ``group_size`` positional, then the fields of
    SelectOptions it uses, with SelectOptions' defaults (``keep`` positional, the others keyword-only): one
    signature, the same for both."""
    fns = getattr(cppo_kernels, name), getattr(reference, name)
    params = [_parameters(fn) for fn in fns]
    assert [list(p) for p in params] == [list(params[0])] * 2
    assert [(p.name, p.kind, p.default) for p in params[0].values()] == [
        (p.name, p.kind, p.default) for p in params[1].values()
    ]
    names = list(params[0])
    assert names[1] == "group_size" and set(names[2:]) == set(SELECTION[name])
    for field in SELECTION[name]:
        p = params[0][field]
        assert p.default == SelectOptions._field_defaults[field], field
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if field == "keep" else inspect.Parameter.KEYWORD_ONLY
        assert p.kind is kind, field


def test_the_selection_binds_as_the_signature_says():
    """keep positionally or by name, the other options by keyword only; the oracle alike."""
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 2.0, 1.0, 0.0, 1.0])
    for fn in (cppo_kernels.cppo_select, reference.cppo_select):
        by_position, by_name = fn(rewards, 4, 2), fn(rewards, group_size=4, keep=2)
        assert all(torch.equal(a, b) for a, b in zip(by_position, by_name))
        with pytest.raises(TypeError, match=r"takes 3 positional arguments but 4 were given"):
            fn(rewards, 4, 2, None)
        with pytest.raises(TypeError, match="multiple values for argument 'keep'"):
            fn(rewards, 4, 2, keep=2)
