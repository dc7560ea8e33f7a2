"""A :class:`~cppo.config.settings.TrainConfig` checked as a whole (:func:`check_config`): each setting's type and
range, then each component's check of its own settings (the engines, the sinks, the loss, pruning while generating,
LoRA, ...), imported as it runs (they import torch, the settings do not), every refusal marked with the setting it is
about (:func:`~cppo.config.values.naming`), so that :func:`~cppo.config.load_config` says where that setting was set
without reading the message."""

from __future__ import annotations

from .choices import DTYPES, KERNEL_BACKENDS, LR_SCHEDULES, MAX_SEED
from .values import check_type, naming


def check_config(cfg, types: dict) -> None:
    """A :class:`~cppo.config.settings.TrainConfig` checked as a whole (``types``: each setting's type): each
    setting's type and range, the pruning policy built (:class:`cppo.step.Pruning` checks its settings and their
    rule), then each component's own check (:func:`check_components`). ``ValueError`` naming the first bad setting,
    marked with it (:func:`naming`)."""
    from cppo_kernels.config import check_float

    for name, hint in types.items():
        with naming(name):
            check_type(name, getattr(cfg, name), hint)
            if isinstance(getattr(cfg, name), float):
                check_float(name, getattr(cfg, name))  # no inf or nan reaches the run
    positive(cfg, "group_size", "max_prompt_length", "max_completion_length", "questions_per_step", "mu")
    positive(cfg, "micro_batch_tokens", "num_epochs", "log_every")
    for name in ("num_steps", "max_questions", "eval_limit"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            with naming(name):
                raise ValueError(f"{name} must be >= 1 or null, got {getattr(cfg, name)}")
    for name in ("save_every", "eval_every"):
        if getattr(cfg, name) < 0:
            with naming(name):
                raise ValueError(f"{name} must be >= 0 (0 = never), got {getattr(cfg, name)}")
    with naming("group_size"):
        if cfg.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are relative within a group), got {cfg.group_size}")
    with naming("micro_batch_tokens"):
        if cfg.micro_batch_tokens < cfg.max_prompt_length + cfg.max_completion_length:
            raise ValueError(
                f"micro_batch_tokens={cfg.micro_batch_tokens} must be >= max_prompt_length + "
                f"max_completion_length = {cfg.max_prompt_length + cfg.max_completion_length} (one sequence must "
                "fit a micro-batch)"
            )
    cfg.pruning  # noqa: B018  pruning_rate, selection_scope, selection_metric, allocation, questions_per_step
    with naming("max_num_gen_batches"):
        if cfg.max_num_gen_batches < 1:
            raise ValueError(
                f"max_num_gen_batches must be >= 1 (generation calls per step with filter_groups; there is no "
                f"unbounded 0 as in verl), got {cfg.max_num_gen_batches}"
            )
    check_components(cfg)


def loss_refusal(build, flat: dict, extra: dict, refusal: ValueError) -> ValueError:
    """``LossConfig``'s refusal of the loss's options, marked with the setting it is about (:func:`naming`): the option
    whose value alone ``build`` refuses the same way, an option of the ``loss`` section named as the section does
    (``loss.NAME ...``); a rule between options is the section's."""
    for name, value in {**flat, **extra}.items():
        try:
            build(**{name: value})
        except ValueError as alone:
            if str(alone) == str(refusal):
                marked = ValueError(f"loss.{alone}") if name in extra else refusal
                marked.settings = ("loss",) if name in extra else (name,)
                return marked
    refusal.settings = ("loss",)
    return refusal


