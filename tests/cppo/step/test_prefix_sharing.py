"""Prefix sharing: a question's kept completions packed after its prompt once (block-causal mask, position ids
continuing from the prompt) give the per-token log-probs, losses and gradients of one prompt per completion, on
Qwen2 and Llama, with sdpa and eager, with gradient checkpointing, in the trainer's whole step and under torchrun.

This file is also the torchrun worker of the last test (``rank<r>.json``: check name -> "ok" or the error).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_model import TINY
from tiny_run import tiny_config
from torchrun_harness import RankRecorder, assert_ranks_ok, torchrun

from cppo.distributed import DistInfo
from cppo.step.balance import balance_samples, split_units
from cppo.step.models import (
    completion_hidden,
    decoder,
    enable_gradient_checkpointing,
    lm_head,
    prefix_attention_mask,
    prefix_sharing_blocker,
    use_prefix_sharing,
)
from cppo.step.packing import Sample, pack_all, pack_shared, prompt_groups, shared_tokens
from cppo.tasks.rewards import digits_reward
from cppo.trainer import Trainer
from cppo_kernels import reference

ARCHS = ("qwen2", "llama")


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    monkeypatch.setenv("CPPO_KERNELS_BACKEND", "torch")


def tiny_model(arch: str, attn: str, *, seed: int = 3):
    """A 2-layer model of ``arch`` built from a config (Qwen2 with tied embeddings, Llama with its own LM head)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch](
        **TINY, num_hidden_layers=2, max_position_embeddings=512, tie_word_embeddings=arch == "qwen2"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def question_samples(seed: int = 0) -> list[Sample]:
    """Three prompts (one of 1 token) with ragged completions, 1-token ones included, interleaved as pruning leaves
    them; no two prompts or completions alike, so that a leak between them would show."""
    g = torch.Generator().manual_seed(seed)

    def draw(n):
        return torch.randint(5, TINY["vocab_size"], (n,), generator=g).tolist()

    prompts = [draw(7), draw(1), draw(12)]
    layout = [(0, 3), (0, 1), (1, 4), (0, 6), (2, 2), (1, 1), (2, 5), (0, 2)]
    return [Sample(prompts[q], draw(c), 0.1 * i - 0.3) for i, (q, c) in enumerate(layout)]


def per_sample_logprobs(model, batches) -> dict[int, torch.Tensor]:
    """Log-probs ``[c]`` (fp64 head) of each sample's completion tokens, by sample index, over micro-batches."""
    weight = lm_head(model)[0].double()
    out = {}
    for b in batches:
        hidden = completion_hidden(model, b.input_ids, b.position_ids, b.predict_index, b.prefix)  # [T, H]
        logp, _ = reference.token_logprobs(hidden.double(), weight, b.targets)  # [T]
        out.update(zip(b.sample_index, torch.split(logp, (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist())))
    return out


def alone_logprobs(model, sample: Sample) -> torch.Tensor:
    """The plain model's log-probs of one sample's completion, prompt and completion in a row of their own."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    hidden = decoder(model)(input_ids=ids, use_cache=False).last_hidden_state[0].double()  # [L, H]
    p = len(sample.prompt_ids)
    logp, _ = reference.token_logprobs(
        hidden[p - 1 : -1], lm_head(model)[0].double(), torch.tensor(sample.completion_ids)
    )
    return logp


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


def test_pack_shared_layout():
    samples = [
        Sample([1, 2, 3], [4, 5], 0.5),
        Sample([6], [7, 8, 9], -1.0),
        Sample([1, 2, 3], [10], 0.25),
        Sample([1, 2, 3], [11, 12, 13], 2.0),
    ]
    (b,) = pack_shared(samples, 100)
    # the prompt [1, 2, 3] once, then each completion's fed tokens (a 1-token completion feeds none), then [6] ...
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 11, 12, 6, 7, 8]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 0, 1, 2]]  # continuing from the prompt, per completion
    # the first token of every completion is predicted from the prompt's last row (2, and 6 for the second prompt)
    assert b.predict_index.tolist() == [2, 3, 2, 2, 4, 5, 6, 7, 8]
    assert b.targets.tolist() == [4, 5, 10, 11, 12, 13, 7, 8, 9]
    assert b.cu_seqlens.tolist() == [0, 2, 3, 6, 9]
    assert b.sample_index == [0, 2, 3, 1]
    assert b.advantages.tolist() == [0.5, 0.25, 2.0, -1.0]
    assert b.prefix.groups == ((0, 3, (1, 0, 2)), (6, 1, (2,)))
    assert (b.num_tokens, b.num_seqs, b.num_input_tokens) == (9, 4, 9)
    allowed = b.prefix.dense_mask()[0, 0]  # [L, L]
    assert allowed[4].tolist() == [True, True, True, False, True, False, False, False, False]  # prompt and itself
    assert allowed[3].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert allowed[8].nonzero().flatten().tolist() == [6, 7, 8]  # never the other question
    group, branch = b.prefix.row_ids()
    q, k = torch.arange(9)[:, None], torch.arange(9)[None, :]
    rule = (
        (group[:, None] == group[None, :]) & (k <= q) & ((branch[None, :] == 0) | (branch[None, :] == branch[:, None]))
    )
    assert torch.equal(allowed, rule)


def test_pack_without_sharing_is_unchanged_and_has_no_prefix():
    samples = question_samples()
    assert all(b.prefix is None for b in pack_all(samples, 1000))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), min_size=1, max_size=14),
    st.lists(st.integers(1, 8), min_size=4, max_size=4),
    st.integers(0, 20),
)
def test_pack_shared_keeps_groups_together_within_budget(layout, prompt_lengths, slack):
    prompts = [[100 + 10 * q + j for j in range(n)] for q, n in enumerate(prompt_lengths)]
    samples = [Sample(prompts[q], [q + 1] * c, 0.0) for q, c in layout]
    budget = max(s.num_input_tokens for s in samples) + slack
    batches = pack_shared(samples, budget)
    assert sorted(i for b in batches for i in b.sample_index) == list(range(len(samples)))
    for b in batches:
        assert b.num_input_tokens <= budget
        assert b.targets.tolist() == [t for i in b.sample_index for t in samples[i].completion_ids]
    holder = {i: k for k, b in enumerate(batches) for i in b.sample_index}
    for group in prompt_groups(samples):
        if shared_tokens(samples, group) <= budget:  # a group that fits stays in one micro-batch, its prompt once
            assert len({holder[i] for i in group}) == 1
    total = sum(b.num_input_tokens for b in batches)
    assert total >= sum(shared_tokens(samples, g) for g in prompt_groups(samples))
    assert total <= sum(s.num_input_tokens for s in samples)


def test_a_group_over_the_budget_is_split_and_resends_its_prompt():
    samples = [Sample([1, 2, 3, 4], [5, 6, 7], 0.0) for _ in range(3)]  # 4 + 3 * 2 = 10 rows shared
    batches = pack_shared(samples, 8)  # 4 + 2 + 2 = 8 fits two completions
    assert [b.sample_index for b in batches] == [[0, 1], [2]]
    assert [b.input_ids[0, :4].tolist() for b in batches] == [[1, 2, 3, 4]] * 2
    with pytest.raises(ValueError, match="micro_batch_tokens=5"):
        pack_shared(samples, 5)


# --------------------------------------------------------------------------------------------
# Log-probs and gradients equal those without sharing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_shared_logprobs_equal_unshared_and_alone(arch, attn):
    model = tiny_model(arch, attn).eval()
    samples = question_samples()
    with torch.no_grad():
        unshared = per_sample_logprobs(model, pack_all(samples, 1000))
        shared = per_sample_logprobs(model, pack_shared(samples, 1000))
        split = per_sample_logprobs(model, pack_shared(samples, 16))  # prompts re-sent in several micro-batches
        for i, s in enumerate(samples):
            alone = alone_logprobs(model, s)
            for got in (shared[i], split[i], unshared[i]):
                torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5, msg=f"sample {i}")
            assert got.shape == (len(s.completion_ids),)
    assert len(pack_shared(samples, 1000)) == 1 and len(pack_shared(samples, 16)) > 1


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_gradients_equal_unshared_with_gradient_checkpointing(arch):
    model = tiny_model(arch, "sdpa").train()
    enable_gradient_checkpointing(model)
    # transformers >= 5.20 names it is_activation_checkpointing, earlier releases is_gradient_checkpointing
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    samples = question_samples(seed=1)
    upstream = {i: torch.randn(len(s.completion_ids), dtype=torch.float64) for i, s in enumerate(samples)}

    def grads(batches):
        model.zero_grad()
        logp = per_sample_logprobs(model, batches)
        sum((logp[i] * upstream[i]).sum() for i in logp).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    want, got = grads(pack_all(samples, 1000)), grads(pack_shared(samples, 20))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
    assert max(g.abs().max() for g in want.values()) > 1e-3  # the check is not about zero gradients


# --------------------------------------------------------------------------------------------
# The trainer's step
# --------------------------------------------------------------------------------------------


def use_sgd(trainer) -> None:
    """Plain SGD: the update is linear in the gradient (Adam would blow up the rounding of gradients that are 0 in
    exact arithmetic, such as the key biases')."""
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.5)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda _: 1.0)


def _step(tmp_path, name: str, **overrides):
    """One step of a fresh trainer (plain SGD); returns its metrics, parameters and the rollout it trained on."""
    trainer = Trainer(tiny_config(tmp_path / name, pruning_rate=0.5, questions_per_step=2, **overrides))
    use_sgd(trainer)
    seen = []
    generate = trainer.rollout.generate
    trainer.rollout.generate = lambda *a, **k: seen.append(generate(*a, **k)) or seen[-1]
    metrics = trainer.train_step()
    return metrics, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, seen[0]


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_trainer_step_equal_with_and_without_sharing(tmp_path, loss_agg):
    shared, shared_params, rollout = _step(tmp_path, "shared", prefix_sharing=True, loss_agg=loss_agg)
    plain, plain_params, plain_rollout = _step(tmp_path, "plain", prefix_sharing=False, loss_agg=loss_agg)
    assert rollout.completion_ids == plain_rollout.completion_ids  # the same batch
    for key in ("loss", "kl", "clip_fraction", "entropy", "grad_norm"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    assert plain["grad_norm"] > 0
    for name, want in plain_params.items():
        torch.testing.assert_close(shared_params[name], want, atol=1e-6, rtol=1e-5, msg=name)
    assert shared["tokens_trained"] == plain["tokens_trained"]
    # tokens_forward counts what ran through the model: each kept question's prompt once per pass
    rewards = torch.tensor(digits_reward([], rollout.texts))
    _, kept = reference.cppo_select(rewards, 4, 2, scope="batch")  # G = 4, 8 of the 16 completions kept
    samples = [Sample(rollout.prompt_ids[i], rollout.completion_ids[i], 0.0) for i in kept.tolist()]
    passes = 1 + 1 + 2  # old, reference, mu = 2 policy passes (micro_batch_tokens=96 fits every question whole)
    assert shared["tokens_forward"] == sum(shared_tokens(samples, g) for g in prompt_groups(samples)) * passes
    assert plain["tokens_forward"] == sum(s.num_input_tokens for s in samples) * passes
    assert shared["tokens_forward"] < plain["tokens_forward"]


def test_select_and_pack_shares_each_kept_question_prompt(tmp_path):
    from cppo.engines import Rollout

    prompts = [[10 + q] * (3 + q) for q in range(4)]
    completions = [[20 + i] * (1 + i % 5) for i in range(16)]
    rollout = Rollout([prompts[i // 4] for i in range(16)], completions, [""] * 16)
    trainer = Trainer(tiny_config(tmp_path, pruning_rate=0.5, questions_per_step=2, prefix_sharing=True))
    batches, num_kept = trainer._select_and_pack(torch.tensor([0.0, 1.0, 2.0, 3.0] * 4), rollout)
    # equal rewards per question: the pooled selection keeps the two extremes (largest |A|) of every question
    kept = [i for q in range(4) for i in (4 * q, 4 * q + 3)]
    assert num_kept == 8 and all(b.prefix is not None for b in batches)
    assert sum(b.num_input_tokens for b in batches) == sum(
        len(prompts[q]) + len(completions[4 * q]) - 1 + len(completions[4 * q + 3]) - 1 for q in range(4)
    )
    assert sorted(t for b in batches for t in b.targets.tolist()) == sorted(t for i in kept for t in completions[i])


# --------------------------------------------------------------------------------------------
# Models that cannot take the mask, balancing helpers
# --------------------------------------------------------------------------------------------


def test_attention_without_a_4d_mask_falls_back_with_a_warning_and_is_refused_in_the_forward():
    model = tiny_model("qwen2", "sdpa")
    assert prefix_sharing_blocker(model) is None and use_prefix_sharing(model, True)
    assert not use_prefix_sharing(model, False)
    model.config._attn_implementation = "flash_attention_2"  # derives its mask from position_ids: cannot share
    with pytest.warns(UserWarning, match="prefix_sharing: .*flash_attention_2"):
        assert not use_prefix_sharing(model, True)
    (b,) = pack_shared(question_samples(), 1000)
    with pytest.raises(ValueError, match="^prefix_sharing: Qwen2ForCausalLM cannot run prompt-shared rows"):
        prefix_attention_mask(model, b.prefix, device=torch.device("cpu"))


def test_sliding_window_models_are_refused():
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**TINY, num_hidden_layers=2, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    assert "sliding" in prefix_sharing_blocker(model)
    with pytest.warns(UserWarning, match="prefix_sharing"):
        assert not use_prefix_sharing(model, True)


def test_split_units_gives_every_rank_one_and_balance_is_a_no_op_alone():
    assert split_units([[0, 1, 2, 3, 4]], 2) == [[0, 1, 2], [3, 4]]
    assert split_units([[0, 1], [2]], 2) == [[0, 1], [2]]
    assert split_units([[0], [1, 2]], 4) == [[0], [1], [2]]
    samples = question_samples()
    assert balance_samples(samples, info=DistInfo(), prefix_sharing=True) is samples


# --------------------------------------------------------------------------------------------
# torchrun: 2 processes
# --------------------------------------------------------------------------------------------

CHECKS = ("balance_keeps_questions_together", "ddp_step_equal_with_and_without_sharing")


def worker(out_dir: str) -> None:
    from cppo import distributed as D

    torch.set_num_threads(1)
    info = D.init_distributed(device="cpu", timeout_s=300)
    out = pathlib.Path(out_dir)
    record = RankRecorder(out, info.rank).record

    def balance():
        everything = question_samples(seed=7)
        mine = everything[info.rank :: 2]  # each rank holds a strided share of the questions' completions
        got = balance_samples(mine, info=info, prefix_sharing=True)
        parts: list = [None] * info.world_size
        torch.distributed.all_gather_object(parts, [(s.prompt_ids, s.completion_ids) for s in got])
        flat = sorted((tuple(p), tuple(c)) for part in parts for p, c in part)
        assert flat == sorted((tuple(s.prompt_ids), tuple(s.completion_ids)) for s in everything)  # a partition
        owners = {}
        for rank, part in enumerate(parts):
            for p, _ in part:
                owners.setdefault(tuple(p), set()).add(rank)
        assert all(len(r) == 1 for r in owners.values()), owners  # 3 questions, 2 ranks: none is split
        one = [s for s in everything if s.prompt_ids == everything[0].prompt_ids]  # 4 completions of one question
        alone = balance_samples(one if info.rank == 0 else [], info=info, prefix_sharing=True)
        assert len(alone) == 2  # one question only: split, so that each rank gets a share (its prompt re-sent)

    def step():
        def run(shared: bool):
            cfg = tiny_config(out / f"run-{shared}", parallelism="ddp", prefix_sharing=shared, pruning_rate=0.5)
            trainer = Trainer(cfg, info=info)
            use_sgd(trainer)
            metrics = trainer.train_step()
            return metrics, torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])

        (shared, p_shared), (plain, p_plain) = run(True), run(False)
        for key in ("loss", "kl", "grad_norm", "tokens_trained"):
            assert shared[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
        assert shared["tokens_forward"] < plain["tokens_forward"]
        torch.testing.assert_close(p_shared, p_plain, atol=1e-6, rtol=1e-5)

    record(CHECKS[0], balance)
    record(CHECKS[1], step)
    D.barrier(info)
    D.close_distributed()


@pytest.mark.distributed
def test_two_processes_share_prompts_exactly(tmp_path):
    proc = torchrun([__file__, str(tmp_path)], timeout=300)
    assert_ranks_ok(tmp_path, [(name, rank) for name in CHECKS for rank in range(2)], proc)


if __name__ == "__main__":
    worker(sys.argv[1])
