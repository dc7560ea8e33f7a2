"""A tiny training run for the reliability tests (``from tiny_run import ...``: pytest puts ``tests/`` on
``sys.path``): a config of a seconds-long run, the ``cppo train`` settings of the same, and a trained output folder.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import shutil

from tiny_model import TINY

from cppo import TrainConfig, run
from cppo.cli import main
from cppo.config import FIXED
from cppo.distributed import DistInfo

#: ``cppo train --config tiny-cpu --set ...`` of a run of a few seconds (before output_dir and num_steps).
CLI_SETTINGS = ["group_size=4", "max_questions=32", "max_completion_length=8", "eval_limit=null", "save_every=1"]


def tiny_config(output_dir, **overrides) -> TrainConfig:
    """A TrainConfig of a tiny model on arithmetic: a step takes well under a second on one CPU thread."""
    options = dict(
        model="tiny-qwen2",
        model_config=TINY,
        device="cpu",
        dataset="arith",
        max_questions=64,
        system_prompt="Answer.",
        max_prompt_length=48,
        max_completion_length=8,
        group_size=4,
        questions_per_step=2,
        micro_batch_tokens=96,
        mu=2,
        lr=1e-2,
        warmup_ratio=0.0,
        num_steps=4,
        rewards=["digits"],
        rollout_backend="hf",
        kernel_backend="torch",
        output_dir=str(output_dir),
    )
    options.update(overrides)
    return TrainConfig(**options)


def train_cli(output_dir, *flags: str, settings: tuple[str, ...] = ()) -> int:
    """``cppo train --config tiny-cpu FLAGS --set CLI_SETTINGS output_dir=... SETTINGS`` in this process."""
    return main(
        ["train", "--config", "tiny-cpu", *flags, "--set", *CLI_SETTINGS, f"output_dir={output_dir}", *settings]
    )


def resume_candidates(config: TrainConfig, *, allow_config_change: bool) -> list[str]:
    """The checkpoints ``cppo train --resume`` would try for ``config``, in one process (as the CLI asks for them)."""
    return run.resume_candidates(
        config.output_dir, changes_from=config.changes_from, fixed=FIXED, allow_config_change=allow_config_change,
        info=DistInfo(),
    )  # fmt: skip


def copy_run(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """A copy of a trained output folder (checkpoints and metrics) at ``target``."""
    shutil.copytree(source, target)
    return target


class Exploit:
    """Unpickling this runs ``exec``, which writes ``marker``: the proof that a load ran code."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def raw_exploit(marker: pathlib.Path) -> bytes:
    """A plain pickle that writes ``marker`` when loaded."""
    return pickle.dumps({"step": 1, "payload": Exploit(marker)})


def ran(marker: pathlib.Path) -> bool:
    return os.path.exists(marker)
