"""The custom ops under ``torch.compile`` as users call it: ``dynamic=True``, and numeric options whose values change
between calls (TRL's adaptive ``entropy_coef`` every step, a new :class:`cppo_kernels.FusedCPPOLoss` config). Every
number travels to the ops as data (``cppo_kernels._ops.encode``): each compiled call gives the eager result, and a new
value compiles nothing (the default ``dynamic=None`` compiles once more at the first change, as for a new shape)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from loss_cases import assert_close
from torch._dynamo.backends.registry import lookup_backend

from cppo_kernels import FusedCPPOLoss, LossConfig, cppo_select, fused_cppo_loss, fused_logprobs
from cppo_kernels._ops import _metric_key, _metric_names, _probe_metric_names, decode, encode

V, H = 16, 8
#: A value of every numeric loss option (and of the head's transform), different from its default.
NUMBERS = dict(
    temperature=0.9, epsilon_low=0.15, epsilon_high=0.25, beta=0.04, sapo_temperature_pos=0.8,
    sapo_temperature_neg=1.2, vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5,
    top_entropy_quantile=0.6, entropy_coef=0.01,
)  # fmt: skip


def _problem(seed: int = 0, tokens: int = 9):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(V, H, generator=g)).requires_grad_()
    bias = (0.1 * torch.randn(V, generator=g)).requires_grad_()
    targets = torch.randint(0, V, (tokens,), generator=g)
    cu = torch.tensor([0, 4, 4, tokens])
    adv = torch.randn(3, generator=g)
    old, ref = -3.0 + torch.randn(tokens, generator=g), -3.0 + torch.randn(tokens, generator=g)
    sampling = old + 0.2 * torch.randn(tokens, generator=g)
    tensors = dict(cu_seqlens=cu, old_logprobs=old, ref_logprobs=ref, sampling_logprobs=sampling)
    return (hidden, weight, bias), targets, adv, tensors


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from nothing (its closures share code objects across parametrizations)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class GraphCounter:
    """A backend (aot_eager) counting the graphs that ran: dynamo may hand the backend a graph and then restart the
    analysis (when a float symbol turns out to be pinned, e.g. by ``entropy_coef != 0`` being False), and such a graph
    never runs."""

    def __init__(self) -> None:
        self.ran: set[int] = set()
        self.graphs: list[str] = []

    @property
    def frame_count(self) -> int:
        return len(self.ran)

    def __call__(self, gm, inputs):
        compiled = lookup_backend("aot_eager")(gm, inputs)
        key, code = len(self.graphs), gm.code
        self.graphs.append(code)

        def run(*args):
            self.ran.add(key)
            return compiled(*args)

        return run


def _counted(fn, **kwargs):
    counter = GraphCounter()
    return torch.compile(fn, backend=counter, fullgraph=True, **kwargs), counter


def _check_loss(got, want, params):
    (loss, metrics), (want_loss, want_metrics) = got, want
    assert_close("loss", loss, want_loss, 1e-6)
    assert list(metrics) == list(want_metrics)
    for name in want_metrics:
        assert_close(name, metrics[name], want_metrics[name], 1e-6)
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(want_loss, params)):
        assert_close("grad", a, b, 1e-5)


def test_encode_keeps_numbers_out_of_the_text():
    """Constants in the text, numbers (int and float, never bool) as data; decode restores both exactly."""
    options = dict(temperature=0.7, epsilon_high=None, beta=1 / 3, kl_estimator="k3", compute_entropy=True, n=4)
    text, numbers = encode(**options)
    assert text == "temperature=float#0;epsilon_high=None;beta=float#1;kl_estimator='k3';compute_entropy=True;n=int#2"
    assert numbers.dtype == torch.float64 and numbers.device.type == "cpu" and numbers.tolist() == [0.7, 1 / 3, 4.0]
    assert decode(text, numbers) == options and type(decode(text, numbers)["n"]) is int
    assert decode(text) == dict(epsilon_high=None, kl_estimator="k3", compute_entropy=True)  # a fake's view


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_agg="seq-mean-token-sum-norm", max_completion_length=6, dual_clip=3.0, delta=2.0,
             use_bias_correction_kl=True, **NUMBERS),
        dict(surrogate="vespo", off_policy_mask_threshold=0.1, importance_sampling="sequence", **NUMBERS),
        dict(surrogate="sapo", compute_entropy=True, temperature=1.1),
        dict(),  # every default: each one a number dynamo sees as a symbol under dynamic=True
    ],
    ids=["clip-every-number", "vespo-sequence", "sapo", "defaults"],
)  # fmt: skip
@pytest.mark.parametrize("mode", ["auto", "grad-in-forward"])
def test_every_loss_option_compiles_with_dynamic_true(options, mode):
    """dynamic=True (every number and size a symbol) with fullgraph=True: the eager loss, metrics and gradients,
    with the head's transform (logit_scale, logit_softcap) and the options as keywords or as a LossConfig."""
    if mode == "grad-in-forward" and ("top_entropy_quantile" in options or "importance_sampling" in options):
        mode = "two-pass"  # the options that need the whole call (or a longer chunk) do not run gradient-in-forward
    params, targets, adv, tensors = _problem()
    head = dict(logit_scale=0.7, logit_softcap=5.0)

    def loss(hidden, weight, bias, targets, adv, scale, cap, cfg):
        return fused_cppo_loss(hidden, weight, targets, adv, bias=bias, logit_scale=scale, logit_softcap=cap,
                               mode=mode, **tensors, **cfg)  # fmt: skip

    compiled, counter = _counted(loss, dynamic=True)
    for cfg in (options, dict(config=LossConfig(**options))):
        args = (*params, targets, adv, *head.values(), cfg)
        _check_loss(compiled(*args), loss(*args), params)
    assert counter.frame_count == 2  # keywords, then a config: two code paths, neither recompiles for a value


