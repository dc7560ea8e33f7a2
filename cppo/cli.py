"""The command line: ``cppo train --config PRESET_OR_YAML [--set key=value ...] [--resume | --overwrite]
[--dry-run]``, ``cppo eval --model PATH --dataset gsm8k|math500|arith [--limit N]`` (greedy accuracy, printed as
JSON; a LoRA checkpoint loads as base + adapter) and ``cppo merge --checkpoint PATH --output DIR`` (a LoRA
checkpoint's adapter merged into its base, written as a plain model). A user error is one line ``cppo <command>:
error: ...`` and exit code 2, found before the model loads.

Several processes: ``torchrun --nproc-per-node N -m cppo train --config ...`` (and torchrun's ``--nnodes``,
``--node-rank``, ``--rdzv-endpoint`` across nodes); ``parallelism`` (ddp | fsdp2) picks how the model is replicated.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import re
import sys
import traceback

import yaml

from . import cli_report as report
from .config import TrainConfig, setting_help  # plain data: no torch (the commands import what trains)


def settings_epilog() -> str:
    """Every ``--set`` setting, its default and meaning (``train --help``), read from :class:`TrainConfig`."""
    lines = ["settings (--set name=value: a YAML value, a list as a,b, null for none; a preset may set others):"]
    meanings = setting_help()
    for f in dataclasses.fields(TrainConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        lines.append(f"  {f.name} = {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...')}")
        lines.append(f"      {meanings[f.name]}")
    return "\n".join(line.rstrip() for line in lines)


def _parser(*, flags_only: bool = False) -> argparse.ArgumentParser:
    """``cppo``'s parser; ``flags_only``: the eval defaults that a checkpoint's training config may replace are None,
    to tell which flags a command line gave."""
    parser = argparse.ArgumentParser(prog="cppo", description="CPPO training with fused kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train with a preset or a YAML config",
        epilog=settings_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", required=True, help="a preset name (tiny-cpu, ...) or a YAML file")
    train.add_argument(
        "--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help="see below"
    )
    run = train.add_mutually_exclusive_group()
    run.add_argument("--resume", action="store_true", help="continue from the newest readable checkpoint in output_dir")
    run.add_argument("--overwrite", action="store_true", help="delete the run already in output_dir and start again")
    train.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue even though settings that change the run differ from the checkpoint's",
    )
    train.add_argument(
        "--dry-run", action="store_true", help="check config, output_dir, data and resume; load no model, write nothing"
    )
    _add_eval(sub, flags_only=flags_only)
    merge = sub.add_parser(
        "merge", help="merge a LoRA checkpoint's adapter into its base: a plain model that from_pretrained loads"
    )
    merge.add_argument("--checkpoint", required=True, help="a LoRA checkpoint folder (or its model/ adapter folder)")
    merge.add_argument("--output", required=True, help="the folder to write (must not exist, or be empty)")
    merge.add_argument("--dtype", default="float32", help="dtype of the merged weights (float32, bfloat16, float16)")
    return parser


def _add_eval(sub, *, flags_only: bool) -> None:  # flags_only: see _parser
    official = {"dataset": "arith", "max_prompt_length": 512, "max_completion_length": 1024}
    official = dict.fromkeys(official) if flags_only else official  # None: the flag was not given
    ev = sub.add_parser(
        "eval",
        help="accuracy of a model on a dataset's test split (the official CPPO protocol)",
        description="A checkpoint of cppo train is evaluated as it trained: the flags not given follow its training "
        "config (dataset, data path, prompt lengths, system prompt), so a CPU run's checkpoint is evaluated at its own "
        "completion length. Any other model, or --official: the official protocol, GSM8K and MATH-500 greedy with "
        "1,024 new tokens; AMC23 / AIME24 .jsonl sets (rows: problem, answer or solution) with --num-samples 4 "
        "--temperature 0.6 --top-p 0.95 --max-completion-length 3072, the accuracy averaged over the samples.",
    )
    ev.add_argument("--model", required=True, help="tiny-qwen2, a checkpoint folder, a hub name or a .gguf file")
    ev.add_argument(
        "--dataset", default=official["dataset"], help="arith | gsm8k | math500 | a .jsonl file | a hub name"
    )
    ev.add_argument("--dataset-path", default=None, help="a .jsonl file or a folder with test.jsonl")
    ev.add_argument("--limit", type=int, default=None, help="evaluate the first N problems")
    ev.add_argument("--max-prompt-length", type=int, default=official["max_prompt_length"])
    ev.add_argument(
        "--max-completion-length", type=int, default=official["max_completion_length"],
        help="new tokens per completion at most",
    )  # fmt: skip
    ev.add_argument(
        "--official", action="store_true",
        help="a checkpoint too by the official protocol (its defaults above), not as it trained",
    )  # fmt: skip
    ev.add_argument("--num-samples", type=int, default=1, help="completions per problem (accuracy averaged)")
    ev.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy decoding)")
    ev.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (sampling only)")
    ev.add_argument("--reward-timeout", type=float, default=0.5, help="seconds math-verify may spend on one answer")
    ev.add_argument("--system-prompt", default=None, help="replaces the default system prompt")
    ev.add_argument(
        "--batch-size", type=int, default=None, help="prompts per generate call (default: 32 on CUDA, 8 on the CPU)"
    )
    ev.add_argument("--device", default="auto")
    ev.add_argument("--dtype", default="float32")
    ev.add_argument("--rollout-backend", default="hf", help="hf, vllm, auto or a registered engine")
    ev.add_argument("--seed", type=int, default=0, help="seed of the tiny model's initialisation and of sampling")
    ev.add_argument(
        "--output", default=None,
        help="also write the result as JSON to this file, with a record per problem (id, correct, format, length)",
    )  # fmt: skip
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")


def _train(args) -> int:
    from . import distributed
    from .config import load_config
    from .run import open_run, resume
    from .trainer import Trainer

    config, progress = load_config(args.config, args.overrides), args.progress
    if args.allow_config_change and not args.resume:
        raise ValueError("--allow-config-change only applies with --resume")
    if args.dry_run:
        return _dry_run(args, config)
    info = distributed.init_distributed(device=config.device)  # torchrun's process group, or one process
    run = trainer = None
    try:
        existing = "resume" if args.resume else "overwrite" if args.overwrite else "refuse"
        run = open_run(config.output_dir, report_to=config.report_to, info=info, existing=existing)
        candidates = _resume_candidates(config, args, info=info) if args.resume else []
        trainer = Trainer(config, info=info, run=run)
        if args.overwrite:
            run.clear()
        if candidates:
            path = resume(trainer, candidates)
            distributed.print_main(f"resumed from {path} at step {trainer.step}", file=sys.stderr, info=info)
        progress.start = getattr(trainer, "step", None)
        history = trainer.train()
        if history:
            last = history[-1]
            keys = ("step", "reward_mean", "accuracy", "kept_fraction", "time/step")
            distributed.print_main(json.dumps({k: last[k] for k in keys}), info=info)
        if trainer.last_checkpoint:  # the last line: where the run went and how to evaluate it
            distributed.print_main(report.eval_hint(trainer.last_checkpoint), file=sys.stderr, info=info)
    except BaseException as e:
        if trainer is not None:  # how far it got, for the report of a stop (report.stop_report)
            progress.step, progress.checkpoint = (
                getattr(trainer, "step", None),
                getattr(trainer, "last_checkpoint", None),
            )
        # the frames of a failed run hold the trainer and its DDP module: release them too (see below)
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        if run is not None:
            run.close()
        # the DDP module's reducer holds the process group: released here, while the group is still registered,
        # so the group is destroyed by destroy_process_group (which lets go of the GIL) and not by the reducer's
        # deallocation (which holds the GIL while joining the Gloo threads, one of which may still need the GIL
        # to free the tensors of the last all-reduce: a process that never exits)
        trainer = None  # noqa: F841
        distributed.close_distributed()
    return 0


def _resume_candidates(config: TrainConfig, args, *, info) -> list[str]:
    """The checkpoints ``--resume`` may load (:func:`cppo.run.resume_candidates`), the run's settings compared
    with each one's."""
    from .config import FIXED
    from .run import resume_candidates

    return resume_candidates(
        config.output_dir, changes_from=config.changes_from, fixed=FIXED,
        allow_config_change=args.allow_config_change, info=info,
    )  # fmt: skip


