"""Issue 20: LoRA through PEFT in the trainer: settings, the reference pass without a copy, the frozen LM head,
checkpoints in PEFT's format, resume, eval and merge."""

import json
import os
import re

import lora_worker
import pytest
import torch
from tiny_model import TINY
from tiny_run import CLI_SETTINGS, resume_candidates, tiny_config, train_cli
from torchrun_harness import assert_ranks_ok, torchrun

from cppo import TrainConfig, load_config
from cppo.cli import main
from cppo.config import FIXED
from cppo.step import lora
from cppo.step.models import load_model_and_tokenizer
from cppo.trainer import Trainer
from cppo_kernels import fused_cppo_loss

LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)


def lora_trainer(output_dir, **overrides) -> Trainer:
    return Trainer(tiny_config(output_dir, **{**LORA, **overrides}))


def adapter_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_" in k}


def tiny_inputs(vocab: int = TINY["vocab_size"]) -> torch.Tensor:
    return torch.randint(4, vocab, (2, 12), generator=torch.Generator().manual_seed(3))  # [B, L]


# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------


def test_lora_settings_use_trls_names_and_defaults():
    cfg = TrainConfig()
    assert (cfg.use_peft, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (False, 16, 32, 0.05)
    assert cfg.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert TrainConfig(lora_target_modules="all-linear").lora_target_modules == "all-linear"


@pytest.mark.parametrize(
    "setting, match",
    [
        (dict(lora_r=0), r"^lora_r must be >= 1, got 0"),
        (dict(lora_alpha=0), r"^lora_alpha must be >= 1"),
        (dict(lora_dropout=1.0), r"^lora_dropout must be in \[0, 1\), got 1.0"),
        (dict(lora_dropout=-0.1), r"^lora_dropout must be in \[0, 1\)"),
        (dict(lora_target_modules="q_proj"), r"^lora_target_modules must be a list of module names or all-linear"),
        (dict(lora_target_modules=[]), r"^lora_target_modules must name at least one module"),
        (dict(lora_target_modules=["all-linear", "q_proj"]), r"^lora_target_modules must name at least one module"),
        (dict(lora_target_modules=[3]), r"^lora_target_modules must be a list of names, but item 1 is 3"),
    ],
)
def test_bad_lora_settings_are_one_line_naming_the_setting(setting, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**setting)


def test_a_target_module_that_does_not_exist_is_one_line_listing_the_candidates(tmp_path):
    with pytest.raises(ValueError) as e:
        lora_trainer(tmp_path, lora_target_modules=["q_proj", "qkv_proj"])
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("lora_target_modules: ['qkv_proj'] not among the linear modules of Qwen2ForCausalLM")
    assert message.endswith(
        "candidates: ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'] (or all-linear)"
    )


def test_the_lm_head_is_no_candidate_and_all_linear_leaves_it_alone(tmp_path):
    with pytest.raises(ValueError, match=r"\['lm_head'\] not among the linear modules"):
        lora_trainer(tmp_path, lora_target_modules=["lm_head"])
    trainer = lora_trainer(tmp_path, lora_target_modules="all-linear")
    adapted = {name.split(".")[-1] for name, m in trainer.model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


# ----------------------------------------------------------------------------------------------
# The reference pass, the optimizer, the frozen LM head
# ----------------------------------------------------------------------------------------------


def storages(module: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def test_the_reference_is_the_policy_with_adapters_disabled_and_no_copy(tmp_path):
    trainer = lora_trainer(tmp_path, lr=5e-2)
    assert trainer.ref_model is None and trainer.ref_policy is not None
    assert storages(trainer.ref_policy) == storages(trainer.policy)  # no parameter of its own: no second model
    unique = {id(p): p for m in (trainer.policy, trainer.ref_policy) for p in m.parameters()}
    in_memory = sum(p.numel() for p in unique.values())
    assert in_memory == sum(p.numel() for p in trainer.model.parameters())
    trainer.train_step()
    trainer.train_step()
    assert any(v.abs().max() > 0 for k, v in adapter_state(trainer).items() if "lora_B" in k)  # the adapters moved
    base, _ = load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=trainer.config.seed)
    ids = tiny_inputs()
    with torch.no_grad(), lora.reference_context(trainer.model):
        disabled = trainer.model(input_ids=ids).logits
    with torch.no_grad():
        torch.testing.assert_close(disabled, base(input_ids=ids).logits, rtol=0, atol=0)
        assert not torch.equal(trainer.model(input_ids=ids).logits, disabled)


def test_the_reference_log_probs_are_those_of_the_base_model(tmp_path):
    """The trainer's reference pass (through ``ref_policy``) gives the log-probs of the untrained base."""
    trainer = lora_trainer(tmp_path, lr=5e-2)
    trainer.train_step()
    rewards = torch.tensor([0.0, 1.0, 0.5, 0.2] * trainer.pruning.questions_drawn)
    torch.manual_seed(1)
    _, _, rollout = trainer._generate()
    batches, _ = trainer._select_and_pack(rewards, rollout)
    ref = trainer._logprobs(trainer.ref_policy, batches)
    policy = trainer._logprobs(trainer.policy, batches)
    plain = Trainer(tiny_config(tmp_path / "plain", lr=5e-2))  # full fine-tuning: a deep copy as the reference
    want = plain._logprobs(plain.ref_policy, batches)
    for got, expected, moved in zip(ref, want, policy):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert not torch.equal(got, moved)


def test_only_the_adapters_train_and_the_lm_head_gets_no_gradient(tmp_path):
    trainer = lora_trainer(tmp_path)
    optimized = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert optimized and all("lora_" in names[id(p)] for p in optimized)
    assert len(optimized) == sum(p.requires_grad for p in trainer.model.parameters())
    head = trainer.model.get_output_embeddings().weight
    assert not head.requires_grad
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.train_step()
    assert head.grad is None
    for n, p in trainer.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


def test_the_fused_loss_skips_the_weight_gradient_of_a_frozen_head():
    """A weight without ``requires_grad`` gets no gradient and the hidden gradient is the same as with one."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=gen)  # [T, H]
    weight = torch.randn(50, 16, generator=gen)  # [V, H]
    targets = torch.randint(0, 50, (10,), generator=gen)
    advantages = torch.tensor([1.0, -0.5])
    cu = torch.tensor([0, 4, 10])
    grads = {}
    for trainable in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(trainable)
        loss, _ = fused_cppo_loss(h, w, targets, advantages, cu_seqlens=cu, beta=0.04, ref_logprobs=-torch.ones(10))
        loss.backward(torch.tensor(0.7))
        grads[trainable] = (h.grad, w.grad)
    assert grads[False][1] is None and grads[True][1] is not None
    torch.testing.assert_close(grads[False][0], grads[True][0], rtol=0, atol=0)


def test_gradient_checkpointing_with_lora_gives_the_same_update(tmp_path):
    updates = []
    for checkpointing in (False, True):
        trainer = lora_trainer(tmp_path / str(checkpointing), gradient_checkpointing=checkpointing, lr=5e-2)
        trainer.train_step()
        updates.append(adapter_state(trainer))
    assert updates[0].keys() == updates[1].keys()
    for k in updates[0]:
        torch.testing.assert_close(updates[1][k], updates[0][k])


# ----------------------------------------------------------------------------------------------
# Checkpoints, resume, eval, merge
# ----------------------------------------------------------------------------------------------


def test_a_lora_checkpoint_holds_the_adapter_in_pefts_format(tmp_path):
    trainer = lora_trainer(tmp_path)
    trainer.train_step()
    path = trainer.save_checkpoint(str(tmp_path / "checkpoint-000001"))
    model_dir = os.path.join(path, "model")
    files = set(os.listdir(model_dir))
    assert {"adapter_config.json", "adapter_model.safetensors", lora.BASE_FILE, "tokenizer.json"} <= files
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in files)  # no full weights
    with open(os.path.join(model_dir, "adapter_config.json")) as f:
        saved = json.load(f)
    assert (saved["peft_type"], saved["task_type"], saved["r"], saved["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8)
    assert saved["base_model_name_or_path"] == "tiny-qwen2"
    with open(os.path.join(model_dir, lora.BASE_FILE)) as f:
        assert json.load(f) == {"model": "tiny-qwen2", "model_config": TINY, "seed": 0}
    from safetensors.torch import load_file

    weights = load_file(os.path.join(model_dir, "adapter_model.safetensors"))
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert sum(t.numel() for t in weights.values()) == sum(p.numel() for p in adapter_state(trainer).values())


def test_the_base_recorded_is_the_model_that_loaded_not_a_folder_of_its_name(tmp_path, monkeypatch, capsys):
    """Issue 27: a built-in tiny-qwen2 run started where a ./tiny-qwen2 model folder lies recorded that folder as
    its base, and eval / merge used it (other weights)."""
    other, tokenizer = load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=1)
    monkeypatch.chdir(tmp_path)
    other.save_pretrained("tiny-qwen2")
    tokenizer.save_pretrained("tiny-qwen2")
    trainer = lora_trainer(tmp_path / "run")
    path = trainer.save_checkpoint(str(tmp_path / "run" / "checkpoint-000000"))  # lora_B is 0: merged = the base
    assert lora.base_recipe(os.path.join(path, "model"))["model"] == "tiny-qwen2"
    capsys.readouterr()
    assert main(["merge", "--checkpoint", path, "--output", str(tmp_path / "merged")]) == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    built_in = load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=0)[0].state_dict()
    assert merged.keys() == built_in.keys()
    for k in merged:
        torch.testing.assert_close(merged[k], built_in[k], rtol=0, atol=0)
    assert not torch.equal(other.state_dict()["model.embed_tokens.weight"], built_in["model.embed_tokens.weight"])


def test_a_local_base_is_recorded_by_its_absolute_path(tmp_path, monkeypatch):
    model, tokenizer = load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=1)
    monkeypatch.chdir(tmp_path)
    model.save_pretrained("base")
    tokenizer.save_pretrained("base")
    base, tokenizer = load_model_and_tokenizer("base")
    adapted = lora.apply_lora(base, r=2, alpha=4, dropout=0.0, target_modules=["q_proj"], seed=0, base_model="base")
    lora.save_adapter(adapted, str(tmp_path / "adapter"), tokenizer=tokenizer)
    assert lora.base_recipe(str(tmp_path / "adapter"))["model"] == str(tmp_path / "base")


def test_resume_continues_a_lora_run_exactly(tmp_path):
    straight = lora_trainer(tmp_path / "straight", num_steps=3, lora_dropout=0.05)
    for _ in range(3):
        straight.train_step()
    first = lora_trainer(tmp_path / "resumed", num_steps=3, lora_dropout=0.05)
    for _ in range(2):
        first.train_step()
    path = first.save_checkpoint(str(tmp_path / "resumed" / "checkpoint-000002"))
    resumed = lora_trainer(tmp_path / "resumed", num_steps=3, lora_dropout=0.05)
    resumed.load_checkpoint(path)
    assert resumed.step == 2
    torch.testing.assert_close(adapter_state(resumed), adapter_state(first), rtol=0, atol=0)
    resumed.train_step()
    torch.testing.assert_close(adapter_state(resumed), adapter_state(straight), rtol=0, atol=0)


def test_a_lora_checkpoint_and_a_full_run_do_not_mix(tmp_path):
    lora_run = lora_trainer(tmp_path)
    path = lora_run.save_checkpoint(str(tmp_path / "checkpoint-000000"))
    plain = Trainer(tiny_config(tmp_path / "plain"))
    with pytest.raises(ValueError, match=r"holds a LoRA adapter: resume it with use_peft=true"):
        plain.load_checkpoint(path)
    full_path = plain.save_checkpoint(str(tmp_path / "plain" / "checkpoint-000000"))
    with pytest.raises(ValueError, match=r"holds no LoRA adapter \(adapter_model.safetensors\): it is a full model"):
        lora_run.load_checkpoint(full_path)
    bigger = lora_trainer(tmp_path / "r8", lora_r=8)
    with pytest.raises(ValueError, match=r"^adapter .* does not fit the model"):
        bigger.load_checkpoint(path)


def test_a_resume_cannot_switch_lora_on_or_change_its_shape():
    saved = tiny_config("runs/x", **LORA).to_dict()
    for change in (dict(use_peft=False), dict(lora_r=8), dict(lora_target_modules=["q_proj"])):
        name = next(iter(change))
        assert tiny_config("runs/x", **{**LORA, **change}).changes_from(saved) != []
        assert name in FIXED


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """``cppo train --config tiny-cpu ... use_peft=true`` for 2 steps, then ``--resume`` to step 3."""
    out = tmp_path_factory.mktemp("lora") / "run"
    settings = ("use_peft=true", "lora_r=4", "lora_alpha=8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CPPO_KERNELS_BACKEND", "torch")
        assert train_cli(out, settings=("num_steps=2", *settings)) == 0
        assert train_cli(out, "--resume", settings=("num_steps=3", *settings)) == 0
    return out


def test_train_resume_and_eval_of_a_lora_run_from_the_command_line(lora_run, capsys, monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")
    assert sorted(p.name for p in lora_run.glob("checkpoint-*")) == [f"checkpoint-00000{i}" for i in (1, 2, 3)]
    records = [json.loads(line) for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    checkpoint = lora_run / "checkpoint-000003"
    capsys.readouterr()
    argv = ["eval", "--model", str(checkpoint), "--limit", "3", "--max-completion-length", "8", "--no-progress"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["model"] == str(checkpoint) and result["total"] == 3


def test_eval_loads_base_plus_adapter(lora_run):
    folder = str(lora_run / "checkpoint-000003" / "model")
    model, _ = lora.load_adapter_model(folder)
    base, _ = load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=0)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert saved.keys() == loaded.keys()
    for k in saved:
        torch.testing.assert_close(loaded[k], saved[k], rtol=0, atol=0)
    ids = tiny_inputs()
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits, base(input_ids=ids).logits)


def test_merge_writes_a_plain_model_that_from_pretrained_loads(lora_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    checkpoint, out = lora_run / "checkpoint-000003", tmp_path / "merged"
    capsys.readouterr()
    assert main(["merge", "--checkpoint", str(checkpoint), "--output", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.strip())["merged"] == str(out)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    assert not (out / "adapter_config.json").exists() and (out / "tokenizer.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert type(merged).__name__ == "Qwen2ForCausalLM"
    adapted, _ = lora.load_adapter_model(str(checkpoint / "model"))
    ids = tiny_inputs()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits)


def test_merge_refuses_a_non_empty_output_and_a_full_checkpoint(lora_run, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["merge", "--checkpoint", str(lora_run / "checkpoint-000003"), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"cppo merge: error: --output {str(out)!r} exists and is not an empty folder: name a new one"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (tmp_path / "full").mkdir()
    assert main(["merge", "--checkpoint", str(tmp_path / "full"), "--output", str(tmp_path / "m")]) == 2
    assert "holds no LoRA adapter (adapter_config.json): nothing to merge" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_lora_run_folder_names_its_latest_checkpoint_to_eval(lora_run, capsys):
    assert main(["eval", "--model", str(lora_run), "--limit", "1"]) == 2
    assert f"evaluate its latest checkpoint, --model {lora_run / 'checkpoint-000003'}" in capsys.readouterr().err


def test_resume_of_a_lora_run_without_use_peft_is_refused(lora_run):
    settings = [*CLI_SETTINGS, f"output_dir={lora_run}", "num_steps=3", "lora_r=4", "lora_alpha=8", "use_peft=false"]
    with pytest.raises(ValueError, match=r"settings that a resume cannot apply \(use_peft: True -> False\)"):
        resume_candidates(load_config("tiny-cpu", settings), allow_config_change=True)


@pytest.fixture(scope="module")
def adapter_on_a_local_base(tmp_path_factory):
    """``(checkpoint folder, base folder)``: an untrained adapter (r=4 on q_proj, v_proj) on a tiny model saved in a
    folder, as a LoRA run of that folder saves it."""
    root = tmp_path_factory.mktemp("adapter")
    model, tokenizer = load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=1)
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    base, tokenizer = load_model_and_tokenizer(str(root / "base"))
    adapted = lora.apply_lora(
        base, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], seed=0, base_model=str(root / "base")
    )
    lora.save_adapter(adapted, str(root / "checkpoint" / "model"), tokenizer=tokenizer)
    return root / "checkpoint", root / "base"


def _edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _truncate(path, keep):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(keep if keep >= 0 else size + keep)


BROKEN_ADAPTERS = {  # what is done to the adapter folder, and what the one-line error must say
    "weights cut in the header": (
        lambda m, base: _truncate(m / lora.ADAPTER_WEIGHTS, 100),
        r"model/adapter_model.safetensors cannot be read \(.*\): a truncated or corrupt file$",
    ),
    "weights cut at the end": (
        lambda m, base: _truncate(m / lora.ADAPTER_WEIGHTS, -100),
        r"model/adapter_model.safetensors cannot be read \(.*\): a truncated or corrupt file$",
    ),
    "weights overwritten": (
        lambda m, base: (m / lora.ADAPTER_WEIGHTS).write_bytes(b"\0" * 4096),
        r"model/adapter_model.safetensors cannot be read \(.*\): a truncated or corrupt file$",
    ),
    "weights missing": (
        lambda m, base: (m / lora.ADAPTER_WEIGHTS).unlink(),
        r"has adapter_config.json but no adapter_model.safetensors: an incomplete adapter$",
    ),
    "config of another rank": (
        lambda m, base: _edit_json(m / lora.ADAPTER_CONFIG, r=8),
        r"model/adapter_config.json says r=8, but .*model/adapter_model.safetensors holds weights of rank 4 "
        r"\(.*lora_A.weight\): the two files are not of the same adapter$",
    ),
    "config cut": (
        lambda m, base: _truncate(m / lora.ADAPTER_CONFIG, 20),
        r"model/adapter_config.json \(the LoRA adapter's config\) cannot be read \(.*\): a truncated or corrupt",
    ),
    "base recipe cut": (
        lambda m, base: _truncate(m / lora.BASE_FILE, 5),
        r"model/base_model.json \(the base model's recipe\) cannot be read \(.*\): a truncated or corrupt file$",
    ),
    "base moved": (
        lambda m, base: base.rename(base.with_name("moved")),
        r"the base model of adapter .*, '.*/base' \(recorded in .*model/base_model.json\), does not exist: it was "
        r"moved or deleted; put it back, or write its new path there$",
    ),
    "base of another width": (
        lambda m, base: _edit_json(
            m / lora.BASE_FILE, model="tiny-qwen2", model_config={**TINY, "hidden_size": 2 * TINY["hidden_size"]}
        ),
        r"adapter '.*model' does not fit its base model 'tiny-qwen2' \(size mismatch for .*\): another base model$",
    ),
}


@pytest.mark.parametrize("case", BROKEN_ADAPTERS)
def test_merge_and_eval_of_a_broken_adapter_are_one_line_naming_the_file(
    adapter_on_a_local_base, tmp_path, monkeypatch, capsys, case
):
    """Issue 27: tracebacks (SafetensorError, a size-mismatch RuntimeError, a hub look-up), "Repo id must be in the
    form ..." for a moved base, and an eval error naming model/model.safetensors, a file that does not exist."""
    import shutil

    checkpoint, base = adapter_on_a_local_base
    shutil.copytree(checkpoint, tmp_path / "checkpoint")
    shutil.copytree(base, tmp_path / "base")
    _edit_json(tmp_path / "checkpoint" / "model" / lora.BASE_FILE, model=str(tmp_path / "base"))
    break_it, expected = BROKEN_ADAPTERS[case]
    break_it(tmp_path / "checkpoint" / "model", tmp_path / "base")
    model = str(tmp_path / "checkpoint")
    commands = {
        "merge": ["merge", "--checkpoint", model, "--output", str(tmp_path / "merged")],
        "eval": ["eval", "--model", model, "--limit", "1", "--max-completion-length", "4", "--no-progress"],
    }
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    for command, argv in commands.items():
        assert main(argv) == 2  # an error that escaped (a traceback) fails the test here
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("cppo ")]
        assert len(lines) == 1, err
        prefix = "cppo merge: error: " if command == "merge" else f"cppo eval: error: --model {model!r}: "
        assert lines[0].startswith(prefix) and re.search(expected, lines[0]), lines[0]
        assert "/model.safetensors" not in lines[0]
    assert not (tmp_path / "merged").exists()


# ----------------------------------------------------------------------------------------------
# DDP and FSDP2 (gloo, 2 processes)
# ----------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_lora_under_ddp_and_fsdp2_equals_one_process(tmp_path):
    """tests/support/lora_worker.py under torchrun: the ranks agree, 2 processes equal 1 (DDP and FSDP2), and a DDP
    resume from a LoRA checkpoint equals the uninterrupted run."""
    proc = torchrun([lora_worker.__file__, str(tmp_path)], timeout=400)
    expected = [(c, r) for c in lora_worker.CHECKS for r in (0, 1)] + [(c, 0) for c in lora_worker.REFERENCE_CHECKS]
    assert_ranks_ok(tmp_path, expected, proc)


def test_use_peft_asks_the_engine_whether_it_takes_a_lora_policy(monkeypatch):
    """Issue 37/39: the refusal comes from the engine's declared capability, not from its name: hf and vllm (merged
    weights) take LoRA; a registered engine that does not declare it is refused in one line."""
    from cppo.engines import base, engine_supports, register_engine

    class NoLora(base.RolloutEngine):
        def generate(self, prompts, num_per_prompt, *, greedy=False):
            raise AssertionError

        def sync_weights(self):
            pass

    monkeypatch.setattr(base, "_ENGINES", dict(base._ENGINES))
    register_engine("nolora", NoLora)
    assert engine_supports("hf", "supports_lora") and engine_supports("vllm", "supports_lora")
    assert engine_supports("auto", "supports_lora") and not engine_supports("nolora", "supports_lora")
    with pytest.raises(ValueError, match=r"^use_peft: rollout_backend='nolora' cannot generate from a LoRA policy"):
        TrainConfig(use_peft=True, rollout_backend="nolora")
