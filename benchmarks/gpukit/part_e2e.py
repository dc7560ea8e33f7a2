"""Part ``e2e``: the packed forward (sequences in one row, position_ids restarting) against separate forwards
(the attention the trainer picks: flash-attention 2 when importable, else torch_varlen where it runs, else sdpa),
recorded; prefix-shared packing against a prompt copy per completion (errors, tokens, forward+backward time and
memory each way; :mod:`gpukit.part_prefix`), its equality checked; torch's own varlen FlashAttention
(``torch_varlen``) packed against separate sdpa forwards, its negative control, its time and memory against sdpa's
padded forward (:mod:`gpukit.part_varlen`), checked; then ``benchmarks/speedup.py`` tiny on the plan's device with
HF rollouts, and vLLM ones when importable. The pass/fail checks of the packed forward and of prefix sharing on
CUDA are tests, ``tests/cppo/step/test_cuda_models.py``, run by the ``tests`` part."""

from __future__ import annotations

import importlib.util
import itertools
import pathlib
import sys
import tempfile
from collections.abc import Sequence

from gpukit import part_varlen
from gpukit.part_prefix import prefix_shared
from gpukit.plan import BENCH, Plan
from gpukit.report import read_json
from gpukit.runner import PartTimeout, Report, child_env, run_child, seconds_left


def packed_errors(plan: Plan, dtype: str) -> dict:
    """Final hidden states of sequences packed in one row (position_ids restarting at 0) against each sequence run
    alone: ``||packed - alone|| / ||alone||`` per sequence and its largest, ``error``. The negative control,
    ``control_error``, runs the same row with position_ids running on (one long causal sequence): its later
    sequences see the earlier ones, the leak the packing must prevent."""
    import torch

    from cppo.step import load_model_and_tokenizer, packed_hidden

    device = torch.device(plan.device)
    model, _ = load_model_and_tokenizer("tiny-qwen2", model_config=plan.packed_model, dtype=dtype, device=device)
    model.eval()
    g = torch.Generator().manual_seed(0)
    lengths = plan.packed_lengths
    ids = torch.randint(5, plan.packed_model["vocab_size"], (1, sum(lengths)), generator=g).to(device)  # [1, L]
    restart = torch.cat([torch.arange(n) for n in lengths])[None].to(device)  # [1, L]
    running = torch.arange(sum(lengths), device=device)[None]  # [1, L]
    bounds = list(itertools.accumulate(lengths, initial=0))
    with torch.no_grad():
        packed = packed_hidden(model, ids, restart).double()  # [L, H]
        control = packed_hidden(model, ids, running).double()  # [L, H]
        errors, leaks = [], []
        for a, b in zip(bounds, bounds[1:]):
            alone = packed_hidden(model, ids[:, a:b], restart[:, a:b]).double()  # [n, H]
            errors.append(((packed[a:b] - alone).norm() / alone.norm()).item())
            leaks.append(((control[a:b] - alone).norm() / alone.norm()).item())
    return {
        "dtype": dtype,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "lengths": list(lengths),
        "error": max(errors),
        "errors": errors,
        "control_error": max(leaks[1:]),
    }


def speedup_rows(path: pathlib.Path) -> list[dict]:
    """The headline columns of a ``speedup.json``'s rows (the whole file stays beside the part's JSON)."""
    data = read_json(path) or {}
    keys = ("pruning_rate", "keep", "steps", "total_seconds", "train_seconds", "speedup_train", "speedup_total")
    return [{k: row.get(k) for k in (*keys, "phase_seconds")} for row in data.get("rows", [])]


