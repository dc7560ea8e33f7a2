"""group_advantages / select_completions / cppo_select on both backends against the fp64 reference."""

import functools
import itertools
import statistics
from fractions import Fraction

import pytest
import torch
from advantage_cases import assert_adv_close, grouped_rewards, ref_adv
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cppo_kernels import (
    _advantages_torch,
    _advantages_triton,
    cppo_select,
    group_advantages,
    reference,
    select_completions,
    use_backend,
)
from cppo_kernels._carriers import SelectOptions
from cppo_kernels.advantages import TRITON_MAX_GROUP_SIZE
from cppo_kernels.config import MAX_VARIANCE_RTOL

# The `backend` fixture only sets an environment variable, so reusing it across examples is sound.
FIXTURE_OK = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
)
# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


@FIXTURE_OK
@given(data=grouped_rewards(), scale=st.sampled_from(["group", "batch", "none"]), unbiased=st.booleans())
def test_advantages_match_reference(backend, data, scale, unbiased):
    rewards, g = data
    got = group_advantages(rewards, g, scale=scale, unbiased=unbiased)
    assert_adv_close(got, ref_adv(rewards, g, scale=scale, unbiased=unbiased), rewards, scale)
    per_group = got.double().reshape(-1, g)
    scale_of = rewards.double().reshape(-1, g).abs().amax(1) if scale == "none" else torch.ones(per_group.shape[0])
    assert (per_group.mean(1).abs() <= 1e-5 * (1 + scale_of)).all()  # zero mean per group


@FIXTURE_OK
@given(
    data=grouped_rewards(dyadic=True),
    shifts=st.lists(st.integers(-64, 64), min_size=6, max_size=6),
    factors=st.lists(st.sampled_from([0.25, 0.5, 2.0, 8.0]), min_size=6, max_size=6),
    scale=st.sampled_from(["group", "none"]),
)
def test_advantages_invariant_to_group_shift_and_scale(backend, data, shifts, factors, scale):
    rewards, g = data
    q = rewards.numel() // g
    shift = torch.tensor(shifts[:q], dtype=torch.float32).repeat_interleave(g)  # [N]
    factor = torch.tensor(factors[:q], dtype=torch.float32).repeat_interleave(g)  # [N]
    base = group_advantages(rewards, g, scale=scale, eps=0.0)
    shifted = group_advantages(rewards + shift, g, scale=scale, eps=0.0)
    torch.testing.assert_close(shifted, base, rtol=1e-6, atol=1e-6)
    if scale == "group":  # dyadic rewards and power-of-two factors: exact transforms
        torch.testing.assert_close(group_advantages(rewards * factor + shift, g, scale=scale, eps=0.0), base)


