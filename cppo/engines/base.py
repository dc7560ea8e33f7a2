"""The rollout-engine seam: the :class:`Rollout` record, the :class:`RolloutEngine` interface, the settings every
engine is built from, the registry that maps a ``rollout_backend`` name to an engine, and the token helpers the
engines share (prompt encoding, the completion mask as a cut after the first EOS)."""

from __future__ import annotations

import importlib.util
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = [
    "Rollout",
    "EngineSettings",
    "RolloutEngine",
    "EngineFactory",
    "register_engine",
    "make_engine",
    "available_engines",
    "check_engine_name",
    "resolve_engine_name",
    "auto_engines",
    "everywhere_engine",
    "engine_supports",
    "cut_after_eos",
    "encode_prompts",
    "eos_ids",
]


@dataclass
class Rollout:
    """N = num_prompts * G completions, prompt after prompt (completion i belongs to prompt i // G): per completion
    its prompt's token ids (1 to ``max_prompt_length``), its own (1 to ``max_completion_length``, cut after the first
    EOS), as lists of Python ints in the model's vocabulary, and its text (:meth:`RolloutEngine.__call__` checks)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    #: Per completion, each token's log-prob under the engine that sampled it (after temperature), where the engine
    #: reports them (``vllm``); ``None`` where it does not (``hf`` samples with the policy itself).
    sampling_logprobs: list[list[float]] | None = None
    #: The prompt positions the engine's prefill forwarded (``hf``: rows x padded width, one row per prompt when
    #: its completions share a prefill; ``vllm``: each distinct prompt once, its prefix cache serving the rest);
    #: ``None``: not reported (a completion's prompt counted each time: :attr:`prefill_positions`).
    prefill_tokens: int | None = None
    #: Per completion, whether a :class:`~cppo.engines.stopping.Stopper` stopped it at its checkpoint (its tokens
    #: end there, without EOS); ``None``: generated without a stopper.
    stopped: list[bool] | None = None

    @property
    def prefill_positions(self) -> int:
        """:attr:`prefill_tokens`, or where the engine does not report them every completion's prompt tokens."""
        return sum(len(p) for p in self.prompt_ids) if self.prefill_tokens is None else self.prefill_tokens

    @property
    def lengths(self) -> list[int]:
        return [len(c) for c in self.completion_ids]


@dataclass(frozen=True)
class EngineSettings:
    """What every engine is built from: the model's name or folder (an engine that loads its own copy reads it),
    the prompt / completion lengths, the sampling parameters, the compute dtype (``None``: the weights' own) and
    whether FSDP2 shards the policy over the ranks (``sharded``: every rank's generate must step in lockstep);
    ``prefill_once``: an engine that decodes from a KV cache runs each prompt's forward once for its G completions
    (``hf``: :mod:`cppo.engines.prefill`; vLLM caches prefixes itself)."""

    model_name: str
    max_prompt_length: int
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    compute_dtype: torch.dtype | None = None
    sharded: bool = False
    prefill_once: bool = True
    #: The engine generates ahead of training (``steps_per_generation`` / ``max_staleness``, :mod:`cppo.overlap`):
    #: from weights of its own, synced when the trainer says, while the policy trains; with the sampled tokens'
    #: log-probs under those weights (the stale behaviour's correction). An engine that always has its own (vllm)
    #: reads nothing here.
    own_weights: bool = False


