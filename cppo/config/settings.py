"""Training configuration: one dataclass of every setting with its one-line meaning, plain data (importing it imports
no torch), its checks (``validate``, run on construction: each component checks its own settings, imported when the
check runs) and the settings a resume compares (:meth:`TrainConfig.changes_from`). Loading it from a preset or a YAML
file: :mod:`cppo.config.loading`."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from .checks import check_config, loss_refusal
from .choices import LORA_TARGET_MODULES, RESUMABLE
from .pruning import HoldsPruning, pruning_setting
from .sections import rollout_stop_defaults, rollout_stop_help, rollout_stop_section, with_rollout_stop_section
from .values import check_type, did_you_mean, naming


def setting(default, help: str, *, factory=None):
    """A :class:`TrainConfig` field with its one-line meaning (``cppo train --help`` lists them all)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def setting_help() -> dict[str, str]:
    """Each setting's one-line meaning, in declaration order."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}


@dataclass
class TrainConfig(HoldsPruning):
    """Every setting of a CPPO run. ``validate()`` (run on construction, once) rejects bad values naming the
    setting; it reads no file: whether the model and the data exist is checked where they load
    (:func:`~cppo.config.sources.check_model_and_data`, by the trainer and the CLI before anything trains).

    The pruning rule (counts, scopes, allocation) is :class:`cppo.step.Pruning`, built once: :attr:`pruning`.
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
    pruning_rate: float = pruning_setting("pruning_rate")
    selection_scope: str = pruning_setting("selection_scope")
    selection_metric: str = pruning_setting("selection_metric")
    allocation: bool = pruning_setting("allocation")
    questions_per_step: int = setting(1, "questions a GRPO step draws (over all processes)")
    filter_groups: bool = setting(
        False,
        "dynamic sampling (DAPO; verl algorithm.filter_groups): drop questions whose G rewards are all equal before "
        "pruning and generate more until the kept budget is filled with non-zero advantages",
    )
    max_num_gen_batches: int = setting(
        4, "filter_groups: generation calls per step at most (verl's name; >= 1), then the step trains what it has"
    )
    greso: bool = setting(
        False,
        "GRESO (arXiv 2506.02177): skip, before rollout, questions whose recent groups were all zero-variance, "
        "with a probability adapting to greso_target_skip_rate",
    )
    greso_target_skip_rate: float = setting(0.5, "greso: the share of considered questions to skip, in [0, 1)")
    greso_min_explore: float = setting(
        0.05, "greso: exploration floor, in (0, 1]: a question is kept with at least this probability"
    )
    greso_adjust_step: float = setting(0.01, "greso: how far the exploration probability moves per draw, in (0, 1]")
    # pruning while generating: the rollout_stop: section, its options declared in sections.py
    rollout_stop: dict = setting(None, rollout_stop_help(), factory=rollout_stop_defaults)
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
    loss: dict = setting(
        None, "the loss's other options, as fields of cppo_kernels.LossConfig (surrogate, importance_sampling, "
        "delta, dual_clip, entropy_coef, top_entropy_quantile, ...) or loss_type (TRL's name: its surrogate and "
        "loss_agg); --set loss.NAME=VALUE", factory=dict,
    )  # fmt: skip
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
    num_epochs: int = setting(
        1, "epochs over the training questions when num_steps is null (the run ends when the sampler has passed them)"
    )
    max_questions: int | None = setting(None, "use only the first N training questions (null: all)")
    # rewards and back-ends
    rewards: list[str] = setting(
        None, "reward functions summed into the reward, e.g. format,accuracy", factory=lambda: ["format", "accuracy"]
    )
    reward_timeout: float = setting(
        0.5, "seconds math-verify may spend on one MATH completion (a worker process is killed past it; scores 0)"
    )
    rollout_backend: str = setting(
        "auto",
        "auto (vllm where installed and able to run the model, one process; else hf), hf (transformers generate), "
        "vllm, or a registered engine",
    )
    prefill_once: bool = setting(
        True, "hf engine: run each prompt's forward once and share its KV cache with its G completions (same tokens)"
    )
    vllm_importance_sampling_correction: bool = setting(
        True, "weigh the loss by exp(training - sampling log-prob) where the engine reports the latter (vllm), as TRL"
    )
    vllm_importance_sampling_mode: str = setting(
        "sequence_mask", "token_truncate, token_mask, sequence_truncate or sequence_mask (TRL's modes and default)"
    )
    vllm_importance_sampling_clip_max: float | None = setting(3.0, "upper bound C_max of the IS ratio (null: none)")
    vllm_importance_sampling_clip_min: float | None = setting(None, "lower bound C_min of the IS ratio (null: none)")
    # generation ahead of training (TRL's names: AsyncGRPOTrainer's max_staleness, GRPOConfig's steps_per_generation)
    max_staleness: int = setting(
        0, "generate the next step's rollouts while this step trains (0: off, today's run): rollouts are trained at "
        "most N optimizer steps after the weights that sampled them, the stale behaviour corrected by the importance "
        "weights (vllm_importance_sampling_*)",
    )  # fmt: skip
    steps_per_generation: int = setting(
        1, "steps whose questions one generation call draws (TRL's name; each step then trains its own share); "
        "needs max_staleness >= steps_per_generation - 1",
    )  # fmt: skip
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
        with naming("rollout_stop"):  # the options a user set, completed with the defaults
            self.rollout_stop = rollout_stop_section(self.rollout_stop)
        self.validate()

    def pruning_fields(self) -> dict:
        """The fields of the run's :attr:`pruning` policy (built and validated on construction, the same object on
        every read: the trainer, the CLI, the counts here)."""
        return dict(
            group_size=self.group_size, pruning_rate=self.pruning_rate, scope=self.selection_scope,
            metric=self.selection_metric, allocation=self.allocation, questions_per_step=self.questions_per_step,
        )  # fmt: skip

    def steps_for(self, problems: int) -> int:
        """Training steps over ``problems`` questions: ``num_steps``, else ``num_epochs`` passes (at least 1)."""
        return self.num_steps or max(1, self.num_epochs * problems // self.pruning.questions_drawn)

    @property
    def loss_config(self):  # -> cppo_kernels.LossConfig (imported here: it imports torch)
        """The options of ``fused_cppo_loss``: the flat settings, then the ``loss`` section's (its ``loss_type``
        expanded to TRL's surrogate and aggregation), with entropy (a step metric); ``LossConfig`` validates them.
        A ``loss`` key that is not a ``LossConfig`` field, or names a flat setting, is refused naming it."""
        from cppo_kernels import LossConfig
        from cppo_kernels.config import LOSS_TYPES

        extra = dict(self.loss)
        flat = dict(
            temperature=self.temperature, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
            beta=self.beta, kl_estimator=self.kl_estimator, loss_agg=self.loss_agg,
            max_completion_length=self.max_completion_length, compute_entropy=True,
        )  # fmt: skip
        fields = {f.name for f in dataclasses.fields(LossConfig)}
        for key in extra:
            if key == "compute_entropy":  # a field of LossConfig the trainer sets itself, not a setting
                raise ValueError(
                    "loss.compute_entropy: cppo train always computes the entropy (each step's entropy metric); "
                    "remove loss.compute_entropy"
                )
            if key in flat:
                raise ValueError(f"loss.{key}: {key} is a setting of its own; set {key}={extra[key]!r}")
            if key not in fields | {"loss_type"}:
                raise ValueError(
                    f"loss.{key}: not an option of the loss{did_you_mean(key, sorted(fields | {'loss_type'}))}; the "
                    f"options are loss_type and {sorted(fields - set(flat))}"
                )
        for key, hint in loss_field_types().items():
            if key in extra:
                check_type(f"loss.{key}", extra[key], hint)  # in the user's words, as a flat setting's
        loss_type = extra.pop("loss_type", None)
        if loss_type is not None:
            if loss_type not in LOSS_TYPES:
                raise ValueError(f"loss.loss_type must be one of {sorted(LOSS_TYPES)} (TRL's), got {loss_type!r}")
            if "surrogate" in extra:
                raise ValueError(f"loss.loss_type={loss_type} sets the surrogate; do not also set loss.surrogate")
            extra["surrogate"], extra["loss_agg"] = LOSS_TYPES[loss_type]  # (the flat loss_agg's default gives way)
            default = TrainConfig.__dataclass_fields__["loss_agg"].default
            if self.loss_agg not in (default, extra["loss_agg"]):  # set both ways: one of them would be dropped
                raise ValueError(
                    f"loss.loss_type={loss_type} aggregates by {extra['loss_agg']}, but loss_agg={self.loss_agg}: "
                    "set one of them"
                )
        try:
            return LossConfig(**{**flat, **extra})
        except ValueError as e:
            raise loss_refusal(LossConfig, flat, extra, e) from None

    def validate(self) -> None:
        """Raises ``ValueError`` naming the first bad setting (and marked with it): the config checked as a whole
        (:func:`~cppo.config.checks.check_config`: each setting's type and range, then each component's own check of
        its settings, imported as it runs)."""
        check_config(self, field_types())

    @property
    def training_question_seed(self) -> int:
        """The seed that picks the training questions: ``question_seed``, else ``seed``."""
        return self.seed if self.question_seed is None else self.question_seed

    def check_sources(self) -> None:
        """Whether the model and the data exist (:func:`~cppo.config.sources.check_model_and_data`) and the rollout
        engine's packages are installed: the checks of this machine, apart from :meth:`validate`; the trainer and
        :func:`load_config` run them before anything loads."""
        from ..engines import check_engine_installed
        from .sources import check_model_and_data

        with naming("rollout_backend"):
            check_engine_installed(self.rollout_backend)
        check_model_and_data(
            model=self.model, model_config=self.model_config, dataset=self.dataset,
            dataset_path=self.dataset_path, dtype=self.dtype, device=self.device,
        )  # fmt: skip

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def changes_from(self, saved: dict) -> list[str]:
        """What differs between the settings a checkpoint was saved with (``saved``: :meth:`to_dict`) and these,
        except the :data:`RESUMABLE` ones: ``"name: saved -> now"`` each. A setting the checkpoint predates counts as
        its default; one saved before the ``rollout_stop`` section (its flat ``rollout_stop_*`` names) counts as the
        section they set."""
        changes, defaults, saved = [], TrainConfig().to_dict(), with_rollout_stop_section(saved)
        for f in dataclasses.fields(TrainConfig):
            if f.name in RESUMABLE:
                continue
            was, now = saved.get(f.name, defaults[f.name]), getattr(self, f.name)
            if was != now:
                changes.append(f"{f.name}: {was!r} -> {now!r}")
        return changes


def field_types() -> dict[str, typing.Any]:
    """The type of each setting (the fields' annotations, not the class variables')."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def loss_field_types() -> dict[str, typing.Any]:
    """The type of each option of the ``loss`` section (the fields of :class:`cppo_kernels.LossConfig`)."""
    from cppo_kernels import LossConfig

    return typing.get_type_hints(LossConfig)
