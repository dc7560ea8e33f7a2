"""Checkpoints written before ``cppo/`` was split into subpackages (commit 1b42f7a, in tests/support/fixtures/) still
load, resume and evaluate: a moved module must never break a saved run."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file

from cppo import load_config
from cppo.cli import main
from cppo.trainer import Trainer

FIXTURE = pathlib.Path(__file__).resolve().parents[2] / "support" / "fixtures" / "checkpoints-1b42f7a"


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_an_old_checkpoint_resumes_and_trains_on(kind, tmp_path, capsys):
    run = shutil.copytree(FIXTURE / kind, tmp_path / kind)
    config = str(FIXTURE / f"{kind}.yaml")
    assert main(["train", "--config", config, "--resume", "--set", f"output_dir={run}", "num_steps=2"]) == 0
    assert f"resumed from {run / 'checkpoint-000001'} at step 1" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert torch.load(run / "checkpoint-000002" / "trainer_state.pt", weights_only=True)["step"] == 2


def test_an_old_checkpoint_loads_its_weights_and_state(tmp_path):
    trainer = Trainer(load_config(str(FIXTURE / "full.yaml"), [f"output_dir={tmp_path}"]))
    trainer.load_checkpoint(str(FIXTURE / "full" / "checkpoint-000001"))
    assert trainer.step == 1 and trainer.sampler.state_dict() == {"epoch": 0, "position": 2}
    saved = load_file(FIXTURE / "full" / "checkpoint-000001" / "model" / "model.safetensors")
    weights = trainer.model.state_dict()
    assert saved and all(torch.equal(weights[name], tensor) for name, tensor in saved.items())


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_an_old_checkpoint_evaluates(kind, capsys):
    model = str(FIXTURE / kind / "checkpoint-000001")
    argv = ["eval", "--model", model, "--limit", "2", "--max-completion-length", "2", "--no-progress"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["total"] == 2
