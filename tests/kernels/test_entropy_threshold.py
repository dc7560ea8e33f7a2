"""``entropy_threshold_fn``: the cut of ``top_entropy_quantile``'s entropy mask given by the caller (TRL's quantile
over every process's tokens), against the float64 oracle with that cut, on every CPU path and the logits path."""

from __future__ import annotations

import pytest
import torch
from loss_cases import TOL, assert_close, cu_seqlens, grads, problem

from cppo_kernels import LossConfig, cppo_loss_from_logits, fused_cppo_loss, reference

LENGTHS = [5, 0, 7, 4, 6]
OPTIONS = dict(top_entropy_quantile=0.4, entropy_coef=0.05, beta=0.04, temperature=0.9)


def _inputs(seed: int = 11):
    hidden, weight, bias, targets, adv, g = problem(seed, LENGTHS, 16, 48, torch.float32, logit_scale=3.0, bias=True)
    T = hidden.shape[0]
    ref = -torch.rand(T, generator=g) * 4
    old = -torch.rand(T, generator=g) * 4
    return hidden, weight, bias, targets, adv, dict(cu_seqlens=cu_seqlens(LENGTHS), old_logprobs=old, ref_logprobs=ref)


def _oracle_entropy(hidden, weight, bias, targets) -> torch.Tensor:
    _, entropy = reference.token_logprobs(
        hidden.double(), weight.double(), targets, temperature=0.9, bias=bias.double()
    )
    return entropy.detach()


def test_the_cut_is_the_callers(loss_path):
    """The mask keeps the tokens at or above the cut the function returns (here the quantile of this call's
    entropies and a second process's, as a gathering caller computes it): loss, metrics and gradients equal the
    oracle's with that cut. The function is called once, with the call's detached fp32 entropies."""
    hidden, weight, bias, targets, adv, tensors = _inputs()
    entropy = _oracle_entropy(hidden, weight, bias, targets)
    other = torch.rand(9, generator=torch.Generator().manual_seed(4)) * float(entropy.max())
    seen = []

    def cut(h: torch.Tensor) -> torch.Tensor:
        seen.append(h)
        return torch.quantile(torch.cat([h, other.float()]), 1.0 - OPTIONS["top_entropy_quantile"])

    params = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
    loss, metrics = fused_cppo_loss(params[0], params[1], targets, adv, bias=params[2], **tensors, **OPTIONS,
                                    entropy_threshold_fn=cut)  # fmt: skip
    assert len(seen) == 1 and seen[0].shape == (sum(LENGTHS),) and seen[0].dtype == torch.float32
    assert not seen[0].requires_grad
    torch.testing.assert_close(seen[0].double(), entropy, atol=1e-5, rtol=1e-5)
    want_cut = float(torch.quantile(torch.cat([entropy, other.double()]), 1.0 - OPTIONS["top_entropy_quantile"]))
    local_cut = float(torch.quantile(entropy, 1.0 - OPTIONS["top_entropy_quantile"]))
    assert abs(want_cut - local_cut) > 1e-3  # the gathered cut differs from the call's own: the test can tell
    params64 = [x.double().requires_grad_() for x in (hidden, weight, bias)]
    want, want_metrics = reference.fused_cppo_loss(
        params64[0], params64[1], targets, adv.double(), bias=params64[2], cu_seqlens=tensors["cu_seqlens"],
        old_logprobs=tensors["old_logprobs"].double(), ref_logprobs=tensors["ref_logprobs"].double(),
        config=LossConfig(**OPTIONS), entropy_threshold=want_cut,
    )  # fmt: skip
    default, _ = fused_cppo_loss(hidden, weight, targets, adv, bias=bias, **tensors, **OPTIONS)
    assert abs(float(default) - float(want.detach())) > 1e-4  # and the loss moved with the cut
    assert_close("loss", loss, want, TOL[torch.float32][0], 1e-6)
    for key in ("policy_loss", "entropy", "kl", "num_tokens"):
        assert_close(key, metrics[key], want_metrics[key], 1e-4, 1e-6)
    upstream = 0.7
    for name, got, exp in zip(
        ("dhidden", "dweight", "dbias"), grads(loss, params, upstream), grads(want, params64, upstream)
    ):  # noqa: E501
        assert_close(name, got, exp, TOL[torch.float32][1 if loss_path[0] == "torch" else 2], 1e-7)


