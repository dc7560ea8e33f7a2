"""Allocation, varlen packing and the packed forward (sequences must not see each other)."""

import pathlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tiny_model import TINY

from cppo.distributed import DistInfo
from cppo.run import checkpoint
from cppo.step.models import lm_head, load_model_and_tokenizer, packed_hidden
from cppo.step.packing import Sample, allocate, loss_weight, pack, pack_all
from cppo_kernels import reference


@given(st.lists(st.integers(1, 50), max_size=30), st.integers(50, 120))
def test_allocate_is_a_partition_within_budget(lengths, budget):
    bins = allocate(lengths, budget)
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    assert all(b == sorted(b) and b for b in bins)
    # first-fit decreasing: no two bins could be merged... at most one bin is at most half full
    assert sum(sum(lengths[i] for i in b) * 2 <= budget for b in bins) <= 1


def test_allocate_first_fit_decreasing_example():
    assert allocate([3, 7, 5, 5, 2], 10) == [[0, 1], [2, 3], [4]]
    assert allocate([], 4) == []


def test_allocate_rejects_a_sequence_over_budget():
    with pytest.raises(ValueError, match="micro_batch_tokens=4"):
        allocate([3, 5], 4)


def test_pack_layout():
    samples = [Sample([1, 2, 3], [4, 5], 0.5), Sample([6], [7, 8, 9], -1.0)]
    b = pack(samples, [0, 1])
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 6, 7, 8]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    # row t predicts token t + 1 of its own sequence
    assert b.predict_index.tolist() == [2, 3, 4, 5, 6]
    assert b.targets.tolist() == [4, 5, 7, 8, 9]
    assert b.cu_seqlens.tolist() == [0, 2, 5]
    assert b.advantages.tolist() == [0.5, -1.0]
    assert (b.num_tokens, b.num_seqs, b.num_input_tokens) == (5, 2, 7)


def test_loss_weights_sum_to_the_batch_loss():
    lengths = [[3, 1], [4], [2, 2, 2]]  # completion tokens per sequence, per micro-batch
    per_token = [torch.randn(sum(ls), dtype=torch.float64) for ls in lengths]
    all_tokens = torch.cat(per_token)
    all_lengths = [n for ls in lengths for n in ls]
    total_t, total_s = len(all_tokens), len(all_lengths)

    def seq_mean(x, ls):
        return torch.stack([c.mean() for c in torch.split(x, ls)]).mean()

    cases = {
        "token-mean": (lambda x, ls: x.mean(), all_tokens.mean()),
        "seq-mean-token-mean": (seq_mean, seq_mean(all_tokens, all_lengths)),
        "seq-mean-token-sum-norm": (lambda x, ls: x.sum() / (len(ls) * 8), all_tokens.sum() / (total_s * 8)),
    }
    for agg, (fn, whole) in cases.items():
        parts = sum(
            fn(x, ls) * loss_weight(agg, num_tokens=len(x), num_seqs=len(ls), total_tokens=total_t, total_seqs=total_s)
            for x, ls in zip(per_token, lengths)
        )
        torch.testing.assert_close(parts, whole, msg=agg)


def _alone_logprobs(model, sample):
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    logits = model(input_ids=ids, use_cache=False).logits[0].double()  # [L, V]
    p = len(sample.prompt_ids)
    logp = torch.log_softmax(logits[p - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(sample.completion_ids)[:, None]).squeeze(-1)


def _packed_logprobs(model, samples):
    out = []
    weight, bias = lm_head(model)
    for b in pack_all(samples, 10_000):
        hidden = packed_hidden(model, b.input_ids, b.position_ids)[b.predict_index]
        logp, _ = reference.token_logprobs(hidden.double(), weight.double(), b.targets)
        out += list(torch.split(logp, (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist()))
        assert b.sample_index == list(range(len(samples)))
    return out


def _random_samples(vocab, lengths, seed):
    g = torch.Generator().manual_seed(seed)

    def draw(n):
        return torch.randint(5, vocab, (n,), generator=g).tolist()

    return [Sample(draw(p), draw(c), 0.0) for p, c in lengths]


def test_packed_forward_matches_each_sequence_alone():
    model, _ = load_model_and_tokenizer("tiny-qwen2", model_config=TINY, seed=3)
    # ragged, including a 1-token prompt and a 1-token completion; identical neighbours would hide leaks
    samples = _random_samples(300, [(5, 3), (1, 4), (9, 1), (3, 7), (6, 2)], seed=0)
    with torch.no_grad():
        packed = _packed_logprobs(model, samples)
        for s, got in zip(samples, packed):
            torch.testing.assert_close(got, _alone_logprobs(model, s), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def smollm2():
    path = pathlib.Path(__file__).resolve().parents[4] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is absent: the SmolLM2 tests need ../shared")
    return load_model_and_tokenizer(str(path))


def test_packed_forward_smollm2(smollm2):
    model, tok = smollm2
    samples = _random_samples(tok.vocab_size, [(7, 4), (3, 6), (10, 2)], seed=1)
    with torch.no_grad():
        for s, got in zip(samples, _packed_logprobs(model, samples)):
            torch.testing.assert_close(got, _alone_logprobs(model, s), atol=2e-4, rtol=1e-4)


def test_gguf_model_checkpoints_and_reloads(smollm2, tmp_path):
    """A GGUF model is de-quantised on load: save_pretrained must accept it and the folder must reload exactly."""
    model, tok = smollm2
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    path = str(tmp_path / "ckpt")
    checkpoint.save(
        path, module=model, tokenizer=tok, optimizer=opt, scheduler=sched, state={"step": 0}, info=DistInfo()
    )
    again, tok2 = load_model_and_tokenizer(checkpoint.model_folder(path))
    assert tok2.eos_token == tok.eos_token
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
