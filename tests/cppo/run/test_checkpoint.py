"""Issue 11, findings 1 and 6: checkpoints load without running code, and a resume survives torn logs, corrupt
checkpoints, killed saves and changed settings."""

import contextlib
import io
import logging
import os
import random

import numpy as np
import pytest
import torch
from tiny_model import TINY
from tiny_run import CLI_SETTINGS, Exploit, copy_run, ran, raw_exploit, resume_candidates, train_cli

from cppo import load_config
from cppo.distributed import DistInfo
from cppo.run import checkpoint, metrics
from cppo.run import folder as rundir
from cppo.step.models import load_model_and_tokenizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step ``cppo train`` run with a checkpoint after each step (copied by each test that changes it)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CPPO_KERNELS_BACKEND", "torch")
        assert train_cli(out, settings=("num_steps=2",)) == 0
    return out


@pytest.fixture
def run(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")
    return copy_run(trained, tmp_path / "run")


def steps_logged(run) -> list[int]:
    return [r["step"] for r in metrics.read_jsonl(str(run / "metrics.jsonl"))]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if ": error: " in line]


# --------------------------------------------------------------------------------------------
# Finding 1: no code execution from a checkpoint
# --------------------------------------------------------------------------------------------


def zip_exploit(marker) -> bytes:
    buf = io.BytesIO()
    torch.save({"step": 2, "world_size": 1, "payload": Exploit(marker)}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("craft", [zip_exploit, raw_exploit], ids=["torch.save", "plain pickle"])
def test_a_crafted_trainer_state_is_refused_naming_the_file_and_runs_nothing(run, tmp_path, capsys, craft):
    marker = tmp_path / "code-ran"
    state_file = run / "checkpoint-000002" / checkpoint.STATE_FILE
    state_file.write_bytes(craft(marker))

    with pytest.raises(checkpoint.UnsafeCheckpoint, match="trainer_state.pt"):
        checkpoint.read_state(str(run / "checkpoint-000002"))
    assert train_cli(run, "--resume", settings=("num_steps=3",)) == 2
    err = capsys.readouterr().err
    assert len(error_lines(err)) == 1 and str(state_file) in error_lines(err)[0], err
    assert "resumed" not in err  # refused outright: an older checkpoint is not used in its place
    assert not ran(marker)
    assert steps_logged(run) == [1, 2]

    with contextlib.suppress(RuntimeError):  # a plain pickle is no torch file, but unpickling it ran the code first
        torch.load(state_file, weights_only=False)  # what the old code did: the file is a working exploit
    assert ran(marker)


def test_a_saved_checkpoint_is_plain_data(trained):
    """The real thing loads with weights_only=True: RNG states, config, sampler position, optimizer, scheduler."""
    state = torch.load(trained / "checkpoint-000002" / checkpoint.STATE_FILE, weights_only=True)
    assert state["step"] == 2 and state["config"]["group_size"] == 4 and state["sampler"]["position"] > 0
    assert set(state["rng"]) >= {"torch", "python", "numpy"} and state["optimizer"]["state"]


def test_rng_states_round_trip_as_plain_data():
    buf = io.BytesIO()
    torch.save(checkpoint.rng_state(), buf)
    want = (torch.rand(3), np.random.rand(3), random.random())
    buf.seek(0)
    checkpoint.set_rng_state(torch.load(buf, weights_only=True))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]


# --------------------------------------------------------------------------------------------
# Finding 6: resume survives a torn log, corrupt checkpoints, killed saves; changed settings are refused
# --------------------------------------------------------------------------------------------


def test_a_torn_last_line_is_dropped_with_a_warning_naming_the_file(tmp_path, caplog):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    with caplog.at_level(logging.WARNING, logger="cppo"):
        assert [r["step"] for r in metrics.read_jsonl(str(log))] == [1, 2]
    assert str(log) in caplog.text
    log.write_text('{"step": 1}\n\n{"step": 2\n{"step": 3}\n')  # a bad line that is not the last: an error
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 3"):
        metrics.read_jsonl(str(log))


