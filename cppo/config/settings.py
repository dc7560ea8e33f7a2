"""Training configuration: one dataclass, loadable from a preset or a YAML file with ``key=value`` overrides, and the
choices each setting accepts."""

from __future__ import annotations

import dataclasses
import difflib
import os
import pathlib
import re
import types
import typing
from dataclasses import dataclass, field

import yaml

from cppo_kernels import LossConfig
from cppo_kernels.config import check_choice, check_float, check_int

from ..distributed import PARALLELISMS, check_device
from ..engines import check_engine_name
from ..run import check_report_to
from ..step import Pruning
from ..tasks import check_arith_eval_limit, check_timeout

PRESET_DIR = pathlib.Path(__file__).resolve().parents[1] / "presets"
#: Models built in code (no download).
TINY_MODELS = ("tiny-qwen2",)
#: ``dtype``: the compute dtype (master weights and optimizer state are always float32).
DTYPES = ("float32", "bfloat16", "float16")
#: ``lr_schedule``: cosine / linear decay or constant, each after a linear warm-up.
LR_SCHEDULES = ("cosine", "linear", "constant")
#: ``kernel_backend``: the cppo_kernels path (``auto`` leaves ``$CPPO_KERNELS_BACKEND`` in charge).
KERNEL_BACKENDS = ("auto", "triton", "torch")
#: ``dataset`` names (besides a .jsonl file and a hub dataset ``owner/name``).
DATASETS = ("arith", "gsm8k", "math", "math500")
#: A hub repository id: ``name`` or ``owner/name`` (a local path that does not exist is none).
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
#: ``lora_target_modules`` by default: the attention and MLP projections (Llama, Qwen2, Mistral, SmolLM2 names).
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: ``seed`` is at most this (the per-step seeds derived from it must fit torch's 64-bit seed).
MAX_SEED = 2**32 - 1
#: Settings a resume may change without --allow-config-change: where and how often the run writes and evaluates,
#: its length (with a decaying lr_schedule, a new length reshapes the remaining schedule), and how (not what) it
#: computes. Any other difference changes the run (:meth:`TrainConfig.changes_from`).
RESUMABLE = frozenset(
    {"output_dir", "num_steps", "num_epochs", "save_every", "log_every", "eval_every", "eval_limit", "preset"}
    | {"report_to"}
    | {"device", "kernel_backend", "micro_batch_tokens", "parallelism", "gradient_checkpointing", "max_skipped_updates"}
)
#: Settings a resume cannot apply, even with --allow-config-change: the weights are of that model, the data
#: position of that question list; LoRA: the checkpoint holds an adapter of that shape (or a full model), which only
#: such a policy loads.
FIXED = frozenset({"model", "model_config", "dataset", "dataset_path", "max_questions"})
FIXED |= {"use_peft", "lora_r", "lora_target_modules"}


def setting(default, help: str, *, factory=None):
    """A :class:`TrainConfig` field with its one-line meaning (``cppo train --help`` lists them all)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def setting_help() -> dict[str, str]:
    """Each setting's one-line meaning, in declaration order."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}


@dataclass
class TrainConfig:
    """Every setting of a CPPO run. ``validate()`` (run on construction, once) rejects bad values naming the
    setting; it reads no file and loads no library: whether the model and the data exist is checked where they
    load (:func:`check_model_and_data`, by the trainer and the CLI before anything trains).

    The pruning rule (counts, scopes, allocation) is :class:`cppo.selection.Pruning`, built by :attr:`pruning`.
    """

    # model
    model: str = setting("tiny-qwen2", "tiny-qwen2 (built in code), a local folder, a hub name or a .gguf file")
    model_config: dict | None = setting(None, "overrides of the tiny model's config (tiny-* models only)")
    dtype: str = setting(
        "float32", "compute dtype of forward, backward and rollouts (float32, bfloat16, float16); weights stay fp32"
    )
    device: str = setting("auto", "auto, cpu, cuda or cuda:N (auto: CUDA when available)")
    # data
    dataset: str = setting(
        "arith", "arith, gsm8k, math, math500 (evaluation only), a .jsonl file or a hub dataset owner/name"
    )
    dataset_path: str | None = setting(
        None, "a .jsonl file or a folder of train.jsonl / test.jsonl for gsm8k / math / math500"
    )
    system_prompt: str | None = setting(
        None, "replaces the default system prompt (null: the paper's <think>/<answer> prompt)"
    )
    max_prompt_length: int = setting(512, "prompts keep their last N tokens")
    max_completion_length: int = setting(1024, "new tokens per completion at most")
    # sampling
    group_size: int = setting(16, "completions sampled per question (G)")
    temperature: float = setting(1.0, "sampling temperature; also divides the logits in the loss")
    top_p: float = setting(1.0, "nucleus sampling threshold in (0, 1]")
    # pruning and allocation
    pruning_rate: float = setting(
        0.0, "fraction P of completions pruned (smallest |advantage|) before the training passes, in [0, 1)"
    )
    selection_scope: str = setting(
        "batch", "batch: prune int(N * P) of the rank's step (official); group: per question; global: all ranks"
    )
    selection_metric: str = setting(
        "smallest",
        "smallest: prune the smallest |A| (CPPO); largest; random; max-variance: keep each question's subset of "
        "largest reward variance (PODS, selection_scope group)",
    )
    allocation: bool = setting(
        True, "draw 1/(1-P) times more questions per step, so a step trains as many completions as GRPO"
    )
    questions_per_step: int = setting(1, "questions a GRPO step draws (over all processes)")
    micro_batch_tokens: int = setting(4096, "token budget of one packed micro-batch (>= prompt + completion length)")
    prefix_sharing: bool = setting(
        True, "pack a question's kept completions after its prompt once (block-causal mask; exact, fewer tokens)"
    )
    gradient_checkpointing: bool = setting(False, "recompute each decoder layer's activations in backward")
    # LoRA (TRL's ModelConfig names)
    use_peft: bool = setting(
        False, "train LoRA adapters (PEFT) on a frozen base; the reference is the policy with them disabled"
    )
    lora_r: int = setting(16, "LoRA rank (>= 1)")
    lora_alpha: int = setting(32, "LoRA alpha: the adapter's update is scaled by lora_alpha / lora_r")
    lora_dropout: float = setting(0.05, "dropout on the adapters' input while training, in [0, 1)")
    lora_target_modules: list[str] | str = setting(
        None, "module names that get adapters, or all-linear (every linear layer but the LM head)",
        factory=lambda: list(LORA_TARGET_MODULES),
    )  # fmt: skip
    # loss
    mu: int = setting(2, "policy updates per rollout (old log-probs taken once before the first)")
    beta: float = setting(0.04, "weight of the KL penalty to the frozen initial model (0: no reference model)")
    kl_estimator: str = setting("k3", "k1, k2 or k3")
    epsilon_low: float = setting(0.2, "lower clip range of the importance ratio: clip(r, 1 - epsilon_low, ...)")
    epsilon_high: float | None = setting(None, "upper clip range (null: epsilon_low)")
    loss_agg: str = setting(
        "token-mean", "token-mean (DAPO / CPPO), seq-mean-token-mean (GRPO) or seq-mean-token-sum-norm (Dr. GRPO)"
    )
    # optimiser
    lr: float = setting(1e-6, "peak learning rate of AdamW")
    lr_schedule: str = setting("cosine", "cosine, linear or constant, after a linear warm-up")
    warmup_ratio: float = setting(0.1, "fraction of the optimizer steps spent warming up, in [0, 1)")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    max_grad_norm: float = setting(1.0, "gradient norm clipping threshold")
    max_skipped_updates: int = setting(
        10, "stop the run after N optimizer updates in a row whose gradient is not finite (each one skipped)"
    )
    # length of the run
    num_steps: int | None = setting(None, "training steps (null: num_epochs over the dataset)")
    num_epochs: int = setting(1, "epochs over the training questions when num_steps is null")
    max_questions: int | None = setting(None, "use only the first N training questions (null: all)")
    # rewards and back-ends
    rewards: list[str] = setting(
        None, "reward functions summed into the reward, e.g. format,accuracy", factory=lambda: ["format", "accuracy"]
    )
    reward_timeout: float = setting(
        0.5, "seconds math-verify may spend on one MATH completion (a worker process is killed past it; scores 0)"
    )
    rollout_backend: str = setting(
        "auto", "auto (vllm on CUDA when installed, else hf), hf (transformers generate), vllm, or a registered engine"
    )
    report_to: list[str] = setting(
        None, "metric sinks: jsonl (metrics.jsonl), tensorboard, wandb, or none", factory=lambda: ["jsonl"]
    )
    kernel_backend: str = setting("auto", "auto, triton or torch: the cppo_kernels path")
    # bookkeeping
    seed: int = setting(0, "seed of the question order, the sampling and a tiny model's initialisation (< 2**32)")
    question_seed: int | None = setting(
        None, "seed that picks the training questions (arith: generates them; max_questions: samples them); null: seed"
    )
    parallelism: str = setting("ddp", "ddp or fsdp2 under torchrun")
    output_dir: str = setting("runs/cppo", "folder of metrics.jsonl, metrics.png and checkpoint-NNNNNN/")
    save_every: int = setting(0, "save a checkpoint every N steps (0: only at the end)")
    log_every: int = setting(1, "append metrics to metrics.jsonl every N steps")
    eval_every: int = setting(0, "evaluate on the test split every N steps and after the last (0: never)")
    eval_limit: int | None = setting(None, "evaluate on the first N test problems (null: all)")
    preset: str | None = setting(None, "the preset this config came from (set by load_config)")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def pruning(self) -> Pruning:
        """The run's pruning policy (:class:`cppo.selection.Pruning`): counts per step and the selection itself."""
        return Pruning.from_config(self)

    def steps_for(self, problems: int) -> int:
        """Training steps over ``problems`` questions: ``num_steps``, else ``num_epochs`` passes (at least 1)."""
        return self.num_steps or max(1, self.num_epochs * problems // self.pruning.questions_drawn)

    @property
    def loss_config(self) -> LossConfig:
        """The options of ``fused_cppo_loss``, with entropy (a step metric); ``LossConfig`` validates them."""
        return LossConfig(
            temperature=self.temperature,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            beta=self.beta,
            kl_estimator=self.kl_estimator,
            loss_agg=self.loss_agg,
            max_completion_length=self.max_completion_length,
            compute_entropy=True,
        )

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first bad setting."""
        for name, hint in _field_types().items():
            _check_type(name, getattr(self, name), hint)
            if isinstance(getattr(self, name), float):
                check_float(name, getattr(self, name))  # no inf or nan reaches the run
        _positive(self, "group_size", "max_prompt_length", "max_completion_length", "questions_per_step", "mu")
        _positive(self, "micro_batch_tokens", "num_epochs", "log_every")
        for name in ("num_steps", "max_questions", "eval_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or null, got {getattr(self, name)}")
        for name in ("save_every", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = never), got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are relative within a group), got {self.group_size}")
        if self.micro_batch_tokens < self.max_prompt_length + self.max_completion_length:
            raise ValueError(
                f"micro_batch_tokens={self.micro_batch_tokens} must be >= max_prompt_length + max_completion_length "
                f"= {self.max_prompt_length + self.max_completion_length} (one sequence must fit a micro-batch)"
            )
        self.pruning  # noqa: B018  pruning_rate, selection_scope, selection_metric, allocation, questions_per_step
        check_choice("parallelism", self.parallelism, PARALLELISMS)
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_engine_name(self.rollout_backend)
        check_report_to(self.report_to)
        check_choice("kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
        self.loss_config  # noqa: B018  temperature, epsilon_low / high, beta, kl_estimator, loss_agg
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_float("lr", self.lr, low=0.0)
        check_float("weight_decay", self.weight_decay, low=0.0)
        check_float("max_grad_norm", self.max_grad_norm, low=0.0, low_open=True)
        check_int("max_skipped_updates", self.max_skipped_updates, low=1)
        check_int("seed", self.seed, low=0, high=MAX_SEED)
        if self.question_seed is not None:
            check_int("question_seed", self.question_seed, low=0, high=MAX_SEED)
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not self.rewards:
            raise ValueError("rewards must name at least one reward function")
        check_timeout(self.reward_timeout)
        check_arith_eval_limit(self.dataset, self.eval_limit)
        check_choice("dtype", self.dtype, DTYPES)
        check_device(self.device)
        _check_lora(self)

    @property
    def training_question_seed(self) -> int:
        """The seed that picks the training questions: ``question_seed``, else ``seed``."""
        return self.seed if self.question_seed is None else self.question_seed

    def check_sources(self) -> None:
        """Whether the model and the data exist (:func:`check_model_and_data`): the file-system checks, apart from
        :meth:`validate`; the trainer and :func:`load_config` run them before anything loads."""
        check_model_and_data(
            model=self.model, model_config=self.model_config, dataset=self.dataset,
            dataset_path=self.dataset_path, dtype=self.dtype, device=self.device,
        )  # fmt: skip

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def changes_from(self, saved: dict) -> list[str]:
        """What differs between the settings a checkpoint was saved with (``saved``: :meth:`to_dict`) and these,
        except the :data:`RESUMABLE` ones: ``"name: saved -> now"`` each. A setting the checkpoint predates counts as
        its default."""
        changes, defaults = [], TrainConfig().to_dict()
        for f in dataclasses.fields(TrainConfig):
            if f.name in RESUMABLE:
                continue
            was, now = saved.get(f.name, defaults[f.name]), getattr(self, f.name)
            if was != now:
                changes.append(f"{f.name}: {was!r} -> {now!r}")
        return changes


def check_model_and_data(
    *,
    model: str,
    dataset: str,
    dataset_path: str | None = None,
    model_config: dict | None = None,
    dtype: str = "float32",
    device: str = "auto",
) -> None:
    """Whether the model and the data exist, checked before anything loads (the trainer, ``cppo train --dry-run`` and
    ``cppo eval`` call it; it reads the file system and imports transformers for a tiny model's config):
    ``ValueError`` naming the setting."""
    check_choice("dtype", dtype, DTYPES)
    check_device(device)
    if dataset_path is not None and not os.path.exists(dataset_path):
        raise ValueError(f"dataset_path {dataset_path!r} does not exist")
    if dataset.endswith(".jsonl") and not os.path.isfile(dataset):
        raise ValueError(f"dataset file {dataset!r} does not exist")
    if not (dataset in DATASETS or dataset.endswith(".jsonl") or ("/" in dataset and HUB_ID_RE.match(dataset))):
        raise ValueError(
            f"dataset {dataset!r} is unknown{did_you_mean(dataset, DATASETS)}: use one of {DATASETS}, a .jsonl file "
            "or a hub dataset owner/name"
        )
    if model.endswith(".gguf") and not os.path.isfile(model):
        raise ValueError(f"model file {model!r} does not exist")
    if model.startswith("tiny-") and model not in TINY_MODELS:
        raise ValueError(f"model {model!r}: the tiny models are {TINY_MODELS}")
    if not (model.startswith("tiny-") or os.path.exists(model) or HUB_ID_RE.match(model)):
        raise ValueError(f"model {model!r} does not exist (not a local folder or file, nor a hub name owner/name)")
    if model_config is not None and not model.startswith("tiny-"):
        raise ValueError("model_config (overrides of the tiny model's config) only applies to a tiny-* model")
    if model_config is not None:
        check_tiny_config(model_config)


def check_tiny_config(model_config: dict) -> None:
    """``ValueError`` naming the keys of ``model_config`` that Qwen2's config does not know (they would be ignored)."""
    from transformers import Qwen2Config

    known = set(Qwen2Config().to_dict())
    try:
        built = set(Qwen2Config(**model_config).to_dict())
    except (TypeError, ValueError) as e:
        raise ValueError(f"model_config: {e}") from None
    unknown = sorted(set(model_config) & (built - known))  # an unknown key is kept as an extra attribute
    if unknown:
        raise ValueError(
            f"model_config: unknown key {unknown[0]!r}{did_you_mean(unknown[0], known)}: the keys are those of "
            "transformers' Qwen2Config"
        )


#: TRL's GRPOConfig / transformers' TrainingArguments names a user types, and what to use here.
TRL_NAMES = {
    "learning_rate": "lr",
    "num_generations": "group_size",
    "per_device_train_batch_size": "questions_per_step (questions per step; each brings group_size completions)",
    "gradient_accumulation_steps": "questions_per_step (one optimizer step per generation step here)",
    "num_iterations": "mu",
    "epsilon": "epsilon_low",
    "num_train_epochs": "num_epochs",
    "max_steps": "num_steps",
    "lr_scheduler_type": "lr_schedule",
    "save_steps": "save_every",
    "logging_steps": "log_every",
    "eval_steps": "eval_every",
    "loss_type": "loss_agg (dapo = token-mean, grpo = seq-mean-token-mean, dr_grpo = seq-mean-token-sum-norm)",
    "bf16": "dtype=bfloat16",
    "fp16": "dtype=float16",
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "use_vllm": "rollout_backend=vllm",
    "pruning_metric": "selection_metric",
}


def _suggest(key: str, hints) -> str:
    """``" (TRL's name: use lr)"`` for a TRL / transformers name, else the closest setting (:func:`did_you_mean`)."""
    if key in TRL_NAMES:
        return f" (that is TRL's name: here use {TRL_NAMES[key]})"
    close = difflib.get_close_matches(key, [*hints, *TRL_NAMES], n=1, cutoff=0.6)
    if close and close[0] in TRL_NAMES:
        return f" (did you mean TRL's {close[0]!r}? here use {TRL_NAMES[close[0]]})"
    return did_you_mean(key, hints)


def did_you_mean(name: str, choices) -> str:
    """``" (did you mean 'x'?)"`` for the choice closest to ``name``, or ``""`` when none is close."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _field_types() -> dict[str, typing.Any]:
    return typing.get_type_hints(TrainConfig)


def _alternatives(hint) -> tuple:
    """``int | None`` -> (int, NoneType); ``list[str]`` -> (list[str],)."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return typing.get_args(hint) if union else (hint,)


def _check_type(name: str, value, hint) -> None:
    allowed = _alternatives(hint)
    for t in allowed:
        t = typing.get_origin(t) or t
        if t is type(None) and value is None:
            return
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if t is int and isinstance(value, bool):
            continue
        if t is list and isinstance(value, list):
            _check_items(name, value, typing.get_args(_alternatives(hint)[0]))
            return
        if isinstance(t, type) and t is not type(None) and isinstance(value, t):
            return
    raise ValueError(f"{name} must be {_type_name(hint)}, got {_shown(value)}")


def _check_items(name: str, value: list, item_types: tuple) -> None:
    """Each item of a ``list[T]`` setting is a ``T`` (``rewards: [format, [digits]]`` names item 2)."""
    for i, item in enumerate(value, start=1):
        if item_types and not isinstance(item, item_types):
            kinds = " or ".join(_TYPE_WORDS.get(t, t.__name__) for t in item_types)
            raise ValueError(f"{name} must be a list of {kinds}s, but item {i} is {_shown(item)}")


#: Type names as a YAML user reads them (no Python reprs in errors).
_TYPE_WORDS = {str: "name", int: "integer", float: "number", bool: "true/false", list: "list", dict: "mapping"}


def _shown(value) -> str:
    """A value as YAML would write it, with its kind: ``abc (text)``, ``[1, 2] (a list)``."""
    kind = {str: "text", bool: "true/false", int: "an integer", float: "a number", list: "a list", dict: "a mapping"}
    text = yaml.safe_dump(value, default_flow_style=True, width=80).strip().removesuffix("...").strip()
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({kind.get(type(value), type(value).__name__)})" if value is not None else "null"


def _type_name(hint) -> str:
    """A setting's type as a YAML user reads it: ``a number``, ``an integer or null``, ``a list of names``."""
    words = {float: "a number", int: "an integer", str: "text", bool: "true or false", dict: "a mapping"}
    parts = []
    for t in _alternatives(hint):
        if t is type(None):
            parts.append("null")
        elif (typing.get_origin(t) or t) is list:
            parts.append("a list of names" if typing.get_args(t) == (str,) else "a list")
        else:
            parts.append(words.get(t, getattr(t, "__name__", str(t))))
    return " or ".join(parts)


def _check_lora(cfg: TrainConfig) -> None:
    """The LoRA settings (checked whether or not ``use_peft`` is on: a preset carries them either way)."""
    check_int("lora_r", cfg.lora_r, low=1)
    check_int("lora_alpha", cfg.lora_alpha, low=1)
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise ValueError(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    targets = cfg.lora_target_modules
    if isinstance(targets, str) and targets != "all-linear":
        raise ValueError(f"lora_target_modules must be a list of module names or all-linear, got {targets!r}")
    if isinstance(targets, list) and (not targets or ("all-linear" in targets and len(targets) > 1)):
        raise ValueError(f"lora_target_modules must name at least one module, or be all-linear alone, got {targets}")
    if cfg.use_peft and cfg.rollout_backend == "vllm":
        raise ValueError("use_peft: the vllm engine cannot load LoRA adapters yet; set rollout_backend=hf")


def _positive(cfg: TrainConfig, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")


def _coerce(name: str, value, hint):
    """YAML reads ``1e-6`` as a string and ``2`` as an int: convert to the field's type where that is lossless."""
    allowed = _alternatives(hint)
    if float in allowed and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if list in [typing.get_origin(t) or t for t in allowed] and isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(preset_or_yaml: str, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """A :class:`TrainConfig` from a preset name (``cppo/presets/NAME.yaml``) or a YAML file, then ``key=value``
    overrides (values parsed as YAML scalars).

    Raises:
        ValueError: naming where the bad setting came from (the file and line, or the ``--set`` item): malformed
            YAML, an unknown setting (with the closest known name), or a value the setting refuses.
    """
    path = pathlib.Path(preset_or_yaml)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ValueError(f"config file {preset_or_yaml!r} does not exist")
        preset = None
    else:
        if preset_or_yaml not in available_presets():
            raise ValueError(
                f"unknown preset {preset_or_yaml!r}{did_you_mean(preset_or_yaml, available_presets())}: the presets "
                f"are {available_presets()} (or pass a YAML path)"
            )
        preset, path = preset_or_yaml, PRESET_DIR / f"{preset_or_yaml}.yaml"
    values, origin = _read_yaml(path)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r} must look like key=value")
        try:
            values[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ValueError(f"--set {item!r}: {raw!r} is not a YAML value ({_yaml_problem(e)})") from None
        origin[key.strip()] = f"--set {item}"
    hints = _field_types()
    for key in values:
        if key not in hints:
            raise ValueError(
                f"{origin[key]}: unknown setting {key!r}{_suggest(key, hints)}; cppo train --help lists them all"
            )
    values = {k: _coerce(k, v, hints[k]) for k, v in values.items()}
    values.setdefault("preset", preset)
    try:
        config = TrainConfig(**values)
        config.check_sources()
        return config
    except ValueError as e:  # the checks' messages start with the setting's name: say where it was set
        name = re.match(r"\w*", str(e)).group()
        if name not in origin:
            raise
        raise ValueError(f"{origin[name]}: {e}") from None


#: Deepest nesting of a config file (settings are scalars, lists and the tiny model's flat mapping).
MAX_YAML_DEPTH = 16


def _read_yaml(path: pathlib.Path) -> tuple[dict, dict]:
    """The settings of a YAML file and where each was set (``"FILE, line N"``). Refused in one line naming the file:
    aliases (``*name``: a config needs none, and a few hundred bytes of them expand to gigabytes), nesting deeper
    than :data:`MAX_YAML_DEPTH`, and a key written twice in any mapping."""
    try:
        text = path.read_text(encoding="utf-8")
        _check_events(text, path)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        values = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"config {str(path)!r} cannot be read: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config {str(path)!r} is not valid YAML: {_yaml_problem(e)}") from None
    if values is None:
        return {}, {}
    if not isinstance(values, dict):
        raise ValueError(f"config {str(path)!r} must be a YAML mapping of settings, got {type(values).__name__}")
    _check_duplicates(node, path)
    lines = {key.value: key.start_mark.line + 1 for key, _ in node.value}
    return values, {k: f"{path}, line {lines.get(str(k), '?')}" for k in values}


def _check_events(text: str, path: pathlib.Path) -> None:
    """Walks the YAML event stream (no recursion, nothing built): aliases and deep nesting are refused."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise ValueError(f"{path}, line {line}: YAML aliases (*{event.anchor}) are not allowed in a config")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise ValueError(f"{path}, line {line}: nested deeper than {MAX_YAML_DEPTH} levels")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _check_duplicates(node: yaml.Node, path: pathlib.Path) -> None:
    """A key written twice in any mapping of the file is named (YAML keeps the last silently)."""
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            if key.value in lines:
                raise ValueError(
                    f"{path}, line {line}: {key.value!r} is set twice (line {lines[key.value]} and {line})"
                )
            lines[key.value] = line
            _check_duplicates(value, path)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicates(item, path)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """Where and what: ``line L, column C: PROBLEM`` (with what the parser was in, e.g. an unclosed list's line)."""
    if not isinstance(e, yaml.MarkedYAMLError) or e.problem_mark is None:
        return " ".join(str(e).split())
    text = f"line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}: {e.problem}"
    if e.context and e.context_mark is not None:
        text += f" ({e.context} started at line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
    return text
