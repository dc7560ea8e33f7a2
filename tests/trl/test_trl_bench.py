"""benchmarks/bench_trl.py: its flags, its summary and table, and a small run end to end (JSON + PNG)."""

from __future__ import annotations

import importlib.util
import json

import bench_trl
import pytest


def row(run: str, rate: float | None, seconds: float, tokens: int) -> dict:
    phases = dict(generation=1.0, scoring=0.1, old_ref=seconds / 4, policy=seconds / 2, optimizer=seconds / 4)
    cpu = {f"cpu_{k}": 2 * v for k, v in phases.items()}  # CPU time: another clock, the same ratios
    return {"run": run, "pruning_rate": rate, **phases, **cpu, "tokens_old_ref": tokens, "tokens_policy": 2 * tokens,
            "peak_memory_mb": 100.0}  # fmt: skip


def test_summary_against_stock():
    rows = [row("stock", None, 8.0, 100), row("P=0.75", 0.75, 2.0, 25)]
    bench_trl.summarise(rows)
    assert [r["train"] for r in rows] == [8.0, 2.0] and rows[1]["total"] == pytest.approx(3.1)
    assert (rows[1]["tokens_vs_stock"], rows[1]["train_speedup"], rows[1]["ideal"]) == (0.25, 4.0, 4.0)
    assert (rows[1]["cpu_train"], rows[1]["cpu_train_speedup"]) == (4.0, 4.0)
    assert rows[1]["total_speedup"] == pytest.approx(9.1 / 3.1)
    assert rows[1]["cpu_total_speedup"] == pytest.approx(18.2 / 6.2)
    lines = bench_trl.table(rows).splitlines()
    assert len(lines) == 4 and "| P=0.75 |" in lines[3] and "| 4.00x | 4.00x | 4.00x |" in lines[3]


@pytest.mark.parametrize("argv, message", [(["--rates", "1.0"], "--rates must be in"), (["--steps", "0"], "--steps")])
def test_bad_flags_are_one_usage_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_trl.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_small_run_writes_json_and_png(tmp_path):
    out = tmp_path / "trl.json"
    argv = ["--rates", "0.5", "--steps", "1", "--group-size", "4", "--max-completion-length", "4", "--out", str(out)]
    bench_trl.main(argv)
    result = json.loads(out.read_text())
    stock, cppo = result["rows"]
    assert (stock["run"], cppo["run"], cppo["kept_fraction"]) == ("stock GRPOTrainer", "CPPOTrainer P=0.5", 0.5)
    assert cppo["tokens_vs_stock"] <= 0.5 + 1e-9 and stock["tokens_policy"] > 0
    # CPPO's old / reference passes (prefix-shared: not through TRL's log-prob method) are timed as old+ref, not
    # left in scoring
    assert stock["cpu_old_ref"] > 0 and cppo["cpu_old_ref"] > 0 and cppo["tokens_old_ref"] > 0
    assert result["meta"]["trl"] == "1.16.0" and result["meta"]["settings"]["group_size"] == 4
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_small_run_with_colocated_vllm_generates_with_vllm_in_every_run(tmp_path):
    out = tmp_path / "trl.json"
    argv = ["--rates", "0.5", "--steps", "1", "--group-size", "4", "--max-completion-length", "4", "--use-vllm",
            "--out", str(out)]  # fmt: skip
    bench_trl.main(argv)
    result = json.loads(out.read_text())
    stock, cppo = result["rows"]
    assert stock["generated_with"] == cppo["generated_with"] == "vllm colocate"
    assert cppo["kept_fraction"] == 0.5 and cppo["tokens_vs_stock"] <= 0.5 + 1e-9
    assert stock["cpu_generation"] > 0 and result["meta"]["settings"]["use_vllm"] is True