def test_resume_skips_corrupt_checkpoints_and_cleans_up_killed_saves(run, capsys):
    (run / "checkpoint-000002" / checkpoint.STATE_FILE).write_bytes(b"PK\x03\x04 torn")  # truncated state
    (run / "checkpoint-000003").mkdir()  # a folder with nothing in it
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward_mean": 0.')  # the line a kill tore
    (run / ".tmp-checkpoint-000004" / "model").mkdir(parents=True)  # a save killed mid-way
    (run / ".tmp-metrics.jsonl").write_text("{")
    (run / ".tmp-notes").write_text("the user's")  # not ours: left alone

    assert train_cli(run, "--resume", settings=("num_steps=3",)) == 0  # num_steps may grow
    err = capsys.readouterr().err
    assert f"resumed from {run / 'checkpoint-000001'} at step 1" in err
    for name in ("checkpoint-000003", "checkpoint-000002", "metrics.jsonl", ".tmp-checkpoint-000004"):
        assert any("warning" in line and name in line for line in err.splitlines()), (name, err)
    assert steps_logged(run) == [1, 2, 3]
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == [".cppo-run.lock", ".tmp-notes"]
    for step in (1, 2, 3):  # the corrupt ones were saved again, whole
        assert checkpoint.read_state(str(run / f"checkpoint-00000{step}"))["step"] == step


def test_truncated_weights_are_a_corrupt_checkpoint(run):
    weights = run / "checkpoint-000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(checkpoint.CorruptCheckpoint, match="model.safetensors"):
        checkpoint.verify(str(run / "checkpoint-000002"))
    config = load_config("tiny-cpu", [*CLI_SETTINGS, f"output_dir={run}", "num_steps=2"])
    candidates = resume_candidates(config, allow_config_change=False)
    assert candidates == [str(run / "checkpoint-000001")]


def test_a_checkpoint_that_fails_while_loading_falls_back_to_the_previous_one(caplog):
    class Trainer:  # records what it was asked to load; the newest one fails part-way
        info, loaded = DistInfo(), []

        def load_checkpoint(self, path):
            self.loaded.append(path)
            if path.endswith("2"):
                raise checkpoint.CorruptCheckpoint(f"{path}/model/model.safetensors cannot be read")

    trainer = Trainer()
    with caplog.at_level(logging.WARNING, logger="cppo"):
        assert rundir.resume(trainer, ["out/checkpoint-2", "out/checkpoint-1"]) == "out/checkpoint-1"
    assert trainer.loaded == ["out/checkpoint-2", "out/checkpoint-1"] and "out/checkpoint-2" in caplog.text


def test_changed_settings_are_refused_naming_each_difference(run, capsys):
    changed = ("num_steps=3", "seed=7", "group_size=8", "lr_schedule=linear", "pruning_rate=0.75")
    assert train_cli(run, "--resume", settings=changed) == 2
    (line,) = error_lines(capsys.readouterr().err)
    for difference in ("seed: 0 -> 7", "group_size: 4 -> 8", "lr_schedule: 'cosine' -> 'linear'", "pruning_rate"):
        assert difference in line, line
    assert "--allow-config-change" in line and steps_logged(run) == [1, 2]

    assert train_cli(run, "--resume", "--allow-config-change", settings=changed) == 0
    assert steps_logged(run) == [1, 2, 3]


def test_a_changed_model_shape_is_one_line(run, capsys):
    shape = "model_config={hidden_size: 32, num_attention_heads: 2, num_key_value_heads: 1}"
    assert train_cli(run, "--resume", settings=("num_steps=3", shape)) == 2
    assert "model_config" in error_lines(capsys.readouterr().err)[0]
    assert train_cli(run, "--resume", "--allow-config-change", settings=("num_steps=3", shape)) == 2
    (line,) = error_lines(capsys.readouterr().err)  # refused before any model loads: no flag can apply it
    assert "that a resume cannot apply (model_config:" in line and "start a new run" in line


