"""``cppo train``'s teardown: every DDP module is gone before the process group is destroyed.

A DDP reducer that outlives the group destroys it on deallocation while holding the GIL, joining the Gloo worker
threads; a worker still freeing the tensors of the last all-reduce needs the GIL, so the process never exits (seen
as a resumed two-process ``torchrun -m cppo train`` that saved its last checkpoint and hung). The race itself is
timing-dependent; these tests pin the order that rules it out, on a real one-rank Gloo group and a real DDP module,
for a run that ends normally and for one that fails with the module held in its frames.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel

from cppo import cli, distributed


class _DDPTrainer:
    """Stands in for ``cppo.trainer.Trainer``: holds a DDP module (in a reference cycle, as a real trainer's
    attributes can be) and runs one forward/backward through it (an all-reduce in backward)."""

    modules: list[weakref.ref] = []
    fail = False

    def __init__(self, config, *, info, run):
        self.policy = DistributedDataParallel(torch.nn.Linear(3, 2))
        self.me = self
        self.last_checkpoint = None
        _DDPTrainer.modules.append(weakref.ref(self.policy))

    def train(self):
        policy = self.policy  # a frame local holding the module, as a training step has
        policy(torch.ones(4, 3)).square().sum().backward()
        if _DDPTrainer.fail:
            raise ValueError("num_steps must be positive")
        return []


@pytest.fixture
def one_rank_gloo(tmp_path, monkeypatch):
    """``cppo train`` on a one-rank Gloo group; yields the list of (module alive?) seen when the group was
    destroyed."""
    store = dist.FileStore(str(tmp_path / "store"), 1)

    def init_distributed(device="auto"):
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        return distributed.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

    seen = []
    destroy = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        seen.append([ref() is not None for ref in _DDPTrainer.modules])
        destroy(*args, **kwargs)

    monkeypatch.setattr(distributed, "init_distributed", init_distributed)
    monkeypatch.setattr(dist, "destroy_process_group", destroy_process_group)
    monkeypatch.setattr("cppo.trainer.Trainer", _DDPTrainer)
    monkeypatch.setattr(_DDPTrainer, "modules", [])
    cfg = {"model": "tiny-qwen2", "device": "cpu", "dataset": "arith", "output_dir": str(tmp_path / "run")}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    yield seen, ["train", "--config", str(tmp_path / "cfg.yaml")]
    if dist.is_initialized():  # a failed assertion above must not leave the group to the next test
        destroy()


def test_a_finished_run_releases_its_ddp_module_before_the_group(one_rank_gloo, monkeypatch):
    seen, argv = one_rank_gloo
    monkeypatch.setattr(_DDPTrainer, "fail", False)
    assert cli.main(argv) == 0
    assert seen == [[False]]  # destroyed once, with the module already gone
    assert not dist.is_initialized()


def test_a_failed_run_releases_its_ddp_module_before_the_group(one_rank_gloo, monkeypatch, capsys):
    seen, argv = one_rank_gloo
    monkeypatch.setattr(_DDPTrainer, "fail", True)
    assert cli.main(argv) == 2  # the user's error, in one line
    assert "num_steps must be positive" in capsys.readouterr().err
    assert seen == [[False]]  # the failing frames held the module: released before the group
    assert not dist.is_initialized()