def test_a_changing_number_runs_one_graph():
    """TRL's adaptive entropy moves entropy_coef every step; a new FusedCPPOLoss config moves every number: from the
    second value on the graph takes the number as a symbol (dynamic=None's first recompilation) and every later
    value runs that graph, with the eager results; dynamic=True compiles once."""
    params, targets, adv, tensors = _problem()
    for dynamic in (None, True):
        torch._dynamo.reset()
        step, counter = _counted(
            lambda h, w, b, coef: fused_cppo_loss(h, w, targets, adv, bias=b, entropy_coef=coef, **tensors),
            dynamic=dynamic,
        )
        for coef in (0.01, 0.02, -0.005, 0.03):
            want = fused_cppo_loss(*params[:2], targets, adv, bias=params[2], entropy_coef=coef, **tensors)
            _check_loss(step(*params, coef), want, params)
        assert counter.frame_count == (2 if dynamic is None else 1)
    configs = [{k: v + 0.01 * i for k, v in NUMBERS.items()} for i in range(4)]  # none reaches its default
    torch._dynamo.reset()  # (torch 2.13 keeps the names of the float symbols it pinned, e.g. a default compared
    # under dynamic=True, until a reset, and specializes any later symbol of the same name: a fresh start here)
    counter, tensors = GraphCounter(), {k: v for k, v in tensors.items() if k != "sampling_logprobs"}
    for cfg in configs:
        module = FusedCPPOLoss(LossConfig(**cfg), logit_scale=cfg["temperature"])
        compiled = torch.compile(module, backend=counter, fullgraph=True)
        got = compiled(params[0], params[1], targets, adv, bias=params[2], **tensors)
        _check_loss(got, module(params[0], params[1], targets, adv, bias=params[2], **tensors), params)
    assert counter.frame_count == 2


def test_a_number_that_crosses_a_rule_compiles_its_own_graph():
    """A comparison of a number decides code (entropy_coef != 0 adds the entropy metric, top_entropy_quantile < 1
    the mask's): dynamo guards the comparison, so crossing it compiles the other graph, with the other metrics."""
    params, targets, adv, tensors = _problem()
    step, counter = _counted(
        lambda h, w, b, coef, q: fused_cppo_loss(h, w, targets, adv, bias=b, entropy_coef=coef,
                                                 top_entropy_quantile=q, **tensors),
        dynamic=True,
    )  # fmt: skip
    for coef, q in ((0.01, 1.0), (0.0, 1.0), (0.02, 1.0), (0.0, 0.5), (0.0, 0.7), (0.01, 1.0)):
        got = step(*params, coef, q)
        _check_loss(got, fused_cppo_loss(*params[:2], targets, adv, bias=params[2], entropy_coef=coef,
                                         top_entropy_quantile=q, **tensors), params)  # fmt: skip
        assert ("entropy" in got[1]) == (coef != 0.0 or q < 1.0)
        assert ("entropy_mask_fraction" in got[1]) == (q < 1.0)
    assert counter.frame_count == 3


