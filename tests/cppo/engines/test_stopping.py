"""Stopping completions mid-generation (cppo.engines.resume, issue 38) in the hf engine: with nothing stopped the
completions and random draws are those of one uninterrupted call; stopped rows are never decoded past their
checkpoint; the survivors decode on from the cache alone and, greedy, give the tokens an uninterrupted call gives
them; the stopper sees the policy's hidden state at each row's last forwarded position."""

from __future__ import annotations

import pytest
import torch
from tiny_generation import ARCHS, PROMPTS, engine, tiny

from cppo.engines import PartialRollout, Rollout, RolloutEngine, Stopper, checkpoint_tokens

G, AT, LENGTH = 4, 4, 10


def run(model, tok, stopper, *, greedy, prefill_once, seed=7):
    torch.manual_seed(seed)
    rollout = engine(model, tok, prefill_once=prefill_once, completion=LENGTH)(PROMPTS, G, greedy=greedy,
                                                                               stopper=stopper)  # fmt: skip
    return rollout, torch.get_rng_state()


def forward_rows(model) -> list[int]:
    """The batch size of every forward ``model`` runs from now on."""
    rows = []
    model.register_forward_pre_hook(lambda m, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    return rows


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
@pytest.mark.parametrize("prefill_once", [True, False], ids=["prefill-once", "plain"])
def test_stopping_nothing_is_the_uninterrupted_call_bit_for_bit(arch, greedy, prefill_once):
    model, tok = tiny(arch, eos_bias=0.0 if greedy else 3.0)
    plain, plain_rng = run(model, tok, None, greedy=greedy, prefill_once=prefill_once)
    seen = []
    none = Stopper(at=AT, choose=lambda partial: seen.append(partial) or [False] * len(partial.finished))
    got, rng = run(model, tok, none, greedy=greedy, prefill_once=prefill_once)
    assert got.completion_ids == plain.completion_ids and got.texts == plain.texts
    assert torch.equal(rng, plain_rng)  # not one random draw more or less
    assert got.stopped == [False] * len(PROMPTS) * G and plain.stopped is None
    (partial,) = seen
    assert partial.at == AT and all(len(c) <= AT for c in partial.completion_ids)
    if not greedy:  # some rows had ended by the checkpoint: the stopper is told so
        assert any(partial.finished) and not all(partial.finished)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefill_once", [True, False], ids=["prefill-once", "plain"])
def test_stopped_rows_end_at_the_checkpoint_and_the_survivors_decode_on_alone(arch, prefill_once):
    model, tok = tiny(arch, eos_bias=0.0)  # greedy: no row ends early, every row runs to LENGTH
    plain, _ = run(model, tok, None, greedy=True, prefill_once=prefill_once)
    rows = forward_rows(model)
    stop_odd = Stopper(at=AT, choose=lambda partial: [i % 2 == 1 for i in range(len(partial.finished))])
    got, _ = run(model, tok, stop_odd, greedy=True, prefill_once=prefill_once)
    n = len(PROMPTS) * G
    assert got.stopped == [i % 2 == 1 for i in range(n)]
    for i in range(n):
        if i % 2:  # stopped: the checkpoint's tokens, nothing decoded after
            assert got.completion_ids[i] == plain.completion_ids[i][:AT]
        else:  # a survivor: the tokens of the uninterrupted call
            assert got.completion_ids[i] == plain.completion_ids[i]
    # every forward after the checkpoint ran the survivors alone: the stopped rows were never decoded further
    after = rows[-(LENGTH - AT) :]
    assert after == [n // 2] * (LENGTH - AT) and max(rows[: -(LENGTH - AT)]) >= n // 2
    decoded_after = sum(after)
    assert decoded_after == (n // 2) * (LENGTH - AT)  # the tokens decoded past the checkpoint: survivors' only


def test_the_stopper_sees_the_hidden_state_that_produced_the_checkpoint_token():
    model, tok = tiny("qwen2", eos_bias=0.0)
    seen: list[PartialRollout] = []
    keep_all = Stopper(at=AT, choose=lambda partial: seen.append(partial) or [False] * len(partial.finished))
    run(model, tok, keep_all, greedy=True, prefill_once=False)
    (partial,) = seen
    assert partial.hidden.shape == (len(PROMPTS) * G, model.config.hidden_size)
    for i in (0, 5, 11):  # the final (normed) hidden state at the position before the checkpoint's last token
        ids = torch.tensor([partial.prompt_ids[i] + partial.completion_ids[i]])
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(partial.hidden[i], out.hidden_states[-1][0, -2], rtol=1e-4, atol=1e-5)


def test_every_row_stopped_or_ended_decodes_nothing_more():
    from cppo.engines.prefill import cache_shares_rows

    model, tok = tiny("llama", eos_bias=0.0)
    assert cache_shares_rows(model)  # its one-time probe forward, before the count starts
    rows = forward_rows(model)
    got, _ = run(model, tok, Stopper(at=AT, choose=lambda p: [True] * len(p.finished)), greedy=True,
                 prefill_once=False)  # fmt: skip
    assert all(got.stopped) and all(len(c) == AT for c in got.completion_ids)
    assert len(rows) == AT  # the prefill and AT - 1 decoding steps: nothing after the checkpoint


def test_a_stopper_that_answers_for_other_rows_is_one_error():
    model, tok = tiny("qwen2", eos_bias=0.0)
    with pytest.raises(ValueError, match="the stopper chose for 3 rows, the checkpoint holds 24"):
        run(model, tok, Stopper(at=AT, choose=lambda p: [True] * 3), greedy=True, prefill_once=False)


def test_an_engine_that_cannot_stop_refuses_a_stopper():
    class Fixed(RolloutEngine):
        def generate(self, prompts, num_per_prompt, *, greedy=False):
            return Rollout([[1]] * len(prompts) * num_per_prompt, [[1]] * len(prompts) * num_per_prompt,
                           ["x"] * len(prompts) * num_per_prompt)  # fmt: skip

        def sync_weights(self):
            pass

    model, tok = tiny("qwen2")
    fixed = Fixed(model, tok, engine(model, tok, prefill_once=False).settings)
    with pytest.raises(ValueError, match="cannot stop completions mid-generation"):
        fixed(["a"], 2, stopper=Stopper(at=2, choose=lambda p: [False] * 2))


@pytest.mark.parametrize(("at", "tokens"), [(4, 4), (0.25, 8), (0.01, 1), (31, 31)])
def test_the_checkpoint_in_tokens_or_as_a_fraction(at, tokens):
    assert checkpoint_tokens(at, 32) == tokens


@pytest.mark.parametrize("at", [0, -1, 1.5, 32, 40, True, "4", float("nan")])
def test_a_bad_checkpoint_is_one_line_naming_the_setting(at):
    with pytest.raises(ValueError, match="rollout_stop.at"):
        checkpoint_tokens(at, 32)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefill_once", [True, False], ids=["prefill-once", "plain"])
def test_one_forward_over_the_partial_completions_gives_the_engines_hidden_states(arch, prefill_once):
    """What an engine without hidden states (vLLM) computes, checkpoint_hidden, equals what the hf engine reads
    from its own forward, so the quality head sees the same feature whichever engine generated."""
    from cppo.engines.hidden import checkpoint_hidden

    model, tok = tiny(arch, eos_bias=3.0)
    seen: list[PartialRollout] = []
    run(model, tok, Stopper(at=AT, choose=lambda p: seen.append(p) or [False] * len(p.finished)), greedy=False,
        prefill_once=prefill_once)  # fmt: skip
    (partial,) = seen
    again = checkpoint_hidden(model, partial.prompt_ids, partial.completion_ids)
    open_rows = [i for i, f in enumerate(partial.finished) if not f]
    assert open_rows
    torch.testing.assert_close(again[open_rows], partial.hidden[open_rows], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["mamba", "falcon_h1"])
def test_a_cache_that_cannot_keep_rows_decodes_all_and_stops_after_the_fact(family):
    """Recurrent and hybrid caches (prefill-once declines them: their states do not follow a row selection): one
    uninterrupted generate, the stopped rows cut at the checkpoint; nothing stopped is the plain call exactly."""
    from tiny_families import tiny_family

    from cppo.engines import EngineSettings, HFEngine
    from cppo.step import tiny_tokenizer

    tok = tiny_tokenizer(128)
    model = tiny_family(family, tok)
    eng = HFEngine(model, tok, EngineSettings(model_name="x", max_prompt_length=64, max_completion_length=LENGTH))
    prompts = PROMPTS[:3]

    def call(stopper, seed=3):
        torch.manual_seed(seed)
        return eng(prompts, G, stopper=stopper), torch.get_rng_state()

    (plain, rng) = call(None)
    (none, rng_none) = call(Stopper(at=AT, choose=lambda p: [False] * len(p.finished)))
    assert none.completion_ids == plain.completion_ids and torch.equal(rng, rng_none)
    seen = []
    (odd, _) = call(Stopper(at=AT, choose=lambda p: seen.append(p) or [i % 2 == 1 for i in range(len(p.finished))]))
    for i, (got, want) in enumerate(zip(odd.completion_ids, plain.completion_ids)):
        assert got == (want[:AT] if odd.stopped[i] else want)
    assert any(odd.stopped) and seen[0].hidden.shape == (len(prompts) * G, model.config.hidden_size)


def test_a_stopper_that_reads_no_hidden_states_costs_no_forward_for_them(monkeypatch):
    """``needs_hidden=False`` (the random and length scorers): the recurrent fallback, which would compute them with
    an extra policy forward, passes None and runs no such forward; the same rows stop."""
    from tiny_families import tiny_family

    from cppo.engines import EngineSettings, HFEngine, resume
    from cppo.step import tiny_tokenizer

    tok = tiny_tokenizer(128)
    model = tiny_family("mamba", tok)
    eng = HFEngine(model, tok, EngineSettings(model_name="x", max_prompt_length=64, max_completion_length=LENGTH))
    odd = lambda p: [i % 2 == 1 for i in range(len(p.finished))]  # noqa: E731
    torch.manual_seed(3)
    want = eng(PROMPTS[:2], G, stopper=Stopper(at=AT, choose=odd))
    monkeypatch.setattr(resume, "checkpoint_hidden", lambda *a, **k: pytest.fail("a forward for hidden states"))
    seen = []
    torch.manual_seed(3)
    got = eng(PROMPTS[:2], G, stopper=Stopper(at=AT, choose=lambda p: seen.append(p) or odd(p), needs_hidden=False))
    assert got.completion_ids == want.completion_ids and got.stopped == want.stopped and seen[0].hidden is None


@pytest.mark.parametrize(("scorer", "reads"), [("learned", True), ("random", False), ("length", False)])
def test_only_the_learned_head_asks_for_hidden_states(scorer, reads):
    from types import SimpleNamespace

    from cppo.step import RolloutStopping

    config = SimpleNamespace(rollout_stop=dict(rate=0.5, scorer=scorer, warmup=0, at=2),
                             max_completion_length=8, group_size=4)  # fmt: skip
    assert RolloutStopping(config, hidden_size=8, tokenizer=None).stopper(step=0, seed=0).needs_hidden is reads