def test_the_calls_own_quantile_is_the_default():
    """A function returning the call's own quantile gives the default loss."""
    hidden, weight, bias, targets, adv, tensors = _inputs(5)
    q = 1.0 - OPTIONS["top_entropy_quantile"]
    got, _ = fused_cppo_loss(hidden, weight, targets, adv, bias=bias, **tensors, **OPTIONS,
                             entropy_threshold_fn=lambda h: torch.quantile(h, q))  # fmt: skip
    want, _ = fused_cppo_loss(hidden, weight, targets, adv, bias=bias, **tensors, **OPTIONS)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)


def test_the_logits_path_takes_the_cut_too():
    hidden, weight, bias, targets, adv, tensors = _inputs(7)
    logits64 = (hidden.double() @ weight.double().t() + bias.double()).requires_grad_()
    logits = logits64.detach().float().requires_grad_()
    entropy = _oracle_entropy(hidden, weight, bias, targets)
    cut = float(entropy.median())
    loss, _ = cppo_loss_from_logits(logits, targets, adv, **tensors, **OPTIONS, entropy_threshold_fn=lambda h: cut)
    want, _ = reference.fused_cppo_loss(
        hidden.double(), weight.double(), targets, adv.double(), bias=bias.double(), cu_seqlens=tensors["cu_seqlens"],
        old_logprobs=tensors["old_logprobs"].double(), ref_logprobs=tensors["ref_logprobs"].double(),
        config=LossConfig(**OPTIONS), entropy_threshold=cut,
    )  # fmt: skip
    assert_close("loss", loss, want, 2e-5, 1e-6)


def test_an_empty_call_still_asks_for_the_cut():
    """A gathering caller must take part in every gather: the function is called for a call without tokens too."""
    hidden, weight, bias, targets, adv, tensors = _inputs()
    seen = []
    loss, metrics = fused_cppo_loss(
        hidden[:0], weight, targets[:0], adv[:1], bias=bias, cu_seqlens=torch.zeros(2, dtype=torch.int64),
        ref_logprobs=hidden[:0, 0], **OPTIONS,
        entropy_threshold_fn=lambda h: seen.append(h.shape) or 0.5,
    )  # fmt: skip
    assert seen == [(0,)] and float(loss) == 0.0 and float(metrics["num_tokens"]) == 0.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(entropy_threshold_fn=0.5), "entropy_threshold_fn must be callable"),
        (dict(entropy_threshold_fn=lambda h: 0.5, top_entropy_quantile=1.0), "top_entropy_quantile=1.0 turns off"),
        (dict(entropy_threshold_fn=lambda h: float("nan")), "must return one finite number"),
        (dict(entropy_threshold_fn=lambda h: h), r"must return one finite number .* got \(22,\)"),
        (dict(entropy_threshold_fn=lambda h: None), r"must return one finite number .* got NoneType None"),
        (dict(entropy_threshold_fn=lambda h: "0.5"), r"must return one finite number .* got str '0.5'"),
    ],
)
def test_bad_threshold_functions_are_refused(options, message):
    hidden, weight, bias, targets, adv, tensors = _inputs()
    with pytest.raises(ValueError, match=message):
        fused_cppo_loss(hidden, weight, targets, adv, bias=bias, **tensors, **{**OPTIONS, **options})


def test_torch_compile_fullgraph_refuses_a_threshold_function_by_name():
    """A Python callable cannot enter the ``cppo_kernels::fused_cppo_loss`` op: a fullgraph compile stops with the
    loss's own message (without fullgraph, dynamo runs that frame eagerly, where the function is used)."""
    hidden, weight, bias, targets, adv, tensors = _inputs()

    def step(h):
        return fused_cppo_loss(
            h, weight, targets, adv, bias=bias, **tensors, **OPTIONS, entropy_threshold_fn=lambda x: 0.3
        )[0]

    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="entropy_threshold_fn is not supported under torch.compile"):
        torch.compile(step, fullgraph=True)(hidden)
