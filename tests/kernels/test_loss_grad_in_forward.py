"""The gradient-in-forward mode of fused_cppo_loss (issue 13): the analytic per-token gradient against autograd, the
mode against the two-pass path, when it runs (and when nothing extra is done), and every way a loss's gradient
can be asked for (scaled, accumulated, used twice, backward twice, double backward)."""

from __future__ import annotations

import math
import re

import loss_cases
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from loss_cases import assert_close, cu_seqlens, hypothesis_settings

from cppo_kernels import LossConfig, _loss_gemm, _loss_torch, _policy, fused_cppo_loss, reference
from cppo_kernels import loss as loss_module
from cppo_kernels._carriers import LossInputs

#: Special log-ratios: the clamp's bounds (and just past them), the clip bounds of eps 0.2 / 0.28, far outside.
SPECIAL = [0.0, 20.0, -20.0, 20.5, -20.5, 1000.0, -1000.0, math.log(0.8), math.log(1.2), math.log(1.28), 0.1, -0.1]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 8 tokens, so the small test shapes span several chunks and a padded tail."""
    monkeypatch.setattr(_loss_torch, "FWD_TOKENS", 8)
    monkeypatch.setattr(_loss_torch, "BWD_TOKENS", 16)
    monkeypatch.setattr(_loss_torch, "BWD_VOCAB", 64)
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")


def _values(draw, n: int, special: list[float], scale: float) -> torch.Tensor:
    return torch.tensor(
        [draw(st.sampled_from(special)) if draw(st.booleans()) else draw(st.floats(-scale, scale)) for _ in range(n)]
    )


@hypothesis_settings(max_examples=60)
@given(
    data=st.data(),
    epsilons=st.sampled_from([(0.2, None), (0.2, 0.28), (0.0, 0.0), (0.1, 0.3)]),
    dual_clip=st.sampled_from([None, 3.0]),
    kl=st.sampled_from([None, "k1", "k2", "k3"]),
    with_old=st.booleans(),
)
def test_analytic_token_gradient_equals_autograd(data, epsilons, dual_clip, kl, with_old):
    """:func:`_policy.token_grad` is autograd's gradient through :func:`_policy.token_terms`, at clamp and clip bounds,
    on the dual-clip cap and on ties (A = 0) too."""
    n = 24
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    logp = -torch.randint(0, 64, (n,), generator=gen) / 8  # dyadic: logp - old hits the clamp bounds exactly
    adv = _values(data.draw, n, [0.0, 1.0, -1.0, 1e6, -1e6], 3.0)
    old = (logp - _values(data.draw, n, SPECIAL, 3.0)) if with_old else None
    ref = (logp + _values(data.draw, n, SPECIAL, 3.0)) if kl else None
    cfg = LossConfig(epsilon_low=epsilons[0], epsilon_high=epsilons[1], dual_clip=dual_clip, beta=0.04 if kl else 0.0,
                     kl_estimator=kl or "k3")  # fmt: skip
    x = logp.clone().requires_grad_()
    per_token, _, _ = _policy.token_terms(x, adv, old, ref, cfg)
    (want,) = torch.autograd.grad(per_token.sum(), x)
    got = _policy.token_grad(logp, adv, old, ref, cfg)
    assert torch.isfinite(got).all()
    # the KL term's gradient beta * (1 - exp(ref - logp)) cancels near ref = logp: each form rounds the exp to fp32,
    # so the two agree to a few ulps of beta * (1 + exp(ref - logp)), not of the (small) difference itself
    slack = 4 * 2**-23 * cfg.beta * (1 + torch.exp((ref - logp).clamp(-20, 20))) if kl else torch.zeros(n)
    err = (got - want).abs()
    assert (err <= 1e-6 * want.abs() + slack + 1e-30).all(), (err - 1e-6 * want.abs() - slack).max()


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_token_weights_are_the_aggregation_gradient(loss_agg):
    lengths = [3, 0, 7, 1]
    cu = cu_seqlens(lengths)
    batch = _policy.batch_constants(LossInputs(None, torch.randn(4), cu_seqlens=cu), sum(lengths))
    cfg = LossConfig(loss_agg=loss_agg, max_completion_length=9)
    per_token = torch.randn(sum(lengths), requires_grad=True)
    (want,) = torch.autograd.grad(_policy.aggregate(per_token, batch, cfg), per_token)
    torch.testing.assert_close(_policy.token_weights(batch, cfg), want, rtol=1e-7, atol=0)


def _inputs(seed: int, lengths: list[int], dtype: torch.dtype, *, bias: bool = True, offsets: float = 0.3):
    hidden, weight, b, targets, adv, g = loss_cases.problem(seed, lengths, 24, 50, dtype, logit_scale=4.0, bias=bias)
    with torch.no_grad():
        logp, _ = reference.token_logprobs(
            hidden.double(), weight.double(), targets, bias=None if b is None else b.double()
        )
    old, ref = ((logp + offsets * torch.randn(logp.shape, generator=g, dtype=torch.float64)).float() for _ in "or")
    return hidden, weight, b, targets, adv, old, ref


def _run(mode: str, hidden, weight, bias, targets, adv, cu, upstream: float = 0.7, **options):
    params = [x.clone().requires_grad_() for x in (hidden, weight) + (() if bias is None else (bias,))]
    b = params[2] if bias is not None else None
    loss, metrics = fused_cppo_loss(params[0], params[1], targets, adv, cu_seqlens=cu, bias=b, mode=mode, **options)
    return loss, metrics, torch.autograd.grad(loss * upstream, params)


@hypothesis_settings(max_examples=25)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(0, 13), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    temperature=st.sampled_from([1.0, 0.7]),
    dual_clip=st.sampled_from([None, 2.0]),
    kl=st.sampled_from([None, "k1", "k2", "k3"]),
    loss_agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
    with_old=st.booleans(),
    with_bias=st.booleans(),
    compute_entropy=st.booleans(),
    offsets=st.sampled_from([0.3, 30.0]),
)
def test_grad_in_forward_equals_two_pass(
    seed, lengths, dtype, temperature, dual_clip, kl, loss_agg, with_old, with_bias, compute_entropy, offsets
):
    """Same loss and metrics (the same log-probs, bit for bit, and per-token math), gradients within fp32 rounding
    (one rounding more for a bf16/fp16 gradient scaled in the backward)."""
    assume(dtype != torch.float16 or offsets < 1)  # e^20-sized ratios give gradients beyond fp16's range
    hidden, weight, bias, targets, adv, old, ref = _inputs(seed, lengths, dtype, bias=with_bias, offsets=offsets)
    options = dict(
        temperature=temperature, dual_clip=dual_clip, beta=0.04 if kl else 0.0, kl_estimator=kl or "k3",
        loss_agg=loss_agg, max_completion_length=13, compute_entropy=compute_entropy,
        old_logprobs=old if with_old else None, ref_logprobs=ref if kl else None,
    )  # fmt: skip
    args = (hidden, weight, bias, targets, adv, cu_seqlens(lengths))
    loss, metrics, grads = _run("grad-in-forward", *args, **options)
    want, want_metrics, want_grads = _run("two-pass", *args, **options)
    assert_close("loss", loss, want, 1e-6)
    assert metrics.keys() == want_metrics.keys()
    for key in metrics:
        assert_close(key, metrics[key], want_metrics[key], 1e-6)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    for name, got, exp in zip(("dhidden", "dweight", "dbias"), grads, want_grads):
        assert got.dtype == exp.dtype == dtype
        assert_close(name, got, exp, tol, 1e-7 + (4 * 2**-24 if dtype == torch.float16 else 0.0))


def test_logprobs_are_bit_identical_and_batch_invariant():
    """The forward of the gradient-in-forward pass is the two-pass forward: identical log-probs, entropies and LSEs,
    and a token's values do not depend on what it is packed with (fixed chunks, zero-padded tail)."""
    hidden, weight, bias, targets, _, _, _ = _inputs(3, [9, 13, 5], torch.float32)
    grads = dict(needs_hidden_grad=True, needs_weight_grad=True, needs_bias_grad=True, compute_entropy=True)
    plain = _loss_torch.logprobs_fwd(hidden, weight, targets, bias, compute_entropy=True)
    fused = _loss_torch.logprobs_fwd_grads(hidden, weight, targets, bias, lambda a, b, lp: torch.ones_like(lp), **grads)
    assert all(torch.equal(a, b) for a, b in zip(plain, fused[:3]))
    tail = _loss_torch.logprobs_fwd_grads(
        hidden[11:], weight, targets[11:], bias, lambda a, b, lp: torch.ones_like(lp), **grads
    )
    assert all(torch.equal(a[11:], b) for a, b in zip(plain, tail[:3]))


