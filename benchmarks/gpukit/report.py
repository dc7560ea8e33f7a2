"""The kit's summary: ``summary.json`` (the kit's record and each part's status and checks) and ``summary.md`` (the
same for people, with one section per part), rewritten after every part; and the exit status they report."""

from __future__ import annotations

import json
import os
import pathlib
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from cppo.fileio import atomic_write, write_json
from gpukit.plan import EXIT_FAIL, EXIT_INCOMPLETE, EXIT_PASS


def read_json(path: str | os.PathLike) -> dict | None:
    """The JSON object at ``path``, or None when it is absent or unreadable (a part killed mid-way never leaves a
    half-written one: every write is atomic)."""
    try:
        return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def exit_status(statuses: Sequence[str]) -> int:
    """The kit's exit status from its parts' statuses: 1 when one failed or crashed, else 3 when one ran out of time
    or was skipped, else 0."""
    if any(s in ("fail", "error") for s in statuses):
        return EXIT_FAIL
    if any(s in ("timeout", "skipped") for s in statuses):
        return EXIT_INCOMPLETE
    return EXIT_PASS


def _cell(text: Any, width: int = 200) -> str:
    return " ".join(str(text).split())[:width].replace("|", "/")


def render_tests(r: dict) -> list[str]:
    """The tests part: outcome counts and each failure, or the selection of a dry run."""
    if "selected" in r:
        return [f"{len(r['selected'])} CUDA tests selected (collection only: dry run)."]
    o = r.get("outcomes")
    if not o:
        return ["No outcomes recorded."]
    lines = [
        f"{o['passed']} passed, {len(o['failed'])} failed, {len(o['errors'])} errors, {len(o['skipped'])} skipped "
        f"(from pytest's {o['source']}) in {r.get('seconds')} s.",
        "",
    ]
    lines += [f"- FAILED `{x['test']}`: {_cell(x['message'])}" for x in o["failed"] + o["errors"]]
    for reason, n in Counter(_cell(x["message"], 150) for x in o["skipped"]).items():
        lines.append(f"- skipped x{n}: {reason}")
    return lines