def _dry_run(args, config: TrainConfig) -> int:
    """What ``cppo train`` checks before the model loads, writing nothing: output_dir, the training data (local data
    only: nothing is downloaded) and, with ``--resume``, the checkpoint and its settings. Prints the plan as JSON."""
    from .distributed import DistInfo
    from .fileio import check_writable
    from .run import check_free, refuse_existing_run
    from .tasks import count_local_problems, get_rewards

    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in output_dir and --overwrite deletes it: pass one of them")
    check_writable(config.output_dir, create=False)
    check_free(config.output_dir)
    get_rewards(config.rewards)
    if not (args.resume or args.overwrite):
        refuse_existing_run(config.output_dir)
    resume_from = _resume_candidates(config, args, info=DistInfo())[0] if args.resume else None
    problems = count_local_problems(
        config.dataset, dataset_path=config.dataset_path, max_questions=config.max_questions
    )
    steps = config.steps_for(problems) if problems else config.num_steps
    pruning = config.pruning  # the trainer's own counts (cppo.step.selection)
    plan = {
        "dry_run": "ok", "output_dir": config.output_dir, "model": config.model, "dataset": config.dataset,
        "train_problems": problems,  # None: a hub dataset, not downloaded here
        "num_steps": steps, "group_size": config.group_size, "keep": pruning.keep,
        "questions_per_step": pruning.questions_drawn, "kept_per_step": pruning.kept_per_step,
        "device": config.device, "resume_from": resume_from,
    }  # fmt: skip
    print(json.dumps(plan))
    return 0