@pytest.mark.parametrize("verdict", ["probed", "forced padding"])
def test_a_partial_chunk_keeps_a_tokens_bits(verdict, monkeypatch):
    """A partial chunk's GEMM is its rows rounded up to TAIL_TOKENS where the probe finds this BLAS giving a row the
    same bits at every such height, else a zero-padded full chunk (forced here): either way a token's log-prob,
    entropy and LSE, in both forwards, are bit for bit those it has inside a full chunk."""
    monkeypatch.setattr(_loss_torch, "TAIL_TOKENS", 4)
    monkeypatch.setattr(_loss_torch, "_BLOCK_PROBES", {})
    if verdict == "forced padding":
        monkeypatch.setattr(_loss_torch, "block_rows", lambda w, bias, f, C: C)
    hidden, weight, bias, targets, _, _, _ = _inputs(7, [9, 13, 5], torch.float32)  # 27 tokens: 3 chunks of 8 + 3
    # (this machine's BLAS: rows bit-identical at 4 and 8 rows, not at 2 or 3: the probe decides, never a guess)
    grads = dict(needs_hidden_grad=True, needs_weight_grad=True, needs_bias_grad=True, compute_entropy=True)
    whole = _loss_torch.logprobs_fwd(hidden, weight, targets, bias, compute_entropy=True)
    heights, real = [], _loss_torch._logits_into

    def spy(z, h, *args):
        heights.append(z.shape[0])
        return real(z, h, *args)

    monkeypatch.setattr(_loss_torch, "_logits_into", spy)
    for lo, hi in ((0, 3), (3, 10), (16, 27), (0, 27)):  # in full chunks there, in partial ones here
        part = _loss_torch.logprobs_fwd(hidden[lo:hi], weight, targets[lo:hi], bias, compute_entropy=True)
        assert all(torch.equal(a[lo:hi], b) for a, b in zip(whole, part)), (lo, hi)
        fused = _loss_torch.logprobs_fwd_grads(
            hidden[lo:hi], weight, targets[lo:hi], bias, lambda a, b, lp: torch.ones_like(lp), **grads
        )
        assert all(torch.equal(a[lo:hi], b) for a, b in zip(whole, fused[:3])), (lo, hi)
    short = verdict == "probed" and all(_loss_torch._BLOCK_PROBES.values())
    assert verdict == "forced padding" or len(_loss_torch._BLOCK_PROBES) == 1  # probed once, by the first call
    tail = 4 if short else 8  # a partial chunk of 3 tokens
    per_call = [[tail], [8], [8, tail], [8, 8, 8, tail]]  # 3, 7, 8 + 3 and 3 x 8 + 3 tokens
    assert heights == [h for call in per_call for h in call * 2], heights  # each twice: both forwards


