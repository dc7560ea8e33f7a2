"""The ``rollout_stop:`` section (issue 50): pruning while generating's four settings as one section of a config, as
``loss:`` is, in a YAML file or ``--set rollout_stop.NAME=VALUE``; the flat ``rollout_stop_*`` names still read, with a
pointer to the section."""

from __future__ import annotations

import logging

import pytest

from cppo.config import load_config

ON = ["pruning_rate=0.75", "selection_scope=group", "max_completion_length=8"]


def test_the_section_sets_the_four_settings(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: tiny-qwen2\ngroup_size: 4\nmax_prompt_length: 8\nmax_completion_length: 8\npruning_rate: 0.75\n"
        "selection_scope: group\nrollout_stop:\n  rate: 0.5\n  at: 3\n  scorer: random\n  warmup: 1\n"
    )
    config = load_config(str(path))
    stop = config.rollout_stop
    assert (stop["rate"], stop["at"], stop["scorer"]) == (0.5, 3.0, "random")
    assert stop["warmup"] == 1
    again = load_config(str(path), ["rollout_stop.warmup=0"])  # one option overridden, the others kept
    assert (again.rollout_stop["rate"], again.rollout_stop["at"], again.rollout_stop["warmup"]) == (0.5, 3.0, 0)


def test_set_takes_one_option_of_the_section_and_flat_names_point_to_it(caplog):
    config = load_config("tiny-cpu", [*ON, "rollout_stop.rate=0.5", "rollout_stop.at=3"])
    assert (config.rollout_stop["rate"], config.rollout_stop["at"]) == (0.5, 3.0)
    with caplog.at_level(logging.WARNING, logger="cppo"):
        flat = load_config("tiny-cpu", [*ON, "rollout_stop_rate=0.5", "rollout_stop_at=3"])
    assert (flat.rollout_stop["rate"], flat.rollout_stop["at"]) == (0.5, 3.0)  # still read, the same settings
    assert [r.getMessage() for r in caplog.records] == [
        "--set rollout_stop_rate=0.5: rollout_stop_rate is read; it is rollout_stop.rate now (--set "
        "rollout_stop.rate=VALUE, or rate under rollout_stop: in a YAML file)",
        "--set rollout_stop_at=3: rollout_stop_at is read; it is rollout_stop.at now (--set rollout_stop.at=VALUE, or "
        "at under rollout_stop: in a YAML file)",
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout_stop.rat=0.5"],
            r"^--set rollout_stop.rat=0.5: rollout_stop.rat: not an option of rollout_stop \(did you mean 'rate'\?\); "
            r"the options are \['rate', 'at', 'scorer', 'warmup'\]$",
        ),
        (["rollout_stop.rate=0.9"], r"^--set rollout_stop.rate=0.9: rollout_stop\.rate=0.9 must be <= pruning_rate"),
        (["rollout_stop.scorer=oracle"], r"^--set rollout_stop.scorer=oracle: rollout_stop\.scorer must be one of"),
        (
            ["rollout_stop_rate=0.5", "rollout_stop.rate=0.5"],
            r"^--set rollout_stop.rate=0.5: rollout_stop.rate is also set as rollout_stop_rate \(--set "
            r"rollout_stop_rate=0.5\): set it once, under rollout_stop:$",
        ),
        (["rollout_stop=0.5"], r"^--set rollout_stop=0.5: rollout_stop must be a mapping of \['rate', 'at'"),
    ],
)
def test_a_bad_option_is_one_line_naming_where_it_was_set(overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        load_config("tiny-cpu", [*ON, *overrides])
    assert "\n" not in str(e.value)


def test_a_checkpoint_saved_with_the_flat_names_resumes_as_the_section_they_set():
    """A run saved before the section (its config's flat ``rollout_stop_*``) compares as the section they set."""
    now = load_config("tiny-cpu", [*ON, "rollout_stop.rate=0.5", "rollout_stop.at=3"])
    saved = {k: v for k, v in now.to_dict().items() if k != "rollout_stop"}
    flat = {**saved, "rollout_stop_rate": 0.5, "rollout_stop_at": 3.0, "rollout_stop_scorer": "learned"}
    assert now.changes_from(flat) == []
    assert now.changes_from({**flat, "rollout_stop_rate": 0.25}) == [
        "rollout_stop: {'rate': 0.25, 'at': 3.0, 'scorer': 'learned', 'warmup': 2} -> "
        "{'rate': 0.5, 'at': 3.0, 'scorer': 'learned', 'warmup': 2}"
    ]
    assert load_config("tiny-cpu", ON).changes_from(saved) == []  # saved before pruning while generating existed
