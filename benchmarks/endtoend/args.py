"""The command line of ``benchmarks/speedup.py``: its flags (``--config`` / ``--set`` exactly as ``cppo train`` takes
them, each shortcut flag one ``--set``), the base trainer config they build, the ablation runs they ask for, and
where the results go (``--out``, by default a new folder of the run's own under the ignored ``benchmarks/runs/``:
:mod:`benchkit.out`). Nothing here plans, trains or writes a result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Sequence

import torch
from benchkit.out import run_folder_name

import cppo
from cppo import TrainConfig
from cppo.distributed import resolve_device
from cppo.fileio import check_writable

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_RATES = (0.0, 0.5, 0.75, 0.875, 0.9375)
#: ``--preset NAME`` is ``--config PRESETS[NAME]`` (a trainer preset under cppo/presets/).
PRESETS = {"cpu": "speedup-cpu", "gsm8k": "gsm8k-qwen2.5-1.5b"}
#: GSM8K's training split where the workplace keeps it (used when the config reads gsm8k without a dataset_path).
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k"

#: Settings every run's plan sets itself (and the flag that chooses them): ``--set`` of one would be dropped, and
#: ``--compare`` of one would leave the two runs of a rate equal.
PLANNED = {"pruning_rate": "--pruning-rates", "num_steps": "--questions", "max_questions": "--questions",
           "output_dir": "--out"}  # fmt: skip

#: ``--selection-metric METRIC@P``: what an ablation run prunes instead of the smallest |A| (cppo_kernels' metrics;
#: ``max-variance``, PODS' selector, runs with ``selection_scope=group``, the only scope it is defined for).
ABLATION_METRICS = ("random", "largest", "max-variance")


def check_out(out: pathlib.Path, *, create: bool) -> None:
    """``--out`` is (or can be made) a writable folder: a ``ValueError`` naming ``--out`` otherwise."""
    try:
        check_writable(str(out), create=create)
    except ValueError as e:
        raise ValueError("--out" + str(e).removeprefix("output_dir")) from None


def parse_ablation(text: str) -> tuple[str, float]:
    """``"random@0.75"`` -> ``("random", 0.75)``: an ablation run (``--selection-metric``) that prunes P with METRIC
    (:data:`ABLATION_METRICS`). ValueError naming the flag for anything else (P = 0 prunes nothing to ablate)."""
    metric, at, rate = str(text).partition("@")
    try:
        p = float(rate)
    except ValueError:
        p = math.nan
    if not at or metric not in ABLATION_METRICS or not 0.0 < p < 1.0:
        raise ValueError(
            f"--selection-metric {text!r}: expected METRIC@P with METRIC in {'/'.join(ABLATION_METRICS)} and P in "
            f"(0, 1), e.g. random@0.75 (the smallest |A|, CPPO itself, is every --pruning-rates run)"
        )
    return metric, p


#: Shortcut flags, each a ``--set`` of one trainer setting: (flag, setting, how the value becomes YAML, help).
SHORTCUTS = (
    ("--model", "model", json.dumps, "'tiny-qwen2', a hub name, a local path or a .gguf file"),
    ("--model-config", "model_config", None, "JSON overrides of the tiny model's config"),
    ("--dataset", "dataset", json.dumps, "arith | gsm8k | math500 | a .jsonl path | a hub dataset"),
    ("--dataset-path", "dataset_path", json.dumps, "local file or folder for --dataset gsm8k / math500"),
    ("--device", "device", json.dumps, "auto | cpu | cuda | cuda:N"),
    ("--dtype", "dtype", json.dumps, "float32 | bfloat16 | float16"),
    ("--group-size", "group_size", int, "completions per question G"),
    ("--questions-per-step", "questions_per_step", int, "questions a GRPO step draws"),
    ("--max-new-tokens", "max_completion_length", int, "completion length cap"),
    ("--max-prompt-length", "max_prompt_length", int, "prompts keep their last N tokens"),
    ("--micro-batch-tokens", "micro_batch_tokens", int, "token budget per packed micro-batch"),
    ("--mu", "mu", int, "policy updates per rollout"),
    ("--backend", "kernel_backend", json.dumps, "auto | triton | torch (triton on CPU runs the interpreter)"),
    ("--rollout-backend", "rollout_backend", json.dumps, "auto | hf | vllm"),
    ("--seed", "seed", int, "the same seed for every rate"),
    ("--allocation", "allocation", None, "CPPO draws 1/(1-P) times more questions per step (the paper's allocation)"),
)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``speedup.py``; :func:`parse_args` turns the shortcut flags into ``--set`` settings."""
    ap = argparse.ArgumentParser(description="CPPO against GRPO, end to end, on the same questions (see docstring).")
    add = ap.add_argument
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--config", help="a trainer preset or a YAML file (default: speedup-cpu)")
    which.add_argument("--preset", choices=sorted(PRESETS), help=f"a shortcut for --config: {PRESETS}")
    add("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help="trainer setting")
    for flag, setting, to_yaml, text in SHORTCUTS:
        kind = {"action": argparse.BooleanOptionalAction} if setting == "allocation" else {"type": to_yaml}
        add(flag, dest=setting, **kind, help=f"--set {setting}=...: {text}")
    add("--pruning-rates", type=float, nargs="+", default=list(DEFAULT_RATES), help="the first must be 0 (GRPO)")
    add("--questions", type=int, help="questions every rate processes (default: the least valid, x2 on CPU)")
    add(
        "--selection-metric",
        dest="ablations",
        nargs="+",
        default=[],
        metavar="METRIC@P",
        help="ablation runs: prune P with METRIC (random: at random; largest: the largest |A|; max-variance: PODS' "
        "subset of largest reward variance per question, with selection_scope=group) instead of the smallest |A|, "
        "e.g. random@0.75; each is one more row and plot line, on the same questions and seed",
    )
    add(
        "--eval",
        type=int,
        metavar="N",
        help="greedy accuracy on the first N test problems (the dataset's official check) before training and during "
        "every run, evaluation time excluded from the training time; 95%% Wilson intervals",
    )
    add(
        "--eval-points",
        type=int,
        metavar="K",
        help="with --eval: evaluate each run after K evenly spaced steps, the last at its end (default: 4, at most "
        "the shortest run's steps)",
    )
    add(
        "--compare",
        action="append",
        metavar="KEY=VALUE",
        help="one more run per --pruning-rates rate with this trainer setting changed (as --set takes it), e.g. "
        "prefix_sharing=false: the two runs of a rate run one after the other on the same seed and questions, and "
        f"meta.compare gives their train / total seconds and tokens ratios (once; not {', '.join(PLANNED)}, which "
        "each run's plan sets)",
    )
    add_whole_run_flags(ap)
    add("--schedule", choices=["interleaved", "sequential"], help="default: interleaved on CPU, else sequential")
    add(
        "--out",
        type=pathlib.Path,
        help="the folder for NAME.json and the PNGs (default: a new benchmarks/runs/NAME-<UTC time>/, ignored by git; "
        "the committed reference results: --out benchmarks/results)",
    )
    add("--name", default="speedup", help="file name stem: NAME.json, NAME.png, NAME-accuracy.png (with --eval)")
    add("--no-plot", action="store_true", help="skip the PNG")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--dry-run", action="store_true", help="validate the whole plan: no model built, nothing trained or written")
    return ap


def add_whole_run_flags(ap: argparse.ArgumentParser) -> None:
    """How the arms run (``--threads``, ``--warmup``) and the whole-run table's flags (issue 51): ``--batched-grpo``
    arms and ``--rounds``."""
    add = ap.add_argument
    add("--threads", type=int, help="torch.set_num_threads (default: 1 on CPU, else torch's choice)")
    add(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one untimed step per arm first, each on questions outside the measured set (once per process)",
    )
    add(
        "--batched-grpo",
        dest="batched",
        type=int,
        nargs="+",
        default=[],
        metavar="Q",
        help="GRPO arms generating Q steps' questions in one call, training unchanged (P = 0 with "
        "steps_per_generation=Q, max_staleness=Q-1), e.g. 2 4 8 beside P = 0.5 0.75 0.875 with allocation: pruning "
        "against batching",
    )
    add(
        "--collect",
        nargs="+",
        type=pathlib.Path,
        metavar="FOLDER",
        help="no run: the whole-run table of several --rounds runs (each FOLDER/NAME.json, its speedups against its "
        "own GRPO), written to --out/NAME.json (when all arms of one process do not fit in memory)",
    )
    add(
        "--rounds",
        type=int,
        metavar="N",
        help="run every arm N times (rounds), each round written to --out as NAME-roundK.json as it ends; a rerun "
        "with the same --out and settings runs only the missing rounds; NAME.json combines them (means, 95%% t "
        "intervals)",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``args.config`` and ``args.overrides`` are what ``cppo train --config --set`` takes.

    A shortcut flag given adds its ``setting=value`` after ``--set``'s; ``--model`` with a model that is not
    ``tiny-*`` also sets ``model_config=null`` (the preset's, if any, only applies to a tiny model).
    """
    args = build_parser().parse_args(argv)
    planned = next((o for o in args.overrides if o.partition("=")[0] in PLANNED), None)
    if planned is not None:  # the plan would replace it without a word
        key = planned.partition("=")[0]
        raise ValueError(f"--set {planned}: speedup.py sets {key} for every run itself: choose it with {PLANNED[key]}")
    args.compare = _one_compare(args.compare)
    values = {setting: getattr(args, setting) for _, setting, _, _ in SHORTCUTS}
    given = {s: json.dumps(v) if isinstance(v, bool) else v for s, v in values.items() if v is not None}
    if "model" in given and not json.loads(given["model"]).startswith("tiny-"):
        given = {"model_config": "null", **given}  # only a tiny model takes a model_config
    args.overrides = [*args.overrides, *(f"{s}={v}" for s, v in given.items())]
    if args.config is None:
        args.preset = args.preset or "cpu"
        args.config = PRESETS[args.preset]
    return args


def _one_compare(given: list[str] | None) -> str | None:
    """The one ``--compare KEY=VALUE`` (None without): a ValueError naming ``--compare`` when it is given twice (one
    comparison a run; a second used to be dropped silently) or names a setting of :data:`PLANNED` (both runs of a
    rate would be the same run)."""
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(
            f"--compare given {len(given)} times ({', '.join(given)}): a run compares one setting; run speedup.py "
            "once per setting"
        )
    key = given[0].partition("=")[0]
    if key in PLANNED:
        raise ValueError(
            f"--compare {given[0]}: speedup.py sets {key} for every run itself (choose it with {PLANNED[key]}), so "
            "the two runs of a rate would be the same: compare another setting"
        )
    return given[0]


def base_config(args: argparse.Namespace, *, need_cuda: bool = True) -> TrainConfig:
    """``load_config(args.config, args.overrides)`` with ``device`` resolved (and ../shared's GSM8K if present).
    ``need_cuda=False`` (``--dry-run``) leaves a CUDA device unresolved on a machine without one."""
    config = cppo.load_config(args.config, args.overrides)
    if config.dataset == "gsm8k" and config.dataset_path is None and SHARED_GSM8K.is_dir():
        config = dataclasses.replace(config, dataset_path=str(SHARED_GSM8K))
    if not need_cuda and config.device.startswith("cuda") and not torch.cuda.is_available():
        return config
    device = resolve_device(config.device)  # ValueError when CUDA is asked for and absent
    if args.preset == "gsm8k" and device.type != "cuda":
        raise ValueError("--preset gsm8k trains Qwen2.5-1.5B-Instruct and needs a CUDA device (--device cuda)")
    return dataclasses.replace(config, device=str(device))


def compare_config(args: argparse.Namespace, base: TrainConfig, *, need_cuda: bool = True) -> TrainConfig | None:
    """``--compare KEY=VALUE``: the base config with that one setting changed (built as ``--set`` builds it, so it
    is validated the same way); None without ``--compare``. ValueError naming ``--compare`` when it is not
    ``KEY=VALUE`` or changes nothing."""
    if args.compare is None:
        return None
    key, eq, _ = str(args.compare).partition("=")
    if not eq or not key:
        raise ValueError(f"--compare {args.compare!r}: expected KEY=VALUE, e.g. prefix_sharing=false")
    variant = argparse.Namespace(**{**vars(args), "overrides": [*args.overrides, str(args.compare)]})
    try:
        config = base_config(variant, need_cuda=need_cuda)
    except ValueError as e:
        raise ValueError(f"--compare {args.compare}: {e}") from None
    if config == base:
        raise ValueError(f"--compare {args.compare}: the setting already has that value, so the runs would be equal")
    return config


def out_folder(args: argparse.Namespace) -> pathlib.Path:
    """``--out``, else the folder a run starting now gets under ``benchmarks/runs/`` (``NAME-<UTC time>``;
    :func:`benchkit.out.new_run_folder` creates it, exclusively, when the run starts)."""
    return pathlib.Path(args.out) if args.out is not None else run_folder_name(str(args.name))


def output_files(args: argparse.Namespace, *, accuracy: bool) -> dict[str, str]:
    """What the run writes in :func:`out_folder`: ``json``, ``png`` (unless ``--no-plot``), ``accuracy_png`` (with
    ``accuracy``: ``--eval``). ValueError unless ``--name`` is a plain file name stem."""
    name = str(args.name)
    if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
        raise ValueError(f"--name must be a file name stem (no folder), got {name!r}")
    out = out_folder(args)
    files = {"json": out / f"{name}.json"}
    if not args.no_plot:
        files["png"] = out / f"{name}.png"
        if accuracy:
            files["accuracy_png"] = out / f"{name}-accuracy.png"
    return {k: str(v) for k, v in files.items()}