SEQUENCE_RULES = {
    "gspo": dict(importance_sampling="sequence"),
    "vespo": dict(surrogate="vespo"),
    "off-policy": dict(off_policy_mask_threshold=0.05),
    "luspo+weights": dict(importance_sampling="sequence", loss_agg="seq-mean-token-sum", delta=1.5),
}


@pytest.mark.parametrize("rule", SEQUENCE_RULES)
def test_sequence_rules_run_in_chunks_of_whole_sequences(rule, monkeypatch):
    """Options that need a whole sequence run gradient-in-forward in chunks of whole sequences (every sequence within
    a chunk of 8): the loss, metrics and gradients equal the two-pass path's, and no chunk splits a sequence."""
    lengths = [3, 4, 0, 6, 2, 7, 5]  # greedy chunks: [3, 4, 0], [6, 2], [7], [5]
    seen = []
    real = _loss_torch.logprobs_fwd_grads

    def spy(*args, chunks=None, **kwargs):
        seen.append(chunks)
        return real(*args, chunks=chunks, **kwargs)

    monkeypatch.setattr(_loss_torch, "logprobs_fwd_grads", spy)
    hidden, weight, bias, targets, adv, old, ref = _inputs(13, lengths, torch.float32)
    g = torch.Generator().manual_seed(2)
    options = dict(beta=0.04, old_logprobs=old, ref_logprobs=ref, **SEQUENCE_RULES[rule])
    options["sampling_logprobs"] = old + 0.1 * torch.randn(old.shape, generator=g)
    options["importance_weights"] = torch.rand(len(lengths), generator=g) + 0.5
    args = (hidden, weight, bias, targets, adv, cu_seqlens(lengths))
    loss, metrics, grads = _run("grad-in-forward", *args, **options)
    assert seen == [[(0, 7), (7, 15), (15, 22), (22, 27)]], seen
    want, want_metrics, want_grads = _run("two-pass", *args, **options)
    assert_close("loss", loss, want, 1e-6)
    assert set(metrics) == set(want_metrics)
    for key in want_metrics:
        assert_close(key, metrics[key], want_metrics[key], 1e-5, 1e-7)
    for name, got, exp in zip(("dhidden", "dweight", "dbias"), grads, want_grads):
        assert_close(name, got, exp, 1e-5, 1e-7)


