"""Issue 39: an engine declares what it supports (LoRA, sharded policies, stopping mid-generation, greedy
evaluation) and the config and the trainer ask the declaration, never the engine's name."""

import pytest

from cppo.engines import HFEngine, RolloutEngine, VLLMEngine, base, engine_supports, register_engine

CAPABILITIES = ("supports_lora", "supports_sharded", "supports_stopping", "supports_greedy")


class Plain(RolloutEngine):
    """An engine that declares nothing."""

    def generate(self, prompts, num_per_prompt, *, greedy=False):
        raise AssertionError("not called")

    def sync_weights(self):
        pass


class Greedy(Plain):
    supports_greedy = True


@pytest.fixture
def engines(monkeypatch):
    monkeypatch.setattr(base, "_ENGINES", dict(base._ENGINES))


def test_the_built_in_engines_declare_their_capabilities():
    assert {c: getattr(HFEngine, c) for c in CAPABILITIES} == dict.fromkeys(CAPABILITIES, True)
    want = {"supports_lora": True, "supports_sharded": False, "supports_stopping": True, "supports_greedy": True}
    assert {c: getattr(VLLMEngine, c) for c in CAPABILITIES} == want
    assert [engine_supports("vllm", c) for c in CAPABILITIES] == list(want.values())
    assert not engine_supports("auto", "supports_sharded")  # auto may pick vllm
    assert engine_supports("auto", "supports_greedy") and engine_supports("auto", "supports_stopping")


def test_an_engine_that_declares_nothing_supports_nothing(engines):
    register_engine("plain", Plain)
    register_engine("greedy", Greedy)
    assert not any(engine_supports("plain", c) for c in CAPABILITIES)
    assert engine_supports("greedy", "supports_greedy") and not engine_supports("greedy", "supports_lora")


def test_greedy_evaluation_runs_on_an_engine_that_declares_it():
    """for_evaluation asks supports_greedy: the engine itself (hf and vllm declare it); an engine that does not is
    evaluated by hf on the policy (tests/cppo/engines/test_rollout.py builds that one)."""
    engine = Greedy(None, None, None)
    assert engine.for_evaluation() is engine