def _check_eval_args(args) -> None:
    """Every check of ``cppo eval``'s arguments, before anything loads: the counts, the sampling settings, the
    verifier's timeout, ``--output`` (a file whose folder can be made) and the model and dataset names. ValueError
    naming the flag."""
    from cppo_kernels.config import check_float, check_int

    from .config import check_model_and_data
    from .engines import check_engine_installed, engine_supports
    from .fileio import check_writable, cppo_program
    from .run import model_folder
    from .step import is_adapter_folder
    from .tasks import verifier

    if args.limit is not None:
        check_int("--limit", args.limit, low=1)
    for flag in ("max_prompt_length", "max_completion_length", "batch_size", "num_samples"):
        if getattr(args, flag) is not None:  # --batch-size: None follows the device
            check_int(f"--{flag.replace('_', '-')}", getattr(args, flag), low=1)
    check_float("--temperature", args.temperature, low=0.0)
    if not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.num_samples > 1 and args.temperature == 0:
        raise ValueError("--num-samples > 1 needs sampling: set --temperature > 0 (greedy decoding repeats itself)")
    verifier(timeout=args.reward_timeout)
    if args.output:  # before the evaluation, not after it
        if os.path.isdir(args.output):
            raise ValueError(f"--output {args.output!r} is a folder: name the JSON file to write")
        try:
            check_writable(os.path.dirname(os.path.abspath(args.output)), create=False)
        except ValueError as e:
            raise ValueError(f"--output {args.output!r}: " + str(e).replace("output_dir", "its folder", 1)) from None
    try:
        check_model_and_data(
            model=args.model, dataset=args.dataset, dataset_path=args.dataset_path, dtype=args.dtype, device=args.device
        )
    except ValueError as e:
        message = _as_flags(str(e))
        close = report.did_you_mean_path(args.model) if getattr(e, "settings", ()) == ("model",) else ""
        raise ValueError(message + close) from None  # checkpoint-00008: a zero short of checkpoint-000008
    _check_not_a_run_folder(args.model)
    try:
        check_engine_installed(args.rollout_backend)
    except ValueError as e:
        message = str(e).replace("rollout_backend=", "--rollout-backend ")
        raise ValueError(re.sub(r"\brollout_backend\b", "--rollout-backend", message)) from None
    if engine_supports(args.rollout_backend, "reads_model_folder") and is_adapter_folder(model_folder(args.model)):
        raise ValueError(
            f"--model {args.model!r} is a LoRA adapter, which --rollout-backend {args.rollout_backend} cannot load (it "
            f"reads full weights from the folder): {cppo_program()} merge it first"
        )


#: ``cppo eval``'s flags for the settings its checks name.
EVAL_FLAGS = {"dataset_path": "--dataset-path", "dataset": "--dataset", "model": "--model", "dtype": "--dtype"}


def _as_flags(message: str) -> str:
    """A setting's message in ``cppo eval``'s words: ``dataset_path`` becomes ``--dataset-path`` (and so on)."""
    for name, flag in EVAL_FLAGS.items():
        message = re.sub(rf"(^|: |pass ){name}\b(?!_)", lambda m, flag=flag: m.group(1) + flag, message)
    return re.sub(r"^device\b", "--device", message)