def test_a_sequence_longer_than_a_chunk_takes_the_two_pass_path(monkeypatch):
    """Under mode="auto" a sequence rule with a sequence longer than a chunk runs two-pass; an explicit
    mode="grad-in-forward" says why it cannot."""
    calls = _spy(monkeypatch)
    hidden, weight, bias, targets, adv, old, _ = _inputs(5, [9, 4], torch.float32)  # 9 > the chunk of 8
    h = hidden.clone().requires_grad_()
    fused_cppo_loss(h, weight, targets, adv, cu_seqlens=cu_seqlens([9, 4]), importance_sampling="sequence")
    assert calls == []
    with pytest.raises(ValueError, match=r"in chunks of whole sequences, on the CPU only, each sequence at most 8"):
        fused_cppo_loss(
            h, weight, targets, adv, cu_seqlens=cu_seqlens([9, 4]), importance_sampling="sequence",
            mode="grad-in-forward",
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_gemms_take_the_real_tokens_only(dtype, monkeypatch):
    """A batch shorter than a chunk (one kept completion): the logits GEMM runs the fixed, zero-padded chunk (the
    log-probs stay batch-invariant), the two gradient GEMMs only the real tokens; the gradients still equal the
    two-pass ones, which never pad."""
    lengths = [3, 2]  # 5 tokens in a chunk of 8
    shapes = []
    real = _loss_torch._matmul

    def spy(a, b, out, **kwargs):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, out, **kwargs)

    monkeypatch.setattr(_loss_torch, "_matmul", spy)
    hidden, weight, bias, targets, adv, old, ref = _inputs(11, lengths, dtype)
    options = dict(beta=0.04, old_logprobs=old, ref_logprobs=ref, max_completion_length=4)
    args = (hidden, weight, bias, targets, adv, cu_seqlens(lengths))
    loss, _, grads = _run("grad-in-forward", *args, **options)
    assert shapes == [((8, 24), (24, 50)), ((5, 50), (50, 24)), ((50, 5), (5, 24))]  # logits, dhidden, dweight
    want, _, want_grads = _run("two-pass", *args, **options)
    assert_close("loss", loss, want, 1e-6)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-7}[dtype]
    for name, got, exp in zip(("dhidden", "dweight", "dbias"), grads, want_grads):
        assert_close(name, got, exp, tol, 1e-7)


def _spy(monkeypatch, module=_loss_torch) -> list[int]:
    """Counts the calls of ``module``'s gradient-in-forward pass (the torch backend's by default)."""
    calls = []
    real = module.logprobs_fwd_grads

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "logprobs_fwd_grads", spy)
    return calls