def run_speedup(argv: Sequence[str], folder: pathlib.Path, report: Report, until: float, label: str) -> None:
    """``benchmarks/speedup.py ARGV --out FOLDER`` in a child process; a check that it ran and wrote its rows."""
    cmd = [sys.executable, str(BENCH / "speedup.py"), *argv, "--out", str(folder)]
    log = folder.with_suffix(".log")
    rc, timed_out, seconds = run_child(cmd, timeout=seconds_left(until), log=log, env=child_env())
    rows = speedup_rows(folder / "speedup.json")
    report.add(label, {"command": cmd[1:], "exit_status": rc, "seconds": round(seconds, 1), "rows": rows})
    if timed_out:
        raise PartTimeout(f"speedup.py ({label}) stopped after {seconds:.0f} s")
    report.check(f"speedup.py runs end to end ({label})", rc == 0 and bool(rows), f"exit status {rc}, see {log.name}")


def vllm_argv(plan: Plan, folder: pathlib.Path) -> list[str]:
    """speedup.py's arguments for vLLM rollouts. vLLM loads a model folder, so the HF run's tiny model (its config,
    its seed) is saved to ``folder`` and named by ``--model`` instead of ``--model-config``."""
    from endtoend import speedup

    from cppo.step import load_model_and_tokenizer

    config = speedup.base_config(speedup.parse_args(list(plan.speedup_argv)))
    model, tokenizer = load_model_and_tokenizer(
        config.model, model_config=config.model_config, dtype="bfloat16", seed=config.seed
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    argv = list(plan.speedup_argv)
    if "--model-config" in argv:  # only a tiny-* model takes one
        del argv[argv.index("--model-config") : argv.index("--model-config") + 2]
    return [*argv, "--model", str(folder), "--dtype", "bfloat16", "--rollout-backend", "vllm"]


def run(plan: Plan, out: pathlib.Path, report: Report, until: float) -> None:
    """The packed-forward errors and the prefix-sharing measurement per dtype (recorded as ``packed prefix-shared
    <dtype>``, the key summary.md renders as a packed forward's errors), torch's varlen FlashAttention against
    separate forwards and sdpa (``varlen``, :mod:`gpukit.part_varlen`), then speedup.py with HF rollouts (and vLLM
    ones when importable)."""
    for dtype in plan.packed_dtypes:
        report.add(f"packed {dtype}", packed_errors(plan, dtype))
        row = prefix_shared(plan, dtype)
        report.add(f"packed prefix-shared {dtype}", row)
        detail = f"{row['attn_implementation'][0]}: relative error {row['error']:.2g}, tolerance {row['tolerance']:g}"
        report.check(f"prefix-shared hidden states equal unshared ({dtype})", row["error"] <= row["tolerance"], detail)
    part_varlen.record(plan, report)
    run_speedup([*plan.speedup_argv, "--rollout-backend", "hf"], out / "speedup-hf", report, until, "speedup hf")
    if not plan.dry and importlib.util.find_spec("vllm") is None:
        report.add("speedup vllm", "skipped: vllm is not importable")
        return
    with tempfile.TemporaryDirectory(prefix="gpu-check-model-") as tmp:
        argv = vllm_argv(plan, pathlib.Path(tmp))
        if not plan.dry:
            run_speedup(argv, out / "speedup-vllm", report, until, "speedup vllm")
            return
        from endtoend import speedup  # the dry run checks the arguments only: vLLM needs a GPU

        args = speedup.parse_args(argv)
        vllm_asked = 'rollout_backend="vllm"' in args.overrides
        note = ""
        if importlib.util.find_spec("vllm") is None:  # refused before loading, as a run here would be (issue 27)
            try:
                speedup.base_config(args)
                refused = False
            except ValueError as e:
                refused = "rollout_backend='vllm' needs the vllm package" in str(e)
            report.check("without vLLM installed, speedup.py refuses rollout_backend=vllm in one line", refused)
            args.overrides = [o for o in args.overrides if not o.startswith("rollout_backend=")]
            note = "; vLLM is not installed here: the other settings checked"
        config = speedup.base_config(args)
        ok = vllm_asked and (config.model, config.model_config) == (tmp, None)
        report.add("speedup vllm", f"dry run: arguments checked, not run ({' '.join(argv)}){note}")
        report.check("speedup.py takes the vLLM run's arguments (saved tiny model, vllm rollouts)", ok)