def check_components(cfg) -> None:
    """Each component's check of its own settings (the greso sampler, pruning while generating, the engines, the
    importance weights, the sinks, the loss, the optimiser, the rewards, the device, LoRA), imported here: they
    import torch, the settings do not."""
    from cppo_kernels.config import check_choice, check_float, check_int

    from ..distributed import PARALLELISMS, check_device
    from ..engines import check_engine_name
    from ..run import check_report_to
    from ..step import check_mode
    from ..tasks import check_arith_eval_limit, check_greso, check_timeout

    with naming("greso_target_skip_rate", "greso_min_explore", "greso_adjust_step"):  # each named in its message
        check_greso(cfg.greso_target_skip_rate, cfg.greso_min_explore, cfg.greso_adjust_step)
    _check_rollout_stop(cfg)
    _check_overlap(cfg)
    _named_checks(
        parallelism=lambda: check_choice("parallelism", cfg.parallelism, PARALLELISMS),
        lr_schedule=lambda: check_choice("lr_schedule", cfg.lr_schedule, LR_SCHEDULES),
        rollout_backend=lambda: check_engine_name(cfg.rollout_backend),
        vllm_importance_sampling_mode=lambda: check_mode(cfg.vllm_importance_sampling_mode),
    )
    low, high = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    for name, value in (("clip_min", low), ("clip_max", high)):
        if value is not None:
            with naming(f"vllm_importance_sampling_{name}"):
                check_float(f"vllm_importance_sampling_{name}", value, low=0.0)
    with naming("vllm_importance_sampling_clip_min"):
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"vllm_importance_sampling_clip_min={low} must be <= vllm_importance_sampling_clip_max={high}"
            )
    _named_checks(
        report_to=lambda: check_report_to(cfg.report_to),
        kernel_backend=lambda: check_choice("kernel_backend", cfg.kernel_backend, KERNEL_BACKENDS),
        loss=lambda: cfg.loss_config,  # temperature, epsilon_low / high, beta, ... (each marked by loss_config)
        top_p=lambda: _in_range("top_p", cfg.top_p, "(0, 1]", 0.0 < cfg.top_p <= 1.0),
        lr=lambda: check_float("lr", cfg.lr, low=0.0),
        weight_decay=lambda: check_float("weight_decay", cfg.weight_decay, low=0.0),
        max_grad_norm=lambda: check_float("max_grad_norm", cfg.max_grad_norm, low=0.0, low_open=True),
        max_skipped_updates=lambda: check_int("max_skipped_updates", cfg.max_skipped_updates, low=1),
        seed=lambda: check_int("seed", cfg.seed, low=0, high=MAX_SEED),
        question_seed=lambda: (
            cfg.question_seed is None or check_int("question_seed", cfg.question_seed, low=0, high=MAX_SEED)
        ),
        warmup_ratio=lambda: _in_range("warmup_ratio", cfg.warmup_ratio, "[0, 1)", 0.0 <= cfg.warmup_ratio < 1.0),
        rewards=lambda: cfg.rewards or _refuse("rewards must name at least one reward function"),
        reward_timeout=lambda: check_timeout(cfg.reward_timeout),
        eval_limit=lambda: check_arith_eval_limit(cfg.dataset, cfg.eval_limit),
        dtype=lambda: check_choice("dtype", cfg.dtype, DTYPES),
        device=lambda: check_device(cfg.device),
        use_peft=lambda: _check_lora(cfg),  # each LoRA setting marked by its own check, use_peft's rule here
    )


def _check_lora(cfg) -> None:
    """The LoRA settings (checked whether or not ``use_peft`` is on: a preset carries them either way)."""
    from cppo_kernels.config import check_int

    from ..engines import engine_supports

    _named_checks(
        lora_r=lambda: check_int("lora_r", cfg.lora_r, low=1),
        lora_alpha=lambda: check_int("lora_alpha", cfg.lora_alpha, low=1),
        lora_dropout=lambda: _in_range("lora_dropout", cfg.lora_dropout, "[0, 1)", 0.0 <= cfg.lora_dropout < 1.0),
    )
    targets = cfg.lora_target_modules
    with naming("lora_target_modules"):
        if isinstance(targets, str) and targets != "all-linear":
            raise ValueError(f"lora_target_modules must be a list of module names or all-linear, got {targets!r}")
        if isinstance(targets, list) and (not targets or ("all-linear" in targets and len(targets) > 1)):
            raise ValueError(
                f"lora_target_modules must name at least one module, or be all-linear alone, got {targets}"
            )
    if cfg.use_peft and not engine_supports(cfg.rollout_backend, "supports_lora"):
        raise ValueError(  # (marked use_peft by _check_components)
            f"use_peft: rollout_backend={cfg.rollout_backend!r} cannot generate from a LoRA policy; set "
            "rollout_backend=hf"
        )


def _check_rollout_stop(cfg) -> None:
    """The ``rollout_stop`` section (issue 38): each option's own value; with ``rollout_stop.rate`` > 0 (the feature
    on) the checkpoint against ``max_completion_length`` and what the feature composes with today. Off, where its
    checkpoint would fall refuses nothing (issue 49: ``max_completion_length=1`` with the default 0.25)."""
    from cppo_kernels.config import check_choice, check_float, check_int

    from ..engines import checkpoint_tokens
    from ..step import SCORERS

    stop = cfg.rollout_stop
    with naming("rollout_stop"):
        check_float("rollout_stop.rate", stop["rate"], low=0.0)
        check_choice("rollout_stop.scorer", stop["scorer"], SCORERS)
        check_int("rollout_stop.warmup", stop["warmup"], low=0)
        if stop["rate"] == 0.0:
            return
        checkpoint_tokens(stop["at"], cfg.max_completion_length)
        _check_stop_rate(cfg, stop["rate"])


