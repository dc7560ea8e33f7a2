"""Every kernel of _loss_triton compiles for sm_80 and sm_90 at its default config, fits and does not spill.

Compiled as the JIT specialises a real launch: pointers 16-byte aligned, and H, V and the row strides
divisible by 16 (true for every model below; T is never specialised). Without these attributes Triton cannot
turn the masked loads into cp.async, so neither the pipelining nor the register use would be a real launch's.

tests/aot.py compiles them in one interpreter-free child process. H is a runtime argument, so H values with
the same config share one binary (compiled once).
"""

from __future__ import annotations

import pytest
import torch
from aot import SHARED_MEMORY_LIMIT, CompiledKernel, compile_many, job

from cppo_kernels import _loss_triton as K

VOCAB = 151_936  # Qwen2.5
ARCHS = (80, 90)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CASES = [(h, "bf16") for h in (896, 1536, 2048, 3584, 4096)] + [(1536, "fp16"), (1536, "fp32")]
KERNELS = {
    "fwd": "_logprobs_fwd_kernel",
    "bwd_dz": "_logprobs_bwd_dz_kernel",
    "fwd_softcap": "_logprobs_fwd_kernel",  # the model's final tanh cap (Gemma 2/3): HAS_SOFTCAP
    "bwd_dz_softcap": "_logprobs_bwd_dz_kernel",
    "matmul_dhidden": "_matmul_dhidden_kernel",  # dhidden = dz @ W
    "matmul_dweight": "_matmul_dweight_kernel",  # dweight (fp32) += dz^T @ X
}
#: The fp32 scalar arguments (the temperature and the model's logit transform); every other scalar is an int.
FLOAT_ARGS = ("z_scale", "cap_out", "grad_scale")
#: Unit strides of the two matmul launches: the JIT turns an int argument equal to 1 into a constant.
UNIT_STRIDES = {"matmul_dhidden": ("stride_ak", "stride_bn"), "matmul_dweight": ("stride_am", "stride_bn")}


def _spec(kernel: str, hidden_size: int, dtype: str):
    """(signature, constexprs, divisible-by-16 arg names, num_warps, num_stages) at the default config."""
    cfg = K.default_config(hidden_size, VOCAB, DTYPES[dtype], torch.device("cuda"))
    flags = {"DOT_PRECISION": K._dot_precision(DTYPES[dtype]), "UPCAST_DOT": False}
    if kernel.startswith("matmul"):
        dhidden = kernel == "matmul_dhidden"
        tiles = (cfg.block_t, cfg.block_h_out, cfg.block_v) if dhidden else (cfg.block_v, cfg.block_h_out, cfg.block_t)
        constexprs = {**flags, "ACCUMULATE": not dhidden, **dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), tiles))}
        constexprs.update(dict.fromkeys(UNIT_STRIDES[kernel], 1))
    else:
        constexprs = {**flags, "HAS_BIAS": True, "BLOCK_T": cfg.block_t, "BLOCK_V": cfg.block_v, "BLOCK_H": cfg.block_h}
        constexprs["HAS_SOFTCAP"] = kernel.endswith("_softcap")
    if kernel.startswith("fwd"):
        constexprs["COMPUTE_ENTROPY"] = True
    # the token dimension (T, or the chunk length: M of dhidden = dz @ W, K of dz^T @ X) is not divisible
    tokens = {"matmul_dhidden": "M", "matmul_dweight": "K"}.get(kernel, "T")
    fp32 = {"logp_ptr", "lse_ptr", "entropy_ptr", "grad_ptr"} | ({"c_ptr"} if kernel == "matmul_dweight" else set())
    signature, divisible = {}, []
    for name in getattr(K, KERNELS[kernel]).arg_names:
        if name in constexprs:
            continue
        if name == "targets_ptr":
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in fp32 else f"*{dtype}"
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
        if name != tokens and name not in FLOAT_ARGS:
            divisible.append(name)  # pointers (16-byte aligned), strides, H, V: multiples of 16
    return signature, constexprs, divisible, cfg.num_warps, cfg.num_stages


