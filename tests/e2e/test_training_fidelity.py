"""The trainer's side of the official recipe: fp32 master weights under a bf16 compute dtype, pooled pruning with the
official count, gradient checkpointing, the warm-up count, and periodic evaluation into metrics.jsonl."""

import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_run import tiny_config

from cppo import TrainConfig
from cppo.step.optim import make_scheduler
from cppo.trainer import Trainer
from cppo_kernels import cppo_select


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")


def config(tmp_path, **overrides) -> TrainConfig:
    """test_trainer's tiny run at the paper's lr 1e-6: one update per step, P = 0.5, a constant schedule."""
    options = dict(pruning_rate=0.5, mu=1, lr=1e-6, lr_schedule="constant", num_steps=2)
    return tiny_config(tmp_path, **{**options, **overrides})


# --------------------------------------------------------------------------------------------
# Master weights
# --------------------------------------------------------------------------------------------


def one_update(trainer: Trainer, generated=None):
    """Runs one step on ``generated`` (default: what the trainer generates now); returns (what it trained on, update
    per parameter, gradient per parameter)."""
    generated = generated if generated is not None else trainer._generate()
    trainer._generate = lambda: generated
    before = [p.detach().clone() for p in trainer.model.parameters()]
    grads, real_step = [], trainer._optimizer_step

    def step():
        grads.extend(p.grad.detach().clone() for p in trainer.model.parameters())
        return real_step()

    trainer._optimizer_step = step
    trainer.train_step()
    return generated, [p.detach() - b for p, b in zip(trainer.model.parameters(), before)], grads


def test_bf16_compute_keeps_fp32_masters_and_updates_like_fp32(tmp_path):
    """At lr 1e-6 a bf16 parameter cannot move (its spacing near 0.02 is 1e-4): the masters must be fp32. The bf16
    step changes >= 99% of the elements with a gradient and points the way the fp32 step does."""
    fp32 = Trainer(config(tmp_path / "a"))
    bf16 = Trainer(config(tmp_path / "b", dtype="bfloat16"))
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in bf16.ref_model.parameters())  # frozen: stored in compute dtype
    assert all(torch.equal(a, b) for a, b in zip(fp32.model.parameters(), bf16.model.parameters()))
    generated, want, _ = one_update(fp32)
    _, got, grads = one_update(bf16, generated)  # the same completions, so the same rewards and selection
    assert all(s["exp_avg"].dtype == torch.float32 for s in bf16.optimizer.state.values())

    has_grad = torch.cat([(g != 0).flatten() for g in grads])
    changed = torch.cat([(u != 0).flatten() for u in got])
    assert has_grad.sum() > 1000
    assert (changed & has_grad).sum() >= 0.99 * has_grad.sum()
    got, want = torch.cat([u.flatten() for u in got]), torch.cat([u.flatten() for u in want])
    assert float(torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=0)) >= 0.99


# --------------------------------------------------------------------------------------------
# Pruning: the official count over the pooled step
# --------------------------------------------------------------------------------------------


def drop_smallest(advantages: torch.Tensor, pruning_rate: float) -> list[int]:
    """The official rule written out directly: drop the int(N * P) smallest |A| of the step (ties: the later index
    goes first, where torch.topk leaves the order unspecified)."""
    n = advantages.numel()
    order = sorted(range(n), key=lambda i: (abs(float(advantages[i])), -i))
    dropped = set(order[: int(n * pruning_rate)])
    return [i for i in range(n) if i not in dropped]


@settings(max_examples=200)
@given(
    groups=st.integers(1, 12),
    group_size=st.sampled_from([2, 4, 8, 16]),
    pruning_rate=st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.6, 0.75, 0.8, 0.875, 0.9375]),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_pooled_selection_drops_the_official_count(groups, group_size, pruning_rate, levels, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, levels, (groups * group_size,), generator=g).float() / 2  # [N], many ties
    cfg = TrainConfig(group_size=group_size, pruning_rate=pruning_rate, max_prompt_length=8, max_completion_length=8)
    kept_count = cfg.pruning.kept_count(rewards.numel())
    advantages, kept = cppo_select(rewards, group_size, num_kept=kept_count, scope="batch", metric="smallest")
    assert kept.tolist() == drop_smallest(advantages, pruning_rate)
    assert kept.numel() == rewards.numel() - int(rewards.numel() * pruning_rate)


