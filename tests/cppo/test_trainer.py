"""The training step: P = 0 equals plain GRPO on padded batches, pruning shrinks every pass, resume is exact."""

import copy

import pytest
import torch
from tiny_run import tiny_config

from cppo.step.models import decoder, lm_head
from cppo.tasks.rewards import digits_reward
from cppo.trainer import Trainer
from cppo_kernels import LossConfig, reference


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")


def record_rollouts(trainer):
    """Wraps the rollout so the test sees what the step generated."""
    seen = []
    generate = trainer.rollout.generate

    def wrapped(*args, **kwargs):
        out = generate(*args, **kwargs)
        seen.append(out)
        return out

    trainer.rollout.generate = wrapped
    return seen


def padded(rollout, index):
    """Right-padded [B, L] ids of prompt + completion, and a mask of the positions that predict completion tokens."""
    seqs = [rollout.prompt_ids[i] + rollout.completion_ids[i] for i in index]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    for row, (i, s) in enumerate(zip(index, seqs)):
        ids[row, : len(s)] = torch.tensor(s)
        attn[row, : len(s)] = 1
        p = len(rollout.prompt_ids[i])
        mask[row, p - 1 : len(s) - 1] = True
    return ids, attn, mask


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_p0_step_equals_grpo_on_padded_batches(tmp_path, loss_agg):
    cfg = tiny_config(tmp_path, pruning_rate=0.0, loss_agg=loss_agg, micro_batch_tokens=64)
    trainer = Trainer(cfg)
    baseline = copy.deepcopy(trainer.model)
    # SGD makes the update a linear function of the gradient (Adam would amplify rounding of near-zero grads)
    lr = 0.5
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=lr)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)
    seen = record_rollouts(trainer)
    metrics = trainer.train_step()
    assert metrics["micro_batches"] > 1  # the check covers loss weighting across micro-batches

    rollout = seen[0]
    rewards = torch.tensor(digits_reward([], rollout.texts))
    assert rewards.std() > 0
    adv = reference.group_advantages(rewards, cfg.group_size)
    ids, attn, mask = padded(rollout, list(range(len(rewards))))
    targets = ids[:, 1:]
    loss_cfg = LossConfig(
        beta=cfg.beta, loss_agg=loss_agg, max_completion_length=cfg.max_completion_length, compute_entropy=True
    )
    opt = torch.optim.SGD(baseline.parameters(), lr=lr)

    def logprobs(model):
        hidden = decoder(model)(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state[:, :-1]
        return reference.token_logprobs(hidden, lm_head(model)[0], targets)[0], hidden

    with torch.no_grad():
        old = logprobs(baseline)[0]
    ref = old.clone()  # the reference model is the initial model
    want_metrics = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0}  # means over the mu updates
    for _ in range(cfg.mu):
        _, hidden = logprobs(baseline)
        loss, stats = reference.fused_cppo_loss(
            hidden,
            lm_head(baseline)[0],
            targets,
            adv,
            mask=mask,
            old_logprobs=old,
            ref_logprobs=ref,
            config=loss_cfg,
        )
        clip = stats["clip_fraction_low"] + stats["clip_fraction_high"]
        for key, value in (
            ("loss", loss.detach()),
            ("kl", stats["kl"]),
            ("clip_fraction", clip),
            ("entropy", stats["entropy"]),
        ):
            want_metrics[key] += float(value) / cfg.mu
        loss.backward()
        torch.nn.utils.clip_grad_norm_(baseline.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad()

    moved = 0.0
    for (name, got), want, init in zip(
        trainer.model.named_parameters(), baseline.parameters(), trainer.ref_model.parameters()
    ):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=name)
        moved = max(moved, float((want - init).detach().abs().max()))
    assert moved > 1e-3  # the update is not trivially zero
    for key, want in want_metrics.items():  # the reported metrics are those of the whole batch
        assert metrics[key] == pytest.approx(want, rel=1e-4, abs=1e-6), key
    assert want_metrics["kl"] > 0 and want_metrics["entropy"] > 0  # the second update moved away from the reference


def count_forward_tokens(trainer):
    """Counts the tokens each decoder runs on outside generation."""
    counts = {"tokens": 0, "calls": 0, "generating": False}

    def hook(module, args, kwargs):
        if not counts["generating"]:
            counts["tokens"] += kwargs["input_ids"].numel()
            counts["calls"] += 1

    for model in (m for m in (trainer.model, trainer.ref_model) if m is not None):
        decoder(model).register_forward_pre_hook(hook, with_kwargs=True)
    generate = trainer.rollout.generate

    def wrapped(*args, **kwargs):
        counts["generating"] = True
        try:
            return generate(*args, **kwargs)
        finally:
            counts["generating"] = False

    trainer.rollout.generate = wrapped
    return counts


