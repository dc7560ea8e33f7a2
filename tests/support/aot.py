"""Test helper: ahead-of-time compilation of Triton kernels for NVIDIA targets, on a machine without a GPU.

Used by the compile-check tests (``from aot import ...``: pytest puts ``tests/`` on ``sys.path``): every kernel must
compile for sm_80 and sm_90, fit the arch's shared memory and not spill registers to local memory.

The compiles always run in one child process with ``TRITON_INTERPRET=0``: once the interpreter has run a
kernel that calls a ``@triton.jit`` helper, it leaves ``triton.language`` patched for the rest of the
process and real compilation fails, so the calling process (a test session) cannot compile itself.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
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


@dataclass(frozen=True)
class Job:
    """One compile: a module-level ``@triton.jit`` function, named so the child process can import it.

    ``signature`` maps every runtime argument to a Triton type (``"*fp32"``, ``"i32"``, ``"fp32"``);
    arguments named in ``constexprs`` are compile-time. ``divisible`` names the arguments the JIT would
    specialise as multiples of 16 (pointers 16-byte aligned, strides and sizes divisible by 16).
    """

    module: str
    name: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    arch: int
    num_warps: int
    num_stages: int
    divisible: tuple[str, ...]


def job(
    fn,
    *,
    signature: dict[str, str],
    constexprs: dict[str, object],
    arch: int,
    num_warps: int = 4,
    num_stages: int = 3,
    divisible: Iterable[str] = (),
) -> Job:
    """A :class:`Job` for ``fn`` (a ``@triton.jit`` function, or its interpreter twin)."""
    module = fn.fn.__module__  # JITFunction and InterpretedFunction both wrap the Python function
    # by the module attribute, not fn.__name__: one Python function may be jitted under several names
    names = [n for n, v in vars(sys.modules[module]).items() if v is fn]
    if not names:
        raise ValueError(f"{fn.fn.__qualname__} is not a module-level @triton.jit function of {module}")
    return Job(
        module=module,
        name=names[0],
        signature=tuple(signature.items()),
        constexprs=tuple(constexprs.items()),
        arch=arch,
        num_warps=num_warps,
        num_stages=num_stages,
        divisible=tuple(divisible),
    )


def compile_many(jobs: Iterable[Job], *, timeout: float = 900) -> list[CompiledKernel | str]:
    """Compiles every job for ``sm_<arch>`` in one interpreter-free child process (identical jobs once) and
    reads each binary's resource usage.

    Returns, in order, a :class:`CompiledKernel` per job, or the error message of a job that failed.
    """
    jobs = list(jobs)
    unique = list(dict.fromkeys(jobs))
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "jobs.pkl"), os.path.join(tmp, "results.pkl")
        with open(src, "wb") as f:
            pickle.dump(unique, f)
        here = os.path.dirname(os.path.abspath(__file__))  # tests/support/: this module
        root = os.path.dirname(os.path.dirname(here))  # the repository: cppo_kernels
        path = os.pathsep.join(p for p in (here, root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": path}
        cmd = [sys.executable, "-m", __name__, src, dst]
        child = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if child.returncode != 0:
            raise RuntimeError(f"AOT compile process failed ({child.returncode}):\n{child.stderr[-4000:]}")
        with open(dst, "rb") as f:
            results = dict(zip(unique, pickle.load(f)))
    return [results[j] for j in jobs]


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"cuobjdump not found in the triton wheel at {path}")
    return path


def _compile(j: Job) -> CompiledKernel:
    """Runs in the child process (no interpreter)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = getattr(importlib.import_module(j.module), j.name)
    if not isinstance(fn, JITFunction):
        raise TypeError(f"{j.module}.{j.name} is not a @triton.jit function")
    given, constexprs = dict(j.signature), dict(j.constexprs)
    missing = [a for a in fn.arg_names if a not in given and a not in constexprs]
    if missing:
        raise ValueError(f"{j.name}: no signature type for {missing}")
    signature = {a: "constexpr" if a in constexprs else given[a] for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in j.divisible}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": j.num_warps, "num_stages": j.num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", j.arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    return CompiledKernel(
        name=compiled.metadata.name,
        arch=j.arch,
        shared=int(compiled.metadata.shared),
        registers=usage.get("REG", 0),
        stack=usage.get("STACK", 0),
        local=usage.get("LOCAL", 0),
        num_warps=j.num_warps,
    )


def _main(src: str, dst: str) -> None:
    with open(src, "rb") as f:
        jobs = pickle.load(f)
    results = []
    for j in jobs:
        try:
            results.append(_compile(j))
        except Exception as e:  # reported per job by the caller
            results.append(f"{type(e).__name__}: {e}"[-3000:])
    with open(dst, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":  # the child: run the importable module, so results unpickle as its classes
    from aot import _main as main

    main(*sys.argv[1:])
