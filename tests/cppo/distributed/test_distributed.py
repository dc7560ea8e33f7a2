"""Single-process tests of cppo.distributed, cppo.parallel and cppo.run.checkpoint: the pure parts (splitting, LPT
balancing, shards, reductions' specs), the single-process defaults every collective and wrapper falls back to, and
checkpoints. The 2-process tests are in test_distributed_multiproc.py."""

import os
import shutil

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny_model import TINY

from cppo import distributed as D
from cppo.run import checkpoint as C
from cppo.step.models import load_model_and_tokenizer

SINGLE = D.DistInfo()


def test_dist_info_defaults_and_validation():
    assert (SINGLE.rank, SINGLE.world_size, SINGLE.is_main, SINGLE.distributed) == (0, 1, True, False)
    assert D.DistInfo(rank=1, world_size=2).is_main is False
    with pytest.raises(ValueError, match="rank"):
        D.DistInfo(rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        D.DistInfo(world_size=0)


def test_init_distributed_without_torchrun_is_single(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    info = D.init_distributed(device="cpu")
    assert info == D.DistInfo(device=torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert D.init_distributed(device="auto").device == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        D.init_distributed(device="cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert D.init_distributed(device="cuda:1").device == torch.device("cuda", 1)  # a single process may pick a GPU
    with pytest.raises(ValueError, match="device"):
        D.init_distributed(device="tpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="under torchrun"):
        D.init_distributed(device="cuda:1")


def test_init_distributed_rejects_bad_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        D.init_distributed(device="cpu")


@given(st.integers(0, 40), st.integers(1, 9))
def test_question_slice_partitions_in_order(num_questions, world_size):
    infos = [D.DistInfo(rank=r, world_size=world_size) for r in range(world_size)]
    slices = [D.question_slice(num_questions, info=info) for info in infos]
    covered = [q for s in slices for q in range(num_questions)[s]]
    assert covered == list(range(num_questions))
    sizes = [len(range(num_questions)[s]) for s in slices]
    assert max(sizes) - min(sizes) <= 1


def test_question_slice_rejects_bad_count():
    with pytest.raises(ValueError, match="num_questions"):
        D.question_slice(-1, info=SINGLE)


def test_sequence_shard_select_and_validation():
    shard = D.SequenceShard(
        lengths=torch.tensor([2, 0, 3]),
        token_fields={"ids": torch.tensor([1, 2, 3, 4, 5])},
        seq_fields={"adv": torch.tensor([0.5, -1.0, 2.0])},
    )
    sub = shard.select([2, 0, 1])
    assert sub.lengths.tolist() == [3, 2, 0]
    assert sub.token_fields["ids"].tolist() == [3, 4, 5, 1, 2]
    assert sub.seq_fields["adv"].tolist() == [2.0, 0.5, -1.0]
    assert shard.select([]).token_fields["ids"].numel() == 0
    with pytest.raises(ValueError, match="token_fields"):
        D.SequenceShard(lengths=torch.tensor([2]), token_fields={"ids": torch.tensor([1])})
    with pytest.raises(ValueError, match="seq_fields"):
        D.SequenceShard(lengths=torch.tensor([2]), seq_fields={"adv": torch.tensor([1.0, 2.0])})
    with pytest.raises(ValueError, match="lengths"):
        D.SequenceShard(lengths=torch.tensor([1.0]))


@given(st.lists(st.integers(0, 4), max_size=8), st.data())
def test_sequence_shard_select_matches_slicing(lengths, data):
    """Any index (repeats, any order, empty sequences): each picked sequence's rows, one after another."""
    index = data.draw(st.lists(st.integers(0, len(lengths) - 1), max_size=10) if lengths else st.just([]))
    total = sum(lengths)
    shard = D.SequenceShard(
        lengths=torch.tensor(lengths, dtype=torch.long),
        token_fields={"ids": torch.arange(total), "pair": torch.arange(2.0 * total).reshape(total, 2)},
        seq_fields={"n": torch.tensor(lengths, dtype=torch.long)},
    )
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    rows = [r for i in index for r in range(starts[i], starts[i] + lengths[i])]
    sub = shard.select(index)
    assert sub.lengths.tolist() == sub.seq_fields["n"].tolist() == [lengths[i] for i in index]
    assert sub.token_fields["ids"].tolist() == rows
    assert torch.equal(sub.token_fields["pair"], shard.token_fields["pair"][torch.tensor(rows, dtype=torch.long)])


def test_single_process_collectives_are_local():
    x = torch.arange(6.0).reshape(3, 2)
    gathered, sizes = D.all_gather_varlen(x, info=SINGLE)
    assert torch.equal(gathered, x) and sizes == [3]
    assert D.global_counts(num_tokens=7, num_seqs=2, info=SINGLE) == D.GlobalCounts(tokens=7, seqs=2)
    assert D.max_across_ranks(3, info=SINGLE) == 3
    D.barrier(SINGLE)


def test_reduce_metrics_single_process_and_spec_errors():
    metrics = {"a": 1.5, "n": 4.0, "t": 2.0}
    specs = {"a": "mean:n", "n": "sum", "t": "max"}
    assert D.reduce_metrics(metrics, info=SINGLE, reductions=specs) == metrics
    with pytest.raises(ValueError, match="'a'"):
        D.reduce_metrics(metrics, info=SINGLE, reductions={"a": "median"})
    with pytest.raises(ValueError, match="'a'"):
        D.reduce_metrics(metrics, info=SINGLE, reductions={"a": "sum:n"})
    with pytest.raises(ValueError, match="'missing'"):
        D.reduce_metrics(metrics, info=SINGLE, reductions={"a": "mean:missing"})


def test_grad_scale_and_wrap_model_single_process():
    two = D.DistInfo(rank=0, world_size=2)
    assert D.grad_scale(parallelism="ddp", info=two) == 2.0
    assert D.grad_scale(parallelism="fsdp2", info=two) == 2.0
    assert D.grad_scale(parallelism="none", info=SINGLE) == 1.0
    with pytest.raises(ValueError, match="parallelism"):
        D.grad_scale(parallelism="zero3", info=SINGLE)
    model = torch.nn.Linear(3, 2)
    assert D.wrap_model(model, parallelism="ddp", info=SINGLE) is model
    wrapped = D.wrap_model(model, parallelism="none", info=SINGLE, forward=lambda m, x: m(x) * 2)
    x = torch.randn(4, 3)
    assert torch.equal(wrapped(x), model(x) * 2) and D.unwrap_model(wrapped) is model
    with pytest.raises(ValueError, match="parallelism='none'"):
        D.wrap_model(model, parallelism="none", info=two)
    # a frozen model has no gradients to synchronise: DDP leaves it unwrapped, without a process group
    frozen = D.wrap_model(model, parallelism="ddp", info=two, forward=lambda m, x: m(x), frozen=True)
    assert isinstance(frozen, D.ForwardModule) and D.unwrap_model(frozen) is model
    assert not D.is_fsdp2(wrapped)
    with D.gradient_sync(model, False), D.root_unsharded(model):
        model(x).sum().backward()
    assert model.weight.grad is not None


def _tiny_run():
    """A tiny causal LM, its tokenizer, AdamW and a step-decay schedule after one update."""
    model, tok = load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train_one(model, opt, sched)
    return model, tok, opt, sched


def _train_one(model, opt, sched):
    loss = model(input_ids=torch.tensor([[5, 9, 2, 7]]), use_cache=False).logits.pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_checkpoint_round_trip_single_process(tmp_path):
    model, tok, opt, sched = _tiny_run()
    path = str(tmp_path / "checkpoint-000001")
    kwargs = dict(module=model, tokenizer=tok, optimizer=opt, scheduler=sched, info=SINGLE)
    C.save(path, state={"step": 0}, **kwargs)
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    assert C.save(path, state={"step": 1, "sampler": {"epoch": 0}}, **kwargs) == path  # overwrites atomically
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()["state"][0]["exp_avg"].clone()
    _train_one(model, opt, sched)
    torch.manual_seed(4)
    state = C.load(path, module=model, optimizer=opt, scheduler=sched, info=SINGLE)
    assert state["step"] == 1 and state["sampler"] == {"epoch": 0} and state["world_size"] == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_opt)
    assert sched.last_epoch == 1 and torch.equal(torch.get_rng_state(), rng)
    assert sorted(os.listdir(path)) == ["model", "trainer_state.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001"]  # no temporary folders left
    assert C.latest(str(tmp_path)) == path and C.model_folder(path) == os.path.join(path, "model")
    again, _ = load_model_and_tokenizer(C.model_folder(path))  # the folder from_pretrained and `cppo eval` load
    assert all(torch.equal(again.state_dict()[k], v) for k, v in saved.items())


def test_checkpoint_load_rejects_other_formats(tmp_path):
    model, tok, opt, sched = _tiny_run()
    path = str(tmp_path / "c")
    C.save(path, module=model, tokenizer=tok, optimizer=opt, scheduler=sched, state={"step": 1}, info=SINGLE)
    load = dict(module=model, optimizer=opt, scheduler=sched, info=SINGLE)
    with pytest.raises(ValueError, match="trainer_state.pt"):
        C.load(str(tmp_path), **load)
    shutil.copytree(os.path.join(path, "model"), tmp_path / "empty")
    for name in os.listdir(tmp_path / "empty"):
        if name.endswith(".safetensors"):
            os.remove(tmp_path / "empty" / name)
    with pytest.raises(ValueError, match="no .safetensors"):
        C.load_weights(model, str(tmp_path / "empty"))
    # FSDP2 shards (dcp/) written by 2 processes: another world size, or another parallelism, cannot resume them
    os.makedirs(os.path.join(path, "dcp"))
    with pytest.raises(ValueError, match="written by 1 processes.*world_size=1, not 2"):
        C.load(path, **{**load, "info": D.DistInfo(rank=0, world_size=2)})
    with pytest.raises(ValueError, match="parallelism=fsdp2"):
        C.load(path, **load)
    shutil.rmtree(os.path.join(path, "dcp"))
    sharded = torch.nn.Module()  # what cppo.parallel.is_fsdp2 recognises
    sharded.set_requires_gradient_sync = sharded.reshard = lambda *args: None
    with pytest.raises(ValueError, match="holds a full model"):
        C.load(path, **{**load, "module": sharded})
