"""Shared cases of the advantage and selection tests: reward strategies, the fp64 reference and its tolerance."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from cppo_kernels import reference

#: Advantages computed in fp32 against the fp64 reference (scale "none": relative to the reward scale).
ADV_TOL = {"rtol": 1e-5, "atol": 2e-5}
DYADIC = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 3.5]  # CPPO's GSM8K reward values: exact in every dtype


def ref_adv(rewards, group_size, **kw):
    return reference.group_advantages(rewards.double(), group_size, **kw)


def assert_adv_close(got, want, rewards, scale):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert not torch.isnan(got).any()
    atol = ADV_TOL["atol"] * (1.0 + float(rewards.double().abs().max())) if scale == "none" else ADV_TOL["atol"]
    torch.testing.assert_close(got, want, rtol=ADV_TOL["rtol"], atol=atol)


@st.composite
def grouped_rewards(draw, *, max_group=40, max_groups=6, dyadic=None):
    group_size = draw(st.integers(1, max_group))
    num_groups = draw(st.integers(1, max_groups))
    kind = draw(st.sampled_from(["binary", "dyadic", "float"])) if dyadic is None else "dyadic"
    n = group_size * num_groups
    if kind == "binary":
        values = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n))
    elif kind == "dyadic":
        values = draw(st.lists(st.sampled_from(DYADIC), min_size=n, max_size=n))
    else:
        values = draw(st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float32), group_size
