"""Metric sinks chosen by ``report_to``: TensorBoard event files and an offline wandb run read back with their own
readers, the jsonl log, ``none``, rank 0 alone writing, and a sink that cannot start failing before the model loads."""

import errno
import json
import subprocess
import sys

import numpy as np
import pytest
from tiny_run import tiny_config, train_cli

from cppo import TrainConfig, load_config
from cppo.distributed import DistInfo
from cppo.run import MetricSink, checkpoint, register_sink, sinks
from cppo.run.metrics import read_jsonl
from cppo.run.sinks import JsonlSink, TensorBoardSink, WandbSink, scalars
from cppo.trainer import Trainer

CHECKED = ("loss", "reward_mean", "kept_fraction")


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series under ``folder`` as TensorBoard itself reads it (purged events dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_cppo_train_writes_tensorboard_events(tmp_path):
    assert train_cli(tmp_path, settings=("num_steps=2", "report_to=[jsonl,tensorboard]")) == 0
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    series = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(series) == set(scalars(records[0]))  # every numeric metric, one tag each
    for tag in CHECKED:  # event files hold float32
        assert series[tag] == [(r["step"], float(np.float32(r[tag]))) for r in records], tag
    assert (tmp_path / "metrics.png").is_file()


def test_a_resume_purges_the_events_a_killed_run_wrote_after_its_checkpoint(tmp_path):
    settings = ("num_steps=2", "report_to=[jsonl,tensorboard]")
    assert train_cli(tmp_path, settings=settings) == 0
    checkpoint.remove(str(tmp_path / "checkpoint-000002"))  # killed after logging step 2, before saving it
    assert train_cli(tmp_path, "--resume", settings=settings) == 0
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    series = tensorboard_scalars(tmp_path / "tensorboard")
    for tag in CHECKED:  # step 2 once, from the resumed run
        assert series[tag] == [(r["step"], float(np.float32(r[tag]))) for r in records], tag


def wandb_history(run_file) -> list[dict]:
    """The history records of an offline run's ``.wandb`` log, read by wandb's own ``wandb leet inspect --json``."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return [r["history"] for r in lines if r["type"] == "history"]


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    history = Trainer(tiny_config(run, num_steps=2, report_to=["wandb"])).train()
    [run_file] = run.glob("wandb/offline-run-*/run-*.wandb")
    logged = wandb_history(run_file)
    assert [h["step"]["num"] for h in logged] == [1, 2]
    for record, h in zip(history, logged):
        assert {k: h["item"][k] for k in CHECKED} == {k: record[k] for k in CHECKED}
    assert not (run / "metrics.jsonl").exists() and (run / "metrics.png").is_file()  # the PNG stays


def test_wandb_is_offline_unless_wandb_mode_says_otherwise(tmp_path, monkeypatch):
    import wandb

    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    config = tiny_config(tmp_path, report_to=["wandb"])
    WandbSink(str(tmp_path)).start(config.to_dict(), step=0)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    WandbSink(str(tmp_path)).start(config.to_dict(), step=0)
    assert [(c["mode"], c["dir"]) for c in calls] == [("offline", str(tmp_path)), ("disabled", str(tmp_path))]
    assert calls[0]["config"] == config.to_dict()


def test_report_to_none_writes_no_metrics_but_the_plot(tmp_path):
    Trainer(tiny_config(tmp_path, num_steps=1, report_to=["none"])).train()
    assert (tmp_path / "metrics.png").is_file()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()


def test_tensorboard_skips_metrics_that_are_not_numbers(tmp_path):
    sink = TensorBoardSink(str(tmp_path))
    sink.start(tiny_config(tmp_path).to_dict(), step=0)
    sink.log({"step": 3, "loss": 0.5, "missing": None, "name": "x", "list": [1], "flag": True}, 3)
    sink.close()
    assert tensorboard_scalars(tmp_path / "tensorboard") == {"loss": [(3, 0.5)], "flag": [(3, 1.0)]}


class ModelLoaded(Exception):
    """Raised in place of loading the model: the sinks were built (and checked) before it."""


@pytest.fixture
def no_model(monkeypatch):
    def build(self):
        raise ModelLoaded(self.run.sinks)

    monkeypatch.setattr(Trainer, "_build_models", build)


def test_only_rank_0_has_sinks(tmp_path, no_model):
    config = tiny_config(tmp_path, report_to=["jsonl", "tensorboard"])
    with pytest.raises(ModelLoaded) as main_rank:
        Trainer(config, info=DistInfo())
    assert [type(s) for s in main_rank.value.args[0]] == [JsonlSink, TensorBoardSink]
    with pytest.raises(ModelLoaded) as other_rank:
        Trainer(config, info=DistInfo(rank=1, world_size=2))
    assert other_rank.value.args[0] == []


@pytest.mark.parametrize(
    ("name", "missing"), [("wandb", ["wandb"]), ("tensorboard", ["tensorboard", "torch.utils.tensorboard"])]
)
def test_a_missing_library_fails_before_the_model_loads(tmp_path, monkeypatch, no_model, name, missing):
    for module in missing:
        monkeypatch.setitem(sys.modules, module, None)  # import fails
    with pytest.raises(ValueError, match=rf"^report_to: '{name}' needs the {name} package .*: pip install {name}"):
        Trainer(tiny_config(tmp_path, report_to=["jsonl", name]))


def test_an_unwritable_sink_folder_fails_before_the_model_loads(tmp_path, no_model):
    (tmp_path / "tensorboard").write_text("not a folder")
    with pytest.raises(ValueError, match=r"^report_to: 'tensorboard' writes to .*tensorboard', which cannot be"):
        Trainer(tiny_config(tmp_path, report_to=["tensorboard"]))


def test_cppo_train_reports_a_sink_that_cannot_start_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert train_cli(tmp_path, settings=("report_to=[wandb]",)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("cppo train: error: report_to: 'wandb' needs the wandb")
    assert not list(tmp_path.glob("checkpoint-*"))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["jsonl", "tb"], r"report_to must list names of \('jsonl', 'tensorboard', 'wandb', 'none'\), got 'tb'"),
        (["jsonl", "jsonl"], r"report_to must name each sink once, or be \[none\] alone"),
        (["none", "jsonl"], r"report_to must name each sink once, or be \[none\] alone"),
        ([], r"report_to must name at least one of"),
        ("jsonl", r"^report_to must be a list"),
    ],
)
def test_bad_report_to_names_the_setting(value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(report_to=value)


def test_report_to_from_the_command_line_and_on_resume(tmp_path):
    assert TrainConfig().report_to == ["jsonl"]
    for item in ("report_to=jsonl,tensorboard", "report_to=[jsonl, tensorboard]"):
        assert load_config("tiny-cpu", [item]).report_to == ["jsonl", "tensorboard"]
    assert load_config("tiny-cpu", ["report_to=none"]).report_to == ["none"]
    saved = TrainConfig().to_dict()
    assert TrainConfig(report_to=["wandb"]).changes_from(saved) == []  # a resume may report elsewhere


def test_scalars_are_the_numeric_metrics():
    assert scalars({"step": 1, "a": 2, "b": 0.5, "c": None, "d": "x", "e": False, "f": [1.0]}) == {
        "a": 2.0, "b": 0.5, "e": 0.0,
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------
# A sink failing mid-run (issue 27): it costs its own output, the run and the other sinks go on
# ----------------------------------------------------------------------------------------------


class DiskFullSink(MetricSink):
    """A registered sink whose disk fills up at step 2."""

    steps: list[int] = []

    def start(self, settings: dict, *, step: int) -> None:
        DiskFullSink.steps = []

    def log(self, record: dict, step: int) -> None:
        DiskFullSink.steps.append(step)
        if step >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")  # its flush fails too: still one warning


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("cppo train: warning:")]


def test_a_sink_failing_mid_run_costs_its_own_output_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sinks, "_SINKS", dict(sinks._SINKS))
    register_sink("diskfull", DiskFullSink)
    settings = ("num_steps=3", "save_every=0", "report_to=[diskfull,jsonl]")  # listed before jsonl
    assert train_cli(tmp_path, settings=settings) == 0
    err = capsys.readouterr().err
    assert warnings_of(err) == [
        "cppo train: warning: report_to: the 'diskfull' sink failed at step 2 (OSError: [Errno 28] No space left on "
        "device): it logs nothing more in this run; the sinks ['jsonl'] and the training go on"
    ], err
    assert DiskFullSink.steps == [1, 2]  # dropped after its failure
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3]
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-000003"]  # the run trained to its end


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # no thread's traceback either
def test_an_unwritable_tensorboard_events_file_costs_the_events_only(tmp_path, monkeypatch, capsys):
    start = TensorBoardSink.start

    def start_on_a_full_disk(self, settings, *, step):  # the events file's disk is full: writes fail with ENOSPC
        start(self, settings, step=step)
        record_writer = self.writer.file_writer.event_writer._async_writer._writer
        record_writer._writer = open("/dev/full", "wb", buffering=0)  # noqa: SIM115  closed with the writer

    monkeypatch.setattr(TensorBoardSink, "start", start_on_a_full_disk)
    assert train_cli(tmp_path, settings=("num_steps=2", "save_every=0", "report_to=[tensorboard,jsonl]")) == 0
    err = capsys.readouterr().err
    found = warnings_of(err)
    assert len(found) == 1 and found[0].startswith(
        "cppo train: warning: report_to: the 'tensorboard' sink failed at step 1 (OSError: [Errno 28] No space left"
    ), err
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2]
    assert (tmp_path / "checkpoint-000002").is_dir() and (tmp_path / "metrics.png").is_file()
