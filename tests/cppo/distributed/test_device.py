"""The device code: which ``device`` settings exist, ``auto`` resolved once, and the autocast of the compute dtype."""

import contextlib

import pytest
import torch

from cppo.distributed import DEVICES, autocast, check_device, resolve_device


@pytest.mark.parametrize("device", [*DEVICES, "cuda:0", "cuda:7"])
def test_the_device_settings(device):
    assert check_device(device) == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", 0, None])
def test_a_bad_device_is_refused_naming_the_setting(device):
    with pytest.raises(ValueError, match=r"^device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        check_device(device)


def test_cpu_and_auto_resolve():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu", local_rank=3) == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(ValueError, match=r"device='cuda' but CUDA is not available: use device=cpu"):
        resolve_device("cuda")


def test_a_numbered_gpu_under_torchrun_is_refused():
    with pytest.raises(ValueError, match=r"under torchrun \(one GPU per rank\), got 'cuda:1'"):
        resolve_device("cuda:1", local_rank=0)


def test_autocast_computes_in_the_compute_dtype_from_fp32_weights():
    weight, x = torch.randn(4, 4), torch.randn(2, 4)
    assert isinstance(autocast("cpu", None), contextlib.nullcontext)
    assert isinstance(autocast("cpu", torch.float32), contextlib.nullcontext)
    with autocast(torch.device("cpu"), torch.bfloat16):
        y = x @ weight
    assert y.dtype == torch.bfloat16 and weight.dtype == torch.float32
    assert (x @ weight).dtype == torch.float32  # outside the block: fp32 again
