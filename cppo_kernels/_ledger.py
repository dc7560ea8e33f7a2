"""The traffic ledger: what a fused-loss path does, operation by operation (GEMMs with their flops, passes over
memory with the bytes they read and write), entered by the path itself while :func:`recording` is active, and read
by the GPU kit's roofline (``benchmarks/gpukit/roofline.py``) and by the tests that check a path's traffic on the CPU.

Recording costs nothing when no ledger is active (a context variable's lookup per operation).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Op", "Ledger", "recording", "record", "KINDS"]

#: ``gemm``: a matrix product (flops, its operands read, its output written); ``pass``: an elementwise or row-wise
#: pass over memory; ``small``: O(tokens) work whose bytes are negligible beside the passes.
KINDS = ("gemm", "pass", "small")


@dataclass(frozen=True)
class Op:
    name: str
    kind: str
    flops: int = 0
    read: int = 0  # bytes
    written: int = 0  # bytes
    shape: tuple[int, ...] = ()

    @property
    def bytes(self) -> int:
        return self.read + self.written


@dataclass
class Ledger:
    """The operations entered while it was recording, in order."""

    ops: list[Op] = field(default_factory=list)

    def by_name(self, name: str) -> list[Op]:
        return [op for op in self.ops if op.name == name]

    def totals(self) -> dict[str, int]:
        """``gemm_flops``, ``gemm_bytes`` and ``pass_bytes`` (passes and small work), summed."""
        gemms = [op for op in self.ops if op.kind == "gemm"]
        return {
            "gemms": len(gemms),
            "gemm_flops": sum(op.flops for op in gemms),
            "gemm_bytes": sum(op.bytes for op in gemms),
            "pass_bytes": sum(op.bytes for op in self.ops if op.kind != "gemm"),
        }


_ACTIVE: contextvars.ContextVar[Ledger | None] = contextvars.ContextVar("cppo_kernels_ledger", default=None)


@contextlib.contextmanager
def recording() -> Iterator[Ledger]:
    """``with recording() as ledger:`` every operation the paths enter inside the block lands in ``ledger``."""
    ledger = Ledger()
    token = _ACTIVE.set(ledger)
    try:
        yield ledger
    finally:
        _ACTIVE.reset(token)


def record(name: str, kind: str, *, flops: int = 0, read: int = 0, written: int = 0, shape=()) -> None:
    """Enter one operation in the active ledger (nothing when none records)."""
    ledger = _ACTIVE.get()
    if ledger is not None:
        if kind not in KINDS:
            raise ValueError(f"ledger kind must be one of {KINDS}, got {kind!r}")
        ledger.ops.append(Op(name, kind, int(flops), int(read), int(written), tuple(int(x) for x in shape)))
