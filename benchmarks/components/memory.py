"""The memory probes of ``bench_loss.py`` (:mod:`components.loss`): the peak memory above a start, on the CPU the
kernel's resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``), on CUDA
``torch.cuda.max_memory_allocated``; :func:`calibrate` shows the probe sees a large tensor."""

from __future__ import annotations

import ctypes
import gc

import torch


class CpuMemory:
    """Peak resident memory of this process via the kernel's VmHWM, reset through /proc/self/clear_refs.

    glibc serves allocations above its mmap threshold with mmap and unmaps them on free; the threshold is
    pinned to 1 MiB (it otherwise grows up to 32 MiB), so every tensor of 1 MiB or more leaves RSS when freed.
    """

    def __init__(self) -> None:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} not in /proc/self/status")

    def start(self) -> int:
        """Resets the peak to the current resident size and returns that size."""
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return self._status("VmRSS:")

    def peak(self) -> int:
        return self._status("VmHWM:")


class CudaMemory:
    def start(self) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def calibrate(probe, T: int, V: int, device: torch.device) -> dict:
    """Measures one filled fp32 [T, V] tensor, to show the memory probe sees such allocations."""
    gc.collect()
    base = probe.start()
    x = torch.empty(T, V, dtype=torch.float32, device=device).fill_(1.0)
    sync(device)
    measured = probe.peak() - base
    del x
    return {"expected_bytes": T * V * 4, "measured_bytes": measured}