def test_when_the_gradients_are_computed_in_the_forward(monkeypatch):
    """Only with grad mode on, an input requiring grad and no option needing the whole call (the entropy mask or
    bonus); the CPU rule for the torch backend picks it under mode="auto"; the rule table decides (the GPU kit
    overrides it)."""
    calls = _spy(monkeypatch)
    hidden, weight, bias, targets, adv, old, _ = _inputs(5, [6, 4], torch.float32)
    cu = cu_seqlens([6, 4])
    h = hidden.clone().requires_grad_()
    with torch.no_grad():
        fused_cppo_loss(h, weight, targets, adv, cu_seqlens=cu, old_logprobs=old)  # the old-policy-style pass
    fused_cppo_loss(hidden, weight, targets, adv, cu_seqlens=cu, old_logprobs=old)  # nothing requires grad
    fused_cppo_loss(h, weight, targets, adv, cu_seqlens=cu, top_entropy_quantile=0.5)  # the whole call: two-pass
    fused_cppo_loss(h, weight, targets, adv, cu_seqlens=cu, mode="two-pass")
    assert calls == []
    loss, _ = fused_cppo_loss(h, weight, targets, adv, cu_seqlens=cu)  # auto on the CPU torch backend
    assert calls == [1] and loss.requires_grad
    monkeypatch.setitem(loss_module.MODE_RULES, ("cpu", "torch", None), "two-pass")
    fused_cppo_loss(h, weight, targets, adv, cu_seqlens=cu)
    assert calls == [1]
    monkeypatch.setitem(loss_module.MODE_RULES, ("cpu", "torch", "float32"), "grad-in-forward")  # a dtype class
    fused_cppo_loss(h, weight, targets, adv, cu_seqlens=cu)
    assert calls == [1, 1]
    assert loss_module.resolve_mode("auto", h) == "grad-in-forward"


def test_mode_errors():
    hidden, weight, _, targets, adv, _, _ = _inputs(5, [6, 4], torch.float32, bias=False)
    with pytest.raises(ValueError, match="mode must be one of"):
        fused_cppo_loss(hidden, weight, targets, adv, cu_seqlens=cu_seqlens([6, 4]), mode="fast")
    whole_call_options = {  # the sequence rules run in chunks of whole sequences (tested above)
        "top_entropy_quantile < 1": dict(top_entropy_quantile=0.2),
        "entropy_coef != 0": dict(entropy_coef=0.01),
    }
    for name, options in whole_call_options.items():
        with pytest.raises(
            ValueError, match=f"mode='grad-in-forward' cannot run {re.escape(name)}: it needs the whole"
        ):
            fused_cppo_loss(hidden, weight, targets, adv, cu_seqlens=cu_seqlens([6, 4]), mode="grad-in-forward",
                            **options)  # fmt: skip


@pytest.fixture
def problem():
    hidden, weight, bias, targets, adv, old, ref = _inputs(11, [7, 9, 3], torch.float32)
    kwargs = dict(cu_seqlens=cu_seqlens([7, 9, 3]), old_logprobs=old, ref_logprobs=ref, beta=0.04)
    return hidden, weight, bias, targets, adv, kwargs


def _params(hidden, weight, bias):
    return [x.clone().requires_grad_() for x in (hidden, weight, bias)]


def _two_pass_grads(problem, scale: float) -> list[torch.Tensor]:
    hidden, weight, bias, targets, adv, kwargs = problem
    p = _params(hidden, weight, bias)
    loss, _ = fused_cppo_loss(p[0], p[1], targets, adv, bias=p[2], mode="two-pass", **kwargs)
    return list(torch.autograd.grad(loss * scale, p))


def _assert_grads(got, want) -> None:
    for name, a, b in zip(("dhidden", "dweight", "dbias"), got, want):
        assert_close(name, a, b, 2e-6)


@pytest.mark.parametrize("scale", [1.0, 0.25, -3.0, 0.0])
def test_scaled_loss(problem, scale):
    hidden, weight, bias, targets, adv, kwargs = problem
    p = _params(hidden, weight, bias)
    loss, _ = fused_cppo_loss(p[0], p[1], targets, adv, bias=p[2], mode="grad-in-forward", **kwargs)
    (loss * scale).backward()
    _assert_grads([x.grad for x in p], _two_pass_grads(problem, scale))


