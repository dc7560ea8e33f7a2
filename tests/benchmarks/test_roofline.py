"""The GPU kit's roofline (benchmarks/gpukit/roofline.py): the ledgers it predicts from, checked without a GPU.

- the old cuBLAS gradient-in-forward path's prediction against the 2026-12-04 H200 measurement (within 20%);
- the GEMM path's plan on meta tensors is exactly the ledger the path enters when it really runs (interpreter);
- the GEMM path's predicted time at the kit's shape, and the loss part's summary and report with the roofline.
"""

from __future__ import annotations

import json
import math
import os
import pathlib

import pytest
import torch
from gpukit import part_loss, report, roofline

from cppo_kernels import _loss_gemm
from cppo_kernels._ledger import recording

REPO = pathlib.Path(__file__).resolve().parents[2]
KIT_SHAPE = (16_384, 1536, 151_936)
RUN = REPO / "benchmarks" / "results" / "gpu" / "2026-12-04-loss" / "loss.json"


def _measured() -> dict:
    results = json.loads(RUN.read_text())["results"]
    return results["T=16384 H=1536 V=151936 bfloat16"]


def test_the_old_paths_roofline_is_within_20_percent_of_its_measurement():
    """The torch backend's cuBLAS gradient-in-forward (the aten ops it issues in its CUDA configuration) at the GEMM
    rate of that run and the H200's peak bandwidth predicts its 2026-12-04 time within 20%."""
    row = _measured()
    got = roofline.roofline(["fused-grad-in-forward-cublas"], *KIT_SHAPE, torch.bfloat16, gemm_ms=row["gemm"]["ms"],
                            bandwidth=roofline.PEAK_BANDWIDTH["H200"])["fused-grad-in-forward-cublas"]  # fmt: skip
    measured = row["methods"]["fused-grad-in-forward-cublas"]["fwd_bwd_ms"]
    assert abs(got["predicted_ms"] / measured - 1) <= 0.2, (got["predicted_ms"], measured)
    # what the ledger holds: 16 chunks of 1,024 tokens, three GEMMs each, and five passes over each fp32 chunk
    ledger = roofline.old_cublas_path(*KIT_SHAPE, torch.bfloat16)
    assert ledger.totals()["gemms"] == 3 * 16
    big = [op for op in ledger.ops if op.kind == "pass" and op.bytes >= 1024 * KIT_SHAPE[2] * 2]
    assert {op.name for op in big} >= {"max", "log_softmax", "exp_", "_to_copy", "add_"}


def test_the_gemm_paths_prediction_at_the_kits_shape():
    """Three GEMMs per 2,048-token chunk and the row pass: predicted within 1.2x the 3-GEMM floor on an H200 (the
    measurement is the kit's, when a GPU is lent)."""
    gemm_ms = _measured()["gemm"]["ms"]
    got = roofline.roofline(["fused-grad-in-forward-gemm", "fused-grad-in-forward-gemm-sapo"], *KIT_SHAPE,
                            torch.bfloat16, gemm_ms=gemm_ms, bandwidth=roofline.PEAK_BANDWIDTH["H200"])  # fmt: skip
    pred = got["fused-grad-in-forward-gemm"]
    assert pred == got["fused-grad-in-forward-gemm-sapo"]  # a loss type shares its path's ledger
    assert pred["gemms"] == 3 * 8 and roofline.floor_ratio(pred["predicted_ms"], gemm_ms) <= 1.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_plan_on_meta_tensors_is_the_ledger_of_a_real_run(dtype, monkeypatch):
    """The kit plans the GEMM path's ledger on meta tensors (no GPU, no data); it must be exactly what the path
    enters when it runs (here on the CPU under the interpreter)."""
    monkeypatch.setattr(_loss_gemm, "CHUNK_MAX", 16)
    T, H, V = 37, 24, 300
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(T, H, generator=g).to(dtype), torch.randn(V, H, generator=g).to(dtype)
    t = torch.randint(0, V, (T,), generator=g)
    assert os.environ.get("TRITON_INTERPRET") == "1"
    with recording() as real:
        _loss_gemm.logprobs_fwd_grads(h, w, t, None, lambda a, b, lp: torch.ones_like(lp))
    planned = roofline.gemm_path(T, H, V, dtype)
    assert planned.ops[: len(real.ops)] == real.ops
    assert [op.name for op in planned.ops[len(real.ops) :]] == ["scale and cast"] * 2


def test_the_loss_summary_and_report_carry_the_roofline():
    row = dict(fwd_s=0.010, bwd_s=0.025, peak_extra_bytes=2e9, workspace_bytes=1e9, loss=0.5)
    res = {"tokens": KIT_SHAPE[0], "hidden": KIT_SHAPE[1], "vocab": KIT_SHAPE[2], "dtype": "bfloat16",
           "matmul_s": 0.01038, "methods": {"fused-grad-in-forward-gemm": {**row, "fwd_bwd_s": 0.0347},
                                            "liger-chunked": {**row, "fwd_bwd_s": 0.9}}}  # fmt: skip
    got = part_loss.loss_summary(res, {"loss64": 0.5}, bandwidth=4.8e12)
    gemm = got["methods"]["fused-grad-in-forward-gemm"]
    assert gemm["predicted_ms"] == pytest.approx(34.66, rel=0.01) and gemm["x_predicted"] == pytest.approx(1.0, 0.01)
    assert got["methods"]["liger-chunked"]["predicted_ms"] is None and got["bandwidth_tbs"] == 4.8
    text = "\n".join(report.render_loss({"T=16384 H=1536 V=151936 bfloat16": {**got, "accuracy": {"logp_error": 0}}}))
    assert "| roofline ms | x roofline |" in text and "| liger-chunked (comparison) |" in text
    assert "| - | - |" in text and "roofline at 4.80 TB/s" in text
    assert math.isfinite(gemm["x_gemm_floor"])


def test_the_committed_predictions_are_the_rooflines_and_the_docs_quote_them():
    """benchmarks/results/gpu/roofline-2026-12-07.json is what prediction_file gives now, and the README's CUDA row
    and gpu-kit.md quote its numbers (rounded as written there)."""
    saved = json.loads((REPO / "benchmarks" / "results" / "gpu" / "roofline-2026-12-07.json").read_text())
    got = roofline.prediction_file(*KIT_SHAPE, torch.bfloat16, gemm_ms=_measured()["gemm"]["ms"],
                                   bandwidth=roofline.PEAK_BANDWIDTH["H200"])  # fmt: skip
    assert {k: v for k, v in saved.items() if k != "source"} == got
    gemm, old = saved["methods"]["fused-grad-in-forward-gemm"], saved["methods"]["fused-grad-in-forward-cublas"]
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| CUDA, one H200"))
    for text in (f"{gemm['predicted_ms']:.1f} ms", f"{gemm['x_floor']:.2f}x", f"{old['predicted_ms']:.1f} ms",
                 f"~{saved['gemm_path_buffers_gb']:.1f} GB"):  # fmt: skip
        assert text in row, text
    kit = (REPO / "docs" / "gpu-kit.md").read_text()
    for name, m in saved["methods"].items():
        assert f"{m['predicted_ms']:.1f} ms" in kit, name
