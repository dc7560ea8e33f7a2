"""Every kernel of _loss_triton compiles for sm_80 and sm_90 at its default config, fits and does not spill.

Compiled as the JIT specialises a real launch: pointers 16-byte aligned, and H, V and the row strides
divisible by 16 (true for every model below; T is never specialised). Without these attributes Triton cannot
turn the masked loads into cp.async, so neither the pipelining nor the register use would be a real launch's.

The compiles run in a child process without TRITON_INTERPRET: once the interpreter has run a kernel that calls
a @triton.jit helper, it leaves triton.language patched for the rest of the process, and the compiler then
fails. H is a runtime argument, so H values with the same config share one binary (compiled once).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

from cppo_kernels import _loss_triton as K
from cppo_kernels._aot import SHARED_MEMORY_LIMIT

VOCAB = 151_936  # Qwen2.5
ARCHS = (80, 90)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CASES = [(h, "bf16") for h in (896, 1536, 2048, 3584, 4096)] + [(1536, "fp16"), (1536, "fp32")]
KERNELS = {
    "fwd": "_logprobs_fwd_kernel",
    "bwd_dz": "_logprobs_bwd_dz_kernel",
    "matmul_dhidden": "_matmul_dhidden_kernel",  # dhidden = dz @ W
    "matmul_dweight": "_matmul_dweight_kernel",  # dweight (fp32) += dz^T @ X
    "slab_dhidden": "_logprobs_bwd_dhidden_kernel",  # the no-scratch backward (dz_chunk_bytes=0)
    "slab_dweight": "_logprobs_bwd_dweight_kernel",
}
#: Unit strides of the two matmul launches: the JIT turns an int argument equal to 1 into a constant.
UNIT_STRIDES = {"matmul_dhidden": ("stride_ak", "stride_bn"), "matmul_dweight": ("stride_am", "stride_bn")}


def _spec(kernel: str, hidden_size: int, dtype: str):
    """(signature, constexprs, divisible-by-16 arg indices, num_warps, num_stages) at the default config."""
    cfg = K.default_config(hidden_size, VOCAB, DTYPES[dtype], torch.device("cuda"))
    flags = {"DOT_PRECISION": K._dot_precision(DTYPES[dtype]), "UPCAST_DOT": False}
    if kernel.startswith("matmul"):
        dhidden = kernel == "matmul_dhidden"
        tiles = (cfg.block_t, cfg.block_h_out, cfg.block_v) if dhidden else (cfg.block_v, cfg.block_h_out, cfg.block_t)
        constexprs = {**flags, "ACCUMULATE": not dhidden, **dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), tiles))}
        constexprs.update(dict.fromkeys(UNIT_STRIDES[kernel], 1))
    else:
        constexprs = {**flags, "HAS_BIAS": True, "BLOCK_T": cfg.block_t, "BLOCK_V": cfg.block_v, "BLOCK_H": cfg.block_h}
    if kernel == "fwd":
        constexprs["COMPUTE_ENTROPY"] = True
    if kernel.startswith("slab"):
        constexprs["BLOCK_H_OUT"] = cfg.block_h_out
    if kernel == "slab_dweight":
        constexprs.update(COMPUTE_DW=True, COMPUTE_DB=True)
    # the token dimension (T, or the chunk length: M of dhidden = dz @ W, K of dz^T @ X) is not divisible
    tokens = {"matmul_dhidden": "M", "matmul_dweight": "K"}.get(kernel, "T")
    fp32 = {"logp_ptr", "lse_ptr", "entropy_ptr", "grad_ptr"} | ({"c_ptr"} if kernel == "matmul_dweight" else set())
    signature, divisible = {}, []
    for i, name in enumerate(getattr(K, KERNELS[kernel]).arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "targets_ptr":
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in fp32 else f"*{dtype}"
        elif name == "inv_temperature":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
        if signature[name] != "constexpr" and name != tokens and name != "inv_temperature":
            divisible.append(i)  # pointers (16-byte aligned), strides, H, V: multiples of 16
    return signature, constexprs, divisible, cfg.num_warps, cfg.num_stages


def _compile(kernel: str, arch: int, hidden_size: int, dtype: str) -> dict:
    """cppo_kernels._aot.compile_for plus the JIT's divisibility attributes (run with TRITON_INTERPRET=0)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cppo_kernels._aot import _cuobjdump

    signature, constexprs, divisible, num_warps, num_stages = _spec(kernel, hidden_size, dtype)
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    src = ASTSource(fn=getattr(K, KERNELS[kernel]), signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        dump = [_cuobjdump(), "--dump-resource-usage", f.name]
        out = subprocess.run(dump, capture_output=True, text=True, check=True).stdout
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    return {"shared": int(compiled.metadata.shared), **usage, **options}


def _compile_all() -> dict[str, dict]:
    """Every (kernel, arch, H, dtype) case; cases whose compile-time arguments match share one compile."""
    results, done = {}, {}
    for kernel in KERNELS:
        for arch in ARCHS:
            for hidden_size, dtype in CASES:
                signature, constexprs, *launch = _spec(kernel, hidden_size, dtype)
                key = repr((kernel, arch, signature, constexprs, launch))
                if key not in done:
                    try:
                        done[key] = _compile(kernel, arch, hidden_size, dtype)
                    except Exception as e:  # reported by the test of that case
                        done[key] = {"error": f"{type(e).__name__}: {e}"[-3000:]}
                results[f"{kernel}|{arch}|{hidden_size}|{dtype}"] = done[key]
    return results


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    child = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout)


def test_every_kernel_is_covered():
    kernels = {name for name in dir(K) if name.startswith("_") and name.endswith("_kernel")}
    assert kernels == set(KERNELS.values())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("hidden_size,dtype", CASES, ids=[f"H{h}-{d}" for h, d in CASES])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_compiles_fits_and_does_not_spill(compiled, kernel, hidden_size, dtype, arch):
    c = compiled[f"{kernel}|{arch}|{hidden_size}|{dtype}"]
    where = f"{kernel} H={hidden_size} {dtype} sm_{arch}"
    assert "error" not in c, f"{where}: {c.get('error')}"
    assert c["shared"] <= SHARED_MEMORY_LIMIT[arch], f"{where}: {c['shared']} B shared > {SHARED_MEMORY_LIMIT[arch]}"
    spill = c.get("STACK", 0) + c.get("LOCAL", 0)
    assert spill == 0, f"{where}: spills (stack {c.get('STACK')} B, local {c.get('LOCAL')} B, {c.get('REG')} regs)"
    assert c.get("REG", 0) <= 255, where


if __name__ == "__main__":  # the child process of the ``compiled`` fixture
    json.dump(_compile_all(), sys.stdout)