def test_micro_batches_accumulate(problem):
    """Two micro-batches, each forward then backward, accumulate into .grad as on the two-pass path."""
    hidden, weight, bias, targets, adv, kwargs = problem
    p = _params(hidden, weight, bias)
    for scale in (0.5, 2.0):
        loss, _ = fused_cppo_loss(p[0], p[1], targets, adv, bias=p[2], mode="grad-in-forward", **kwargs)
        (loss * scale).backward()
    _assert_grads([x.grad for x in p], _two_pass_grads(problem, 2.5))


def test_loss_used_twice_in_one_graph(problem):
    """Two uses of the loss sum into one backward call (scaled by 1.5)."""
    hidden, weight, bias, targets, adv, kwargs = problem
    p = _params(hidden, weight, bias)
    loss, _ = fused_cppo_loss(p[0], p[1], targets, adv, bias=p[2], mode="grad-in-forward", **kwargs)
    (loss + 0.5 * loss).backward()
    _assert_grads([x.grad for x in p], _two_pass_grads(problem, 1.5))


def test_backward_twice_through_one_graph_recomputes(problem, monkeypatch):
    """retain_graph: the first backward takes the gradients computed in the forward, the second recomputes them
    (the two-pass backward from the saved per-token upstream gradients): both correct."""
    hidden, weight, bias, targets, adv, kwargs = problem
    p = _params(hidden, weight, bias)
    loss, _ = fused_cppo_loss(p[0], p[1], targets, adv, bias=p[2], mode="grad-in-forward", **kwargs)
    bwd = []
    real = _loss_torch.logprobs_bwd
    monkeypatch.setattr(_loss_torch, "logprobs_bwd", lambda *a, **k: bwd.append(1) or real(*a, **k))
    first = torch.autograd.grad(loss * 2.0, p, retain_graph=True)
    assert bwd == []
    second = torch.autograd.grad(loss * -0.5, p)
    assert bwd == [1]
    _assert_grads(first, _two_pass_grads(problem, 2.0))
    _assert_grads(second, _two_pass_grads(problem, -0.5))


@pytest.mark.parametrize("mode", ["grad-in-forward", "two-pass"])
def test_double_backward_raises(problem, mode):
    """create_graph=True: a clear error (neither backward is differentiable), never gradients that silently carry
    no second derivative."""
    hidden, weight, bias, targets, adv, kwargs = problem
    p = _params(hidden, weight, bias)
    loss, _ = fused_cppo_loss(p[0], p[1], targets, adv, bias=p[2], mode=mode, **kwargs)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(loss, p, create_graph=True)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_only_some_inputs_require_grad(problem, which):
    """A frozen LM head, a frozen trunk, a trainable bias only: the gradients asked for, no others computed."""
    hidden, weight, bias, targets, adv, kwargs = problem
    p = [x.clone() for x in (hidden, weight, bias)]
    p[which].requires_grad_()
    calls = []
    real = _loss_torch.logprobs_fwd_grads

    def spy(*args, **kw):
        calls.append((kw["needs_hidden_grad"], kw["needs_weight_grad"], kw["needs_bias_grad"]))
        return real(*args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_loss_torch, "logprobs_fwd_grads", spy)
        loss, _ = fused_cppo_loss(p[0], p[1], targets, adv, bias=p[2], mode="grad-in-forward", **kwargs)
    assert calls == [tuple(i == which for i in range(3))]
    (got,) = torch.autograd.grad(loss * 0.3, [p[which]])
    assert_close("grad", got, _two_pass_grads(problem, 0.3)[which], 2e-6)


def test_padded_layout_and_empty_batch():
    hidden, weight, bias, targets, adv, old, _ = _inputs(2, [4, 0, 6], torch.float32)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, 1:5], mask[2, :6] = True, True
    hp = torch.zeros(3, 7, 24).masked_scatter(mask[..., None].expand(3, 7, 24), hidden)
    tp = torch.zeros(3, 7, dtype=torch.long).masked_scatter(mask, targets)
    op = torch.zeros(3, 7).masked_scatter(mask, old)
    got, want = ([*_run(m, hp, weight, bias, tp, adv, None, mask=mask.float(), old_logprobs=op)] for m in (
        "grad-in-forward", "two-pass"))  # fmt: skip
    assert torch.equal(got[0], want[0])
    _assert_grads(got[2], want[2])
    empty = _run("grad-in-forward", hidden[:0], weight, bias, targets[:0], adv[:2], cu_seqlens([0, 0]))
    assert empty[0].item() == 0.0 and all(torch.equal(g, torch.zeros_like(g)) for g in empty[2][1:])