def test_logprobs_and_selection_compile_with_dynamic_true_and_changing_numbers():
    """fused_logprobs (temperature, logit_scale, logit_softcap) and cppo_select (eps, group_size, keep, num_kept)
    under dynamic=True, every number changing between calls: the eager results, one graph."""

    def step(rewards, group_size, keep, eps, hidden, weight, targets, temperature, scale, cap):
        adv, kept = cppo_select(rewards, group_size, keep, eps=eps, scale="batch")
        adv2, kept2 = cppo_select(rewards, group_size, num_kept=keep + 1, eps=eps, scope="batch", metric="largest")
        logp, entropy = fused_logprobs(hidden, weight, targets, temperature=temperature, logit_scale=scale,
                                       logit_softcap=cap, compute_entropy=True)  # fmt: skip
        return adv, kept, adv2, kept2, logp, entropy, fused_logprobs(hidden, weight, targets, temperature=temperature)

    compiled, counter = _counted(step, dynamic=True)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(V, H, generator=g)
    for i, (n, group_size) in enumerate(((12, 4), (18, 3), (30, 5))):  # no size equals H or V (duck sizing)
        rewards = torch.randint(0, 3, (n,), generator=g).float()
        hidden, targets = torch.randn(n, H, generator=g), torch.randint(0, V, (n,), generator=g)
        args = (rewards, group_size, 2, 1e-4 * (i + 1), hidden, weight, targets, 0.9 + i / 10, 1.0 - i / 10, 4.0 + i)
        for a, b in zip(compiled(*args), step(*args), strict=True):
            assert torch.equal(a, b)
    assert counter.frame_count == 1


def test_the_metric_key_decides_the_metric_names():
    """The fake's metric count comes from _metric_key alone: for every option (each number on both sides of every
    comparison the code makes, every choice), the key's names are the names of the full config's eager metrics."""
    choices = dict(surrogate=("clip", "cispo", "sapo", "vespo"), compute_entropy=(False, True),
                   top_entropy_quantile=(1.0, 0.5, 0.0), entropy_coef=(0.0, 0.01, -0.01))  # fmt: skip
    others = [{}, dict(beta=0.04, use_bias_correction_kl=True, kl_estimator="k1"), dict(importance_sampling="sequence"),
              dict(off_policy_mask_threshold=0.1), dict(loss_agg="seq-mean-token-sum-norm", max_completion_length=3),
              dict(epsilon_high=0.3, temperature=0.5, epsilon_low=0.1), dict(loss_agg="seq-mean-token-sum"),
              dict(dual_clip=3.0, delta=2.0), dict(sapo_temperature_pos=2.0, sapo_temperature_neg=0.5),
              dict(vespo_k_pos=0.0, vespo_lambda_pos=1.0, vespo_k_neg=1.0, vespo_lambda_neg=0.0)]  # fmt: skip
    covered = set(choices).union(*others)
    assert covered == {f.name for f in dataclasses.fields(LossConfig)}  # a new option joins the grid
    for values in itertools.product(*choices.values()):
        for extra in others:
            options = {**dict(zip(choices, values)), **extra}
            if "dual_clip" in extra and options["surrogate"] != "clip":
                continue  # the dual clip and delta are the clip surrogate's
            cfg = LossConfig(**options)
            assert _metric_names(_metric_key(cfg)) == _probe_metric_names(cfg), cfg


def test_backward_twice_through_a_retained_graph():
    """loss.backward(retain_graph=True) then loss.backward() on the compiled loss accumulates the eager gradients
    twice (its backward only reads the gradients its forward saved). torch.compile refuses a retained graph when the
    backward was compiled with donated buffers (saved tensors no one else holds: here the op's gradients, for
    PyTorch's cross_entropy its softmax), as for every compiled loss: torch._functorch.config.donated_buffer=False
    before compiling allows it (docs/kernels.md)."""
    params, targets, adv, tensors = _problem()

    def loss(h, w, b):
        return fused_cppo_loss(h, w, targets, adv, bias=b, beta=0.04, **tensors)[0]

    want = torch.autograd.grad(loss(*params), params)
    with torch._functorch.config.patch(donated_buffer=False):
        compiled, _ = _counted(loss, dynamic=True)  # dynamic: the backward is compiled with the forward
        out = compiled(*params)
        out.backward(retain_graph=True)
        out.backward()
    for p, g in zip(params, want):
        assert_close("grad", p.grad, 2 * g, 1e-5)
