"""Generation ahead of training (issue 51: ``max_staleness``, ``steps_per_generation``; :mod:`cppo.overlap`) with the hf
engine on a tiny model: which weights sampled each trained rollout, that the next call really runs while a step
trains, the staleness bound, resume without a rollout lost or trained twice, and the refusals."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from tiny_run import tiny_config

from cppo import TrainConfig
from cppo.engines.hf import sampled_logprobs
from cppo.trainer import Trainer


def recorded(trainer):
    """Wraps the engine's generate: each call's rollout, its thread, and the policy's weights when it started."""
    calls = []
    generate = trainer.rollout.generate

    def wrapped(prompts, n, **kwargs):
        engine_state = {k: v.clone() for k, v in trainer.rollout.model.state_dict().items()}
        out = generate(prompts, n, **kwargs)
        calls.append({"rollout": out, "thread": threading.current_thread().name, "engine": engine_state,
                      "prompts": list(prompts)})  # fmt: skip
        return out

    trainer.rollout.generate = wrapped
    return calls


def run_steps(trainer, steps: int):
    """``steps`` train steps; the policy's weights before each (index = policy version) and the records."""
    versions, records = [], []
    for _ in range(steps):
        versions.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
        records.append(trainer.train_step())
    versions.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    return versions, records


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_defaults_keep_todays_run_no_queue_and_the_engine_is_the_policy(tmp_path):
    trainer = Trainer(tiny_config(tmp_path))
    assert trainer.queue is None and trainer.rollout.model is trainer.model
    assert "staleness" not in trainer.train_step()


def test_max_staleness_1_samples_step_k_plus_1_with_the_weights_after_step_k_minus_1_in_another_thread(tmp_path):
    """Step 0 generates now (staleness 0); from then on each call runs in the generating thread, launched as the
    previous step takes its draw, from the engine's copy synced to that step's policy: trained one update later."""
    trainer = Trainer(tiny_config(tmp_path, max_staleness=1, num_steps=4, lr=0.05))
    calls = recorded(trainer)
    versions, records = run_steps(trainer, 4)
    assert [r["staleness"] for r in records] == [0, 1, 1, 1]
    assert len(calls) == 4  # steps 0-3: the call for step 4 is never launched (no such step)
    assert calls[0]["thread"] == threading.current_thread().name
    assert all(c["thread"].startswith("cppo-generate") for c in calls[1:])
    # call k (k >= 1) trains at step k and was sampled by the policy before step k - 1 ... after step k - 1: version k-1
    for k, call in enumerate(calls):
        assert same(call["engine"], versions[max(k - 1, 0)]), k
    assert not same(versions[1], versions[0])  # the updates changed the weights (so the check above can fail)
    # the engine reports the copy's log-probs: the stale behaviour policy's, as the correction needs
    model = copy.deepcopy(trainer.model)
    model.load_state_dict(versions[1])
    r = calls[2]["rollout"]
    expected = sampled_logprobs(model, r.prompt_ids, r.completion_ids, temperature=1.0, compute_dtype=None)
    for got, want in zip(r.sampling_logprobs, expected):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    assert all("sampling/importance_sampling_ratio/mean" in rec for rec in records)


def test_the_next_call_runs_while_the_step_trains(tmp_path, monkeypatch):
    """Deterministic, no timing: the generating thread blocks until the training thread has started the step's
    policy update; run one after the other, it would wait forever (bounded here, and then the test fails)."""
    trainer = Trainer(tiny_config(tmp_path, max_staleness=1, num_steps=3))
    training, overlapped = threading.Event(), []
    generate, update = trainer.rollout.generate, trainer._update

    def gen(*args, **kwargs):
        if threading.current_thread().name.startswith("cppo-generate"):
            overlapped.append(training.wait(timeout=60))
        return generate(*args, **kwargs)

    def upd(*args, **kwargs):
        training.set()
        return update(*args, **kwargs)

    monkeypatch.setattr(trainer.rollout, "generate", gen)
    monkeypatch.setattr(trainer, "_update", upd)
    for _ in range(3):
        training.clear()
        trainer.train_step()
    assert overlapped == [True, True]


def test_steps_per_generation_one_call_serves_its_steps_in_order(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, steps_per_generation=2, max_staleness=1, num_steps=4))
    calls = recorded(trainer)
    questions = trainer.pruning.questions_drawn
    _, records = run_steps(trainer, 4)
    assert len(calls) == 2 and all(len(c["prompts"]) == 2 * questions for c in calls)
    assert all(c["thread"] == threading.current_thread().name for c in calls)  # max_staleness 1 < 2: no overlap
    assert [r["staleness"] for r in records] == [0, 1, 0, 1]
    assert [r["questions"] for r in records] == [questions] * 4


def test_steps_per_generation_2_with_max_staleness_2_overlaps_and_stays_within_the_bound(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, steps_per_generation=2, max_staleness=2, num_steps=5))
    calls = recorded(trainer)
    _, records = run_steps(trainer, 5)
    assert [r["staleness"] for r in records] == [0, 1, 1, 2, 1]
    assert [c["thread"].startswith("cppo-generate") for c in calls] == [False, True, True]