def _check_not_a_run_folder(model: str) -> None:
    """A training run's folder (checkpoints, no model of its own) is named with the checkpoint to evaluate."""
    from .run import latest, model_folder
    from .step import is_adapter_folder

    found = latest(model) if os.path.isdir(model) else None
    folder = model_folder(model)
    is_model = os.path.isfile(os.path.join(folder, "config.json")) or is_adapter_folder(folder)
    if found and not is_model:
        raise ValueError(
            f"--model {model!r} is a run folder, not a model: evaluate its latest checkpoint, --model {found}"
        )
    if os.path.isdir(model) and not is_model:
        raise ValueError(
            f"--model {model!r} is a folder without a config.json: not a model (a transformers save, a cppo checkpoint "
            "or a LoRA adapter)"
        )


def _eval(args) -> int:
    """``cppo eval``: :func:`_check_eval_args`, then the model's accuracy on the test split, printed as JSON (and
    written atomically to ``--output``, with the per-problem records)."""
    import torch
    from safetensors import SafetensorError

    from . import fileio
    from .distributed import resolve_device
    from .engines import EngineSettings, make_engine
    from .evaluate import evaluate_model
    from .run import model_folder
    from .tasks import load_problems

    trained = _as_trained(args)
    _check_eval_args(args)
    device = resolve_device(args.device)
    if args.batch_size is None:  # the progress bar moves per batch: a CPU's batches are small
        args.batch_size = 32 if device.type == "cuda" else 8
    if trained:
        print(
            f"cppo eval: {args.model} is evaluated as it trained ({trained}); --official for the official protocol",
            file=sys.stderr,
        )
    try:
        problems = load_problems(args.dataset, split="test", dataset_path=args.dataset_path, max_questions=args.limit)
    except ValueError as e:
        raise ValueError(_as_flags(str(e))) from None
    try:
        model, tokenizer = _load_eval_model(model_folder(args.model), dtype=args.dtype, device=device, seed=args.seed)
    except (OSError, ValueError) as e:  # not a model folder, and the hub could not provide it
        raise ValueError(f"--model {args.model!r}: {e}") from None
    except SafetensorError as e:  # a truncated or corrupt weights file (an adapter's are checked by name before)
        files = sorted(glob.glob(os.path.join(glob.escape(model_folder(args.model)), "*.safetensors")))
        weights = files[0] if len(files) == 1 else f"a *.safetensors file of {model_folder(args.model)}"
        raise ValueError(
            f"--model {args.model!r}: {weights} cannot be read ({e}): a truncated or corrupt file"
        ) from None
    settings = EngineSettings(
        model_name=model_folder(args.model), max_prompt_length=args.max_prompt_length,
        max_completion_length=args.max_completion_length, temperature=args.temperature or 1.0, top_p=args.top_p,
    )  # fmt: skip
    rollout = make_engine(args.rollout_backend, model, tokenizer, settings)
    torch.manual_seed(args.seed)  # sampled evaluation draws from torch's global RNG
    result = evaluate_model(
        rollout, tokenizer, problems, system_prompt=args.system_prompt, batch_size=args.batch_size,
        num_samples=args.num_samples, greedy=args.temperature == 0, progress=not args.no_progress,
    )  # fmt: skip
    result = {"model": args.model, "dataset": args.dataset, **result}
    print(json.dumps({k: v for k, v in result.items() if k != "per_problem"}))  # the records go to --output only
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        fileio.write_json(args.output, result)
    return 0


#: What ``cppo eval`` takes from a checkpoint's training config for the flags not given (the dataset's path only with
#: the dataset itself).
TRAINED = ("dataset", "dataset_path", "max_prompt_length", "max_completion_length", "system_prompt")