def test_explicit_mode_on_the_triton_backend(monkeypatch):
    """mode="grad-in-forward" on the Triton backend runs the GEMM path (GEMMs around the Triton row pass, here under
    the interpreter), not the torch twin; it agrees with the Triton two-pass kernels."""
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "triton")
    calls, gemm_calls = _spy(monkeypatch), _spy(monkeypatch, _loss_gemm)
    hidden, weight, bias, targets, adv, old, ref = _inputs(8, [5, 11], torch.float32)
    args = (hidden, weight, bias, targets, adv, cu_seqlens([5, 11]))
    options = dict(old_logprobs=old, ref_logprobs=ref, beta=0.04)
    loss, _, grads = _run("grad-in-forward", *args, **options)
    assert calls == [] and gemm_calls == [1]
    want, _, want_grads = _run("auto", *args, **options)  # the CPU rule of the Triton backend: two-pass
    assert calls == [] and gemm_calls == [1]
    assert_close("loss", loss, want, 1e-6)
    for name, got, exp in zip(("dhidden", "dweight", "dbias"), grads, want_grads):
        assert_close(name, got, exp, 1e-4)


def test_both_modes_take_their_backend_from_the_dispatcher(monkeypatch):
    """Each mode asks the dispatcher for its backend module, naming the mode it runs (gradient-in-forward only when
    gradients are wanted; the entropy mask takes the two-pass path under mode="auto")."""
    asked = []
    real = loss_module.backend_module
    monkeypatch.setattr(
        loss_module, "backend_module", lambda op, t, *, mode=None: asked.append((op, mode)) or real(op, t, mode=mode)
    )
    hidden, weight, bias, targets, adv, old, _ = _inputs(4, [6, 5], torch.float32)
    cu = cu_seqlens([6, 5])
    for mode in ("grad-in-forward", "two-pass", "auto"):
        _run(mode, hidden, weight, bias, targets, adv, cu, old_logprobs=old)
    _run("auto", hidden, weight, bias, targets, adv, cu, old_logprobs=old, top_entropy_quantile=0.5)
    fused_cppo_loss(hidden, weight, targets, adv, cu_seqlens=cu, mode="grad-in-forward")  # no gradient wanted
    modes = ["grad-in-forward", "two-pass", "grad-in-forward", "two-pass", "two-pass"]
    assert asked == [("loss", mode) for mode in modes]


def test_the_torch_backend_runs_gradient_in_forward_on_its_own_code(monkeypatch):
    """The torch backend's gradient-in-forward is the chunked torch code (CPU BLAS / cuBLAS), never the GEMM path
    of the Triton backend; a forced Triton backend that cannot run here (no interpreter) raises its error in both
    modes."""
    calls, gemm_calls = _spy(monkeypatch), _spy(monkeypatch, _loss_gemm)
    hidden, weight, bias, targets, adv, old, _ = _inputs(9, [7, 4], torch.float32)
    args = (hidden, weight, bias, targets, adv, cu_seqlens([7, 4]))
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")
    loss, _, grads = _run("grad-in-forward", *args, old_logprobs=old)
    assert calls == [1] and gemm_calls == [] and torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for mode in ("grad-in-forward", "two-pass"):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            _run(mode, *args, old_logprobs=old)


