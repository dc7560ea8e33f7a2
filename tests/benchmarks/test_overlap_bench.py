"""benchmarks/overlap.py (issue 51, part 3): its plan alternates the arms ABBA over rounds, its combination pairs each
unit with GRPO's synchronous run of the same round, and a real run on the tiny model writes every unit and resumes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from endtoend import overlap

REPO = overlap.REPO


def test_plan_alternates_the_arms_and_reverses_every_other_round():
    args = overlap.parse_args(["--out", "x", "--rates", "0", "0.875", "--rounds", "2"])
    assert overlap.plan(args) == [
        (1, "sync", 0.0), (1, "overlap", 0.0), (1, "sync", 0.875), (1, "overlap", 0.875),
        (2, "overlap", 0.875), (2, "sync", 0.875), (2, "overlap", 0.0), (2, "sync", 0.0),
    ]  # fmt: skip


@pytest.mark.parametrize("argv", [["--rates", "0.5"], ["--rates", "0", "0"], ["--rounds", "0"], ["--questions", "0"]])
def test_bad_flags_are_refused_naming_them(argv, capsys):
    with pytest.raises(SystemExit):
        overlap.parse_args(["--out", "x", *argv])
    assert argv[0] in capsys.readouterr().err


def unit(arm, rate, r, wall, cpu):
    return {"arm": arm, "pruning_rate": rate, "round": r, "wall_seconds": wall, "cpu_seconds": cpu,
            "per_step": [{"time/generate_wait": 1.0}]}  # fmt: skip


def test_combine_pairs_every_unit_with_grpos_sync_run_of_its_round():
    units = [unit("sync", 0.0, 1, 100.0, 90.0), unit("sync", 0.0, 2, 120.0, 100.0),
             unit("overlap", 0.875, 1, 10.0, 15.0), unit("overlap", 0.875, 2, 20.0, 20.0)]  # fmt: skip
    rows = {(r["arm"], r["pruning_rate"]): r for r in overlap.combine(units)}
    fast = rows[("overlap", 0.875)]
    assert fast["speedup_vs_grpo_sync"]["mean"] == pytest.approx((100 / 10 + 120 / 20) / 2)  # per round, then mean
    assert fast["cpu_ratio_vs_grpo_sync"]["mean"] == pytest.approx((90 / 15 + 100 / 20) / 2)
    assert fast["wall_seconds"]["mean"] == 15.0 and fast["speedup_vs_grpo_sync"]["ci95"] is not None
    assert rows[("sync", 0.0)]["speedup_vs_grpo_sync"]["mean"] == 1.0


def test_a_real_tiny_run_writes_every_unit_resumes_and_refuses_other_settings(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "overlap.py"), "--config", "tiny-cpu", "--questions", "16",
           "--rounds", "1", "--rates", "0", "0.5", "--set", "max_completion_length=4",
           "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "overlap.json").read_text())
    assert sorted(result["units"]) == ["overlap-p0-r1", "overlap-p0.5-r1", "sync-p0-r1", "sync-p0.5-r1"]
    ahead = json.loads((tmp_path / "units" / "overlap-p0.5-r1.json").read_text())
    steps = ahead["config"]["num_steps"]
    assert ahead["steps"] == steps > 1 and [s["staleness"] for s in ahead["per_step"]] == [0] + [1] * (steps - 1)
    assert "staleness" not in json.loads((tmp_path / "units" / "sync-p0-r1.json").read_text())["per_step"][0]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0 and "..." not in again.stdout  # every unit skipped
    other = subprocess.run([*cmd[:-2], "--set", "max_completion_length=5", "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip
    assert other.returncode != 0 and "other settings" in other.stderr
