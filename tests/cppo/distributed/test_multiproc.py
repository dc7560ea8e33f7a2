"""2-process tests of cppo.distributed, cppo.parallel and cppo.run.checkpoint on CPU (gloo), launched once through
torchrun.

This file is both the pytest module and the worker: the test runs ``python -m torch.distributed.run --standalone
--nproc-per-node 2 <this file> OUT`` once, each rank runs every check in :data:`CHECKS` and writes
``OUT/rank<r>.json`` (check name -> "ok" or the error), and the test asserts every check on both ranks.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch
from torch import nn
from torchrun_harness import RankRecorder, assert_ranks_ok, torchrun

from cppo import distributed as D
from cppo.run import checkpoint as C
from cppo.step import balance as B
from cppo.step.selection import Pruning
from cppo_kernels import LossConfig, reference

WORLD = 2
CHECKS: dict = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# --------------------------------------------------------------------------------------------
# Worker side: each check runs on both ranks and raises AssertionError on a wrong result
# --------------------------------------------------------------------------------------------


def _global_advantages() -> tuple[torch.Tensor, list[int]]:
    """5 groups of 4 (3 on rank 0, 2 on rank 1) with ties inside a rank and across ranks."""
    adv = torch.tensor(
        [0.5, -0.5, 1.0, -1.0]
        + [0.0, 0.0, 2.0, 0.5]
        + [0.5, -0.5, 0.1, 0.0]
        + [1.0, -1.0, 0.5, 0.5]
        + [-2.0, 0.1, 0.1, 0.5]
    )  # [20]
    return adv, [12, 8]


def _mine(x: torch.Tensor, sizes: list[int], info: D.DistInfo) -> torch.Tensor:
    start = sum(sizes[: info.rank])
    return x[start : start + sizes[info.rank]]


#: Pruning rates whose official counts over the 20 completions of both ranks are 20, 17, 13, 10, 7, 3, 1 (17, 13, 7,
#: 3, 1: no multiple of the 5 groups).
GLOBAL_RATES = (0.0, 0.15, 0.35, 0.5, 0.65, 0.85, 0.95)


@check
def global_selection_equals_single_process_batch(info):
    adv, sizes = _global_advantages()
    local = _mine(adv, sizes, info)
    start = sum(sizes[: info.rank])
    errors = []  # collected, not raised, so that both ranks run the same collectives whatever fails
    for rate in GLOBAL_RATES:
        for metric in ("smallest", "largest", "random"):
            pruning = Pruning(group_size=4, pruning_rate=rate, scope="global", metric=metric)
            got = pruning.prune(local, seed=11, info=info)  # the random draws seeded alike on both ranks
            gathered, _ = D.all_gather_varlen(got + start, info=info)
            ref_gen = torch.Generator().manual_seed(11)
            num_kept = 20 - int(20 * rate)
            want = reference.select_completions(
                adv, 4, num_kept=num_kept, scope="batch", metric=metric, generator=ref_gen
            )
            want_mine = want[(want >= start) & (want < start + sizes[info.rank])] - start
            if not torch.equal(got, want_mine):
                errors.append((rate, metric, got.tolist(), want_mine.tolist()))
            if not torch.equal(gathered, want):  # survivors over the ranks = the 1-process choice
                errors.append((rate, metric, gathered.tolist(), want.tolist()))
    assert not errors, errors
    # local scopes need no communication: they equal cppo_kernels on the local batch
    for scope, count in (("group", {"keep": 2}), ("batch", {"num_kept": len(local) // 2})):
        got = Pruning(group_size=4, pruning_rate=0.5, scope=scope).prune(local, info=info)
        assert torch.equal(got, reference.select_completions(local, 4, scope=scope, **count)), scope


@check
def global_selection_bad_size_raises_on_every_rank(info):
    local = torch.zeros(8 if info.rank == 0 else 6)  # rank 1 is not a whole number of groups of 4
    try:
        Pruning(group_size=4, pruning_rate=0.5, scope="global").prune(local, info=info)
    except ValueError as e:
        assert "rank 1" in str(e) and "group_size=4" in str(e), str(e)
    else:
        raise AssertionError("no ValueError")


@check
def all_gather_varlen_with_an_empty_rank(info):
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2) if info.rank == 0 else torch.empty(0, 2)
    gathered, sizes = D.all_gather_varlen(x, info=info)
    assert sizes == [3, 0] and torch.equal(gathered, torch.arange(6, dtype=torch.float32).reshape(3, 2))


def _local_sequences(info) -> D.SequenceShard:
    """Rank 0 holds 5 sequences, rank 1 holds 2 long ones; ids are global, tokens encode (id, position)."""
    lengths = [3, 9, 1, 4, 4] if info.rank == 0 else [12, 2]
    ids = list(range(5)) if info.rank == 0 else [5, 6]
    tokens = torch.cat([100 * i + torch.arange(n) for i, n in zip(ids, lengths)])  # [T]
    return D.SequenceShard(
        lengths=torch.tensor(lengths),
        token_fields={"tokens": tokens, "logp": -tokens.double() / 1000},
        seq_fields={"id": torch.tensor(ids), "adv": torch.tensor(ids, dtype=torch.float32) - 2.5},
    )


@check
def balancing_is_a_balanced_partition(info):
    out = B.balance_sequences(_local_sequences(info), info=info)
    ids, _ = D.all_gather_varlen(out.seq_fields["id"], info=info)
    all_loads, _ = D.all_gather_varlen(out.lengths.sum().reshape(1), info=info)
    all_lengths = [3, 9, 1, 4, 4, 12, 2]
    assert sorted(ids.tolist()) == list(range(7))  # every sequence on exactly one rank
    assert all_loads.max() - all_loads.min() <= max(all_lengths), all_loads.tolist()
    assert all_loads.tolist() in ([17, 18], [18, 17]), all_loads.tolist()  # before: 21 and 14
    owner = B.lpt_assign(all_lengths, WORLD)
    mine = [i for i, r in enumerate(owner) if r == info.rank]
    assert out.seq_fields["id"].tolist() == mine  # exactly the LPT plan, in global order
    # the fields travel with their sequence
    expect_tokens = torch.cat([100 * i + torch.arange(all_lengths[i]) for i in mine])
    assert torch.equal(out.token_fields["tokens"], expect_tokens)
    assert torch.equal(out.token_fields["logp"], -expect_tokens.double() / 1000)
    assert torch.equal(out.seq_fields["adv"], torch.tensor(mine, dtype=torch.float32) - 2.5)
    assert out.lengths.tolist() == [all_lengths[i] for i in mine]


@check
def counts_and_reductions(info):
    r = info.rank
    counts = D.global_counts(num_tokens=10 + r, num_seqs=2 + 3 * r, info=info)
    largest = D.max_across_ranks(4 - 3 * r, info=info)
    local = {
        "tokens": [30.0, 10.0][r],
        "kl": [0.1, 0.5][r],  # a token-mean on each rank
        "completions": [4, 4][r],
        "reward_mean": [1.0, 2.0][r],
        "time/step": [1.5, 2.5][r],
        "ratio_min": [0.9, 0.8][r],
        "zero_w": [0.0, 0.0][r],
        "x": [3.0, 5.0][r],
    }
    specs = {
        "tokens": "sum",
        "kl": "mean:tokens",
        "completions": "sum",
        "reward_mean": "mean:completions",
        "time/step": "max",
        "ratio_min": "min",
        "x": "mean:zero_w",  # weights sum to 0: plain mean
    }
    out = D.reduce_metrics(local, info=info, reductions=specs)
    all_max = D.reduce_metrics(local, info=info, reductions=lambda name: "max")
    assert counts == D.GlobalCounts(tokens=21, seqs=7) and largest == 4, (counts, largest)
    want = {
        "tokens": 40.0,
        "kl": (0.1 * 30 + 0.5 * 10) / 40,
        "completions": 8.0,
        "reward_mean": 1.5,
        "time/step": 2.5,
        "ratio_min": 0.8,
        "zero_w": 0.0,
        "x": 4.0,
    }
    assert out.keys() == want.keys() and all(abs(out[k] - want[k]) < 1e-12 for k in want), out
    assert isinstance(out["completions"], int) and isinstance(out["tokens"], float)  # int sums stay ints
    assert all_max["x"] == 5.0 and all_max["ratio_min"] == 0.9


@check
def reduce_metrics_name_mismatch_raises_on_every_rank(info):
    metrics = {"a": 1.0} if info.rank == 0 else {"a": 1.0, "b": 2.0}
    try:
        D.reduce_metrics(metrics, info=info)
    except ValueError as e:
        assert "'b'" in str(e), str(e)
    else:
        raise AssertionError("no ValueError")


class ToyLM(nn.Module):
    """Embedding, two residual blocks in a ModuleList, a tied LM head: the shape of a causal LM for the tests."""

    def __init__(self, vocab: int = 13, hidden: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(2)])
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # [T, H]
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return h


def _toy_batch():
    """7 sequences (1..6 tokens), token ids, targets, advantages, reference log-probs: the global batch."""
    g = torch.Generator().manual_seed(11)
    lengths = [3, 1, 5, 2, 6, 4, 2]
    t = sum(lengths)
    return {
        "lengths": lengths,
        "ids": torch.randint(0, 13, (t,), generator=g),
        "targets": torch.randint(0, 13, (t,), generator=g),
        "adv": torch.randn(len(lengths), generator=g),
        "ref": -torch.rand(t, generator=g) * 3,
    }


def _micro_loss(model_fn, head_of, batch, seqs: list[int], agg: str) -> tuple[torch.Tensor, int, int]:
    """Loss of the sequences ``seqs`` aggregated with ``agg`` over themselves; (loss, tokens, seqs)."""
    lengths = batch["lengths"]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    rows = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in seqs])  # [T_m]
    cu = torch.tensor([0] + [sum(lengths[i] for i in seqs[: k + 1]) for k in range(len(seqs))])  # [S_m + 1]
    hidden = model_fn(batch["ids"][rows])  # [T_m, H]
    weight = head_of()  # read after the forward (FSDP2 unshards the root during it)
    cfg = LossConfig(beta=0.04, loss_agg=agg, max_completion_length=8)
    loss, _ = reference.fused_cppo_loss(
        hidden, weight, batch["targets"][rows], batch["adv"][seqs], cu_seqlens=cu, ref_logprobs=batch["ref"][rows],
        config=cfg,
    )  # fmt: skip
    return loss, rows.numel(), len(seqs)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _distributed_grads(info, parallelism: str, agg: str) -> tuple[dict, dict]:
    batch = _toy_batch()
    torch.manual_seed(0)
    single = ToyLM()
    state = {k: v.clone() for k, v in single.state_dict().items()}
    loss, _, _ = _micro_loss(single.hidden_states, lambda: single.head.weight, batch, list(range(7)), agg)
    loss.backward()
    want = _grads(single)

    model = ToyLM()
    model.load_state_dict(state)
    wrapped = D.wrap_model(model, parallelism=parallelism, info=info, forward=lambda m, ids: m.hidden_states(ids))
    inner = D.unwrap_model(wrapped)
    assert inner is model
    # rank 0 holds sequences 0..3 in two micro-batches, rank 1 holds 4..6 in one: both run max_across_ranks passes,
    # the short rank a dummy pass with weight 0, and only the last pass synchronises gradients
    micro = [[0, 1], [2, 3]] if info.rank == 0 else [[4, 5, 6]]
    local_tokens = sum(batch["lengths"][i] for m in micro for i in m)
    counts = D.global_counts(num_tokens=local_tokens, num_seqs=sum(map(len, micro)), info=info)
    passes = D.max_across_ranks(len(micro), info=info)
    scale = D.grad_scale(parallelism=parallelism, info=info)
    for k in range(passes):
        seqs = micro[k] if k < len(micro) else micro[0]
        with D.gradient_sync(wrapped, k == passes - 1):
            loss, t, s = _micro_loss(wrapped, lambda: inner.head.weight, batch, seqs, agg)
            share = (t / counts.tokens if agg == "token-mean" else s / counts.seqs) if k < len(micro) else 0.0
            (loss * share * scale).backward()
    assert counts == D.GlobalCounts(tokens=23, seqs=7), counts
    return _grads(model), want


def _assert_grads_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-6), (name, (got[name] - want[name]).abs().max())


@check
def ddp_gradient_equals_single_process(info):
    aggs = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
    runs = [_distributed_grads(info, "ddp", agg) for agg in aggs]
    for got, want in runs:
        _assert_grads_close(got, want)


@check
def fsdp2_gradient_equals_single_process(info):
    runs = [_distributed_grads(info, "fsdp2", agg) for agg in ("token-mean", "seq-mean-token-mean")]
    for got, want in runs:
        _assert_grads_close(got, want)


@check
def fsdp2_root_unsharded_for_code_outside_forward(info):
    torch.manual_seed(0)
    model = ToyLM()
    want = ToyLM()
    want.load_state_dict(model.state_dict())
    wrapped = D.wrap_model(model, parallelism="fsdp2", info=info, forward=lambda m, ids: m.hidden_states(ids))
    ids = torch.tensor([1, 4, 2])
    with D.root_unsharded(wrapped):
        whole = type(model.embed.weight).__name__
        h = model.hidden_states(ids)  # what generate does: the model's own code, the blocks gathering themselves
    after = type(model.embed.weight).__name__
    again = wrapped(ids)  # the wrapper is still the FSDP root after a block ran outside it
    assert (whole, after) == ("Parameter", "DTensor"), (whole, after)
    assert torch.allclose(h, want.hidden_states(ids)) and torch.allclose(again, h)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in full.items()}


def _tiny_lm():
    """A tiny causal LM (transformers, seeded) and its tokenizer: what the trainer checkpoints."""
    from tiny_model import TINY

    from cppo.step.models import load_model_and_tokenizer

    return load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=0)


def _hidden(model, ids: torch.Tensor) -> torch.Tensor:
    from cppo.step.models import packed_hidden

    return packed_hidden(model, ids[None], torch.arange(ids.numel())[None])  # [L, H]


def _checkpoint_round_trip(info, parallelism: str, root: pathlib.Path) -> None:
    model, tok = _tiny_lm()
    wrapped = D.wrap_model(model, parallelism=parallelism, info=info, forward=_hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ids = torch.arange(5) + info.rank

    def step():
        (wrapped(ids).pow(2).mean()).backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    step()
    path = str(root / parallelism)
    torch.manual_seed(100)
    rng = torch.get_rng_state()
    C.save(path, module=wrapped, tokenizer=tok, optimizer=opt, scheduler=sched, state={"step": 1}, info=info)
    saved = _full_params(model)
    step()
    assert any(not torch.equal(saved[n], p) for n, p in _full_params(model).items())
    torch.manual_seed(7)
    state = C.load(path, module=wrapped, optimizer=opt, scheduler=sched, info=info)
    assert state["step"] == 1 and state["world_size"] == 2
    assert sorted(os.listdir(path)) == ["dcp" if parallelism == "fsdp2" else "model", "trainer_state.pt"]
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(saved[n], p) for n, p in _full_params(model).items())
    assert sched.last_epoch == 1
    # the restored optimizer continues exactly as an uninterrupted one: one more step from both must agree
    step()
    after_resume = _full_params(model)
    twin, _ = _tiny_lm()
    twin_wrapped = D.wrap_model(twin, parallelism=parallelism, info=info, forward=_hidden)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.05)
    twin_sched = torch.optim.lr_scheduler.StepLR(twin_opt, step_size=1, gamma=0.5)
    for _ in range(2):
        (twin_wrapped(ids).pow(2).mean()).backward()
        twin_opt.step()
        twin_sched.step()
        twin_opt.zero_grad()
    assert all(torch.allclose(after_resume[n], p, rtol=0, atol=1e-7) for n, p in _full_params(twin).items())


@check
def ddp_checkpoint_round_trip(info, root):
    _checkpoint_round_trip(info, "ddp", root)


@check
def fsdp2_checkpoint_round_trip(info, root):
    _checkpoint_round_trip(info, "fsdp2", root)


@check
def fsdp2_prefill_once_generates_the_plain_tokens(info):
    """The hf engine on an FSDP2-sharded policy (``synced_gpus``, the blocks gathering in every forward), each
    prompt prefilled once: the tokens and random draws of G prefills of it, with the ranks holding different numbers
    of questions of different lengths (so different prefill and decode batches)."""
    from cppo.engines import EngineSettings, HFEngine

    model, tok = _tiny_lm()
    wrapped = D.wrap_model(model, parallelism="fsdp2", info=info, forward=_hidden)
    prompts = [["1+1", "What is 12 + 7?"], ["3", "Hi there, friend", "3", "x"]][info.rank]
    runs = []
    for prefill_once in (True, False):
        settings = EngineSettings(
            model_name="x", max_prompt_length=32, max_completion_length=6, sharded=True, prefill_once=prefill_once
        )
        torch.manual_seed(5 + info.rank)
        with D.root_unsharded(wrapped):
            rollout = HFEngine(model, tok, settings).generate(prompts, 3)
        runs.append((rollout.completion_ids, torch.get_rng_state()))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])
    assert len(runs[0][0]) == 3 * len(prompts)


def _scripted_draws(scripts: list[list[float]], sizes: list[int], info):
    """Dynamic sampling's draw on this rank: hands out this rank's groups of ``scripts`` (then zero-variance ones),
    ``n / world`` at a time, recording each ``n``."""
    script = list(scripts)

    def draw(n: int) -> torch.Tensor:
        sizes.append(n)
        groups = [script.pop(0) if script else [0.0] * 4 for _ in range(n // info.world_size)]
        return torch.tensor(groups).reshape(-1)

    return draw


MIXED, HALF, ZERO = [0.0, 1.0, 0.0, 2.0], [0.0, 0.5, 0.5, 1.0], [0.0] * 4


@check
def dynamic_sampling_counts_are_exact_on_every_rank(info):
    """filter_groups on two ranks: every rank makes the same generation calls; ``batch`` and ``group`` keep each
    rank's budget, ``global`` the step's over both ranks (as one process keeps of the two pools concatenated); the
    kept rows are of non-zero advantage unless the bound was reached."""
    from cppo.step import fill_step

    # rank 0: 2 useful completions (HALF) of 4; rank 1: 8 (two MIXED); P = 0.75, 8 questions: budget 4 per rank
    scripts = [[ZERO, HALF, ZERO, ZERO, MIXED, MIXED], [MIXED, ZERO, MIXED, ZERO]][info.rank]
    errors = []
    # (scope, calls, the draws' sizes, kept per rank or None, kept over both ranks)
    for scope, calls, want_sizes, per_rank, kept_total in (
        ("batch", 2, [8, 4], 4, 8),  # rank 0 misses 2; 10 useful of 8 questions: 1.25 each -> 4 more questions
        ("global", 1, [8], None, 8),  # 10 useful over both ranks >= 8: one call
        ("group", 3, [8, 8, 8], 4, 8),  # rank 1 never holds 4 useful groups: the bound; 4 groups x 1 kept per rank
    ):
        sizes: list[int] = []
        pruning = Pruning(group_size=4, pruning_rate=0.75, questions_per_step=2, scope=scope)
        filled = fill_step(pruning, _scripted_draws(scripts, sizes, info), max_calls=3, info=info)
        kept = len(filled.rows(4))
        ranks, _ = D.all_gather_varlen(torch.tensor([[filled.calls, kept]]), info=info)  # [2, 2]
        got = (ranks[:, 0].tolist(), sizes, int(ranks[:, 1].sum()))
        if got != ([calls, calls], want_sizes, kept_total) or per_rank not in (None, kept):
            errors.append((scope, got, kept))
        if scope != "group" and not filled.bound_reached and filled.metrics()["kept_zero_advantage"]:
            errors.append((scope, "kept rows with A = 0", filled.metrics()))
        if scope == "global":  # one process over the two pools concatenated, the step's budget as its count
            adv = pruning.advantages(filled.rewards.reshape(-1, 4)[filled.pool].reshape(-1))
            pooled, sizes_r = D.all_gather_varlen(adv, info=info)
            want = reference.select_completions(pooled, 4, num_kept=8, scope="batch")
            start = sum(sizes_r[: info.rank])
            mine = want[(want >= start) & (want < start + sizes_r[info.rank])] - start
            if not torch.equal(filled.selection.kept, mine):
                errors.append(("global selection", filled.selection.kept.tolist(), mine.tolist()))
    # the bound: nothing useful anywhere, 3 calls on both ranks, each rank's budget kept
    sizes = []
    pruning = Pruning(group_size=4, pruning_rate=0.75, questions_per_step=2)
    filled = fill_step(pruning, _scripted_draws([], sizes, info), max_calls=3, info=info)
    if (filled.calls, filled.bound_reached, len(filled.rows(4)), sizes) != (3, True, 4, [8, 8, 8]):
        errors.append(("bound", filled.calls, filled.bound_reached, sizes))
    assert not errors, errors


def worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    info = D.init_distributed(device="cpu", timeout_s=30)
    assert info.world_size == WORLD
    recorder = RankRecorder(out_dir, info.rank)
    root = pathlib.Path(out_dir) / "ckpt"
    for name, fn in CHECKS.items():
        recorder.record(name, lambda fn=fn: fn(info, root) if "root" in fn.__code__.co_varnames else fn(info))
        D.barrier(info)
    D.close_distributed()


@check
def evaluate_split_gathers_per_problem_records_in_problem_order(info):
    """5 problems over 2 ranks (3 + 2): every rank gets the counts and every problem's record, in order; a problem
    is answered right when its number is odd (rank 1 holds 3 and 4), its completion is as long as the number + 1."""
    from cppo.engines import Rollout
    from cppo.evaluate import evaluate_split
    from cppo.step import tiny_tokenizer
    from cppo.tasks import question_id

    class Echo:
        def __call__(self, prompts, n, *, greedy=False):
            nums = [next(i for i in range(5) if f"What is {i} + 0?" in p) for p in prompts]
            texts = [str(i) if i % 2 else "wrong" for i in nums]
            return Rollout([[1]] * len(nums), [[1] * (i + 1) for i in nums], texts)

    problems = [{"question": f"What is {i} + 0?", "answer": str(i), "kind": "arith"} for i in range(5)]
    result = evaluate_split(Echo(), tiny_tokenizer(300), problems, info=info)
    assert (result["correct"], result["total"], result["problems"]) == (2, 5, 5), result
    recs = result["per_problem"]
    assert [r["index"] for r in recs] == list(range(5))
    assert [r["id"] for r in recs] == [question_id(p) for p in problems]
    assert [r["correct"] for r in recs] == [i % 2 == 1 for i in range(5)]
    assert [r["completion_tokens"] for r in recs] == [i + 1 for i in range(5)]


# --------------------------------------------------------------------------------------------
# pytest side
# --------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_two_processes(tmp_path):
    """Every check in CHECKS passes on both ranks (one test, so that pytest-xdist launches torchrun once)."""
    proc = torchrun([__file__, str(tmp_path)], timeout=240, world=WORLD, CPPO_KERNELS_BACKEND="torch")
    assert_ranks_ok(tmp_path, [(name, rank) for name in CHECKS for rank in range(WORLD)], proc)


if __name__ == "__main__":
    worker(sys.argv[1])