def test_weights_that_do_not_fit_the_model_are_one_line(run, capsys):
    """Past the settings check (a checkpoint whose recorded settings say nothing of the shape), the weights
    themselves are refused naming the file."""
    from tiny_run import tiny_config

    from cppo.trainer import Trainer

    shape = {**TINY, "hidden_size": 64}
    trainer = Trainer(tiny_config(run, model_config=shape))
    with pytest.raises(ValueError) as e:
        trainer.load_checkpoint(str(run / "checkpoint-000002"))
    line = str(e.value)
    assert "does not fit the model" in line and "model.safetensors" in line and "size mismatch" in line


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model_and_tokenizer("tiny-qwen2", model_config=TINY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, tokenizer, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def save(path, tiny, step):
    model, tokenizer, optimizer, scheduler = tiny
    kwargs = dict(module=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler, info=DistInfo())
    return checkpoint.save(str(path), state={"step": step}, **kwargs)


def test_resaving_a_step_never_leaves_it_without_a_checkpoint(tmp_path, tiny, monkeypatch):
    path = tmp_path / "checkpoint-000005"
    save(path, tiny, 1)
    real_replace, moments = os.replace, []

    def replace(src, dst):
        for _ in range(2):  # before and after each rename
            moments.append(path.is_dir() or (tmp_path / ".replaced-checkpoint-000005").is_dir())
            if len(moments) % 2:
                real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    save(path, tiny, 2)
    assert len(moments) == 4 and all(moments)
    assert checkpoint.read_state(str(path))["step"] == 2

    def killed_between_the_renames(src, dst):
        if str(src).endswith("tmp-checkpoint-000005"):
            raise KeyboardInterrupt  # the kill, after the old folder was renamed away
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", killed_between_the_renames)
    with pytest.raises(KeyboardInterrupt):
        save(path, tiny, 3)
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    assert not path.exists()
    assert checkpoint.remove_leftovers(str(tmp_path)) == [".replaced-checkpoint-000005", ".tmp-checkpoint-000005"]
    assert checkpoint.read_state(str(path))["step"] == 2 and sorted(os.listdir(tmp_path)) == [path.name]


def test_save_fsyncs_every_file_and_folder_before_the_rename(tmp_path, tiny, monkeypatch):
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.abspath(src)))
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    path = save(tmp_path / "checkpoint-000001", tiny, 1)
    tmp = str(tmp_path / ".tmp-checkpoint-000001")
    renamed = events.index(("replace", tmp))
    synced = {p for kind, p in events[:renamed] if kind == "fsync"}
    written = {os.path.join(root, n) for root, dirs, files in os.walk(path) for n in [*files, *dirs]}
    assert {p.replace(path, tmp) for p in written} | {tmp} <= synced
    assert ("fsync", str(tmp_path)) in events[renamed:]  # the rename itself, in the parent folder


@pytest.mark.parametrize("key", ["sampler", "optimizer", "rng"])
def test_a_state_without_a_key_the_resume_reads_is_skipped_before_anything_loads(run, key):
    state = checkpoint.read_state(str(run / "checkpoint-000002"))
    del state[key]
    torch.save(state, run / "checkpoint-000002" / checkpoint.STATE_FILE)
    with pytest.raises(checkpoint.CorruptCheckpoint, match=f"lacks \\['{key}'\\]"):
        checkpoint.verify(str(run / "checkpoint-000002"), required=checkpoint.TRAINER_KEYS)
    config = load_config("tiny-cpu", [*CLI_SETTINGS, f"output_dir={run}", "num_steps=2"])
    candidates = resume_candidates(config, allow_config_change=False)
    assert candidates == [str(run / "checkpoint-000001")]


def test_pickle_of_the_old_format_is_refused_too(run):
    """A trainer_state.pt holding numpy arrays (what saves wrote before) is refused, not unpickled."""
    state = checkpoint.read_state(str(run / "checkpoint-000002"))
    state["rng"]["numpy"] = np.random.get_state()
    torch.save(dict(state), run / "checkpoint-000002" / checkpoint.STATE_FILE)
    with pytest.raises(checkpoint.UnsafeCheckpoint, match="numpy"):
        checkpoint.read_state(str(run / "checkpoint-000002"))


def test_settings_that_do_not_change_the_math_may_differ_on_resume():
    """Gradient checkpointing (recomputation only), the skip limit, the length of the run and the output side may
    change on resume; a setting that changes the run is named."""
    saved = load_config("tiny-cpu").to_dict()
    free = ("gradient_checkpointing=true", "max_skipped_updates=3", "num_steps=99", "eval_every=4", "log_every=2")
    assert load_config("tiny-cpu", list(free)).changes_from(saved) == []
    changed = load_config("tiny-cpu", [*free, "reward_timeout=2.0", "top_p=0.9"]).changes_from(saved)
    assert [c.split(":")[0] for c in changed] == ["top_p", "reward_timeout"], changed


# --------------------------------------------------------------------------------------------
# Issue 21, findings 6 and 7: a symlinked checkpoint, a full disk during a save
# --------------------------------------------------------------------------------------------


def test_a_symlinked_checkpoint_is_replaced_as_a_link_and_its_archive_kept(run, tmp_path, capsys):
    """checkpoint-2 linked to an archive: resuming the finished run re-saves step 2 in place of the link (the archive
    untouched), leaves no .replaced-* behind, and the folder resumes and overwrites again afterwards."""
    archive = tmp_path / "archive" / "checkpoint-000002"
    archive.parent.mkdir()
    (run / "checkpoint-000002").rename(archive)
    os.symlink(archive, run / "checkpoint-000002")
    before = sorted(p.relative_to(archive) for p in archive.rglob("*"))
    final_save = ("num_steps=2", "save_every=0")  # a finished run saves its last step again at the end
    assert train_cli(run, "--resume", settings=final_save) == 0, capsys.readouterr().err
    assert not (run / "checkpoint-000002").is_symlink() and (run / "checkpoint-000002" / "model").is_dir()
    assert sorted(p.relative_to(archive) for p in archive.rglob("*")) == before  # the archive is whole
    assert not [p.name for p in run.iterdir() if p.name.startswith((checkpoint.REPLACED_PREFIX, ".tmp-"))]
    assert train_cli(run, "--resume", settings=final_save) == 0
    assert train_cli(run, "--overwrite", settings=("num_steps=1",)) == 0


