"""The sink registry (issue 49's neighbour of a task kind shadowed by a built-in one): a built-in sink's name is
refused in one line, a sink the user registered is replaced by a later registration."""

import pytest

from cppo.run import JsonlSink, MetricSink, available_sinks, register_sink, sinks


class NullSink(MetricSink):
    def start(self, settings: dict, *, step: int) -> None:
        pass

    def log(self, record: dict, step: int) -> None:
        pass


class OtherSink(NullSink):
    pass


@pytest.mark.parametrize("name", ["jsonl", "tensorboard", "wandb"])
def test_a_built_in_sink_is_not_replaced(monkeypatch, name):
    """``jsonl`` is what a resume rewinds and ``metrics.png`` is drawn from: replaced, both would read another
    sink's output."""
    monkeypatch.setattr(sinks, "_SINKS", dict(sinks._SINKS))
    with pytest.raises(ValueError, match=rf"^register_sink: {name!r} is a built-in sink: register yours under another"):
        register_sink(name, NullSink)
    assert sinks._SINKS["jsonl"] is JsonlSink and available_sinks()[:3] == ("jsonl", "tensorboard", "wandb")


def test_a_user_s_sink_registered_again_is_replaced(monkeypatch):
    monkeypatch.setattr(sinks, "_SINKS", dict(sinks._SINKS))
    register_sink("null", NullSink)
    register_sink("null", OtherSink)
    assert sinks._sink_class("null") is OtherSink and available_sinks().count("null") == 1
