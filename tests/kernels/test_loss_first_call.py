"""The CPU loss's first call is as lean as the later ones (issue 39): the one-time BLAS probe that picks the partial
chunks' GEMM height (``_loss_torch.block_rows``) runs on a slice of the head, gives the verdict the whole head
gives, and adds nothing measurable to the first call's peak memory."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cppo_kernels import _loss_torch
from cppo_kernels._loss_inputs import logit_factors


def _whole_head_verdict(w, bias, f, C=256, step=64) -> bool:
    """The probe as it ran before: GEMMs over every column of the head."""
    h = torch.randn(C, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    full = _loss_torch._logits_into(torch.empty(C, w.shape[0]), h, w, bias, f)
    return all(
        torch.equal(full[:m], _loss_torch._logits_into(torch.empty(m, w.shape[0]), h[:m], w, bias, f))
        for m in range(step, C, step)
    )


@pytest.mark.parametrize(("V", "H"), [(20_000, 128), (9_000, 320)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cap", [None, 30.0])
def test_the_sliced_probe_gives_the_whole_heads_verdict(V, H, bias, cap, monkeypatch):
    monkeypatch.setattr(_loss_torch, "_BLOCK_PROBES", {})
    g = torch.Generator().manual_seed(V + H)
    w = torch.randn(V, H, generator=g) * 0.05
    b = torch.randn(V, generator=g) * 0.1 if bias else None
    f = logit_factors(0.7, 0.5 if cap else 1.0, cap)
    sliced = _loss_torch.block_rows(w, b, f, 256) == _loss_torch.TAIL_TOKENS
    assert sliced == _whole_head_verdict(w, b, f)
    assert V > _loss_torch.PROBE_VOCAB  # the probe saw a slice


MEASURE = r"""
import sys, gc, torch
torch.set_num_threads(1)
from cppo_kernels import fused_cppo_loss

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

T, H, V = 1000, 896, 151_936  # a partial chunk: the probe runs in the first call
g = torch.Generator().manual_seed(0)
hidden, weight = torch.randn(T, H, generator=g) * 0.1, torch.randn(V, H, generator=g) * 0.02
targets, adv = torch.randint(0, V, (T,), generator=g), torch.randn(4, generator=g)
cu = torch.tensor([0, 250, 500, 750, 1000])
if sys.argv[1] == "probed":  # the verdict already known: the first call runs no probe
    from cppo_kernels import _loss_torch
    _loss_torch._BLOCK_PROBES[((V, H), torch.float32, True, True, 256, 64, 1)] = True
peaks = []
for _ in range(2):
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")
    base = status("VmRSS")
    with torch.no_grad():
        loss, _ = fused_cppo_loss(hidden, weight, targets, adv, cu_seqlens=cu, mode="two-pass")
    peaks.append(status("VmHWM") - base)
    del loss
print(peaks[0], peaks[1])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_probe_adds_nothing_to_the_first_calls_peak_memory():
    """Two fresh processes, the first call's peak above its start with the probe and without it (its verdict set
    beforehand), and a later call's: the probe adds under 5% of the loss's working memory (before it ran on a slice
    of the head it held a [256, V] and a [192, V] block at once: 304 MB on top of the forward's 149 MB)."""
    peaks = {}
    for kind in ("probing", "probed"):
        done = subprocess.run([sys.executable, "-c", MEASURE, kind], capture_output=True, text=True, timeout=600,
                              env={"CPPO_KERNELS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr[-2000:]
        peaks[kind] = tuple(map(int, done.stdout.split()[-2:]))  # (first call, later call)
    (first, later), (first_without, _) = peaks["probing"], peaks["probed"]
    mib = {k: (a / 2**20, b / 2**20) for k, (a, b) in peaks.items()}
    assert later > 100 * 2**20, mib  # the forward's [256, V] fp32 logits block (148 MiB)
    assert first - first_without <= 0.05 * later, mib
