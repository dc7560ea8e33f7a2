"""The command line: train (tiny-cpu end to end, resume) and eval."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from cppo.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_train_tiny_cpu_preset_end_to_end(tmp_path):
    """The whole tiny-cpu preset, as CI runs it: ``python -m cppo train --config tiny-cpu``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "cppo", "train", "--config", "tiny-cpu", "--set", f"output_dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(r["kept_fraction"] == 0.5 for r in records)
    assert (tmp_path / "metrics.png").is_file()
    assert (tmp_path / "checkpoint-000008" / "model" / "config.json").is_file()
    assert json.loads(out.stdout.strip().splitlines()[-1])["step"] == 8
    last = out.stderr.strip().splitlines()[-1]  # the run ends naming its checkpoint and how to evaluate it
    want = tmp_path / "checkpoint-000008"
    assert last.startswith(f"cppo train: saved {want}; evaluate it with: "), last
    assert last.endswith(f"-m cppo eval --model {want}"), last


FIXTURE = ROOT / "tests" / "support" / "fixtures" / "checkpoints-1b42f7a" / "full" / "checkpoint-000001"


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        ((), (4, 48, "Answer.", 8)),  # as the checkpoint trained (full.yaml), small batches on the CPU
        (("--official",), (1024, 512, None, 8)),  # the official protocol, and for any model that is no checkpoint
        (("--max-completion-length", "2", "--batch-size", "3"), (2, 48, "Answer.", 3)),  # a flag given wins
    ],
)
def test_eval_of_a_checkpoint_follows_its_training_config(flags, want, monkeypatch, capsys):
    seen = []

    def evaluate_model(rollout, tokenizer, problems, *, system_prompt, batch_size, **kwargs):
        s = rollout.settings
        seen.append((s.max_completion_length, s.max_prompt_length, system_prompt, batch_size))
        return {"accuracy": 0.0, "correct": 0, "total": len(problems), "problems": len(problems), "format_rate": 0.0}

    monkeypatch.setattr("cppo.evaluate.evaluate_model", evaluate_model)
    assert main(["eval", "--model", str(FIXTURE), "--limit", "2", *flags]) == 0
    assert seen == [want]
    said = "is evaluated as it trained (dataset 'arith', dataset_path None, max_prompt_length 48"
    assert (said in capsys.readouterr().err) == (not flags or flags[0] != "--official")


def test_resume_and_eval(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")
    common = [f"output_dir={tmp_path}", "group_size=4", "max_questions=32", "max_completion_length=8"]
    assert main(["train", "--config", "tiny-cpu", "--set", "num_steps=2", "save_every=1", *common]) == 0
    shutil.rmtree(tmp_path / "checkpoint-000002")  # as if killed before step 2's checkpoint: step 2 is redone
    assert main(["train", "--config", "tiny-cpu", "--resume", "--set", "num_steps=3", *common]) == 0
    assert "checkpoint-000001 at step 1" in capsys.readouterr().err
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    ckpt = tmp_path / "checkpoint-000003"
    assert main(["eval", "--model", str(ckpt), "--dataset", "arith", "--limit", "4", "--max-completion-length", "8",
                 "--output", str(tmp_path / "eval.json")]) == 0  # fmt: skip
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["total"] == 4 and 0.0 <= result["accuracy"] <= 1.0
    written = json.loads((tmp_path / "eval.json").read_text())
    assert "per_problem" not in result and len(written.pop("per_problem")) == 4  # the records go to --output only
    assert written == result


@pytest.mark.parametrize(
    "argv, match",
    [
        (["train", "--config", "tiny-cpu", "--set", "pruning_rate=1.5"], "pruning_rate"),
        (["train", "--config", "tiny-cpu", "--set", "bogus=1"], "bogus"),
        (["eval", "--model", "tiny-qwen2", "--dataset", "nope.jsonl"], "nope.jsonl"),
        (["eval", "--model", "tiny-qwen2", "--limit", "0"], "--limit"),
        (["eval", "--model", "tiny-qwen2", "--max-completion-length", "0"], "--max-completion-length"),
        (["eval", "--model", "tiny-qwen2", "--batch-size", "0"], "--batch-size"),
        (["eval", "--model", "tiny-qwen2", "--dtype", "float8"], "dtype"),
        (["eval", "--model", "missing.gguf"], "missing.gguf"),
    ],
)
def test_bad_input_exits_with_a_message(argv, match, capsys, tmp_path):
    assert main(argv + ([f"output_dir={tmp_path}"] if argv[0] == "train" else [])) == 2
    assert match in capsys.readouterr().err


def test_resume_without_checkpoint(tmp_path, capsys):
    assert main(["train", "--config", "tiny-cpu", "--resume", "--set", f"output_dir={tmp_path}"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory):
    from tiny_run import train_cli

    out = tmp_path_factory.mktemp("eval") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CPPO_KERNELS_BACKEND", "torch")
        assert train_cli(out, settings=("num_steps=1",)) == 0
    return out


def _eval_error(capsys, *argv) -> str:
    assert main(["eval", *argv]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("cppo eval: error: ")]
    assert len(lines) == 1, lines
    return lines[0]


def test_eval_names_a_run_folders_latest_checkpoint(one_step_run, capsys):
    line = _eval_error(capsys, "--model", str(one_step_run), "--dataset", "arith", "--limit", "2")
    assert f"is a run folder, not a model: evaluate its latest checkpoint, --model {one_step_run}/checkpoint-" in line


def test_eval_of_a_truncated_checkpoint_names_the_file(one_step_run, tmp_path, capsys):
    broken = shutil.copytree(one_step_run / "checkpoint-000001", tmp_path / "broken")
    weights = broken / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    line = _eval_error(capsys, "--model", str(broken), "--dataset", "arith", "--limit", "2")
    assert f"{weights} cannot be read" in line and "truncated or corrupt" in line


def test_eval_names_its_own_flags(one_step_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = str(one_step_run / "checkpoint-000001")
    line = _eval_error(capsys, "--model", model, "--dataset", "gsm8k", "--dataset-path", str(tmp_path / "none"))
    assert "--dataset-path" in line and "dataset_path" not in line
    line = _eval_error(capsys, "--model", model, "--dataset", "gsm8k", "--limit", "2")  # the hub, offline
    assert "pass --dataset-path" in line and "dataset_path" not in line, line