@pytest.mark.parametrize("value", [0.1, 1 / 3, -2.7, 1e4 + 0.1, 1e7 + 1, 0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_zero_variance_groups_are_exactly_zero(backend, value, dtype):
    g = 7
    if not torch.isfinite(torch.tensor(value, dtype=dtype)):
        pytest.skip(f"{value} is not finite in {dtype}")
    rewards = torch.tensor([value] * g + [0.0, 1.0] + [0.25] * (g - 2) + [value] * g, dtype=dtype)
    for scale in ("group", "batch", "none"):
        for eps in (1e-4, 0.0):
            adv = group_advantages(rewards, g, scale=scale, eps=eps)
            assert torch.equal(adv[:g], torch.zeros(g)) and torch.equal(adv[2 * g :], torch.zeros(g))
            assert not torch.isnan(adv).any() and (adv[g : 2 * g] != 0).all()
    constant_batch = torch.full((4 * g,), value, dtype=dtype)
    for scale in ("group", "batch", "none"):
        assert torch.equal(group_advantages(constant_batch, g, scale=scale, eps=0.0), torch.zeros(4 * g))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_reward_dtypes(backend, dtype):
    gen = torch.Generator().manual_seed(3)
    rewards = (torch.randn(6 * 12, generator=gen, dtype=torch.float64) * 3).to(dtype)
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, 12, scale=scale)
        assert_adv_close(adv, ref_adv(rewards, 12, scale=scale), rewards, scale)
        for scope in ("group", "batch"):
            want = reference.select_completions(adv.to(dtype), 12, 5, scope=scope)
            assert torch.equal(select_completions(adv.to(dtype), 12, 5, scope=scope), want)


def test_fp64_rewards_keep_differences_fp32_cannot_hold(backend):
    rewards = torch.tensor([10000.0, 10000.0001, 10000.0, 10000.0001], dtype=torch.float64)
    adv = group_advantages(rewards, 4)
    assert_adv_close(adv, ref_adv(rewards, 4), rewards, "group")
    assert (adv.abs() > 0.1).all()


def test_batch_std_over_65536_completions(backend):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(65536, generator=gen) * 4 + 100.0  # [N]: offset exposes a naive one-pass variance
    for scale in ("batch", "group"):
        adv = group_advantages(rewards, 16, scale=scale)
        assert_adv_close(adv, ref_adv(rewards, 16, scale=scale), rewards, scale)


#: Finite rewards at the edges of their dtype's range (issue 11): products, squares and spreads overflow or underflow
#: a naive computation; fp32 ones used to give NaN (then an out-of-bounds store) or all-zero advantages.
EXTREME = {
    "fp32 near the max": ([3e38, 0.0, 0.0, -1.5e38], torch.float32),
    "fp32 spread 2e19": ([1e19, -1e19, 0.0, 0.0], torch.float32),
    "fp32 spread 4e19, clustered": ([2e19, 2e19, -2e19, 2e19], torch.float32),
    "fp32 saturating scale none": ([3.4e38, -3.4e38, -3.4e38, -3.4e38], torch.float32),
    "fp32 subnormal": ([1e-45, 0.0, 0.0, -1e-45], torch.float32),
    "fp64 near the max": ([1.7e308, -1.7e308, 0.0, 1e-300], torch.float64),
    "fp64 1e300": ([1e300, 0.0, 0.0, -1.5e300], torch.float64),
    "fp64 clustered": ([1e150, 1e150 * (1 + 2**-50), 1e150, 1e150], torch.float64),
    "fp64 subnormal": ([1e-310, 0.0, -3e-310, 2e-320], torch.float64),
}


@pytest.mark.parametrize("case", list(EXTREME))
def test_extreme_finite_rewards_both_backends_and_the_oracle_agree(case):
    values, dtype = EXTREME[case]
    rewards = torch.tensor(values * 2 + [1.0, 2.0, 3.0, 4.0], dtype=dtype)  # with an ordinary group
    for scale in ("group", "batch", "none"):
        for eps in (1e-4, 0.0):
            want = ref_adv(rewards, 4, scale=scale, eps=eps)
            got = {}
            for choice in ("torch", "triton"):
                with use_backend(choice):
                    for scope in ("group", "batch"):
                        adv, idx = cppo_select(rewards, 4, 2, scale=scale, eps=eps, scope=scope)
                        assert torch.isfinite(adv).all(), (choice, scale, scope, adv)
                        torch.testing.assert_close(adv, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
                        assert torch.equal(idx, reference.select_completions(adv, 4, 2, scope=scope))
                        assert torch.equal(group_advantages(rewards, 4, scale=scale, eps=eps), adv)
                        got[choice, scope] = idx
            assert got["torch", "group"].equal(got["triton", "group"]) and got["torch", "batch"].equal(
                got["triton", "batch"]
            )
        if scale == "group":
            assert (want[4:8] != 0).any() or max(values) == min(values)  # never silently all-zero


def test_fp32_spread_of_2e19_gives_the_textbook_advantages(backend):
    """The issue's all-zero case by hand: mean 0, Bessel std sqrt(2/3) 1e19, so A = +-sqrt(3/2) (eps is negligible)."""
    for scope in ("group", "batch"):
        adv, idx = cppo_select(torch.tensor([1e19, -1e19, 0.0, 0.0]), 4, 2, scope=scope)
        torch.testing.assert_close(adv, torch.tensor([1.5**0.5, -(1.5**0.5), 0.0, 0.0]))
        assert torch.equal(idx, torch.tensor([0, 1]))


@pytest.mark.parametrize("scope", ["group", "batch"])
@pytest.mark.parametrize("metric", ["smallest", "largest"])
def test_selection_stores_are_bounded_whatever_the_scores(scope, metric):
    """NaN, inf and signed-zero scores (impossible after validation, so given straight to the backends): exactly
    ``keep`` per group (group) or a total of 7 (batch: no multiple of the Q = 3 groups) valid ascending indices,
    and nothing written past the output.

    Regression: the Triton group kernel ranked by float comparisons, so NaN scores ranked 0, every completion was
    "kept" and G indices went into a keep-sized slot range (past the end of the output for the last group).
    """
    G, Q, keep = 8, 3, 3
    nan, inf = float("nan"), float("inf")
    adv = torch.tensor([nan, 1.0, nan, -inf, 0.5, nan, inf, 2.0] + [nan] * 8 + [0.0, -0.0, 1.0, nan, inf, -inf, 3, 3])
    count, K = (keep, keep * Q) if scope == "group" else (7, 7)  # the backends' count: per group, or in all
    for name, impl in (("torch", _advantages_torch), ("triton", _advantages_triton)):
        if name == "torch":
            idx = impl.select_completions(adv, G, count, SelectOptions(scope=scope, metric=metric), None)
        else:
            buf = torch.full((K + 64,), -7, dtype=torch.long)  # the output, then a guard region
            launch = impl._launch_batch if scope == "batch" else functools.partial(impl._launch_group, std=adv)
            launch(adv, adv, adv, buf[:K], Q, G, count, 0.0, 0, scale="none", mode=impl.MODE_SELECT, metric=metric)
            assert torch.equal(buf[K:], torch.full((64,), -7)), f"{name}: wrote past the output"
            idx = buf[:K]
        assert idx.numel() == K and ((idx >= 0) & (idx < G * Q)).all(), (name, idx)
        if scope == "group":
            assert torch.equal(torch.bincount(idx // G, minlength=Q), torch.full((Q,), keep)), (name, idx)
            assert (idx.reshape(Q, keep).diff(dim=1) > 0).all(), (name, idx)
        else:
            assert (idx.diff() > 0).all(), (name, idx)


def test_group_size_above_the_triton_limit_runs_the_torch_path(monkeypatch):
    """A group too large for the Triton tiles runs the PyTorch backend (on the same device), not a raw Triton error;
    the Triton launcher itself names group_size."""
    assert TRITON_MAX_GROUP_SIZE == _advantages_triton.MAX_GROUP_SIZE
    g = TRITON_MAX_GROUP_SIZE + 1
    with pytest.raises(ValueError, match=f"group_size={g} is above"):
        _advantages_triton.group_config(g)

    def no_launch(*a, **k):
        raise AssertionError("launched a Triton kernel above its group-size limit")

    for name in ("_launch_group", "_launch_batch", "_launch_batch_std", "_launch_max_variance"):
        monkeypatch.setattr(_advantages_triton, name, no_launch)
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "triton")
    rewards = torch.randint(0, 3, (2 * g,), generator=torch.Generator().manual_seed(0)).float()  # [N]
    for scope in ("group", "batch"):
        adv, idx = cppo_select(rewards, g, 5, scope=scope)
        want_adv, want_idx = reference.cppo_select(rewards.double(), g, 5, scope=scope)
        assert_adv_close(adv, want_adv, rewards, "group")
        assert torch.equal(idx, want_idx)
        assert torch.equal(select_completions(adv, g, 5, scope=scope), want_idx)
    assert_adv_close(group_advantages(rewards, g, scale="batch"), ref_adv(rewards, g, scale="batch"), rewards, "batch")
    adv, idx = cppo_select(rewards, g, 5, metric="max-variance")
    assert torch.equal(idx, reference.select_completions(adv, g, 5, metric="max-variance"))


# --------------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------------


@FIXTURE_OK
@given(
    data=grouped_rewards(),
    keep_frac=st.floats(0, 1),
    scope=st.sampled_from(["group", "batch"]),
    metric=st.sampled_from(["smallest", "largest"]),
)
def test_select_matches_reference(backend, data, keep_frac, scope, metric):
    rewards, g = data
    adv = reference.group_advantages(rewards, g)  # binary rewards give many exact ties
    keep = round(keep_frac * g)
    got = select_completions(adv, g, keep, scope=scope, metric=metric)
    want = reference.select_completions(adv, g, keep, scope=scope, metric=metric)
    assert got.dtype == torch.long and torch.equal(got, want)
    if scope == "group":
        assert torch.equal(torch.bincount(got // g, minlength=adv.numel() // g), torch.full((adv.numel() // g,), keep))


@FIXTURE_OK
@given(
    data=grouped_rewards(dyadic=True),
    keep_frac=st.floats(0, 1),
    scale=st.sampled_from(["group", "batch", "none"]),
    scope=st.sampled_from(["group", "batch"]),
    metric=st.sampled_from(["smallest", "largest"]),
)
def test_cppo_select_matches_reference_on_exact_rewards(backend, data, keep_frac, scale, scope, metric):
    rewards, g = data
    keep = round(keep_frac * g)
    adv, idx = cppo_select(rewards, g, keep, scale=scale, scope=scope, metric=metric)
    want_adv, want_idx = reference.cppo_select(rewards.double(), g, keep, scale=scale, scope=scope, metric=metric)
    assert_adv_close(adv, want_adv, rewards, scale)
    assert torch.equal(idx, want_idx)


@FIXTURE_OK
@given(
    data=grouped_rewards(),
    keep_frac=st.floats(0, 1),
    scale=st.sampled_from(["group", "batch", "none"]),
    unbiased=st.booleans(),
    scope=st.sampled_from(["group", "batch"]),
    metric=st.sampled_from(["smallest", "largest", "random"]),
    seed=st.integers(0, 2**31),
)
def test_cppo_select_is_the_composition(backend, data, keep_frac, scale, unbiased, scope, metric, seed):
    rewards, g = data
    keep = round(keep_frac * g)
    opts = {"scale": scale, "unbiased": unbiased}
    sel = {"scope": scope, "metric": metric}
    adv, idx = cppo_select(rewards, g, keep, **opts, **sel, generator=torch.Generator().manual_seed(seed))
    want_adv = group_advantages(rewards, g, **opts)
    want_idx = select_completions(want_adv, g, keep, **sel, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(adv, want_adv) and torch.equal(idx, want_idx)


@FIXTURE_OK
@given(
    data=grouped_rewards(),
    fraction=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0, 1)),
    scale=st.sampled_from(["group", "batch", "none"]),
    metric=st.sampled_from(["smallest", "largest", "random"]),
    seed=st.integers(0, 2**31),
)
def test_num_kept_matches_reference(backend, data, fraction, scale, metric, seed):
    """``num_kept``: any count of the batch, 0 and N included, most of them no multiple of the number of groups;
    binary and dyadic rewards tie heavily. A multiple of the groups keeps what ``keep`` keeps."""
    rewards, g = data
    n, q = rewards.numel(), rewards.numel() // g
    count = round(fraction * n)
    sel = {"num_kept": count, "scope": "batch", "metric": metric}
    adv, idx = cppo_select(rewards, g, scale=scale, **sel, generator=torch.Generator().manual_seed(seed))
    want_adv = ref_adv(rewards, g, scale=scale)
    assert_adv_close(adv, want_adv, rewards, scale)
    # the oracle's selection on the kernel's fp32 advantages (on dyadic rewards those are the oracle's own: below)
    exact = reference.select_completions(adv, g, **sel, generator=torch.Generator().manual_seed(seed))
    assert idx.dtype == torch.long and idx.numel() == count and torch.equal(idx, exact)
    got = select_completions(adv, g, **sel, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(got, exact)
    if count % q == 0:
        per_group = select_completions(
            adv, g, count // q, scope="batch", metric=metric, generator=torch.Generator().manual_seed(seed)
        )
        assert torch.equal(per_group, exact)


@pytest.mark.parametrize("count", [0, 1, 7, 15, 31, 32])
@pytest.mark.parametrize("metric", ["smallest", "largest", "random"])
def test_num_kept_edge_counts(backend, count, metric):
    """4 groups of 8 with many exact ties: 0, N = 32 and counts that are no multiple of 4."""
    rewards = torch.tensor([0, 1] * 8 + [1, 1, 0, 0, 1, 0, 1, 1] + [0.5] * 8, dtype=torch.float32)  # [32]
    gen, ref_gen = torch.Generator().manual_seed(count), torch.Generator().manual_seed(count)
    adv, idx = cppo_select(rewards, 8, num_kept=count, scope="batch", metric=metric, generator=gen)
    want_adv, want = reference.cppo_select(
        rewards.double(), 8, num_kept=count, scope="batch", metric=metric, generator=ref_gen
    )
    assert torch.equal(adv, want_adv) and torch.equal(idx, want) and idx.numel() == count
    assert torch.equal(gen.get_state(), ref_gen.get_state())  # the same draws consumed as the oracle


def test_num_kept_count_is_not_a_triton_specialisation():
    """The batch kernel takes ``keep_total`` at run time and the JIT does not specialise on it, so a new count (1,
    one not divisible by 16, one divisible by 16) gives the same compile key: no new compile. Checked on CPU with
    Triton's own argument binder for an sm_90 target (the one whose key picks the cached kernel); without the
    ``do_not_specialize`` these counts give three keys (1 becomes a constant, multiples of 16 a divisibility hint).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = _advantages_triton._batch_kernel
    options = getattr(kernel, "kwargs", None)  # the interpreter's twin keeps the @triton.jit options here
    jit = JITFunction(kernel.fn, **options) if options is not None else kernel
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    x, idx = torch.zeros(64), torch.zeros(64, dtype=torch.long)
    constexprs = {"SCALE": 0, "MODE": 2, "METRIC": 0, "BLOCK_Q": 1, "BLOCK_G": 16, "BLOCK": 64, "BINS": 256}
    keys = set()
    for count in (1, 7, 16, 48, 64):
        _, specialization, _ = binder(x, x, x, idx, 4, 16, 64, count, 1e-4, 1, **constexprs)
        keys.add(repr(specialization))
    assert len(keys) == 1, keys


@pytest.mark.parametrize("scope", ["group", "batch"])
def test_random_metric_count_reproducibility_and_generator_contract(backend, scope):
    g, q, keep = 16, 8, 5
    adv = reference.group_advantages(
        torch.randint(0, 2, (g * q,), generator=torch.Generator().manual_seed(1)).float(), g
    )
    picks = []
    for seed in (7, 7, 8):
        gen = torch.Generator().manual_seed(seed)
        picks.append(select_completions(adv, g, keep, scope=scope, metric="random", generator=gen))
        after = torch.rand(1, generator=gen)
        ref_gen = torch.Generator().manual_seed(seed)
        want = reference.select_completions(adv, g, keep, scope=scope, metric="random", generator=ref_gen)
        assert torch.equal(picks[-1], want)
        assert torch.equal(after, torch.rand(1, generator=ref_gen))  # same draws consumed as the reference
    assert torch.equal(picks[0], picks[1]) and not torch.equal(picks[0], picks[2])
    assert picks[0].numel() == keep * q and (picks[0].diff() > 0).all()
    if scope == "group":
        assert torch.equal(torch.bincount(picks[0] // g, minlength=q), torch.full((q,), keep))


@pytest.mark.parametrize(
    "g,q,keep",
    [
        (1, 5, 0),
        (1, 5, 1),
        (16, 1, 4),
        (16, 3, 0),
        (16, 3, 16),
        (7, 5, 3),
        (13, 1, 13),
        (33, 2, 17),
        (2, 9, 1),
        (1000, 1, 300),
    ],
)
@pytest.mark.parametrize("scope", ["group", "batch"])
def test_edge_shapes(backend, g, q, keep, scope):
    gen = torch.Generator().manual_seed(g * 100 + q)
    rewards = torch.randint(0, 3, (g * q,), generator=gen).float() / 2  # [N]
    for metric in ("smallest", "largest"):
        adv, idx = cppo_select(rewards, g, keep, scope=scope, metric=metric)
        want_adv, want_idx = reference.cppo_select(rewards.double(), g, keep, scope=scope, metric=metric)
        assert_adv_close(adv, want_adv, rewards, "group")
        assert torch.equal(idx, want_idx) and idx.numel() == keep * q


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_exact_ties_across_groups_go_to_the_lower_index(backend, scale):
    """Advantages equal in exact arithmetic are one fp32 value, so a tie across groups goes to the lower index.

    Regression: the Triton kernels computed fp32 rewards in fp32, where ``1 - fl(1/3)`` is an ulp below ``fl(2/3)``:
    the 1/3 of index 13 (``[0, 1, 1]``) lost its tie with the -1/3 of index 15 (``[0, 0, 1]``), so 15 was kept.
    """
    rewards = torch.tensor([0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0, 1], dtype=torch.float32)  # G = 3
    adv, idx = cppo_select(rewards, 3, 2, scale=scale, scope="batch")
    want_adv, want_idx = reference.cppo_select(rewards.double(), 3, 2, scale=scale, scope="batch")
    assert torch.equal(adv, want_adv)
    assert torch.equal(idx, want_idx) and 13 in idx and 15 not in idx
    assert torch.equal(group_advantages(rewards, 3, scale=scale), want_adv)


def test_empty_batch(backend):
    adv, idx = cppo_select(torch.empty(0), 4, 2)
    assert adv.shape == (0,) and adv.dtype == torch.float32 and idx.shape == (0,) and idx.dtype == torch.long


def test_group_size_1024(backend):
    gen = torch.Generator().manual_seed(5)
    binary = torch.randint(0, 2, (2 * 1024,), generator=gen).float()  # [N]
    adv, idx = cppo_select(binary, 1024, 256)
    want_adv, want_idx = reference.cppo_select(binary.double(), 1024, 256)
    assert_adv_close(adv, want_adv, binary, "group")
    assert torch.equal(idx, want_idx)
    floats = torch.randn(1024, generator=gen)  # [N]
    adv = group_advantages(floats, 1024)
    torch.testing.assert_close(adv, ref_adv(floats, 1024), rtol=1e-5, atol=1e-4)
    assert torch.equal(
        select_completions(adv, 1024, 700, metric="largest"),
        reference.select_completions(adv, 1024, 700, metric="largest"),
    )


@pytest.mark.parametrize("n", [4096, 65536])
def test_batch_scope_thousands(backend, n):
    gen = torch.Generator().manual_seed(n)
    rewards = torch.randint(0, 4, (n,), generator=gen).float() / 2  # [N]: heavy exact ties
    adv = reference.group_advantages(rewards, 16)
    for metric in ("smallest", "largest"):
        got = select_completions(adv, 16, 5, scope="batch", metric=metric)
        assert torch.equal(got, reference.select_completions(adv, 16, 5, scope="batch", metric=metric))
    floats = torch.randn(n, generator=gen)
    got_adv, got_idx = cppo_select(floats, 16, 11, scope="batch", scale="batch")
    assert_adv_close(got_adv, ref_adv(floats, 16, scale="batch"), floats, "batch")
    assert torch.equal(got_idx, reference.select_completions(got_adv, 16, 11, scope="batch"))


def test_triton_launch_counts(monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "triton")
    calls = []
    for name in ("_launch_group", "_launch_batch", "_launch_batch_std", "_launch_max_variance"):
        real = getattr(_advantages_triton, name)

        def record(*a, _n=name, _f=real, **k):
            calls.append((_n, k.get("mode")))
            return _f(*a, **k)

        monkeypatch.setattr(_advantages_triton, name, record)
    rewards = torch.randint(0, 2, (64,), generator=torch.Generator().manual_seed(0)).float()
    fused, adv_only = _advantages_triton.MODE_FUSED, _advantages_triton.MODE_ADVANTAGES
    std = ("_launch_batch_std", None)
    expected = {
        ("group", "group", 4): [("_launch_group", fused)],
        ("group", "none", 4): [("_launch_group", fused)],
        ("group", "batch", 4): [std, ("_launch_group", fused)],
        ("batch", "group", 4): [("_launch_batch", fused)],
        ("batch", "batch", 4): [("_launch_batch", fused)],
        ("group", "group", 0): [("_launch_group", adv_only)],  # nothing to rank
        ("batch", "batch", 0): [std, ("_launch_group", adv_only)],
    }
    for (scope, scale, keep), launches in expected.items():
        calls.clear()
        cppo_select(rewards, 16, keep, scope=scope, scale=scale)
        assert calls == launches, (scope, scale, keep, calls)
    for count, launches in {7: [("_launch_batch", fused)], 0: [("_launch_group", adv_only)]}.items():
        calls.clear()
        cppo_select(rewards, 16, num_kept=count, scope="batch")
        assert calls == launches, (count, calls)
    for scale, launches in {
        "group": [("_launch_group", adv_only)],
        "batch": [std, ("_launch_group", adv_only)],
    }.items():
        calls.clear()
        group_advantages(rewards, 16, scale=scale)
        assert calls == launches, (scale, calls)
    variance = ("_launch_max_variance", None)
    for (scale, keep), launches in {
        ("group", 4): [("_launch_group", adv_only), variance],
        ("batch", 4): [std, ("_launch_group", adv_only), variance],
        ("group", 0): [("_launch_group", adv_only)],
    }.items():
        calls.clear()
        cppo_select(rewards, 16, keep, scale=scale, metric="max-variance")
        assert calls == launches, (scale, keep, calls)
    calls.clear()
    select_completions(rewards, 16, 3, metric="max-variance")
    assert calls == [variance]


# --------------------------------------------------------------------------------------------
# Max-variance (PODS): the keep-subset of largest variance per group
# --------------------------------------------------------------------------------------------


def _assert_keep_per_group(idx, g, q, keep):
    assert idx.dtype == torch.long and idx.numel() == keep * q and (idx.diff() > 0).all()
    assert torch.equal(torch.bincount(idx // g, minlength=q), torch.full((q,), keep))


@FIXTURE_OK
@given(data=grouped_rewards(), keep_frac=st.floats(0, 1))
def test_max_variance_matches_reference(backend, data, keep_frac):
    rewards, g = data
    adv = reference.group_advantages(rewards, g)  # binary and dyadic rewards: few values, exact candidate ties
    keep = round(keep_frac * g)
    got = select_completions(adv, g, keep, metric="max-variance")
    assert torch.equal(got, reference.select_completions(adv, g, keep, metric="max-variance"))
    _assert_keep_per_group(got, g, adv.numel() // g, keep)


@FIXTURE_OK
@given(
    data=grouped_rewards(),
    keep_frac=st.floats(0, 1),
    scale=st.sampled_from(["group", "batch", "none"]),
    unbiased=st.booleans(),
)
def test_cppo_select_max_variance_is_the_composition(backend, data, keep_frac, scale, unbiased):
    """The advantages are the same as group_advantages', and the kept set is the oracle's on them."""
    rewards, g = data
    keep = round(keep_frac * g)
    adv, idx = cppo_select(rewards, g, keep, scale=scale, unbiased=unbiased, metric="max-variance")
    assert_adv_close(adv, ref_adv(rewards, g, scale=scale, unbiased=unbiased), rewards, scale)
    assert torch.equal(adv, group_advantages(rewards, g, scale=scale, unbiased=unbiased))
    assert torch.equal(idx, select_completions(adv, g, keep, metric="max-variance"))
    assert torch.equal(idx, reference.select_completions(adv, g, keep, metric="max-variance"))


#: Groups of ties: constant (zero variance, 0.1 repeated too), binary, symmetric, signed zeros, one outlier.
TIE_GROUPS = {
    "constant": [0.0] * 7,
    "constant 0.1": [0.1] * 7,
    "binary": [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0],
    "symmetric": [-1.0, 0.0, 1.0, 1.0, 0.0, -1.0, 0.0],
    "signed zeros": [0.0, -0.0, 1.0, -0.0, 0.0, -1.0, 0.0],
    "outlier": [0.5, 0.5, 0.5, 9.0, 0.5, 0.5, 0.5],
}


@pytest.mark.parametrize("case", list(TIE_GROUPS))
def test_max_variance_ties_zero_variance_and_every_keep(backend, case):
    """Every keep of 0..G (odd G = 7, two groups) against the oracle."""
    values = torch.tensor(TIE_GROUPS[case] + TIE_GROUPS[case][::-1])  # [14]
    for keep in range(8):
        got = select_completions(values, 7, keep, metric="max-variance")
        assert torch.equal(got, reference.select_completions(values, 7, keep, metric="max-variance")), keep
        _assert_keep_per_group(got, 7, 2, keep)
        if case.startswith("constant"):  # every subset has variance 0: the lowest indices
            assert torch.equal(got, torch.tensor([q * 7 + i for q in (0, 1) for i in range(keep)]))


@pytest.mark.parametrize(
    "values,keep,want",
    [
        ([1, 0, 1, 0, 0, 1], 3, [0, 1, 3]),  # 1 or 2 of the 1s tie: the fewer highest, of equal values the first
        ([1, 0, 1, 0, 0, 1], 2, [0, 1]),
        ([1, 0, 1, 0, 0, 1], 4, [0, 1, 2, 3]),
        ([0.5, -1, 2, -1], 1, [1]),  # one value has no spread: the lowest, the first of equal ones
        ([3, 2, 1, 0], 3, [0, 2, 3]),  # {3, 1, 0} and {3, 2, 0} tie: the fewer highest
        ([0, 10, 1, 2, 3, 4], 2, [0, 1]),
        ([0, 10, 1, 2, 3, 4, 100], 3, [0, 2, 6]),  # {100, 0, 1} beats {100, 10, 0}
        ([0, -0.0, 5, 0, -0.0], 3, [0, 1, 2]),  # -0.0 is 0.0
    ],
)
def test_max_variance_by_hand(backend, values, keep, want):
    got = select_completions(torch.tensor(values, dtype=torch.float32), len(values), keep, metric="max-variance")
    assert got.tolist() == want


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_max_variance_dtypes_and_saturation(backend, dtype):
    """Advantages of any float dtype are scored rounded to fp32; fp64 ones beyond fp32's range saturate."""
    gen = torch.Generator().manual_seed(4)
    adv = (torch.randn(5 * 9, generator=gen, dtype=torch.float64) * 2).to(dtype)  # [45]
    got = select_completions(adv, 9, 4, metric="max-variance")
    assert torch.equal(got, reference.select_completions(adv, 9, 4, metric="max-variance"))
    if dtype == torch.float64:
        huge = torch.tensor([1e300, 3e38, -1e300, 0.0, 1.0, -1e39], dtype=torch.float64)
        got = select_completions(huge, 6, 3, metric="max-variance")
        assert torch.equal(got, reference.select_completions(huge, 6, 3, metric="max-variance"))
        assert got.tolist() == [0, 2, 5]  # +max and twice -max: -1e300 and -1e39 both saturate


@FIXTURE_OK
@given(
    bits=st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=60),
    group_size=st.integers(1, 12),
    keep_frac=st.floats(0, 1),
)
def test_max_variance_same_subset_from_rewards_or_advantages(backend, bits, group_size, keep_frac):
    """Binary rewards: the advantages are an increasing affine map of them per group, so scoring either keeps the
    same completions (ties included: the fewer highest either way)."""
    rewards = torch.tensor(bits[: len(bits) // group_size * group_size] or [0.0] * group_size)
    keep = round(keep_frac * group_size)
    adv = group_advantages(rewards, group_size)
    for kw in ({}, {"scale": "none"}, {"scale": "batch"}):
        _, idx = cppo_select(rewards, group_size, keep, metric="max-variance", **kw)
        assert torch.equal(idx, select_completions(rewards, group_size, keep, metric="max-variance"))
    assert torch.equal(idx, select_completions(adv, group_size, keep, metric="max-variance"))


def _variance(values) -> Fraction:
    return statistics.pvariance([Fraction(v) for v in values]) if values else Fraction(0)


@given(
    values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=8),
    keep_frac=st.floats(0, 1),
)
def test_the_optimum_takes_the_highest_and_the_lowest(values, keep_frac):
    """PODS' claim, exactly: the largest variance over every keep-subset is that of some candidate (the i highest and
    keep - i lowest), and the oracle's scan keeps a subset within the tolerance of it."""
    keep = round(keep_frac * len(values))
    best = max(_variance(c) for c in itertools.combinations(values, keep))
    ordered = sorted(values, reverse=True)
    candidates = [ordered[:i] + ordered[len(values) - keep + i :] for i in range(keep + 1)]
    assert max(_variance(c) for c in candidates) == best
    kept = reference.max_variance_subset(values, keep)
    assert len(kept) == keep and kept == sorted(kept)
    assert _variance([values[p] for p in kept]) >= best * (1 - Fraction(MAX_VARIANCE_RTOL))


@given(
    values=st.lists(st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0]), min_size=1, max_size=8),
    keep_frac=st.floats(0, 1),
)
def test_max_variance_scan_matches_brute_force(values, keep_frac):
    """On values the tolerance never merges (a few dyadic values, many ties) the scan picks what the exhaustive search
    over every keep-subset picks: the largest variance, then the smallest sum, then the lowest indices."""
    keep = round(keep_frac * len(values))
    scan = reference.max_variance_subset(values, keep)
    assert scan == reference.max_variance_subset(values, keep, exhaustive=True)
    assert _variance([values[p] for p in scan]) == max(_variance(c) for c in itertools.combinations(values, keep))


def test_max_variance_group_size_1024(backend):
    gen = torch.Generator().manual_seed(6)
    binary = torch.randint(0, 2, (1024,), generator=gen).float()  # [N]
    adv, idx = cppo_select(binary, 1024, 301, metric="max-variance")
    assert torch.equal(idx, reference.select_completions(adv, 1024, 301, metric="max-variance"))
    floats = torch.randn(1024, generator=gen)  # [N]
    got = select_completions(floats, 1024, 300, metric="max-variance")
    assert torch.equal(got, reference.select_completions(floats, 1024, 300, metric="max-variance"))


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's max over NaN scores
def test_max_variance_stores_are_bounded_whatever_the_scores():
    """NaN and inf scores (impossible after validation, so given straight to the backends): exactly ``keep`` valid
    ascending indices per group, and nothing written past the output."""
    G, Q, keep = 8, 3, 3
    nan, inf = float("nan"), float("inf")
    adv = torch.tensor([nan, 1.0, nan, -inf, 0.5, nan, inf, 2.0] + [nan] * 8 + [0.0, -0.0, 1.0, nan, inf, -inf, 3, 3])
    buf = torch.full((keep * Q + 64,), -7, dtype=torch.long)  # the output, then a guard region
    _advantages_triton._launch_max_variance(adv, buf[: keep * Q], Q, G, keep)
    assert torch.equal(buf[keep * Q :], torch.full((64,), -7)), "wrote past the output"
    for idx in (buf[: keep * Q], _advantages_torch.max_variance(adv, G, keep)):
        assert ((idx >= 0) & (idx < G * Q)).all(), idx
        _assert_keep_per_group(idx, G, Q, keep)


# --------------------------------------------------------------------------------------------
# Bad input: the same ValueError on both backends, raised before any launch or random draw
# --------------------------------------------------------------------------------------------

R8 = torch.arange(8, dtype=torch.float32)
BAD = [
    (group_advantages, (torch.arange(5.0), 2), {}, "rewards has 5 elements"),
    (group_advantages, (R8.reshape(2, 4), 4), {}, "rewards must be 1-D"),
    (group_advantages, (torch.tensor([0.0, float("nan")]), 2), {}, "rewards must be finite"),
    (group_advantages, (torch.tensor([0.0, float("inf")]), 2), {}, "rewards must be finite"),
    (group_advantages, (torch.arange(8), 4), {}, "rewards must have a floating dtype"),
    (group_advantages, ([0.0, 1.0], 2), {}, "rewards must be a torch.Tensor"),
    (group_advantages, (R8, 0), {}, "group_size must be >= 1"),
    (group_advantages, (R8, 4), {"scale": "std"}, "scale must be one of"),
    (group_advantages, (R8, 4), {"eps": -1.0}, "eps must be >= 0"),
    (group_advantages, (R8, 4), {"unbiased": 1}, "unbiased must be a bool"),
    (select_completions, (R8, 4, 5), {}, "keep must be <= 4"),
    (select_completions, (R8, 4, -1), {}, "keep must be >= 0"),
    (select_completions, (R8, 3, 1), {}, "advantages has 8 elements"),
    (select_completions, (torch.tensor([0.0, float("nan")]), 2, 1), {}, "advantages must be finite"),
    (select_completions, (R8, 4, 2), {"scope": "global"}, "scope must be one of"),
    (select_completions, (R8, 4, 2), {"metric": "median"}, "metric must be one of"),
    (select_completions, (R8, 4, 2), {"metric": "random", "generator": 3}, "generator must be"),
    (select_completions, (R8, 4), {"num_kept": 3}, "num_kept .* needs scope='batch', got scope='group'"),
    (select_completions, (R8, 4, 1), {"num_kept": 3, "scope": "batch"}, "exactly one of keep"),
    (select_completions, (R8, 4), {"scope": "batch"}, "exactly one of keep"),
    (select_completions, (R8, 4), {"num_kept": 9, "scope": "batch"}, "num_kept must be <= 8"),
    (select_completions, (R8, 4), {"num_kept": -1, "scope": "batch"}, "num_kept must be >= 0"),
    (select_completions, (R8, 4), {"num_kept": 2.0, "scope": "batch"}, "num_kept must be an int"),
    (select_completions, (R8, 4), {"num_kept": True, "scope": "batch"}, "num_kept must be an int"),
    (cppo_select, (torch.arange(6.0), 4, 2), {}, "rewards has 6 elements"),
    (cppo_select, (R8, 4, 5), {}, "keep must be <= 4"),
    (cppo_select, (R8, 4), {"num_kept": 9, "scope": "batch"}, "num_kept must be <= 8"),
    (cppo_select, (R8, 4), {"num_kept": 3, "scope": "group"}, "num_kept .* needs scope='batch'"),
    (cppo_select, (R8, 4, 2), {"metric": "random", "scope": "pool"}, "scope must be one of"),
    (cppo_select, (R8, 4, 2), {"scale": "z"}, "scale must be one of"),
    (cppo_select, (torch.tensor([1.0, float("-inf")]), 2, 1), {}, "rewards must be finite"),
    (
        select_completions,
        (R8, 4, 2),
        {"metric": "max-variance", "scope": "batch"},
        "max-variance.* needs scope='group'",
    ),
    (select_completions, (R8, 4), {"metric": "max-variance", "num_kept": 3, "scope": "batch"}, "needs scope='group'"),
    (cppo_select, (R8, 4, 2), {"metric": "max-variance", "scope": "batch"}, "metric='max-variance' .* scope='batch'"),
]


@pytest.mark.parametrize("fn,args,kwargs,message", BAD, ids=[f"{b[0].__name__}-{b[3]}" for b in BAD])
def test_bad_input_same_error_before_any_launch(monkeypatch, fn, args, kwargs, message):
    def no_launch(*a, **k):
        raise AssertionError("launched before validating")

    for name in ("_launch_group", "_launch_batch", "_launch_batch_std", "_launch_max_variance"):
        monkeypatch.setattr(_advantages_triton, name, no_launch)
    texts = []
    for choice in ("torch", "triton"):
        monkeypatch.setenv("CPPO_KERNELS_BACKEND", choice)
        gen = torch.Generator().manual_seed(0)
        kw = dict(kwargs, generator=gen) if fn is not group_advantages and "generator" not in kwargs else kwargs
        with pytest.raises(ValueError, match=message) as err:
            fn(*args, **kw)
        texts.append(str(err.value))
        assert torch.equal(gen.get_state(), torch.Generator().manual_seed(0).get_state())  # nothing drawn
    assert texts[0] == texts[1]
