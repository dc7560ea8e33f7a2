"""Every kernel of _advantages_triton compiles for sm_80 and sm_90 at the launchers' configs, fits, no spills."""

import pytest
import triton.language as tl
from aot import SHARED_MEMORY_LIMIT, compile_many, job

from cppo_kernels import _advantages_triton as K

POINTER = {tl.float32: "*fp32", tl.float64: "*fp64", tl.bfloat16: "*bf16"}
SCALARS = {"eps": "fp32", "ddof": "i32"}


def _fused_args(group_size, mode, scale, metric):
    """(config, constexprs both kernels share)."""
    cfg = K.group_config(group_size)
    codes = {"SCALE": K.SCALE_CODE[scale], "MODE": mode, "METRIC": K.METRIC_CODE[metric]}
    constexprs = {name: code.value for name, code in codes.items()}  # as the launchers pass them
    return cfg, {**constexprs, "BLOCK_Q": cfg.block_q, "BLOCK_G": cfg.block_g}


def group_kernel(group_size, mode, scale, metric, dtype):
    cfg, constexprs = _fused_args(group_size, mode, scale, metric)
    signature = {
        "x_ptr": POINTER[dtype],
        "rand_ptr": "*fp32",
        "std_ptr": "*fp64" if scale == "batch" else "*fp32",  # the fp64 batch std, else an unread placeholder
        "adv_ptr": "*fp32",
        "idx_ptr": "*i64",
        "num_groups": "i32",
        "group_size": "i32",
        "keep": "i32",
        **SCALARS,
    }
    return K._group_kernel, signature, {**constexprs, "BLOCK_J": cfg.block_j}, cfg.num_warps


def batch_kernel(group_size, mode, scale, metric, dtype):
    cfg, constexprs = _fused_args(group_size, mode, scale, metric)
    signature = {
        "x_ptr": POINTER[dtype],
        "src_ptr": "*fp32" if metric == "random" or mode == K.MODE_FUSED else POINTER[dtype],
        "adv_ptr": "*fp32",
        "idx_ptr": "*i64",
        "num_groups": "i32",
        "group_size": "i32",
        "n": "i32",
        "keep_total": "i32",
        **SCALARS,
    }
    return K._batch_kernel, signature, {**constexprs, "BLOCK": cfg.block, "BINS": K.RADIX_BINS}, cfg.num_warps


def batch_std_kernel(group_size, dtype):
    cfg = K.group_config(group_size)
    signature = {"x_ptr": POINTER[dtype], "std_ptr": "*fp64", "n": "i32", "ddof": "i32"}
    return K._batch_std_kernel, signature, {"BLOCK": cfg.block}, cfg.num_warps


def max_variance_kernel(group_size, dtype):
    cfg = K.group_config(group_size)
    signature = {"x_ptr": POINTER[dtype], "idx_ptr": "*i64", "group_size": "i32", "keep": "i32", "rtol": "fp32"}
    constexprs = {"BLOCK_G": cfg.block_g, "BLOCK_J": cfg.variance_j, "BLOCK_I": cfg.variance_i}
    return K._max_variance_kernel, signature, constexprs, cfg.num_warps


CONFIGS = {
    # group kernel: advantages only, selection from given advantages, fused (the CPPO default first)
    **{
        f"group-G{g}-{name}": (group_kernel, (g, *variant))
        for g in (16, 1024, K.MAX_GROUP_SIZE)  # the largest group the kernels take (larger: the PyTorch path)
        for name, variant in {
            "fused-group-smallest": (K.MODE_FUSED, "group", "smallest", tl.float32),
            "fused-none-random": (K.MODE_FUSED, "none", "random", tl.float32),
            "fused-batch-fp64": (K.MODE_FUSED, "batch", "largest", tl.float64),
            "advantages-batch": (K.MODE_ADVANTAGES, "batch", "smallest", tl.float32),
            "select-largest-bf16": (K.MODE_SELECT, "none", "largest", tl.bfloat16),
        }.items()
    },
    # batch kernel: its selection part does not depend on group_size, its fused advantage tile does
    "batch-select": (batch_kernel, (16, K.MODE_SELECT, "none", "smallest", tl.float32)),
    "batch-G16-fused-batch-largest": (batch_kernel, (16, K.MODE_FUSED, "batch", "largest", tl.float32)),
    "batch-G1024-fused-group-random-fp64": (batch_kernel, (1024, K.MODE_FUSED, "group", "random", tl.float64)),
    "batch-Gmax-fused-batch-fp64": (batch_kernel, (K.MAX_GROUP_SIZE, K.MODE_FUSED, "batch", "smallest", tl.float64)),
    # max-variance kernel: fp32 advantages (cppo_select's), any float dtype from select_completions
    "max-variance-G16": (max_variance_kernel, (16, tl.float32)),
    "max-variance-G1024-bf16": (max_variance_kernel, (1024, tl.bfloat16)),
    "max-variance-Gmax": (max_variance_kernel, (K.MAX_GROUP_SIZE, tl.float32)),
    "max-variance-Gmax-fp64": (max_variance_kernel, (K.MAX_GROUP_SIZE, tl.float64)),
    "batch-std-G16": (batch_std_kernel, (16, tl.float32)),
    "batch-std-G1024-fp64": (batch_std_kernel, (1024, tl.float64)),
}


def test_every_kernel_is_covered():
    covered = {make.__name__.replace("_kernel", "") for make, _ in CONFIGS.values()}
    kernels = {name[1:].replace("_kernel", "") for name in dir(K) if name.startswith("_") and name.endswith("_kernel")}
    assert kernels == covered


@pytest.mark.parametrize("arch", [80, 90])
def test_compiles_fits_and_does_not_spill(arch):
    jobs = []
    for make, args in CONFIGS.values():
        fn, signature, constexprs, num_warps = make(*args)
        jobs.append(job(fn, signature=signature, constexprs=constexprs, arch=arch, num_warps=num_warps))
    for name, c in zip(CONFIGS, compile_many(jobs), strict=True):
        assert not isinstance(c, str), f"{name}: does not compile for sm_{arch}: {c}"
        assert c.fits, f"{name}: {c.shared} B shared > {SHARED_MEMORY_LIMIT[arch]} B on sm_{arch}"
        assert not c.spills, f"{name}: spills on sm_{arch} (stack {c.stack} B, local {c.local} B)"