class RolloutEngine(ABC):
    """Generates G completions per prompt from the policy ``model``. A new engine subclasses this, implements
    :meth:`generate` and :meth:`sync_weights` and is registered with :func:`register_engine`; training and ``cppo
    eval`` then pick it by name (``rollout_backend``)."""

    #: Can generate from a policy whose parameters FSDP2 shards over the ranks (``parallelism: fsdp2``).
    supports_sharded: ClassVar[bool] = False

    #: Can generate from a LoRA policy (``use_peft``): the config asks this, never the engine's name.
    supports_lora: ClassVar[bool] = False

    #: Can stop completions at a checkpoint mid-generation (``generate(..., stopper=...)``: issue 38).
    supports_stopping: ClassVar[bool] = False

    #: Decodes greedily (``generate(..., greedy=True)``), so greedy evaluation runs on the engine itself
    #: (:meth:`for_evaluation`); an engine that does not declare it is evaluated by ``hf`` on the policy.
    supports_greedy: ClassVar[bool] = False

    #: Loads its own copy of the model from ``EngineSettings.model_name`` (a folder of full weights: a LoRA adapter
    #: folder must be merged first, ``cppo merge``) instead of generating from the policy object it is given.
    reads_model_folder: ClassVar[bool] = False

    #: The packages it imports when built (``{module: what to install}``), checked before any model loads
    #: (:func:`check_engine_installed`).
    requires: ClassVar[dict[str, str]] = {}

    #: The name it was built by (``rollout_backend``; set by :func:`make_engine`), for messages.
    name: str = ""

    def __init__(self, model, tokenizer, settings: EngineSettings) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings

    def __call__(self, prompts: list[str], num_per_prompt: int, *, greedy: bool = False, stopper=None) -> Rollout:
        """:meth:`generate`, its result checked against the :class:`Rollout` contract: what training and evaluation
        call. A broken contract is one ``ValueError`` naming the engine, what it returned and what was promised
        (instead of a zip() error, an IndexError, or training on completions longer than ``max_completion_length``).
        ``stopper``: a :class:`~cppo.engines.stopping.Stopper` (engines that declare ``supports_stopping``)."""
        name = self.name or type(self).__name__
        if stopper is not None and not self.supports_stopping:
            raise ValueError(f"rollout engine {name!r} cannot stop completions mid-generation; use rollout_backend=hf")
        kwargs = {} if stopper is None else {"stopper": stopper}
        rollout = self.generate(prompts, num_per_prompt, greedy=greedy, **kwargs)
        problem = _contract_breach(
            rollout, count=len(prompts) * num_per_prompt, settings=self.settings,
            vocab=self.model.get_input_embeddings().num_embeddings,
        )  # fmt: skip
        if problem:
            raise ValueError(
                f"rollout engine {name!r} broke its contract: generate({len(prompts)} prompts, {num_per_prompt} per "
                f"prompt) returned {problem}"
            )
        return rollout

    @abstractmethod
    def generate(self, prompts: list[str], num_per_prompt: int, *, greedy: bool = False) -> Rollout:
        """``num_per_prompt`` completions of each prompt, prompt after prompt: sampled with the settings'
        temperature and top_p from torch's global RNG (seed it first), or greedy."""

    @abstractmethod
    def sync_weights(self) -> None:
        """Takes the policy's current weights, after each optimizer step and checkpoint load (nothing to do for an
        engine that generates with ``model`` itself)."""

    def for_evaluation(self) -> RolloutEngine:
        """The engine greedy evaluation decodes with: itself when it declares ``supports_greedy``, else the engine
        that runs every model (:func:`everywhere_engine`: ``hf``, transformers ``generate``) on the same model,
        tokenizer, lengths and compute dtype."""
        fallback = everywhere_engine()
        return self if self.supports_greedy else make_engine(fallback, self.model, self.tokenizer, self.settings)


#: Builds an engine: ``factory(model, tokenizer, settings)``; a :class:`RolloutEngine` subclass is one. Its
#: ``supports_sharded`` attribute (False when absent) says whether it may run under ``parallelism: fsdp2``.
EngineFactory = Callable[..., RolloutEngine]

_ENGINES: dict[str, EngineFactory] = {}
_AUTO: dict[str, int] = {}  # name -> its auto priority (register_engine's auto_priority)