def test_pruned_completions_never_reach_the_model(tmp_path):
    # each completion with its own prompt; the prompt-shared count: tests/cppo/step/test_prefix_sharing.py
    cfg = tiny_config(tmp_path, pruning_rate=0.5, allocation=True, questions_per_step=2, prefix_sharing=False)
    trainer = Trainer(cfg)
    assert cfg.pruning.questions_drawn == 4 and cfg.pruning.keep == 2
    seen = record_rollouts(trainer)
    counts = count_forward_tokens(trainer)
    metrics = trainer.train_step()

    rollout = seen[0]
    assert len(rollout.completion_ids) == 4 * 4
    rewards = torch.tensor(digits_reward([], rollout.texts))
    _, kept = reference.cppo_select(rewards, cfg.group_size, cfg.pruning.keep, scope="batch")  # 8 of 16, pooled
    assert metrics["completions_kept"] == len(kept) == cfg.pruning.kept_per_step == 8
    per_pass = sum(len(rollout.prompt_ids[i]) + len(rollout.completion_ids[i]) - 1 for i in kept.tolist())
    everything = sum(len(p) + len(c) - 1 for p, c in zip(rollout.prompt_ids, rollout.completion_ids))
    passes = 1 + 1 + cfg.mu  # old, reference, mu policy passes
    assert counts["tokens"] == per_pass * passes == metrics["tokens_forward"]
    assert per_pass < everything
    assert metrics["tokens_trained"] == sum(len(rollout.completion_ids[i]) for i in kept.tolist()) * cfg.mu


def comparable(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    cfg = tiny_config(tmp_path, pruning_rate=0.5, num_steps=4, lr=3e-3, warmup_ratio=0.25)
    straight = Trainer(cfg)
    history = [straight.train_step() for _ in range(2)]
    ckpt = straight.save_checkpoint(str(tmp_path / "checkpoint-000002"))
    history += [straight.train_step() for _ in range(2)]

    resumed = Trainer(cfg)
    torch.manual_seed(1234)  # the checkpoint must restore everything that matters, whatever the RNG state now
    resumed.load_checkpoint(ckpt)
    assert resumed.step == 2
    tail = [resumed.train_step() for _ in range(2)]
    assert [comparable(m) for m in tail] == [comparable(m) for m in history[2:]]
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()
    assert history[0]["loss"] != 0 or history[1]["loss"] != 0


def test_mu1_skips_the_old_policy_pass_and_beta0_has_no_reference(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, mu=1, beta=0.0, pruning_rate=0.5))
    assert trainer.ref_model is None
    counts = count_forward_tokens(trainer)
    metrics = trainer.train_step()
    assert counts["calls"] == metrics["micro_batches"]  # only the policy pass
    assert metrics["kl"] == 0.0


def test_train_writes_metrics_plot_and_checkpoint(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, num_steps=2, save_every=1, pruning_rate=0.5))
    history = trainer.train()
    assert [m["step"] for m in history] == [1, 2]
    assert (tmp_path / "metrics.png").stat().st_size > 0
    assert (tmp_path / "checkpoint-000001" / "trainer_state.pt").is_file()
    assert (tmp_path / "checkpoint-000002" / "model").is_dir()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    for key in ("reward_mean", "accuracy", "kept_fraction", "tokens_trained", "kl", "clip_fraction", "entropy"):
        assert key in history[0]
    for phase in ("generate", "reward", "select", "logprobs", "update", "optimizer", "step"):
        assert history[0][f"time/{phase}"] >= 0
    result = trainer.evaluate(limit=3)
    assert result["total"] == 3 and 0 <= result["accuracy"] <= 1


def test_kernel_backend_is_scoped_to_the_step(tmp_path, monkeypatch):
    """kernel_backend applies inside the step without touching the process environment."""
    import cppo.step.selection as selection_module

    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "auto")
    seen = []
    real = selection_module.cppo_select

    def spy(*args, **kwargs):
        from cppo_kernels._dispatch import requested_backend

        seen.append(requested_backend())
        return real(*args, **kwargs)

    monkeypatch.setattr(selection_module, "cppo_select", spy)
    trainer = Trainer(tiny_config(tmp_path, kernel_backend="torch", num_steps=1, mu=1, beta=0.0))
    trainer.train_step()
    assert seen == ["torch"]
    import os

    assert os.environ["CPPO_KERNELS_BACKEND"] == "auto"
