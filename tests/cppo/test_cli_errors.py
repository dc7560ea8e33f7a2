"""Issue 11, findings 7 and 8: every user error of ``cppo train/eval`` is one line naming the setting, file and line,
exit code 2, found before the model loads; a run never mixes with another; ``--help``, progress, ``--dry-run``."""

import dataclasses
import json
import pathlib
import warnings

import pytest
import torch
import yaml
from tiny_run import tiny_config, train_cli

from cppo.cli import main
from cppo.config import TrainConfig, setting_help
from cppo.trainer import Trainer

REPO = pathlib.Path(__file__).resolve().parents[2]
#: A LoRA run's saved adapter (PEFT's format), from the checkpoint fixtures.
ADAPTER = REPO / "tests/support/fixtures/checkpoints-1b42f7a/lora/checkpoint-000001/model"


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a model starts loading: the errors must be found before."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded before the error was found")

    monkeypatch.setattr("cppo.step.load_model_and_tokenizer", refuse)
    monkeypatch.setattr("cppo.step.models.load_model_and_tokenizer", refuse)


GOOD_ROW = '{"question": "1+1", "answer": "2"}'
#: The files the cases below read, written into the test's folder.
FILES = {
    "bad.yaml": "model: tiny-qwen2\n  lr: 3\ngroup_size: 4\n",
    "unclosed.yaml": "model: tiny-qwen2\nrewards: [digits,\n",
    "binary.yaml": b"model: \xff\xfe\n",
    "typo.yaml": "model: tiny-qwen2\nlr_shedule: cosine\n",
    "inf.yaml": "model: tiny-qwen2\ngroup_size: 4\nlr: .inf\n",
    "twice.yaml": "model: tiny-qwen2\ngroup_size: 8\ngroup_size: 4\n",
    "rows.jsonl": f"{GOOD_ROW}\n\n[1, 2]\n",
    "torn.jsonl": f'\n{GOOD_ROW}\n{{"q',
    "null.jsonl": '{"question": null, "answer": "1"}\n',
    "kind.jsonl": '{"question": "a", "answer": "1", "kind": "gsm8"}\n',
    "file": "a file where a folder should be",
}


