"""The custom ops of cppo_kernels._ops (``torch.ops.cppo_kernels.*``): ``torch.library.opcheck`` of each op, and
``torch.compile(fullgraph=True)`` of a tiny model with the fused loss on CPU (inductor): no graph break, the eager
results, the eager one-line errors, and no recompilation once the batch shape has changed."""

from __future__ import annotations

import pytest
import torch
from loss_cases import assert_close
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from cppo_kernels import LossConfig, cppo_select, fused_cppo_loss, fused_logprobs
from cppo_kernels._ops import _metric_key, _metric_names, decode, encode

OPS = torch.ops.cppo_kernels
V, H = 24, 8


def _padded(batch: int, length: int, seed: int = 0):
    """Padded inputs ``[B, L]`` of a batch: ids, targets, a mask with ragged rows, advantages, old log-probs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (batch, length), generator=g)
    targets = torch.randint(0, V, (batch, length), generator=g)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = torch.arange(length) < lengths[:, None]
    adv = torch.randn(batch, generator=g)
    old = -3.0 + 0.3 * torch.randn(batch, length, generator=g)
    return ids, targets, mask, adv, old


def test_options_round_trip_exactly():
    options = dict(temperature=0.7, epsilon_high=None, beta=1 / 3, kl_estimator="k3", compute_entropy=True, n=4)
    assert decode(*encode(**options)) == options
    assert _metric_names(_metric_key(LossConfig(compute_entropy=True)))[-1] == "entropy"


def _loss_options(cfg: LossConfig, **options) -> tuple[str, torch.Tensor]:
    """The op's ``(options, numbers)`` of ``cfg`` and ``options`` (mode, needs), as ``compiled_loss`` encodes them."""
    return encode(**vars(cfg), **options, metrics=_metric_key(cfg))


def _loss_args(mode: str, padded: bool, needs: str, new_options: bool = False):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 5, H, generator=g) if padded else torch.randn(9, H, generator=g)
    weight, bias = 0.3 * torch.randn(V, H, generator=g), 0.1 * torch.randn(V, generator=g)
    for x, n in zip((hidden, weight, bias), needs):
        x.requires_grad_(n == "1")
    lead = hidden.shape[:-1]
    targets = torch.randint(0, V, lead, generator=g)
    old, ref = -3.0 + torch.randn(lead, generator=g), -3.0 + torch.randn(lead, generator=g)
    if padded:
        mask, cu, adv = torch.arange(5) < torch.tensor([[5], [2], [4]]), None, torch.randn(3, generator=g)
    else:
        mask, cu, adv = None, torch.tensor([0, 4, 4, 9]), torch.randn(3, generator=g)
    cfg = LossConfig(beta=0.04, loss_agg="seq-mean-token-mean", compute_entropy=True)
    weights = sampling = None
    if new_options:  # issue 26's options and tensors: importance weights per sequence, sampling log-probs
        cfg = LossConfig(beta=0.04, surrogate="vespo", use_bias_correction_kl=True, off_policy_mask_threshold=0.1,
                         top_entropy_quantile=0.5, entropy_coef=0.01)  # fmt: skip
        weights, sampling = torch.rand(3, generator=g), old + 0.2 * torch.randn(lead, generator=g)
    return (hidden, weight, bias, targets, adv, cu, mask, old, ref, weights, sampling,
            *_loss_options(cfg, mode=mode, needs=needs))  # fmt: skip


@pytest.mark.parametrize(
    "mode, padded, needs, new_options",
    [("grad-in-forward", False, "111", False), ("two-pass", True, "110", False), ("auto", False, "010", False),
     ("auto", True, "111", True)],
)  # fmt: skip
def test_opcheck_fused_cppo_loss(mode, padded, needs, new_options):
    """Schema, fake, autograd registration and AOT dispatch (dynamic shapes) of the loss op."""
    torch.library.opcheck(OPS.fused_cppo_loss.default, _loss_args(mode, padded, needs, new_options))