def test_only_cuda_bf16_takes_half_precision_gemms():
    """fp16 would overflow the weight gradient's scaled operand (ratios up to e^20): it runs fp32 GEMMs."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _loss_torch.half_gemms(cuda, torch.bfloat16) == _loss_torch._MM_OUT_DTYPE
    assert not any(_loss_torch.half_gemms(cuda, d) for d in (torch.float16, torch.float32))
    assert not any(_loss_torch.half_gemms(cpu, d) for d in (torch.bfloat16, torch.float16, torch.float32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_gemm_path_on_cpu(dtype, monkeypatch):
    """The CUDA bf16 branch (fp16 too, should the rule ever allow it: weights kept in their dtype, GEMMs with fp32
    outputs, the dz operand rounded to the weight's dtype), run on the CPU with the one cuBLAS call emulated: it
    matches the two-pass path."""
    monkeypatch.setattr(_loss_torch, "_compute_weight", lambda weight: weight)
    gemms = []
    monkeypatch.setattr(
        _loss_torch,
        "_half_gemm",
        lambda a, b, out=None: gemms.append(a.dtype) or torch.mm(a.float(), b.float(), out=out),
    )
    hidden, weight, bias, targets, adv, old, ref = _inputs(6, [9, 12, 4], dtype)
    args = (hidden, weight, bias, targets, adv, cu_seqlens([9, 12, 4]))
    options = dict(old_logprobs=old, ref_logprobs=ref, beta=0.04, temperature=0.8)
    loss, _, grads = _run("grad-in-forward", *args, **options)
    assert gemms == [dtype] * 3 * 4  # 4 chunks of 8 tokens: logits, dhidden, dweight each
    want, _, want_grads = _run("two-pass", *args, **options)
    assert_close("loss", loss, want, 1e-5)
    for name, got, exp in zip(("dhidden", "dweight", "dbias"), grads, want_grads):
        assert got.dtype == dtype
        assert_close(name, got, exp, 2**-6 if dtype == torch.bfloat16 else 2**-9, 1e-6)  # 8 / 11 mantissa bits


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLAS bf16 GEMMs with fp32 outputs)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_grad_in_forward_matches_the_triton_two_pass(dtype, monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "auto")
    hidden, weight, bias, targets, adv, old, ref = (
        None if x is None else x.cuda() for x in _inputs(4, [300, 700, 100], dtype)
    )
    args = (hidden, weight, bias, targets, adv, cu_seqlens([300, 700, 100]).cuda())
    options = dict(old_logprobs=old, ref_logprobs=ref, beta=0.04)
    loss, _, grads = _run("grad-in-forward", *args, **options)
    want, _, want_grads = _run("two-pass", *args, **options)
    assert_close("loss", loss, want, 1e-5)
    for name, got, exp in zip(("dhidden", "dweight", "dbias"), grads, want_grads):
        assert_close(name, got, exp, 2e-2 if dtype == torch.bfloat16 else 1e-4)


def test_sequence_chunks_keep_empty_sequences_and_fill_greedily():
    """Empty sequences join the chunk they sit in (a chunk never starts empty); full chunks close at the limit."""
    chunks = _loss_torch.sequence_chunks
    assert chunks(torch.tensor([0, 0, 3, 0]), 8) == [(0, 3, 0, 4)]
    assert chunks(torch.tensor([0, 0]), 8) == [(0, 0, 0, 2)]
    assert chunks(torch.tensor([8, 8, 0]), 8) == [(0, 8, 0, 1), (8, 16, 1, 3)]
    assert chunks(torch.tensor([5, 3, 1]), 8) == [(0, 8, 0, 2), (8, 9, 2, 3)]


def test_vespo_of_a_call_without_tokens_matches_the_two_pass_path():
    """No chunk runs: the empty sequences' gamma weights still come out as the two-pass path's (the metric)."""
    w = torch.randn(10, 8, requires_grad=True)
    got = []
    for mode in ("grad-in-forward", "two-pass"):
        h = torch.randn(0, 8, requires_grad=True)
        loss, metrics = fused_cppo_loss(
            h, w, torch.zeros(0, dtype=torch.long), torch.tensor([1.0, -1.0]),
            cu_seqlens=torch.zeros(3, dtype=torch.long), surrogate="vespo", importance_weights=torch.tensor([2.0, 0.5]),
            mode=mode,
        )  # fmt: skip
        got.append((float(loss.detach()), {k: float(v) for k, v in metrics.items()}))
    assert got[0] == got[1] and got[0][1]["vespo_phi_mean"] > 0, got