def _as_trained(args) -> str | None:
    """A checkpoint of ``cppo train`` (its ``trainer_state.pt`` beside ``model/``) is evaluated as it trained: the
    flags of :data:`TRAINED` not given on the command line take its training config's values (unless ``--official``).
    Returns what was taken, in words, or None (another model: the official protocol)."""
    from .run import STATE_FILE, CorruptCheckpoint, read_state

    folder = os.path.abspath(args.model)
    if not os.path.isfile(os.path.join(folder, STATE_FILE)):
        folder = os.path.dirname(folder)  # CHECKPOINT/model names the same checkpoint
    if args.official or not os.path.isfile(os.path.join(folder, STATE_FILE)):
        return None
    try:
        config = read_state(folder, mmap=True).get("config") or {}
    except CorruptCheckpoint as e:
        logging.getLogger("cppo").warning("%s; evaluating by the official protocol", e)
        return None
    taken = [
        name for name in TRAINED
        if name in config and name not in args.given and (name != "dataset_path" or "dataset" not in args.given)
    ]  # fmt: skip
    for name in taken:
        setattr(args, name, config[name])
    return ", ".join(f"{name} {config[name]!r}" for name in taken) or None


def _load_eval_model(folder: str, *, dtype: str, device, seed: int):
    """``(model, tokenizer)`` of ``cppo eval``: base + adapter for a LoRA adapter folder, else the model itself."""
    from .step import is_adapter_folder, load_adapter_model, load_model_and_tokenizer

    if is_adapter_folder(folder):
        return load_adapter_model(folder, dtype=dtype, device=device)
    return load_model_and_tokenizer(folder, dtype=dtype, device=device, seed=seed)


def _merge(args) -> int:
    """``cppo merge``: the adapter of a LoRA checkpoint merged into its base (``merge_and_unload``), written as a
    plain model + tokenizer to ``--output`` (a new or empty folder, filled beside itself and renamed into place)."""
    from cppo_kernels.config import check_choice

    from .config import DTYPES
    from .run import model_folder
    from .step import is_adapter_folder, merge

    check_choice("--dtype", args.dtype, DTYPES)
    if not os.path.exists(args.checkpoint):
        raise ValueError(f"--checkpoint {args.checkpoint!r} does not exist{report.did_you_mean_path(args.checkpoint)}")
    folder = model_folder(args.checkpoint)
    if not is_adapter_folder(folder):
        raise ValueError(
            f"--checkpoint {args.checkpoint!r} holds no LoRA adapter (adapter_config.json): nothing to merge"
        )
    print(json.dumps({"checkpoint": args.checkpoint, "merged": merge(folder, args.output, dtype=args.dtype)}))
    return 0


COMMANDS = {"train": _train, "eval": _eval, "merge": _merge}


def main(argv: list[str] | None = None) -> int:
    """Runs ``cppo train``, ``cppo eval`` or ``cppo merge``; returns the exit code (2: a user error; 1: a run that
    diverged; 128 + the signal's number: stopped by a signal, said in words with the command to run next)."""
    args = _parser().parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    args.progress = report.Progress(resume=bool(getattr(args, "resume", False)))
    if args.command == "eval":  # which flags the command line gave (a checkpoint's training config fills the others)
        flags = vars(_parser(flags_only=True).parse_args(argv))
        args.given = {name for name in TRAINED if flags.get(name) is not None}
    handler = logging.StreamHandler()  # the package's warnings (files skipped, cleaned up), as one line each
    handler.setFormatter(logging.Formatter(f"cppo {args.command}: warning: %(message)s"))
    logging.getLogger("cppo").addHandler(handler)
    try:
        return _run(args, argv)
    except KeyboardInterrupt as e:  # a second signal, or a Ctrl-C outside the training steps (imports included)
        lines = report.stop_report(args.command, e, args.progress, argv)
        report.error(args.command, lines[0].split(": stopped: ", 1)[1], kind="stopped")
        print(*lines[1:], sep="\n", file=sys.stderr)
        return 130
    finally:
        logging.getLogger("cppo").removeHandler(handler)


def _run(args, argv: list[str]) -> int:
    """The command, its user errors as one line (exit code 2), a diverged run (1), a stop at a safe point."""
    from .run import Interrupted  # the package's modules import torch: --help and bad flags have not waited for it
    from .step import NonFiniteUpdates

    try:
        return COMMANDS[args.command](args)
    except (ValueError, OSError, yaml.YAMLError) as e:  # the user's input: settings, files, paths, hub names
        report.error(args.command, e)
        return 2
    except NonFiniteUpdates as e:
        report.error(args.command, e)
        return 1
    except Interrupted as e:  # the first Ctrl-C / SIGTERM: stopped at a safe point, this step saved
        report.error(args.command, e, kind="stopped")
        print(report.continue_hint(argv), file=sys.stderr)
        return e.exit_code