def test_opcheck_fused_logprobs_and_cppo_select():
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 4, H, generator=g), torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (2, 4), generator=g)
    for head in (dict(temperature=0.7, compute_entropy=True), dict(temperature=1.0, compute_entropy=False)):
        torch.library.opcheck(OPS.fused_logprobs.default, (hidden, weight, targets, None, *encode(**head)))
    rewards = torch.randint(0, 2, (12,), generator=g).float()
    for scope, keep, num_kept in (("group", 2, -1), ("batch", -1, 5)):
        options = encode(scale="group", unbiased=True, eps=1e-4, scope=scope, metric="smallest")
        torch.library.opcheck(OPS.cppo_select.default, (rewards, None, 4, keep, num_kept, *options))


class TinyModel(nn.Module):
    """Embedding, one tanh layer, an LM head: a model whose last hidden states feed the fused loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layer = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V)

    def forward(self, ids, targets, mask, adv, old):
        hidden = torch.tanh(self.layer(self.embed(ids)))  # [B, L, H]
        return fused_cppo_loss(
            hidden, self.lm_head.weight, targets, adv, mask=mask, old_logprobs=old, bias=self.lm_head.bias,
            epsilon_high=0.28, compute_entropy=True,
        )  # fmt: skip


def _step(model, batch):
    model.zero_grad()
    loss, metrics = model(*batch)
    loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()  # the compiled module's are its model's
    return loss.detach(), metrics, {name: p.grad.clone() for name, p in params}


def test_compiled_model_with_the_loss_equals_eager_and_does_not_recompile():
    """fullgraph=True (no graph break) under inductor on CPU, three batch shapes: the eager loss, metrics and
    gradients; the first shape compiles, the second recompiles once with symbolic sizes (dynamo's automatic
    dynamic shapes; nothing in the ops specialises on a size), the third compiles nothing. A bad value still raises
    the eager one-line error, from inside the compiled graph."""
    torch.manual_seed(0)
    model = TinyModel()
    counter, graphs = CompileCounterWithBackend("inductor"), []
    compiled = torch.compile(model, backend=lambda gm, inputs: graphs.append(gm.code) or counter(gm, inputs),
                             fullgraph=True)  # fmt: skip
    for i, shape in enumerate([(2, 5), (3, 7), (4, 6)]):
        batch = _padded(*shape, seed=i)
        loss, metrics, grads = _step(compiled, batch)
        want_loss, want_metrics, want_grads = _step(model, batch)
        assert_close("loss", loss, want_loss, 1e-5)
        assert list(metrics) == list(want_metrics) and not any(m.requires_grad for m in metrics.values())
        for name in want_metrics:
            assert_close(name, metrics[name], want_metrics[name], 1e-5)
        for name in want_grads:
            assert_close(name, grads[name], want_grads[name], 1e-5)
        assert counter.frame_count == min(i + 1, 2)
    assert all("torch.ops.cppo_kernels.fused_cppo_loss.default" in code for code in graphs)  # the op ran
    ids, targets, mask, adv, old = _padded(4, 6, seed=3)
    with pytest.raises(ValueError, match="advantages must be finite"):
        compiled(ids, targets, mask, torch.full_like(adv, float("nan")), old)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, V=24\)"):
        compiled(ids, targets + V, mask, adv, old)
    assert counter.frame_count == 2


def test_compiled_logprobs_and_selection():
    """fused_logprobs and cppo_select compile with fullgraph=True: the eager results, and the kept count changing
    with the batch (``num_kept``) does not recompile after the first change."""
    counter, graphs = CompileCounterWithBackend("aot_eager"), []

    @torch.compile(backend=lambda gm, inputs: graphs.append(gm.code) or counter(gm, inputs), fullgraph=True)
    def step(rewards, num_kept, hidden, weight, targets):
        adv, kept = cppo_select(rewards, 4, num_kept=num_kept, scope="batch")
        logp, entropy = fused_logprobs(hidden, weight, targets, temperature=0.9, compute_entropy=True)
        return adv, kept, logp, entropy

    g = torch.Generator().manual_seed(4)
    weight = torch.randn(V, H, generator=g)
    for i, n in enumerate((8, 12, 20)):
        rewards = torch.randint(0, 3, (n,), generator=g).float()
        hidden, targets = torch.randn(n, H, generator=g), torch.randint(0, V, (n,), generator=g)
        got = step(rewards, n // 2 + 1, hidden, weight, targets)
        want = (*cppo_select(rewards, 4, num_kept=n // 2 + 1, scope="batch"),
                *fused_logprobs(hidden, weight, targets, temperature=0.9, compute_entropy=True))  # fmt: skip
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert counter.frame_count == min(i + 1, 2)
    assert all(
        f"torch.ops.cppo_kernels.{op}.default" in code for code in graphs for op in ("cppo_select", "fused_logprobs")
    )
    with pytest.raises(ValueError, match="rewards must be finite"):
        step(torch.full((20,), float("nan")), 3, hidden, weight, targets)


def test_the_loss_op_called_directly_scales_its_gradients_and_refuses_double_backward():
    """The op's backward scales the gradients of its forward by the incoming gradient (also on a second backward
    through a retained graph); create_graph=True is a clear error, as on the eager path."""
    args = _loss_args("two-pass", False, "111")
    params = args[0], args[1], args[2]
    loss = OPS.fused_cppo_loss(*args)[0]
    first = torch.autograd.grad(loss * 2.0, params, retain_graph=True)
    second = torch.autograd.grad(loss * -0.5, params, retain_graph=True)
    for a, b in zip(first, second):
        assert_close("grad", a * -0.25, b, 1e-6)
    cfg = LossConfig(**{k: v for k, v in decode(*args[-2:]).items() if k not in ("mode", "needs", "metrics")})
    want, _ = fused_cppo_loss(*params[:2], *args[3:5], cu_seqlens=args[5], old_logprobs=args[7], ref_logprobs=args[8],
                              bias=args[2], config=cfg)  # fmt: skip
    assert_close("loss", loss, want, 1e-6)
    for a, b in zip(first, torch.autograd.grad(want * 2.0, params)):
        assert_close("grad", a, b, 1e-5)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(loss, params, create_graph=True)


def test_the_backend_is_read_when_the_op_runs(monkeypatch):
    """One compiled graph runs the backend of the call (use_backend around it), not the one of the trace: the
    Triton kernels (here under the interpreter) and the torch path give the eager results of each."""
    from cppo_kernels import _loss_triton, use_backend

    calls = []
    real = _loss_triton.logprobs_fwd
    monkeypatch.setattr(_loss_triton, "logprobs_fwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = _loss_args("two-pass", False, "000")
    options = dict(cu_seqlens=args[5], old_logprobs=args[7], ref_logprobs=args[8], bias=args[2], beta=0.04)
    tensors = (*args[:2], *args[3:5])  # hidden, weight, targets, advantages
    compiled = torch.compile(lambda *a: fused_cppo_loss(*a, **options)[0], backend="aot_eager", fullgraph=True)
    for backend, ran in (("torch", []), ("triton", [1]), ("torch", [])):
        with use_backend(backend):
            got = compiled(*tensors)
            assert calls == ran
            want, _ = fused_cppo_loss(*tensors, **options)
        assert_close("loss", got, want, 1e-6)
        calls.clear()


def test_compiled_loss_with_the_new_options_equals_eager():
    """Issue 26's options and tensors (VESPO, the bias-corrected KL, the masks, the entropy bonus, importance
    weights, sampling log-probs) through the compiled op: one graph, the eager loss and gradients."""
    args = _loss_args("auto", True, "111", new_options=True)
    cfg = LossConfig(**{k: v for k, v in decode(*args[-2:]).items() if k not in ("mode", "needs", "metrics")})
    tensors = dict(mask=args[6], old_logprobs=args[7], ref_logprobs=args[8], importance_weights=args[9],
                   sampling_logprobs=args[10])  # fmt: skip

    def step(hidden, weight, bias):
        return fused_cppo_loss(hidden, weight, args[3], args[4], bias=bias, config=cfg, **tensors)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    params = (args[0], args[1], args[2])
    got, got_metrics = compiled(*params)
    want, want_metrics = step(*params)
    assert_close("loss", got, want, 1e-6)
    assert list(got_metrics) == list(want_metrics) and "vespo_phi_mean" in got_metrics
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        assert_close("grad", a, b, 1e-5)
