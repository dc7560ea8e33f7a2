"""bench_loss.py's loss types (components/loss.py) come from the one table, ``cppo_kernels.config.LOSS_TYPES``; each
method carries its loss type (so does each result row), and the names the benchmark made are read back without taking
them apart."""

from __future__ import annotations

import pytest
from components import loss

from cppo_kernels.config import LOSS_TYPES


@pytest.mark.parametrize("loss_type", loss.TIMED_LOSS_TYPES)
def test_each_timed_loss_type_takes_the_kernels_table(loss_type):
    options = loss.loss_options(loss_type)
    assert (options["surrogate"], options["loss_agg"]) == LOSS_TYPES[loss_type]
    assert {k: v for k, v in options.items() if k not in ("surrogate", "loss_agg")} == loss.RECIPE_OPTIONS.get(
        loss_type, {}
    )
    assert loss.LOSS_TYPES[loss_type] == options  # the view the GPU kit reads


def test_the_view_is_read_only_and_holds_no_type_of_its_own():
    assert set(loss.LOSS_TYPES) == set(loss.TIMED_LOSS_TYPES) <= set(LOSS_TYPES)
    with pytest.raises(TypeError):
        loss.LOSS_TYPES["dapo"] = {}  # type: ignore[index]


def test_every_fused_method_name_reads_back_its_loss_type():
    for paths in loss.FUSED_PATHS.values():
        for path in paths:
            for loss_type in loss.TIMED_LOSS_TYPES:
                assert loss.loss_type_of(loss.method_name(path, loss_type)) == loss_type


@pytest.mark.parametrize("name", ["naive", "liger-chunked", "liger-triton", "naive-sapo", "my-own-cispo"])
def test_a_method_not_fused_is_dapo_whatever_its_name_ends_with(name):
    assert loss.loss_type_of(name) == "dapo"


def test_a_fused_method_named_alike_elsewhere_reads_as_its_suffix():
    """The GPU kit's tests name ``fused-triton-sapo``; this module's own rows record ``loss_type`` instead."""
    assert loss.loss_type_of("fused-triton-sapo") == "sapo" and loss.loss_type_of("fused-triton") == "dapo"