def test_the_official_count_at_other_rates():
    base = dict(group_size=16, max_prompt_length=8, max_completion_length=8, questions_per_step=1)
    cfg = TrainConfig(**base, pruning_rate=0.3)  # 2 questions: 32 completions, int(9.6) = 9 pruned
    assert (
        cfg.pruning.questions_drawn,
        cfg.pruning.completions_per_step,
        cfg.pruning.kept_per_step,
        cfg.pruning.keep,
    ) == (2, 32, 23, 12)
    assert TrainConfig(**base, pruning_rate=0.3, selection_scope="group").pruning.kept_per_step == 24
    assert (
        TrainConfig(**base, pruning_rate=0.3, selection_scope="global").pruning.kept_per_step == 23
    )  # 23 of 2 questions
    for p, questions in ((0.5, 2), (0.75, 4), (0.875, 8), (0.9375, 16)):  # the paper's rates: 16 kept of 16 / (1-P)
        cfg = TrainConfig(**base, pruning_rate=p)
        assert (cfg.pruning.questions_drawn, cfg.pruning.kept_per_step, cfg.pruning.keep) == (
            questions,
            16,
            16 // questions,
        )
        assert questions == 16 // int(16 * (1 - p))  # the official per_device_batch / num_generations


def test_a_step_keeps_the_official_count(tmp_path):
    trainer = Trainer(config(tmp_path, pruning_rate=0.3, group_size=4, questions_per_step=2))
    metrics = trainer.train_step()  # ceil(2 / 0.7) = 3 questions: 12 completions, int(3.6) = 3 pruned
    assert (metrics["completions"], metrics["completions_kept"]) == (12, 9)


# --------------------------------------------------------------------------------------------
# Gradient checkpointing, warm-up, evaluation schedule
# --------------------------------------------------------------------------------------------


def test_gradient_checkpointing_recomputes_and_gives_the_same_step(tmp_path):
    plain = Trainer(config(tmp_path / "a", lr=1e-3))
    ckpt = Trainer(config(tmp_path / "b", lr=1e-3, gradient_checkpointing=True))

    def checkpointed(model):
        return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())

    assert checkpointed(ckpt.model) and not checkpointed(plain.model)
    generated, want, _ = one_update(plain)
    _, got, _ = one_update(ckpt, generated)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("total", [30, 934 * 2, 14946, 7])
def test_warmup_is_the_hugging_face_count(tmp_path, total):
    cfg = config(tmp_path, warmup_ratio=0.1, lr_schedule="cosine", lr=1.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler(opt, schedule=cfg.lr_schedule, warmup_ratio=cfg.warmup_ratio, total=total)
    warmup = math.ceil(total * 0.1)  # transformers' TrainingArguments.get_warmup_steps
    lrs = []
    for _ in range(warmup + 1):
        lrs.append(scheduler.get_last_lr()[0])
        opt.step()
        scheduler.step()
    assert lrs[warmup] == pytest.approx(1.0) and lrs[warmup - 1] < 1.0


def test_periodic_evaluation_goes_to_metrics_jsonl(tmp_path):
    trainer = Trainer(config(tmp_path, num_steps=3, eval_every=2, eval_limit=2, log_every=10))
    history = trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3]  # evaluated steps are logged whatever log_every says
    assert [("eval/accuracy" in h) for h in history] == [False, True, True]  # every 2 steps and after the last
    assert all(r["eval/total"] == 2 and 0 <= r["eval/accuracy"] <= 1 for r in records)
    # each evaluation's per-problem records go to eval/step-N.json, not to the metric sinks
    assert not any(k.startswith("eval/per_problem") for r in records for k in r)
    for r in records:
        saved = json.loads((tmp_path / "eval" / f"step-{r['step']}.json").read_text())
        assert saved["step"] == r["step"] and saved["correct"] == r["eval/correct"]
        assert [p["index"] for p in saved["per_problem"]] == [0, 1]
        assert sum(p["correct"] for p in saved["per_problem"]) == r["eval/correct"]
    assert sorted(os.listdir(tmp_path / "eval")) == ["step-2.json", "step-3.json"]