def cases(tmp: pathlib.Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (argv, what the one error line must contain); the files are :data:`FILES` in ``tmp``."""
    train = ["train", "--config", "tiny-cpu", "--set", f"output_dir={tmp / 'run'}"]
    yml = lambda name: ["train", "--config", str(tmp / name)]  # noqa: E731
    return {
        "malformed YAML": (
            yml("bad.yaml"),
            ["bad.yaml' is not valid YAML: line 2, column 5: mapping values are not allowed here"],
        ),
        "malformed --set": ([*train, "lr=[1e-3"], ["--set 'lr=[1e-3'", "not a YAML value"]),
        "unknown setting in a file": (
            yml("typo.yaml"),
            ["typo.yaml, line 2", "'lr_shedule'", "did you mean 'lr_schedule'"],
        ),
        "unknown --set setting": ([*train, "num_step=3"], ["--set num_step=3", "did you mean 'num_steps'"]),
        "setting twice in a file": (
            yml("twice.yaml"),
            ["twice.yaml, line 3: 'group_size' is set twice (line 2 and 3)"],
        ),
        "bad value in a file": (
            yml("inf.yaml"),
            ["inf.yaml, line 3", "lr must be finite"],
        ),
        "row not an object": (
            [*train, f"dataset={tmp / 'rows.jsonl'}"],
            ["rows.jsonl, line 3", "must be a JSON object, got list"],
        ),
        "malformed JSON line": (
            ["eval", "--model", "tiny-qwen2", "--dataset", str(tmp / "torn.jsonl")],
            ["torn.jsonl, line 3", "not valid JSON"],
        ),
        "question null": (
            [*train, f"dataset={tmp / 'null.jsonl'}"],
            ["null.jsonl, line 1", "'question' must be a non-empty string, got None"],
        ),
        "unknown kind": (
            [*train, f"dataset={tmp / 'kind.jsonl'}"],
            ["kind.jsonl, line 1", "'kind' must be one of"],
        ),
        "output_dir a file": ([*train, f"output_dir={tmp / 'file'}"], ["output_dir", "is a file, not a folder"]),
        "output_dir unwritable": ([*train, f"output_dir={tmp / 'file' / 'run'}"], ["output_dir", "not writable"]),
        "missing model folder": ([*train, f"model={tmp / 'no' / 'such' / 'model'}"], ["model", "does not exist"]),
        "eval --output a folder": (
            ["eval", "--model", "tiny-qwen2", "--output", str(tmp)],
            [f"--output {str(tmp)!r} is a folder: name the JSON file to write"],
        ),
        "eval --output under a file": (
            ["eval", "--model", "tiny-qwen2", "--output", str(tmp / "file" / "x.json")],
            [f"--output {str(tmp / 'file' / 'x.json')!r}: its folder", "is a file, not a folder"],
        ),
        "missing checkpoint to eval": (
            ["eval", "--model", str(tmp / "runs" / "tiny-cpu" / "checkpoint-000008")],
            [f"'{tmp / 'runs' / 'tiny-cpu' / 'checkpoint-000008'}' does not exist"],
        ),
        "eval a folder that is no model": (
            ["eval", "--model", str(tmp)],
            [f"--model {str(tmp)!r} is a folder without a config.json: not a model"],
        ),
        "typo'd dataset (train)": ([*train, "dataset=gsm8kk"], ["did you mean 'gsm8k'", "'arith'", "'math500'"]),
        "typo'd dataset (eval)": (["eval", "--model", "tiny-qwen2", "--dataset", "math5000"], ["'math500'"]),
        "unknown model_config key": (
            [*train, "model_config={hidden_sise: 32}"],
            ["model_config: unknown key 'hidden_sise'", "did you mean 'hidden_size'"],
        ),
        "unknown preset": (["train", "--config", "tiny-cpuu"], ["unknown preset 'tiny-cpuu'", "did you mean"]),
        "unclosed list": (yml("unclosed.yaml"), ["unclosed.yaml' is not valid YAML: line 3", "flow"]),
        "config not UTF-8": (yml("binary.yaml"), ["binary.yaml' cannot be read", "utf-8"]),
        "huge seed": ([*train, f"seed={2**70}"], ["seed must be <="]),
        "allow-config-change alone": ([*train[:3], "--allow-config-change"], ["only applies with --resume"]),
        "eval a LoRA adapter with an engine that reads full weights": (
            ["eval", "--model", str(ADAPTER), "--rollout-backend", "vllm"],
            [f"--model {str(ADAPTER)!r} is a LoRA adapter, which --rollout-backend vllm cannot load", "cppo merge"],
        ),
    }


NAMES = list(cases(pathlib.Path("/nonexistent")))


@pytest.mark.parametrize("name", NAMES)
def test_a_user_error_is_one_line_exit_2_before_the_model_loads(name, tmp_path, capsys, no_model):
    for file, content in FILES.items():
        (tmp_path / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    argv, wanted = cases(tmp_path)[name]
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cppo {argv[0]}: error: "), lines
    for text in wanted:
        assert text in lines[0], (text, lines[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", [["train", "--config", "tiny-cpu", "--set"], ["eval", "--model", "tiny-qwen2"]])
def test_cuda_without_cuda_is_one_line(command, tmp_path, capsys, no_model):
    extra = ["device=cuda", f"output_dir={tmp_path}"] if command[0] == "train" else ["--device", "cuda"]
    assert main([*command, *extra]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "device='cuda' but CUDA is not available" in line


def fake_run(folder: pathlib.Path) -> bytes:
    """What a run leaves in its output_dir (names only matter): returns the log's bytes."""
    (folder / "checkpoint-000008" / "model").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 8}\n')
    (folder / "notes.txt").write_text("the user's own file")
    return (folder / "metrics.jsonl").read_bytes()


