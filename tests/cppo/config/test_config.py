"""TrainConfig, presets and overrides; bad settings are rejected before any work, naming the setting."""

import pytest
import torch

from cppo import TrainConfig, load_config
from cppo.config import available_presets
from cppo.distributed import DistInfo, resolve_device
from cppo.step.models import lm_head
from cppo.trainer import Trainer


def test_presets_load():
    assert set(available_presets()) >= {"gsm8k-qwen2.5-1.5b", "math-qwen2.5-7b", "tiny-cpu", "smollm2-arith-cpu"}
    for name in ("gsm8k-qwen2.5-1.5b", "math-qwen2.5-7b", "tiny-cpu"):
        cfg = load_config(name)
        assert cfg.preset == name
    paper = load_config("gsm8k-qwen2.5-1.5b")
    assert (paper.group_size, paper.lr, paper.beta, paper.mu, paper.epsilon_low) == (16, 1e-6, 0.04, 2, 0.2)
    assert (paper.max_prompt_length, paper.max_completion_length, paper.kl_estimator) == (512, 1024, "k3")


def test_overrides_are_yaml_scalars(tmp_path):
    cfg = load_config("tiny-cpu", ["lr=1e-4", "pruning_rate=0.75", "rewards=format,accuracy", "epsilon_high=null"])
    assert cfg.lr == 1e-4 and isinstance(cfg.lr, float)
    assert cfg.rewards == ["format", "accuracy"] and cfg.epsilon_high is None
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny-qwen2\ngroup_size: 4\nmax_completion_length: 8\nmax_prompt_length: 8\n")
    assert load_config(str(path), ["mu=1"]).mu == 1


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["not_a_key=1"], "not_a_key"),
        (["pruning_rate=1.0"], "pruning_rate"),
        (["pruning_rate=-0.1"], "pruning_rate"),
        (["reward_timeout=0"], "reward_timeout"),
        (["reward_timeout=.nan"], "reward_timeout"),
        (["gradient_checkpointing=maybe"], "gradient_checkpointing"),
        (["micro_batch_tokens=16"], "micro_batch_tokens"),
        (["dataset=missing.jsonl"], "missing.jsonl"),
        (["dataset_path=/nonexistent"], "dataset_path"),
        (["loss_agg=mean"], "loss_agg"),
        (["kl_estimator=k4"], "kl_estimator"),
        (["temperature=0"], "temperature"),
        (["epsilon_high=-0.1"], "epsilon_high"),
        (["selection_metric=median"], "selection_metric"),
        (["selection_scope=world"], "selection_scope"),
        (["parallelism=tp"], "parallelism"),
        (["device=tpu"], "device"),
        (["device=cuda:x"], "device"),
        (["group_size=two"], "group_size"),
        (["mu=0"], "mu"),
        (["model=tiny-gpt"], "tiny"),
        (["lr=abc"], "lr"),
        (["oops"], "key=value"),
    ],
)
def test_bad_settings_are_rejected(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config("tiny-cpu", overrides)


def test_unknown_preset_and_missing_file():
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        load_config("nope")
    with pytest.raises(ValueError, match="does not exist"):
        load_config("missing.yaml")


def test_allocation_rounding():
    base = dict(group_size=16, max_prompt_length=8, max_completion_length=8)
    assert TrainConfig(**base, pruning_rate=0.875, questions_per_step=2).pruning.questions_drawn == 16
    assert TrainConfig(**base, pruning_rate=0.75, questions_per_step=2).pruning.keep == 4
    assert TrainConfig(**base, pruning_rate=0.5, questions_per_step=3).pruning.questions_drawn == 6
    assert TrainConfig(**base, pruning_rate=0.3, questions_per_step=2).pruning.questions_drawn == 3  # ceil(2.857)
    assert TrainConfig(**base, pruning_rate=0.5, questions_per_step=3, allocation=False).pruning.questions_drawn == 3


def test_model_without_lm_head_is_rejected():
    class NoHead:
        def get_output_embeddings(self):
            return None

    with pytest.raises(ValueError, match="no LM head"):
        lm_head(NoHead())


def test_questions_must_divide_by_world_size(tmp_path):
    cfg = TrainConfig(group_size=4, max_prompt_length=8, max_completion_length=8, questions_per_step=3)
    assert cfg.pruning.questions_drawn == 3
    with pytest.raises(ValueError, match="world_size"):
        Trainer(cfg, info=DistInfo(rank=0, world_size=2))


def test_resolve_device(monkeypatch):
    """The one resolution of ``device``: ``auto`` follows CUDA, and CUDA asked for where there is none (or a GPU the
    node lacks) is a ValueError, not a failure later when the model moves."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto", local_rank=1) == torch.device("cpu")
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device(device)
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("auto", local_rank=1) == resolve_device("cuda", local_rank=1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="2 CUDA devices"):
        resolve_device("cuda:2")
    with pytest.raises(ValueError, match="LOCAL_RANK=2"):
        resolve_device("cuda", local_rank=2)
    with pytest.raises(ValueError, match="under torchrun"):
        resolve_device("cuda:0", local_rank=0)


ALIAS_BOMB = """model: tiny-qwen2
a: &a [x, x, x, x, x, x, x, x, x]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
model_config: {hidden_size: [*d, *d, *d, *d, *d, *d, *d, *d, *d]}
"""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rewards: " + "[" * 20_000 + "]" * 20_000 + "\n", r"line 1: nested deeper than 16 levels"),
        (ALIAS_BOMB, r"line 3: YAML aliases \(\*a\) are not allowed in a config"),
        (
            "model_config:\n  hidden_size: 32\n  hidden_size: 64\n",
            r"line 3: 'hidden_size' is set twice \(line 2 and 3\)",
        ),
        (
            "rewards: [format, [digits]]\n",
            r"line 1: rewards must be a list of names, but item 2 is \[digits\] \(a list\)",
        ),
        ("lr: abc\n", r"line 1: lr must be a number, got abc \(text\)"),
    ],
)
def test_hostile_yaml_is_one_line_naming_the_file(tmp_path, text, message):
    """Deep nesting (a RecursionError before), an alias bomb (478 bytes that expand to gigabytes), a key twice inside
    a mapping (kept silently before) and a list inside rewards (a TypeError before) name the file and line."""
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as e:
        load_config(str(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learning_rate=1e-6", r"unknown setting 'learning_rate' \(that is TRL's name: here use lr\)"),
        ("learning_rat=1e-6", r"did you mean TRL's 'learning_rate'\? here use lr"),
        ("num_generations=8", "here use group_size"),
        ("prunning_rate=0.5", r"did you mean 'pruning_rate'\?"),
    ],
)
def test_trl_names_point_to_ours(override, message):
    with pytest.raises(ValueError, match=message):
        load_config("tiny-cpu", [override])


def test_a_relative_path_error_says_where_it_was_resolved_from(tmp_path, monkeypatch):
    """A preset's ../shared path depends on where cppo runs: the error names the current directory it resolved from."""
    (tmp_path / "run.yaml").write_text("model: ../nowhere/model.gguf\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        load_config("run.yaml")
    want = f"run.yaml, line 1: model file '../nowhere/model.gguf' (resolved from the current directory '{tmp_path}' to"
    assert str(error.value).startswith(want) and str(error.value).endswith(" does not exist")
