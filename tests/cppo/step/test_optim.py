"""The optimizer side of a run: AdamW over the trainable parameters, the schedule after a warm-up of the Hugging Face
count, a resume's settings applied to the restored state, one step skipped when the gradient is not finite, and the
run stopped after too many skipped steps in a row."""

import math

import pytest
import torch

from cppo.step.optim import (
    NonFiniteUpdates,
    SkipCounter,
    apply_settings,
    make_optimizer,
    make_scheduler,
    optimizer_step,
)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)  # a frozen part (a LoRA base): not in the optimizer
    return model


def test_adamw_holds_the_trainable_parameters_alone():
    model = tiny_model()
    opt = make_optimizer(model, lr=0.01, weight_decay=0.1)
    (group,) = opt.param_groups
    assert isinstance(opt, torch.optim.AdamW) and (group["lr"], group["weight_decay"]) == (0.01, 0.1)
    assert [p.shape for p in group["params"]] == [torch.Size([2, 4]), torch.Size([2])]
    assert (group["betas"], group["eps"]) == ((0.9, 0.999), 1e-8)  # torch's defaults, as adamw_torch


@pytest.mark.parametrize(
    ("schedule", "at_half", "at_end"), [("cosine", 0.5, 0.0), ("linear", 0.5, 0.0), ("constant", 1.0, 1.0)]
)
def test_schedules_after_the_warm_up(schedule, at_half, at_end):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, schedule=schedule, warmup_ratio=0.2, total=10)  # ceil(10 * 0.2) = 2 warm-up steps
    lrs = []
    for _ in range(11):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:3] == [0.0, 0.5, 1.0]  # linear warm-up to the peak
    assert lrs[6] == pytest.approx(at_half) and lrs[10] == pytest.approx(at_end)


def test_a_resume_applies_this_runs_lr_and_weight_decay():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0, weight_decay=0.0)
    sched = make_scheduler(opt, schedule="linear", warmup_ratio=0.0, total=4)
    for _ in range(2):
        opt.step()
        sched.step()
    apply_settings(opt, sched, lr=0.1, weight_decay=0.05)
    (group,) = opt.param_groups
    assert group["lr"] == pytest.approx(0.1 * 0.5) and group["weight_decay"] == 0.05 and group["initial_lr"] == 0.1
    assert sched.get_last_lr() == [group["lr"]]
    opt.step()
    sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.1 * 0.25)  # the schedule goes on from the new peak


def test_one_step_clips_steps_schedules_and_zeroes():
    model = tiny_model()
    opt = make_optimizer(model, lr=0.1, weight_decay=0.0)
    sched = make_scheduler(opt, schedule="constant", warmup_ratio=0.0, total=4)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(5, 3)).pow(2).sum().backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
    got, applied = optimizer_step(model, opt, sched, max_grad_norm=1e-3)
    assert applied and got == pytest.approx(norm, rel=1e-6)  # the norm before clipping
    assert torch.equal(model[0].weight, before[0]) and not torch.equal(model[1].weight, before[2])
    assert all(p.grad is None for p in model.parameters()) and sched.last_epoch == 1


def test_a_step_whose_gradient_is_not_finite_changes_nothing():
    model = tiny_model()
    opt = make_optimizer(model, lr=0.1, weight_decay=0.0)
    sched = make_scheduler(opt, schedule="constant", warmup_ratio=0.0, total=4)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(5, 3)).sum().backward()
    model[1].bias.grad[0] = float("nan")
    norm, applied = optimizer_step(model, opt, sched, max_grad_norm=1.0)
    assert not applied and math.isnan(norm)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)) and opt.state == {}
    assert sched.last_epoch == 0 and all(p.grad is None for p in model.parameters())


def test_skipped_updates_in_a_row_stop_the_run_naming_the_setting():
    counter = SkipCounter(3)
    for applied in (False, False, True, False, False):  # an applied update resets the count
        counter.record(applied, grad_norm=float("inf"), step=1)
    with pytest.raises(NonFiniteUpdates, match=r"step 6: 3 optimizer updates in a row .*max_skipped_updates=3"):
        counter.record(False, grad_norm=float("nan"), step=6)
