"""Single-process tests of cppo.distributed: the pure parts (splitting, LPT balancing, shards, reductions' specs)
and the single-process defaults every collective falls back to. The 2-process tests are in
test_distributed_multiproc.py."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cppo import distributed as D
from cppo_kernels import reference

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


@given(st.lists(st.integers(0, 50), max_size=30), st.integers(1, 5))
def test_lpt_assign_is_a_balanced_partition(costs, num_bins):
    owner = D.lpt_assign(costs, num_bins)
    assert len(owner) == len(costs) and all(0 <= b < num_bins for b in owner)
    loads = [sum(c for c, b in zip(costs, owner) if b == k) for k in range(num_bins)]
    assert sum(loads) == sum(costs)
    assert max(loads) <= sum(costs) / num_bins + max(costs, default=0)
    assert D.lpt_assign(costs, num_bins) == owner


def test_lpt_assign_example_and_ties():
    # longest first, to the emptiest bin, ties to the lower index and the lower bin
    assert D.lpt_assign([3, 5, 5, 2, 1], 2) == [0, 0, 1, 1, 1]  # 5->0, 5->1, 3->0, 2->1, 1->1
    assert D.lpt_assign([4, 4, 4, 4], 2) == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="num_bins"):
        D.lpt_assign([1], 0)
    with pytest.raises(ValueError, match="costs"):
        D.lpt_assign([1, -1], 2)


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


def test_balance_sequences_rejects_costs_of_the_wrong_shape():
    shard = D.SequenceShard(lengths=torch.tensor([1, 2]), token_fields={"t": torch.tensor([7, 8, 9])})
    with pytest.raises(ValueError, match="costs"):
        D.balance_sequences(shard, info=SINGLE, costs=torch.tensor([1, 2, 3]))


def test_single_process_collectives_are_local():
    x = torch.arange(6.0).reshape(3, 2)
    gathered, sizes = D.all_gather_varlen(x, info=SINGLE)
    assert torch.equal(gathered, x) and sizes == [3]
    shard = D.SequenceShard(lengths=torch.tensor([1, 2]), token_fields={"t": torch.tensor([7, 8, 9])})
    assert D.balance_sequences(shard, info=SINGLE) is shard
    assert D.global_counts(num_tokens=7, num_seqs=2, info=SINGLE) == D.GlobalCounts(tokens=7, seqs=2)
    assert D.max_across_ranks(3, info=SINGLE) == 3
    D.barrier(SINGLE)


@pytest.mark.parametrize("scope", ["group", "batch", "global"])
def test_select_across_ranks_single_process_matches_cppo_kernels(scope):
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.0, 0.0, 2.0, 0.5, 0.5, -0.5, 0.1, 0.0])
    got = D.select_across_ranks(adv, 4, 2, scope=scope, info=SINGLE)
    want = reference.select_completions(adv, 4, 2, scope="batch" if scope == "global" else scope)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="scope"):
        D.select_across_ranks(adv, 4, 2, scope="world", info=SINGLE)


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
    with D.gradient_sync(model, False):
        model(x).sum().backward()
    assert model.weight.grad is not None


def _train_one(model, opt, sched):
    loss = model(torch.ones(2, 3)).pow(2).sum()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_checkpoint_round_trip_single_process(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train_one(model, opt, sched)
    path = tmp_path / "ckpt"
    D.save_checkpoint(path, module=model, optimizer=opt, scheduler=sched, meta={"step": 1}, info=SINGLE)
    D.save_checkpoint(path, module=model, optimizer=opt, scheduler=sched, meta={"step": 1}, info=SINGLE)  # overwrite
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()["state"][0]["exp_avg"].clone()
    _train_one(model, opt, sched)
    meta, rank_state = D.load_checkpoint(path, module=model, optimizer=opt, scheduler=sched, info=SINGLE)
    assert meta["step"] == 1 and meta["world_size"] == 1 and meta["format"] == "full" and rank_state is None
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved_opt)
    assert sched.last_epoch == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directories left


def test_checkpoint_rank_state_needs_same_world_size(tmp_path):
    model = torch.nn.Linear(2, 2)
    rng = torch.Generator().manual_seed(5).get_state()
    D.save_checkpoint(tmp_path / "c", module=model, rank_state={"rng": rng, "step": 3}, info=SINGLE)
    _, state = D.load_checkpoint(tmp_path / "c", module=model, info=SINGLE)
    assert torch.equal(state["rng"], rng) and state["step"] == 3
    with pytest.raises(ValueError, match="world_size=1"):
        D.load_checkpoint(tmp_path / "c", module=model, info=D.DistInfo(rank=0, world_size=2))
    with pytest.raises(ValueError, match="not a checkpoint"):
        D.load_checkpoint(tmp_path, module=model, info=SINGLE)
