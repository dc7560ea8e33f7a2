"""CPPOConfig: TRL's GRPOConfig plus the CPPO settings, each bad value one ValueError naming the setting."""

from __future__ import annotations

import pytest
from transformers import HfArgumentParser
from trl import GRPOConfig
from trl_tiny import CPU

from cppo.step.selection import Pruning
from cppo.trl import CPPOConfig


def config(tmp_path, **options) -> CPPOConfig:
    return CPPOConfig(output_dir=str(tmp_path), **{**CPU, **options})


def test_defaults_are_grpo(tmp_path):
    args = config(tmp_path)
    assert isinstance(args, GRPOConfig)
    assert (args.pruning_rate, args.pruning_metric, args.allocation, args.selection_scope) == (
        0.0,
        "smallest",
        False,
        "batch",
    )
    assert args.pruning == Pruning(group_size=4, allocation=False, questions_per_step=2)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"pruning_rate": 1.0}, r"pruning_rate must be in \[0, 1\), got 1.0"),
        ({"pruning_rate": -0.5}, "pruning_rate must be"),
        ({"pruning_rate": "half"}, "pruning_rate must be a float"),
        ({"pruning_metric": "median"}, "pruning_metric must be one of"),
        ({"selection_scope": "world"}, "selection_scope must be one of"),
        ({"allocation": "yes"}, "allocation must be true or false"),
        (  # named as CPPOConfig names it (the cppo trainer's selection_metric is not a CPPOConfig setting)
            {"pruning_metric": "max-variance", "pruning_rate": 0.5},
            r"^pruning_metric='max-variance' keeps each question's subset of largest variance, which needs "
            r"selection_scope='group', got 'batch': set selection_scope='group'$",
        ),
        ({"prefill_once": 1}, "prefill_once must be true or false, got 1"),
    ],
)
def test_a_bad_setting_is_one_error_naming_it(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **options)


def test_max_variance_prunes_per_question(tmp_path):
    assert config(tmp_path, pruning_metric="max-variance", selection_scope="group").pruning.metric == "max-variance"


def test_allocation_draws_one_over_one_minus_p_more_prompts(tmp_path):
    # 8 completions of 4 per generation = 2 prompts; P = 0.75 with allocation draws 8 prompts (32 completions)
    pruning = config(tmp_path, pruning_rate=0.75, allocation=True).pruning
    assert (pruning.questions_drawn, pruning.completions_per_step, pruning.kept_count(32)) == (8, 32, 8)
    assert config(tmp_path, pruning_rate=0.75).pruning.questions_drawn == 2


def test_the_cli_parser_knows_the_cppo_settings(tmp_path):
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", "--pruning_rate", "0.5"]
    argv += ["--pruning_metric", "random", "--allocation", "true", "--selection_scope", "group"]
    (args,) = HfArgumentParser(CPPOConfig).parse_args_into_dataclasses(argv)
    assert (args.pruning_rate, args.pruning_metric, args.allocation, args.selection_scope) == (
        0.5,
        "random",
        True,
        "group",
    )