def trained_completions(calls) -> list:
    return [tuple(map(tuple, c["rollout"].completion_ids)) for c in calls]


def test_resume_trains_every_rollout_once_and_equals_the_uninterrupted_run(tmp_path):
    """A checkpoint after step 2 saves the call generating ahead (waited for); the resumed run trains it at step 2
    and goes on as the uninterrupted run: the same completions and the same final weights."""
    settings = dict(max_staleness=1, num_steps=4, lr=0.05)
    whole = Trainer(tiny_config(tmp_path / "whole", **settings))
    whole_calls = recorded(whole)
    run_steps(whole, 4)
    first = Trainer(tiny_config(tmp_path / "first", **settings))
    first_calls = recorded(first)
    run_steps(first, 2)
    path = first.save_checkpoint(str(tmp_path / "first" / "checkpoint-000002"))
    assert len(first.queue.ready) == 1 and first.queue.ready[0].version == 1  # generated by the policy of step 1
    second = Trainer(tiny_config(tmp_path / "second", **settings))
    second.load_checkpoint(path)
    second_calls = recorded(second)
    run_steps(second, 2)
    assert trained_completions(first_calls + second_calls) == trained_completions(whole_calls)
    for k, v in whole.model.state_dict().items():
        torch.testing.assert_close(second.model.state_dict()[k], v, rtol=0, atol=0)


def test_num_epochs_runs_as_many_steps_as_the_run_that_does_not_generate_ahead(tmp_path):
    """Without num_steps the run ends by the questions trained, not by those already drawn for the next call."""
    plain = Trainer(tiny_config(tmp_path / "plain", num_steps=None, max_questions=8))
    ahead = Trainer(tiny_config(tmp_path / "ahead", num_steps=None, max_questions=8, max_staleness=1))
    assert len(plain.train()) == len(ahead.train()) == 4
    assert ahead.queue.ready == [] and ahead.queue._pending is None


def test_an_error_in_the_generating_thread_surfaces_in_the_training_step(tmp_path, monkeypatch):
    trainer = Trainer(tiny_config(tmp_path, max_staleness=1, num_steps=3))
    trainer.train_step()  # launches the call for step 1 ... after patching it fails

    def broken(*args, **kwargs):
        raise RuntimeError("engine broke")

    trainer.queue.drain()
    trainer.queue.ready.clear()
    monkeypatch.setattr(trainer.rollout, "generate", broken)
    trainer.queue._launch(trainer.step - 1)
    with pytest.raises(RuntimeError, match="engine broke"):
        trainer.train_step()


def test_generating_ahead_composes_with_greso_filter_groups_and_lora(tmp_path):
    for i, settings in enumerate([
        dict(greso=True, steps_per_generation=2, max_staleness=2),
        dict(filter_groups=True, max_staleness=1),
        dict(use_peft=True, lora_dropout=0.0, max_staleness=1),
    ]):  # fmt: skip
        trainer = Trainer(tiny_config(tmp_path / str(i), num_steps=3, **settings))
        records = [trainer.train_step() for _ in range(3)]
        assert max(r["staleness"] for r in records) >= 1, settings
        assert all(r["completions_kept"] > 0 for r in records), settings


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(steps_per_generation=3, max_staleness=1), r"^steps_per_generation=3 trains the last step"),
        (dict(max_staleness=-1), r"max_staleness"),
        (dict(steps_per_generation=0), r"steps_per_generation"),
        (dict(steps_per_generation=2, max_staleness=2, filter_groups=True), r"^steps_per_generation > 1 with filter"),
        (dict(max_staleness=1, pruning_rate=0.5, rollout_stop={"rate": 0.25}), r"^max_staleness > 0 with rollout_stop"),
        (dict(max_staleness=1, parallelism="fsdp2"), r"^max_staleness > 0 with parallelism fsdp2"),
    ],
)
def test_refusals_name_the_setting(tmp_path, settings, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(tmp_path, **settings)


def test_the_settings_are_trls_names_and_not_resumable_changes():
    from cppo.config.choices import RESUMABLE

    fields = TrainConfig.__dataclass_fields__
    assert fields["max_staleness"].default == 0 and fields["steps_per_generation"].default == 1
    assert not {"max_staleness", "steps_per_generation"} & RESUMABLE


@pytest.mark.parametrize("peft", [False, True])
def test_the_hf_engines_log_probs_equal_the_models_own_logits(tmp_path, peft):
    """sampled_logprobs (decoder + fused_logprobs) against log_softmax of the model's own logits / temperature, row by
    row, unpadded; with LoRA adapters (a PEFT model) too."""
    trainer = Trainer(tiny_config(tmp_path, max_staleness=1, use_peft=peft, lora_dropout=0.0, temperature=0.7))
    model = trainer.rollout.model  # the engine's copy
    torch.manual_seed(0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    completions = [[20, 21], [22, 23, 24, 25], [26]]
    got = sampled_logprobs(model, prompts, completions, temperature=0.7, compute_dtype=None, rows=2)
    for p, c, values in zip(prompts, completions, got):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) + len(c) - 1].float()
        want = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(values), want, rtol=1e-5, atol=1e-5)