def test_a_leftover_replaced_link_never_blocks_a_run(run, tmp_path):
    """A ``.replaced-checkpoint-N`` that is a link (left by the old code) is removed as a link at the next start."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    os.symlink(target, run / (checkpoint.REPLACED_PREFIX + "checkpoint-000002"))
    assert checkpoint.remove_leftovers(str(run)) == [checkpoint.REPLACED_PREFIX + "checkpoint-000002"]
    assert (target / "keep.txt").read_text() == "mine"
    assert train_cli(run, "--resume", settings=("num_steps=2",)) == 0


@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4480 vs 4368"),
        OSError(28, "No space left on device"),
    ],
    ids=["torch.save", "ENOSPC"],
)
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(run, monkeypatch, capsys, failure):
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith(checkpoint.STATE_FILE) and "checkpoint-000003" in str(f):
            real_save(obj, f, *args, **kwargs)  # a partial file, as a disk that fills up leaves
            raise failure
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    before = (run / "checkpoint-000002" / checkpoint.STATE_FILE).read_bytes()
    assert train_cli(run, "--resume", settings=("num_steps=3",)) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"cannot write checkpoint {run / 'checkpoint-000003'}" in lines[0], lines
    assert "free, about" in lines[0] and f"the previous checkpoint {run / 'checkpoint-000002'} is intact" in lines[0]
    assert not (run / ".tmp-checkpoint-000003").exists() and not (run / "checkpoint-000003").exists()
    assert (run / "checkpoint-000002" / checkpoint.STATE_FILE).read_bytes() == before
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    assert train_cli(run, "--resume", settings=("num_steps=3",)) == 0  # space freed: the run goes on


# --------------------------------------------------------------------------------------------
# Issue 21, finding 2: --allow-config-change applies what it accepts
# --------------------------------------------------------------------------------------------


def test_an_accepted_change_of_lr_weight_decay_and_schedule_is_applied(tmp_path, monkeypatch):
    """Restoring the optimizer and scheduler used to bring the saved lr and weight decay back; the resumed run's own
    values now apply from the first step after the resume, on the run's own schedule."""
    from tiny_run import tiny_config

    from cppo.trainer import Trainer

    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")
    base = dict(num_steps=2, lr=1e-2, weight_decay=0.0, lr_schedule="constant", mu=1)
    first = Trainer(tiny_config(tmp_path / "run", **base))
    first.train()
    saved = checkpoint.read_state(str(tmp_path / "run" / "checkpoint-000002"))["optimizer"]["param_groups"]
    same = Trainer(tiny_config(tmp_path / "run", **base))
    same.load_checkpoint(str(tmp_path / "run" / "checkpoint-000002"))
    assert [g["lr"] for g in same.optimizer.param_groups] == [g["lr"] for g in saved]  # unchanged: bit for bit
    changed = dict(base, num_steps=6, lr=5e-3, weight_decay=0.1, lr_schedule="cosine", warmup_ratio=0.5)
    resumed = Trainer(tiny_config(tmp_path / "run", **changed))
    resumed.load_checkpoint(str(tmp_path / "run" / "checkpoint-000002"))
    lam = resumed.scheduler.lr_lambdas[0]
    want = 5e-3 * lam(2)  # step 2 of 6 under a 3-step warm-up, then cosine
    assert want != 5e-3 and all(g["lr"] == want and g["weight_decay"] == 0.1 for g in resumed.optimizer.param_groups)
    record = resumed.train_step()
    assert record["lr"] == 5e-3 * lam(3)
    assert all(g["weight_decay"] == 0.1 for g in resumed.optimizer.param_groups)


def test_settings_a_resume_cannot_apply_are_refused_naming_them(run):
    config = load_config("tiny-cpu", [*CLI_SETTINGS, f"output_dir={run}", "max_questions=16", "lr=0.5"])
    with pytest.raises(ValueError, match=r"settings that a resume cannot apply \(max_questions: 32 -> 16\)"):
        resume_candidates(config, allow_config_change=True)
