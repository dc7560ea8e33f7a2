"""Issue 50, part 1: the settings are plain data, each declared once, and a refusal says where its setting was set
without its message being read: the pruning settings' one help text each, shared by TrainConfig and CPPOConfig; each
check marks the settings it refuses (``naming``; ``Pruning`` with the names its config uses)."""

from __future__ import annotations

import dataclasses

import pytest

from cppo.config import PRUNING_SETTINGS, TrainConfig, load_config, setting_help
from cppo.config.values import naming
from cppo.step import Pruning


def test_trainconfig_declares_the_pruning_settings_from_the_one_block():
    helps = setting_help()
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for name, (default, meaning) in PRUNING_SETTINGS.items():
        assert (defaults[name], helps[name]) == (default, meaning), name


def test_cppoconfig_declares_them_from_the_same_block():
    pytest.importorskip("trl")
    from cppo.trl import CPPOConfig

    fields = {f.name: f for f in dataclasses.fields(CPPOConfig)}
    as_trl = {"pruning_rate": "pruning_rate", "selection_metric": "pruning_metric", "allocation": "allocation"}
    as_trl["selection_scope"] = "selection_scope"
    for name, (default, meaning) in PRUNING_SETTINGS.items():
        field = fields[as_trl[name]]
        assert field.metadata["help"] == meaning, name
        assert field.default == (False if name == "allocation" else default), name  # TRL's GRPO: no allocation


def test_a_check_marks_the_setting_it_refuses():
    with pytest.raises(ValueError, match="^x$") as e, naming("lr"):
        raise ValueError("x")
    assert e.value.settings == ("lr",)
    with pytest.raises(ValueError) as e, naming("outer"), naming("inner"):
        raise ValueError("y")
    assert e.value.settings == ("inner",)  # the deeper check's mark is kept


@pytest.mark.parametrize(
    ("options", "settings"),
    [
        ({"pruning_rate": 1.5}, ("pruning_rate",)),
        ({"metric": "max-variance"}, ("selection_metric",)),
        ({"scope": "world"}, ("selection_scope",)),
        ({"metric": "max-variance", "names": {"metric": "pruning_metric"}}, ("pruning_metric",)),
        ({"group_size": 0, "names": {"group_size": "num_generations"}}, ("num_generations",)),
    ],
)
def test_pruning_marks_its_refusals_with_the_config_s_names(options, settings):
    with pytest.raises(ValueError) as e:
        Pruning(**{"group_size": 4, **options})
    assert e.value.settings == settings
    assert str(e.value).startswith(settings[0])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["selection_metric=median"], r"^--set selection_metric=median: selection_metric must be one of"),
        (["greso_min_explore=2"], r"^--set greso_min_explore=2: greso_min_explore must be"),
        (["temperature=-1"], r"^--set temperature=-1: temperature"),
        (["lora_dropout=1.5"], r"^--set lora_dropout=1.5: lora_dropout must be in \[0, 1\), got 1.5$"),
        (["model=tiny-gpt"], r"^--set model=tiny-gpt: model 'tiny-gpt': the tiny models are"),
    ],
)
def test_load_config_says_where_the_refused_setting_was_set(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config("tiny-cpu", overrides)