def test_a_new_run_never_mixes_with_the_one_in_output_dir(tmp_path, capsys, monkeypatch, no_model):
    log = fake_run(tmp_path)
    assert train_cli(tmp_path, settings=("num_steps=1",)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "already holds a run (checkpoint-000008, metrics.jsonl)" in line and "--resume" in line
    assert "--overwrite" in line
    assert (tmp_path / "metrics.jsonl").read_bytes() == log and (tmp_path / "checkpoint-000008").is_dir()


def test_the_python_api_refuses_to_mix_runs_too(tmp_path, monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")
    trainer = Trainer(tiny_config(tmp_path, num_steps=1))
    log = fake_run(tmp_path)
    with pytest.raises(ValueError, match="already holds a run"):
        trainer.train()
    assert (tmp_path / "metrics.jsonl").read_bytes() == log  # the old log was not truncated


def test_overwrite_deletes_the_old_run_and_nothing_else(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")
    fake_run(tmp_path)
    assert train_cli(tmp_path, "--overwrite", settings=("num_steps=1",)) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".cppo-run.lock",  # the run lock, free again (empty) once the run ended
        "checkpoint-000001",
        "metrics.jsonl",
        "metrics.png",
        "notes.txt",
    ]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.parametrize("dry_run", [False, True])
def test_overwrite_with_a_bad_setting_keeps_the_old_run(tmp_path, capsys, dry_run, no_model):
    """The old run is deleted only once the new one's settings, rewards and model have loaded: a typo costs nothing."""
    log = fake_run(tmp_path)
    flags = ("--overwrite", "--dry-run") if dry_run else ("--overwrite",)
    assert train_cli(tmp_path, *flags, settings=("rewards=[accuracyy]",)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "rewards: unknown reward 'accuracyy'" in line
    assert (tmp_path / "metrics.jsonl").read_bytes() == log and (tmp_path / "checkpoint-000008" / "model").is_dir()


def test_the_trainer_checks_output_dir_before_the_model_loads(tmp_path, no_model):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="output_dir .* is a file"):
        Trainer(tiny_config(tmp_path / "file"))


def test_train_help_lists_every_setting_with_its_default_and_meaning(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        assert f"  {f.name} = {shown}\n      {setting_help()[f.name]}\n" in out + "\n", f.name
    for flag in ("--resume", "--overwrite", "--allow-config-change", "--dry-run"):
        assert flag in out


def test_eval_shows_progress(capsys):
    argv = ["eval", "--model", "tiny-qwen2", "--limit", "3", "--batch-size", "2", "--max-completion-length", "4"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["total"] == 3
    assert "eval" in captured.err and "3/3" in captured.err


def test_dry_run_checks_what_train_checks_and_writes_nothing(tmp_path, capsys, no_model):
    out = tmp_path / "new" / "run"
    assert train_cli(out, "--dry-run", settings=("num_steps=5",)) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["dry_run"] == "ok" and plan["num_steps"] == 5 and plan["keep"] == 2 and plan["train_problems"] == 32
    assert not (tmp_path / "new").exists()
    fake_run(tmp_path)
    assert train_cli(tmp_path, "--dry-run") == 2
    assert "already holds a run" in capsys.readouterr().err
    assert train_cli(tmp_path / "x.yaml" / "run", "--dry-run", settings=("lr=nan",)) == 2


def test_speedup_dry_run_validates_the_whole_plan_without_a_model(speedup, tmp_path, monkeypatch, capsys):
    def no_trainer(*args, **kwargs):
        raise AssertionError("a dry run built a trainer")

    monkeypatch.setattr("cppo.trainer.Trainer", no_trainer)
    argv = ["--pruning-rates", "0", "0.5", "0.875", "--questions", "32", "--max-new-tokens", "64", "--dry-run"]
    plan = speedup.main([*argv, "--out", str(tmp_path / "out")])
    rates = [(r["pruning_rate"], r["keep"], r["steps"]) for r in plan["rates"]]
    assert rates == [(0, 16, 32), (0.5, 8, 16), (0.875, 2, 4)]
    assert plan["steps"] == 52 and plan["schedule"] == "interleaved" and plan["train_problems"] == 10_000
    assert not (tmp_path / "out").exists()
    assert json.loads(capsys.readouterr().out) == plan
    with pytest.raises(ValueError, match="--questions must be a multiple of 8"):
        speedup.main([*argv[:5], "33", "--dry-run", "--out", str(tmp_path)])
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="--out .*a-file.* is a file, not a folder"):
        speedup.main(["--dry-run", "--out", str(tmp_path / "a-file")])
    plan = speedup.main(["--preset", "gsm8k", "--device", "cuda", "--dry-run", "--out", str(tmp_path / "out")])
    assert plan["model"] == "Qwen/Qwen2.5-1.5B-Instruct" and [r["keep"] for r in plan["rates"]] == [16, 8, 4, 2, 1]


def test_ddp_wrapping_raises_no_warning_of_ours(tmp_path):
    """torchrun printed a ``broadcast_buffers`` FutureWarning from cppo/parallel.py: the DDP wrap must warn nothing."""
    import torch.distributed as dist

    from cppo.distributed import DistInfo, wrap_model

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = wrap_model(torch.nn.Linear(2, 2), parallelism="ddp", info=DistInfo(rank=0, world_size=2))
        assert type(wrapped).__name__ == "DistributedDataParallel"
        assert not [w for w in caught if "parallel.py" in w.filename or "broadcast_buffers" in str(w.message)]
    finally:
        dist.destroy_process_group()


def test_a_mistyped_local_path_is_not_sent_to_the_hub(tmp_path, capsys, monkeypatch, no_model):
    """``runs/tiny-cpuu`` looks like a hub name owner/name; with a ``runs/`` folder here it is a local path with a
    typo: one line, at once (the hub would be retried for about a minute first)."""
    (tmp_path / "runs" / "tiny-cpu").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for argv in (["eval", "--model", "runs/tiny-cpuu"], ["train", "--config", "tiny-cpu", "--set", "model=runs/x"]):
        assert main(argv) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert "runs/ is a folder here, so this names a local path, not a hub model" in line, line


def test_a_checkpoint_a_zero_short_names_the_one_there(tmp_path, capsys, monkeypatch, no_model):
    """``cppo eval --model runs/tiny-cpu/checkpoint-00008`` (one zero short) and ``cppo merge --checkpoint`` of a
    missing folder name the checkpoint of the same step (issue 49)."""
    (tmp_path / "runs" / "tiny-cpu" / "checkpoint-000008").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--model", "runs/tiny-cpu/checkpoint-00008"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("(did you mean 'runs/tiny-cpu/checkpoint-000008'?)"), err
    assert main(["merge", "--checkpoint", "runs/tiny-cpu/checkpoint-8", "--output", "merged"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "cppo merge: error: --checkpoint 'runs/tiny-cpu/checkpoint-8' does not exist (did you mean "
        "'runs/tiny-cpu/checkpoint-000008'?)"
    ]
    assert not (tmp_path / "merged").exists()


def test_printed_commands_start_with_the_program_as_called(tmp_path, capsys, monkeypatch):
    """A hint's command runs as printed from a fresh shell: ``.venv/bin/cppo ...`` (as the run's last line), never a
    bare ``cppo`` (issue 49)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("sys.argv", [str(REPO / ".venv" / "bin" / "cppo")])
    assert main(["train", "--config", "tiny-cpu", "--set", "bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "; .venv/bin/cppo train --help lists them all" in err and " cppo train --help" not in err, err