@pytest.fixture(scope="module")
def compiled() -> dict[str, CompiledKernel | str]:
    """Every (kernel, arch, H, dtype) case; cases whose compile-time arguments match share one compile."""
    cases = [(k, a, h, d) for k in KERNELS for a in ARCHS for h, d in CASES]
    jobs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")  # default_config gives the interpreter's tiles while it is on
        for kernel, arch, hidden_size, dtype in cases:
            signature, constexprs, divisible, num_warps, num_stages = _spec(kernel, hidden_size, dtype)
            fn = getattr(K, KERNELS[kernel])
            kw = {"constexprs": constexprs, "arch": arch, "num_warps": num_warps, "num_stages": num_stages}
            jobs.append(job(fn, signature=signature, divisible=divisible, **kw))
    return {"|".join(map(str, case)): c for case, c in zip(cases, compile_many(jobs), strict=True)}


def test_every_kernel_is_covered():
    kernels = {name for name in dir(K) if name.startswith("_") and name.endswith("_kernel")}
    assert kernels == set(KERNELS.values())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("hidden_size,dtype", CASES, ids=[f"H{h}-{d}" for h, d in CASES])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_compiles_fits_and_does_not_spill(compiled, kernel, hidden_size, dtype, arch):
    c = compiled[f"{kernel}|{arch}|{hidden_size}|{dtype}"]
    where = f"{kernel} H={hidden_size} {dtype} sm_{arch}"
    assert not isinstance(c, str), f"{where}: {c}"
    assert c.fits, f"{where}: {c.shared} B shared > {SHARED_MEMORY_LIMIT[arch]}"
    assert not c.spills, f"{where}: spills (stack {c.stack} B, local {c.local} B, {c.registers} regs)"
    assert c.registers <= 255, where


#: The GEMM path's row pass (cppo_kernels._loss_rows_triton): fp32 or bf16 factors, with and without the cap, at the
#: CUDA tile; V is a runtime argument the JIT does not specialise.
ROW_CASES = [(q, cap) for q in ("bf16", "fp32") for cap in (False, True)]


@pytest.fixture(scope="module")
def compiled_rows() -> dict[str, CompiledKernel | str]:
    from cppo_kernels import _loss_rows_triton as R

    fn, cases, jobs = R._row_pass_kernel, [(q, cap, a) for q, cap in ROW_CASES for a in ARCHS], []
    for q, cap, arch in cases:
        signature = {}
        for name in fn.arg_names:
            if name in ("HAS_BIAS", "HAS_CAP", "COMPUTE_ENTROPY", "WANT_Q", "BLOCK_V"):
                continue
            signature[name] = ({"q_ptr": f"*{q}", "targets_ptr": "*i64"}.get(name, "*fp32") if name.endswith("_ptr")
                               else "fp32" if name in ("z_scale", "cap_out", "margin") else "i32")  # fmt: skip
        constexprs = {"HAS_BIAS": True, "HAS_CAP": cap, "COMPUTE_ENTROPY": True, "WANT_Q": True,
                      "BLOCK_V": R.ROW_BLOCK_V["cuda"]}  # fmt: skip
        divisible = [n for n in signature if n.endswith("_ptr") or n.startswith("stride")]
        jobs.append(job(fn, signature=signature, divisible=divisible, constexprs=constexprs, arch=arch, num_warps=8))
    return {f"{q}|{cap}|{a}": c for (q, cap, a), c in zip(cases, compile_many(jobs), strict=True)}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("q,cap", ROW_CASES, ids=[f"{q}-{'cap' if c else 'plain'}" for q, c in ROW_CASES])
def test_the_row_pass_compiles_fits_and_does_not_spill(compiled_rows, q, cap, arch):
    c = compiled_rows[f"{q}|{cap}|{arch}"]
    where = f"row pass q={q} cap={cap} sm_{arch}"
    assert not isinstance(c, str), f"{where}: {c}"
    assert c.fits and not c.spills and c.registers <= 255, f"{where}: {c}"