def register_engine(name: str, factory: EngineFactory, *, auto_priority: int | None = None) -> None:
    """Makes ``factory`` the engine ``rollout_backend: name`` builds (a name registered again is replaced);
    ``auto_priority``: ``rollout_backend: auto`` may pick it, before every engine of a lower priority
    (:func:`resolve_engine_name`; None: auto never picks it)."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"register_engine: name must be a non-empty string other than 'auto', got {name!r}")
    if not callable(factory):
        raise ValueError(f"register_engine: factory of {name!r} must be callable, got {type(factory).__name__}")
    _ENGINES[name] = factory
    if auto_priority is None:
        _AUTO.pop(name, None)
    else:
        _AUTO[name] = auto_priority


def available_engines() -> tuple[str, ...]:
    """The registered engine names, in registration order (``rollout_backend`` also takes ``auto``)."""
    return tuple(_ENGINES)


def check_engine_name(name: str) -> str:
    """``name`` when ``rollout_backend`` may take it (``auto`` or a registered engine), else a ``ValueError``."""
    if not isinstance(name, str) or (name != "auto" and name not in _ENGINES):
        raise ValueError(f"rollout_backend must be 'auto' or a registered engine {available_engines()}, got {name!r}")
    return name


def check_engine_installed(name: str) -> str:
    """``name`` (``rollout_backend``) when the packages its engine imports (its ``requires``) are installed, else a
    ``ValueError`` saying what to install: before any model loads (the engine imports them only when built)."""
    factory = _ENGINES.get(check_engine_name(name))
    for module, install in (getattr(factory, "requires", None) or {}).items():
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"rollout_backend={name!r} needs the {module} package, which is not installed here: {install}, or set "
                "rollout_backend=hf"
            )
    return name


def engine_supports(name: str, capability: str) -> bool:
    """Whether the engine ``name`` (registered; ``auto`` asks every engine auto may pick) declares ``capability``
    (``supports_lora``, ``supports_sharded``, ``supports_stopping``, ``supports_greedy``: a class attribute of its
    factory, False when absent)."""
    names = auto_engines() if name == "auto" else (check_engine_name(name),)
    return all(bool(getattr(_ENGINES.get(n), capability, False)) for n in names if n in _ENGINES)


def auto_engines() -> tuple[str, ...]:
    """The engines ``rollout_backend: auto`` may pick (registered with an ``auto_priority``), the highest priority
    first (ties: in registration order)."""
    return tuple(sorted((n for n in _ENGINES if n in _AUTO), key=lambda n: -_AUTO[n]))


def resolve_engine_name(
    name: str, *, device: torch.device, model_name: str, model=None, sharded: bool = False, tokenizer=None,
    settings: EngineSettings | None = None,
) -> str:  # fmt: skip
    """``auto`` -> the first engine of :func:`auto_engines` that runs ``model`` here: under ``sharded`` one that
    ``supports_sharded``, and one whose ``runs_here(model=, tokenizer=, settings=, device=, model_name=)`` (a class
    method of its factory; absent: it runs every model) answers True. An answer False passes over it; a string (why
    it cannot) passes over it with one warning naming that. Any other name is itself. Registered here: ``vllm``
    (priority 1: where vLLM is installed and takes the model through a whole training step,
    :meth:`cppo.engines.vllm.VLLMEngine.runs_here`), then ``hf`` (priority 0: every model)."""
    if name != "auto":
        return check_engine_name(name)
    passed = []
    for candidate in auto_engines():
        factory = _ENGINES[candidate]
        if sharded and not getattr(factory, "supports_sharded", False):
            continue
        runs_here = getattr(factory, "runs_here", None)
        answer = True if runs_here is None else runs_here(
            model=model, tokenizer=tokenizer, settings=settings, device=device, model_name=model_name
        )  # fmt: skip
        if answer is True:
            for why in passed:
                warnings.warn(f"rollout_backend=auto: {why}; generating with {candidate}", stacklevel=3)
            return candidate
        if isinstance(answer, str):
            passed.append(answer)
    raise ValueError(f"rollout_backend=auto: none of the engines auto may pick {auto_engines()} runs this model here")


def everywhere_engine() -> str:
    """The engine that runs every model on every device: the last of :func:`auto_engines` without ``runs_here``
    (``hf``), which evaluates an engine that cannot decode greedily (:meth:`RolloutEngine.for_evaluation`)."""
    return next(n for n in reversed(auto_engines()) if getattr(_ENGINES[n], "runs_here", None) is None)


def make_engine(name: str, model, tokenizer, settings: EngineSettings) -> RolloutEngine:
    """The engine ``name`` (``rollout_backend``; ``auto`` resolved on ``model.device``) on ``model``.

    Raises:
        ValueError: ``name`` is not registered, or ``settings.sharded`` and the engine cannot generate from a sharded
            policy (both before the engine is built).
    """
    name = resolve_engine_name(
        name, device=torch.device(model.device), model_name=settings.model_name, model=model, sharded=settings.sharded,
        tokenizer=tokenizer, settings=settings,
    )  # fmt: skip
    factory = _ENGINES[name]
    if settings.sharded and not getattr(factory, "supports_sharded", False):
        capable = tuple(n for n, f in _ENGINES.items() if getattr(f, "supports_sharded", False))
        raise ValueError(
            f"parallelism='fsdp2' generates from the sharded policy, which rollout_backend={name!r} cannot: set "
            f"rollout_backend to one of {capable}"
        )
    engine = factory(model, tokenizer, settings)
    if not isinstance(engine, RolloutEngine):
        raise ValueError(
            f"rollout_backend={name!r}: its factory returned {type(engine).__name__}, not a RolloutEngine (an engine "
            "is a RolloutEngine subclass, registered with register_engine)"
        )
    engine.name = name
    return engine


def _contract_breach(rollout, *, count: int, settings: EngineSettings, vocab: int) -> str | None:
    """What of ``rollout`` breaks the :class:`Rollout` contract for ``count`` completions (the first finding, as
    "X, the interface promises Y"), or None."""
    if not isinstance(rollout, Rollout):
        return f"a {type(rollout).__name__}, the interface promises a Rollout"
    lengths = {"prompt_ids": (1, settings.max_prompt_length), "completion_ids": (1, settings.max_completion_length)}
    for field in ("prompt_ids", "completion_ids", "texts"):
        rows = getattr(rollout, field)
        if not isinstance(rows, list):
            return f"{field} as a {type(rows).__name__}, the interface promises a list"
        if len(rows) != count:
            return f"{len(rows)} {field}, the interface promises {count} (num_prompts x num_per_prompt)"
        if field == "texts":
            bad = next((i for i, t in enumerate(rows) if not isinstance(t, str)), None)
            if bad is not None:
                return f"texts[{bad}] as a {type(rows[bad]).__name__}, the interface promises a str"
            continue
        low, high = lengths[field]
        for i, ids in enumerate(rows):
            if not isinstance(ids, list):
                return f"{field}[{i}] as a {type(ids).__name__}, the interface promises a list of int token ids"
            if set(map(type, ids)) - {int}:  # one C-level pass; a bool or numpy integer is not a Python int
                odd = next(j for j, t in enumerate(ids) if type(t) is not int)
                return f"{field}[{i}][{odd}] as a {type(ids[odd]).__name__}, the interface promises an int token id"
            if not low <= len(ids) <= high:
                return f"{field}[{i}] of {len(ids)} tokens, the interface promises {low} to {high}"
            if min(ids) < 0 or max(ids) >= vocab:
                token = min(ids) if min(ids) < 0 else max(ids)
                return f"{field}[{i}] holding token id {token}, outside the model's vocabulary [0, {vocab})"
    logprobs = rollout.sampling_logprobs
    if logprobs is not None:
        if not isinstance(logprobs, list) or len(logprobs) != count:
            got = len(logprobs) if isinstance(logprobs, list) else type(logprobs).__name__
            return f"sampling_logprobs of {got}, the interface promises None or a list of {count}"
        for i, (lp, ids) in enumerate(zip(logprobs, rollout.completion_ids)):
            if not isinstance(lp, list) or len(lp) != len(ids):
                return (
                    f"sampling_logprobs[{i}] not one float per token of completion_ids[{i}], as the interface promises"
                )
    stopped = rollout.stopped
    if stopped is not None and (not isinstance(stopped, list) or len(stopped) != count):
        got = len(stopped) if isinstance(stopped, list) else type(stopped).__name__
        return f"stopped of {got}, the interface promises None or a list of {count} bools"
    return None


def cut_after_eos(ids: list[int], eos: set[int], max_length: int) -> list[int]:
    """The completion mask as a cut: tokens up to and including the first EOS, at most ``max_length`` tokens."""
    ids = ids[:max_length]
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def encode_prompts(tokenizer, prompts: list[str], max_prompt_length: int) -> list[list[int]]:
    """Token ids of each prompt, truncated on the left to ``max_prompt_length``."""
    return [p[-max_prompt_length:] for p in tokenizer(prompts, add_special_tokens=False)["input_ids"]]


def eos_ids(tokenizer, model) -> set[int]:
    """Every EOS id of the tokenizer and of the model's generation config (a completion ends at any of them)."""
    eos = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos.add(source)
        elif source is not None:
            eos.update(source)
    if not eos:
        raise ValueError("the tokenizer has no eos_token: completions could never end")
    return eos