def _check_stop_rate(cfg, rate: float) -> None:
    """What pruning while generating composes with: at most ``pruning_rate``, and the settings and engines it runs
    with today."""
    from ..engines import engine_supports

    if rate > cfg.pruning_rate:
        raise ValueError(
            f"rollout_stop.rate={rate} must be <= pruning_rate={cfg.pruning_rate}: CPPO's selection after generation "
            "keeps (1 - pruning_rate) of each group, which the stopped completions cannot supply"
        )
    blockers = {  # fsdp2: the ranks of a sharded policy must decode in lockstep, and stopping rows breaks it
        "selection_metric": cfg.selection_metric != "smallest", "selection_scope": cfg.selection_scope == "global",
        "parallelism": cfg.parallelism == "fsdp2",
    }  # fmt: skip
    named = [k for k, v in blockers.items() if v]
    if named:
        raise ValueError(
            f"rollout_stop.rate > 0 runs with selection_metric smallest, selection_scope group or batch, "
            f"parallelism ddp; this config sets {named}"
        )
    if not engine_supports(cfg.rollout_backend, "supports_stopping"):
        raise ValueError(
            f"rollout_stop.rate > 0: rollout_backend={cfg.rollout_backend!r} cannot stop completions mid-generation; "
            "set rollout_backend=hf"
        )


def _check_overlap(cfg) -> None:
    """``max_staleness`` and ``steps_per_generation`` (generation ahead of training: :mod:`cppo.overlap`): each one's
    range, their rule (one call's last step trains its rollouts ``steps_per_generation - 1`` updates late), and with
    generation ahead of training what it composes with."""
    from cppo_kernels.config import check_int

    from ..engines import engine_supports

    _named_checks(
        max_staleness=lambda: check_int("max_staleness", cfg.max_staleness, low=0),
        steps_per_generation=lambda: check_int("steps_per_generation", cfg.steps_per_generation, low=1),
    )
    if cfg.steps_per_generation - 1 > cfg.max_staleness:
        with naming("steps_per_generation"):
            raise ValueError(
                f"steps_per_generation={cfg.steps_per_generation} trains the last step of a generation call on "
                f"rollouts {cfg.steps_per_generation - 1} optimizer steps old, past max_staleness={cfg.max_staleness}: "
                f"set max_staleness >= {cfg.steps_per_generation - 1} (or {cfg.steps_per_generation} to generate the "
                "next call while these steps train)"
            )
    with naming("steps_per_generation"):
        if cfg.steps_per_generation > 1 and cfg.filter_groups:
            raise ValueError(
                "steps_per_generation > 1 with filter_groups: dynamic sampling fills one step's budget call after "
                "call, so a call cannot serve several steps; set steps_per_generation=1 (max_staleness=1 still "
                "generates the next step while this one trains)"
            )
    if cfg.max_staleness == 0:
        return
    with naming("max_staleness"):
        if cfg.rollout_stop["rate"] > 0:
            raise ValueError(
                "max_staleness > 0 with rollout_stop.rate > 0: pruning while generating reads the policy's hidden "
                "states mid-generation, which the step training beside it changes; set one of them to 0"
            )
        if cfg.parallelism == "fsdp2":
            raise ValueError(
                "max_staleness > 0 with parallelism fsdp2: a sharded policy generates with every rank gathering its "
                "shards in step, which a step training beside it cannot share; use parallelism ddp"
            )
        if not engine_supports(cfg.rollout_backend, "supports_overlap"):
            raise ValueError(
                f"max_staleness > 0: rollout_backend={cfg.rollout_backend!r} cannot generate while the policy trains "
                "(it needs weights of its own, synced when a step ends); set rollout_backend to vllm or hf"
            )


def positive(cfg, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            with naming(name):
                raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")


def _named_checks(**checks) -> None:
    """Each check in turn, a ``ValueError`` marked with the setting it checks (the keyword's name)."""
    for name, check in checks.items():
        with naming(name):
            check()


def _in_range(name: str, value: float, interval: str, inside: bool) -> None:
    if not inside:
        raise ValueError(f"{name} must be in {interval}, got {value}")


def _refuse(message: str) -> None:
    raise ValueError(message)
