"""Ahead-of-time compilation of Triton kernels for NVIDIA targets, on a machine without a GPU.

Used by the compile-check tests: every kernel must compile for sm_80 and sm_90, fit the arch's
shared memory and not spill registers to local memory.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

#: Max dynamic shared memory per block (bytes) that Triton may use on each arch.
SHARED_MEMORY_LIMIT = {80: 166_912, 90: 232_448}


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    arch: int
    shared: int  # bytes of shared memory the launch needs
    registers: int
    stack: int  # bytes of per-thread stack (spills land here)
    local: int
    num_warps: int

    @property
    def fits(self) -> bool:
        return self.shared <= SHARED_MEMORY_LIMIT[self.arch]

    @property
    def spills(self) -> bool:
        return self.stack > 0 or self.local > 0


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"cuobjdump not found in the triton wheel at {path}")
    return path


def compile_for(
    fn, *, signature: dict[str, str], constexprs: dict[str, object], arch: int, num_warps: int = 4, num_stages: int = 3
) -> CompiledKernel:
    """Compiles ``fn`` (a ``@triton.jit`` function) for ``sm_<arch>`` and reads its resource usage.

    ``signature`` maps every argument name to a Triton type (``"*fp32"``, ``"i32"``, ``"fp32"``,
    ``"constexpr"``); ``constexprs`` gives the compile-time values.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction):  # under TRITON_INTERPRET=1 @triton.jit gives an InterpretedFunction
        fn = JITFunction(fn.fn)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    return CompiledKernel(
        name=compiled.metadata.name,
        arch=arch,
        shared=int(compiled.metadata.shared),
        registers=usage.get("REG", 0),
        stack=usage.get("STACK", 0),
        local=usage.get("LOCAL", 0),
        num_warps=num_warps,
    )