def render_loss(r: dict) -> list[str]:
    """The loss part: per shape, the GEMM floor and one row per method."""
    lines = []
    if r.get("masked_optional_modules"):
        lines.append(f"Optional modules that failed to import (their methods skipped): {r['masked_optional_modules']}")
    for key, row in r.items():
        if not (isinstance(row, dict) and "methods" in row):
            continue
        gemm, acc = row["gemm"], row["accuracy"]
        lines += [
            "",
            f"**{key}**: GEMM floor (one plain [T,H]x[H,V] matmul) {gemm['ms']:.2f} ms = {gemm['tflops']:.0f} "
            f"TFLOP/s; fastest {row['fastest']}, fastest of the library's {row['fastest_library']}; fused_logprobs "
            f"max abs error vs fp64 {acc['logp_error']:.2g} (judged against the kernels' bound by the tests part); "
            f"roofline at {row.get('bandwidth_tbs') or 0:.2f} TB/s (a measured copy) and the GEMM's rate",
            "",
            "| method | fwd ms | bwd ms | fwd+bwd ms | roofline ms | x roofline | TFLOP/s (6THV) | x 3-GEMM floor "
            "| peak extra GB | workspace GB | loss abs error vs fp64 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, m in row["methods"].items():
            pred = m.get("predicted_ms")
            roof = "- | -" if not pred else f"{pred:.2f} | {m['x_predicted']:.2f}"
            lines.append(
                f"| {name}{'' if m['library'] else ' (comparison)'} | {m['fwd_ms']:.2f} | {m['bwd_ms']:.2f} | "
                f"{m['fwd_bwd_ms']:.2f} | {roof} | {m['tflops']:.1f} | {m['x_gemm_floor']:.2f} | "
                f"{m['peak_extra_gb']:.2f} | {m['workspace_gb']:.2f} | {m['loss_error']:.2g} |"
            )
    return lines


def render_select(r: dict) -> list[str]:
    """The select part: one row per (op, scope, N), both backends side by side."""
    table: dict[tuple, dict[str, dict]] = {}
    for row in r.get("rows", []):
        table.setdefault((row["op"], row["scope"], row["n"]), {})[row["backend"]] = row
    lines = [
        "Median ms per call (CUDA events on a GPU), GPU kernels per call (torch.profiler).",
        "",
        "| op | scope | N | torch ms | triton ms | torch kernels/call | triton kernels/call | matches fp64 |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for (op, scope, n), by in table.items():
        ms = [f"{by[b]['median_ms']:.4f}" if b in by else "-" for b in ("torch", "triton")]
        kernels = [f"{by[b]['launches_per_call']['kernels']:g}" if b in by else "-" for b in ("torch", "triton")]
        ok = "yes" if all(x["matches_reference"] for x in by.values()) else "**no**"
        lines.append(f"| {op} | {scope} | {n:,} | {' | '.join(ms)} | {' | '.join(kernels)} | {ok} |")
    return lines


def render_e2e(r: dict) -> list[str]:
    """The e2e part: the packed-forward errors, then each speedup.py run's rows."""
    lines = []
    for key, v in r.items():
        if key.startswith("packed"):
            lines.append(
                f"- {key} ({v['attn_implementation']}, lengths {v['lengths']}): max relative error {v['error']:.2g}; "
                f"negative control {v['control_error']:.2g}"
            )
        elif isinstance(v, str):
            lines.append(f"- {key}: {v}")
        elif key == "varlen":
            lines += render_varlen(v)
        else:
            lines += [f"- {key}: exit status {v['exit_status']} in {v['seconds']} s", ""]
            lines += ["| P | keep | steps | total s | train s | speedup train | speedup total |", "|" + "---:|" * 7]
            for row in v["rows"]:
                cells = [row.get(k) for k in ("pruning_rate", "keep", "steps", "total_seconds", "train_seconds")]
                cells += [row.get("speedup_train"), row.get("speedup_total")]
                lines.append("| " + " | ".join("-" if c is None else f"{c:.3g}" for c in cells) + " |")
            lines.append("")
    return lines


def render_varlen(v: dict) -> list[str]:
    """The e2e part's varlen row: its errors, then forward+backward time and memory against sdpa."""
    lines = [
        f"- varlen packed forward ({v['attn_implementation']}: {v['kernel']}, {v['dtype']}, lengths {v['lengths']}): "
        f"max relative error against separate sdpa forwards {v['error']:.2g} (tolerance {v['tolerance']:g}); "
        f"negative control {v['control_error']:.2g}; calls run by sdpa instead: {len(v['fallbacks'])}",
        "",
        f"  forward+backward of {len(v['timing_lengths'])} sequences, {v['tokens_packed']:,} tokens "
        f"({v['tokens_padded']:,} padded):",
        "",
        "| attention | layout | fwd+bwd ms | peak extra GB |",
        "|---|---|---:|---:|",
    ]
    for key, label in (("varlen", f"{v['attn_implementation']} | packed"), ("sdpa_padded", "sdpa | padded"),
                       ("sdpa_packed", "sdpa | packed (block mask)")):  # fmt: skip
        peak = v[f"peak_extra_gb_{key}"]
        lines.append(f"| {label} | {1e3 * v[f'fwd_bwd_s_{key}']:.2f} | {'-' if peak is None else f'{peak:.2f}'} |")
    return lines + ["", f"  speedup against sdpa padded {v['speedup_vs_sdpa_padded']:.2f}x, packed "
                        f"{v['speedup_vs_sdpa_packed']:.2f}x", ""]  # fmt: skip


RENDERERS: dict[str, Callable[[dict], list[str]]] = {
    "tests": render_tests,
    "loss": render_loss,
    "select": render_select,
    "e2e": render_e2e,
}


def _header(kit: dict, status: int) -> list[str]:
    """The summary's first lines: the machine, the software, the commit, the wheels, the time taken."""
    env = kit["environment"]
    gpu = "no CUDA device"
    if env.get("gpu"):
        gpu = (f"{env['gpu']}, {env['gpu_memory_gib']} GiB, compute capability {env['compute_capability']}, "
               f"{env['multiprocessors']} SMs, driver {env.get('driver')}")  # fmt: skip
    wheels = kit["wheels"]
    lines = ["# GPU validation kit: results", ""]
    if kit["dry_run"]:
        lines += ["**Dry run**: the kit's plumbing on tiny CPU shapes; nothing here is a GPU measurement.", ""]
    return lines + [
        f"- GPU: {gpu}",
        f"- software: python {env['python']}, torch {env['torch']} (CUDA runtime {env['cuda_runtime']}), "
        f"triton {env.get('triton')}, transformers {env.get('transformers')}, liger-kernel {env.get('liger-kernel')}",
        f"- git commit: {env['git_commit']} (uncommitted changes: {env['git_dirty']})",
        f"- wheels from {wheels['folder']}: {', '.join(wheels['installed']) or 'none'}",
        f"- {env['date']}; the kit took {kit.get('elapsed_s')} s of its {kit['deadline_s']:.0f} s deadline; "
        f"exit status {status}",
    ]


def render_summary(kit: dict, parts: dict[str, dict], status: int) -> str:
    """summary.md: the header, a table of the parts, every check, then one section per part."""
    lines = _header(kit, status)
    lines += ["", "| part | status | seconds | budget (s) | checks passed |", "|---|---|---:|---:|---:|"]
    for part, data in parts.items():
        passed = sum(c["ok"] for c in data["checks"])
        lines.append(f"| {part} | {data['status']} | {data.get('seconds')} | {data.get('budget_s'):.0f} | "
                     f"{passed}/{len(data['checks'])} |")  # fmt: skip
    lines += ["", "## Checks", ""]
    for owner, checks in [("kit", kit["checks"])] + [(p, d["checks"]) for p, d in parts.items()]:
        for c in checks:
            detail = f" ({_cell(c['detail'])})" if c["detail"] else ""
            lines.append(f"- [{'x' if c['ok'] else ' '}] {owner}: {c['name']}{detail}")
    for part, data in parts.items():
        lines += ["", f"## {part}", ""] + RENDERERS[part](data.get("results", {}))
        if data.get("error"):
            lines += ["", "```", *str(data["error"]).strip().splitlines()[-12:], "```"]
    return "\n".join(lines) + "\n"


def write_summary(out: pathlib.Path, kit: dict, parts: dict[str, dict]) -> int:
    """Writes summary.json and summary.md (atomically); returns the exit status they report."""
    statuses = [d["status"] for d in parts.values()]
    status = EXIT_FAIL if any(not c["ok"] for c in kit["checks"]) else exit_status(statuses)
    brief = {p: {k: d.get(k) for k in ("status", "seconds", "budget_s", "checks", "error")} for p, d in parts.items()}
    write_json(out / "summary.json", {"kit": kit, "exit_status": status, "parts": brief}, indent=1)
    atomic_write(out / "summary.md", render_summary(kit, parts, status))
    return status
