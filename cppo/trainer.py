"""The CPPO trainer: one step reads top to bottom in :meth:`Trainer.train_step`, each stage a method.

prompts -> rollouts (G each) -> rewards -> cppo.step.selection (advantages over the full group, then prune) -> allocate
+ pack the retained completions -> old / reference log-probs (fused_logprobs) -> mu policy updates
(fused_cppo_loss, micro-batches weighted so that they sum to the whole batch's loss) -> optimizer.

Under torchrun (see :mod:`cppo.distributed`) each rank rolls out its share of the step's questions, selection is
per group, per rank ("batch") or over all ranks ("global"), the survivors are balanced across ranks by token count,
the loss is normalised by the global token / sequence counts and the gradients are synchronised by DDP or FSDP2
(:mod:`cppo.distributed.parallel`), so an update equals the single-process update of the concatenated batch.

Precision: parameters and AdamW state are fp32 whatever ``dtype`` says; ``dtype`` is the compute dtype of the
forward and backward passes (``torch.autocast``; under FSDP2 a mixed-precision policy with fp32 gradient reduction)
and of the rollouts. The frozen reference model is stored in the compute dtype.

Generation ahead of training (``steps_per_generation``, ``max_staleness``) is :mod:`cppo.overlap`'s queue, which
:meth:`Trainer.train_step` takes its draw from. Over 500 lines: the step's stages, the loop, evaluation and
checkpoints read here as one story of one step; each stage's work lives in :mod:`cppo.step`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import time

import torch

from cppo_kernels import fused_cppo_loss, fused_logprobs, use_backend

from . import distributed, step
from .config import TrainConfig
from .distributed import autocast, resolve_device
from .engines import EngineSettings, Rollout, RolloutEngine, make_engine
from .evaluate import evaluate_model, evaluate_split
from .overlap import RolloutQueue, make_queue
from .rollouts import StepRollouts
from .run import (
    TRAINER_KEYS,
    Interrupted,
    PhaseTimer,
    Run,
    StopSignals,
    load_checkpoint,
    metric_reduction,
    open_run,
    plot_run,
    save_checkpoint,
)  # fmt: skip
from .step import PackedBatch, lm_head
from .tasks import QuestionSampler, SelectiveRollout, get_rewards, load_problems, verifier


def _on_kernel_backend(method):
    """Runs ``method`` with the kernels on ``config.kernel_backend`` (``auto`` leaves ``$CPPO_KERNELS_BACKEND``
    in charge); the process environment is never modified."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        backend = self.config.kernel_backend
        with contextlib.nullcontext() if backend == "auto" else use_backend(backend):
            return method(self, *args, **kwargs)

    return wrapper


class Trainer:
    """CPPO training of ``config.model``, in one process or one rank of a torchrun job.

    ``info`` places this process (:class:`cppo.distributed.DistInfo`); by default it is read from torchrun's
    environment (joining the process group) or is the single process on ``config.device``. ``run``: the output
    folder as ``cppo train`` opened it (:func:`cppo.run.folder.open_run`); by default the trainer opens it itself, the
    lock and the look for a run already there waiting until :meth:`train` starts (a checkpoint may be loaded first).
    """

    def __init__(
        self, config: TrainConfig, *, info: distributed.DistInfo | None = None, run: Run | None = None
    ) -> None:
        config.check_sources()  # the model and the data exist (the settings were validated when config was built)
        self.info = info if info is not None else distributed.init_distributed(device=config.device)
        self.config, self.rank, self.world_size = config, self.info.rank, self.info.world_size
        self.pruning = config.pruning
        if self.pruning.questions_drawn % self.world_size:
            raise ValueError(
                f"questions per step ({self.pruning.questions_drawn}) must divide by world_size ({self.world_size})"
            )
        self.device = self.info.device if self.info.distributed else resolve_device(config.device)
        # output_dir writable and the report_to sinks built (so checked) before anything loads
        self.run = run or open_run(config.output_dir, report_to=config.report_to, info=self.info, existing="later")
        self.problems = load_problems(
            config.dataset, split="train", dataset_path=config.dataset_path, max_questions=config.max_questions,
            question_seed=config.training_question_seed,
        )  # fmt: skip
        self.reward_fns = get_rewards(config.rewards)
        verifier(timeout=config.reward_timeout)
        self.sampler = QuestionSampler(len(self.problems), seed=config.seed, rank=self.rank, world_size=self.world_size)
        self.greso = None if not config.greso else SelectiveRollout(
            len(self.problems), seed=config.seed, target_skip_rate=config.greso_target_skip_rate,
            min_explore=config.greso_min_explore, adjust_step=config.greso_adjust_step,
        )  # fmt: skip
        self.num_steps = config.steps_for(len(self.problems))
        self._build_models()
        # after wrapping: FSDP2 replaces the parameters with sharded ones
        self.optimizer = step.make_optimizer(self.model, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = step.make_scheduler(
            self.optimizer, schedule=config.lr_schedule, warmup_ratio=config.warmup_ratio,
            total=self.num_steps * config.mu,
        )  # fmt: skip
        self.rollout = self._make_rollout()
        self.rollouts = StepRollouts(
            self.problems, sampler=self.sampler, greso=self.greso, tokenizer=self.tokenizer, info=self.info,
            system_prompt=config.system_prompt, reward_fns=self.reward_fns, group_size=config.group_size,
            device=self.device,
        )  # fmt: skip
        self.queue = self._make_queue()  # generation ahead of training (None: each step generates its own)
        self.stopping = None if not config.rollout_stop["rate"] else step.RolloutStopping(  # pruning while generating
            config, hidden_size=self.model.config.hidden_size, tokenizer=self.tokenizer, info=self.info)  # fmt: skip
        self.loss_config = config.loss_config
        self.skips = step.SkipCounter(config.max_skipped_updates)
        self.step = 0
        self.last_checkpoint: str | None = None  # the absolute path of the last checkpoint written

    def _build_models(self) -> None:
        """The policy (fp32 master weights; with ``use_peft`` LoRA adapters on a frozen base), the frozen reference
        in the compute dtype (only with ``beta > 0``; with ``use_peft`` no copy: the policy's forward with the
        adapters disabled) and the modules the packed forward runs through: DDP / FSDP2 wrappers under torchrun,
        plain otherwise."""
        cfg = self.config
        self.compute_dtype = getattr(torch, cfg.dtype)
        self.model, self.tokenizer = step.load_model_and_tokenizer(
            cfg.model, model_config=cfg.model_config, dtype="float32", device=self.device, seed=cfg.seed,
            prefix_sharing=cfg.prefix_sharing,
        )  # fmt: skip
        self.logit_transform = step.check_logit_transform(self.model)  # the model's own scale and cap, or refused
        if cfg.gradient_checkpointing:
            step.enable_gradient_checkpointing(self.model)
        if cfg.use_peft:  # only the adapters train; the reference is the policy with them disabled
            self.model = step.apply_lora(
                self.model, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                target_modules=cfg.lora_target_modules, seed=cfg.seed, base_model=cfg.model,
                base_config=cfg.model_config,
            )  # fmt: skip
        self.model.train()
        self.ref_model = None
        if cfg.beta > 0 and not cfg.use_peft:
            self.ref_model = copy.deepcopy(self.model).to(self.compute_dtype).eval().requires_grad_(False)
        wrap = functools.partial(
            distributed.wrap_model, parallelism=cfg.parallelism, info=self.info, forward=step.completion_hidden,
            compute_dtype=self.compute_dtype,
        )  # fmt: skip
        self.policy = wrap(self.model)
        self.ref_policy = wrap(self.ref_model, frozen=True) if self.ref_model is not None else None
        if cfg.beta > 0 and cfg.use_peft:  # the wrapped policy itself (DDP / FSDP2 included), adapters disabled
            reference = functools.partial(step.reference_forward, self.policy)
            self.ref_policy = distributed.ForwardModule(self.model, reference)

    def _make_rollout(self) -> RolloutEngine:
        """The engine ``rollout_backend`` names (:mod:`cppo.engines`), generating in the compute dtype; under FSDP2
        one that generates from the sharded policy, every rank stepping together (refused before it is built)."""
        cfg = self.config
        settings = EngineSettings(
            model_name=cfg.model, max_prompt_length=cfg.max_prompt_length,
            max_completion_length=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
            compute_dtype=self._autocast_dtype, sharded=self._sharded, prefill_once=cfg.prefill_once,
            own_weights=cfg.steps_per_generation > 1 or cfg.max_staleness > 0,
        )  # fmt: skip
        return make_engine(cfg.rollout_backend, self.model, self.tokenizer, settings)

    def _make_queue(self) -> RolloutQueue | None:
        """The queue of draws ahead of training (:func:`cppo.overlap.make_queue`; None: each step generates its own):
        a call of ``steps`` steps' questions whose first trains at step ``first``, seeded by that step."""
        cfg = self.config

        def draw_call(timer: PhaseTimer, steps: int, first: int):
            return self.rollouts.draw_step(
                timer, self._generate, self._reward, pruning=self.pruning, stopping=self.stopping,
                filter_groups=cfg.filter_groups, max_calls=cfg.max_num_gen_batches, seed=self._step_seed(first, 0),
                questions=steps * self.pruning.questions_drawn,
            )  # fmt: skip

        return make_queue(
            cfg, draw_call, info=self.info, device=self.device, sync=self.rollout.sync_weights,
            passed=lambda: self.sampler.passed, seed=lambda first: torch.manual_seed(self._step_seed(first)),
        )  # fmt: skip

    @property
    def _sharded(self) -> bool:
        return self.info.distributed and self.config.parallelism == "fsdp2"

    @property
    def _autocast_dtype(self) -> torch.dtype | None:
        """The dtype the forward passes autocast to: the compute dtype, except under FSDP2, whose mixed-precision
        policy already gathers the parameters in it."""
        return None if self._sharded else self.compute_dtype

    # One step -------------------------------------------------------------------------------------------------

    @_on_kernel_backend
    def train_step(self) -> dict[str, float]:
        """One CPPO step; returns its metrics (docs/training.md lists them)."""
        cfg = self.config
        timer, start = PhaseTimer(self.device), time.perf_counter()
        if self.queue is None or not self.queue.overlap:  # generating ahead: seeded as each call is launched
            torch.manual_seed(self._step_seed())  # sampling draws from the global RNG: reproducible per step

        # generate and reward (call after call with filter_groups / GRESO: cppo.step.dynamic, cppo.tasks.greso)
        if self.queue is None:
            problems, prompts, rollout, rewards, scores, correct, filled, extra = self._draw_step(timer)
            ahead = {}
        else:  # the queue's draw: generated ahead, by a call of several steps, or now
            draw, ahead = self.queue.take(self.step, timer, more=self._trains_after)
            problems, prompts, rollout, rewards, scores, correct, filled, extra = draw.fields()
        with timer("select"):
            batches, num_kept = self._select_and_pack(rewards, rollout, filled)
            passes = batches + self._fillers(batches)  # what every pass runs: the micro-batches, then fillers
        mismatch = cfg.vllm_importance_sampling_correction and all(b.sampling_logprobs is not None for b in passes)
        with timer("logprobs"):
            # before the update: the old policy of mu > 1, and what the engine's sampling log-probs are compared with
            before = self._logprobs(self.policy, passes) if cfg.mu > 1 or mismatch else [None] * len(passes)
            old = before if cfg.mu > 1 else [None] * len(passes)
            ref = self._logprobs(self.ref_policy, passes) if self.ref_policy is not None else [None] * len(passes)
        is_weights, is_metrics = step.correct_batches(
            before, passes, real=len(batches), mode=cfg.vllm_importance_sampling_mode,
            clip_min=cfg.vllm_importance_sampling_clip_min, clip_max=cfg.vllm_importance_sampling_clip_max,
        ) if mismatch else ([None] * len(passes), {})  # fmt: skip

        weights = step.step_weights(self.loss_config, batches, num_passes=len(passes), mu=cfg.mu, info=self.info)
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss, kl, clip_fraction, entropy
        skipped = 0
        for _ in range(cfg.mu):
            with timer("update"):
                self._update(passes, old, ref, weights=weights, into=sums, importance=is_weights)
            with timer("optimizer"):
                grad_norm, applied = self._optimizer_step()
            skipped += not applied

        self.step += 1
        record = self._step_metrics(problems, rollout, rewards, scores, correct, batches, num_kept=num_kept)
        record.update(extra | is_metrics | ahead)
        record.update(dict(zip(("loss", "kl", "clip_fraction", "entropy"), sums.tolist())))
        record.update(grad_norm=grad_norm, lr=self.scheduler.get_last_lr()[0], skipped_updates=skipped)
        record.update({f"time/{k}": v for k, v in timer.seconds.items()})
        record["time/step"] = time.perf_counter() - start
        return distributed.reduce_metrics(record, info=self.info, reductions=metric_reduction)

    # Stages ---------------------------------------------------------------------------------------------------

    def _step_seed(self, step: int | None = None, rank: int | None = None) -> int:
        """The seed of ``step`` (default: this one) for ``rank`` (default: this rank's)."""
        step = self.step if step is None else step
        return (self.config.seed * 1_000_003 + step) * 64 + (self.rank if rank is None else rank)

    def _trains_after(self, step: int) -> bool:
        """Whether a step after ``step`` trains, known as ``step`` takes its draw (generating ahead launches the
        next call only then): the planned steps, and without ``num_steps`` the epochs passed by the draws taken."""
        cfg, n = self.config, self.sampler.num_questions
        if step + 1 >= self.num_steps:
            return False
        return cfg.num_steps is not None or self.queue.taken_passed < cfg.num_epochs * n

    def _draw_step(self, timer: PhaseTimer):
        """The step's generation calls through :meth:`_generate` and :meth:`_reward`
        (:meth:`cppo.rollouts.StepRollouts.draw_step`): what :meth:`train_step` reads."""
        cfg = self.config
        return self.rollouts.draw_step(
            timer, self._generate, self._reward, pruning=self.pruning, stopping=self.stopping,
            filter_groups=cfg.filter_groups, max_calls=cfg.max_num_gen_batches, seed=self._step_seed(rank=0),
        )  # fmt: skip

    def _generate(self, num_questions: int | None = None) -> tuple[list[dict], list[str], Rollout]:
        """This rank's share of the step's questions (``num_questions`` over all ranks, default the step's), their
        prompts, and G sampled completions of each (with ``rollout_stop.rate``, some stopped mid-generation)."""
        stopper = None if self.stopping is None else self.stopping.stopper(self.step, self._step_seed())
        n = num_questions or self.pruning.questions_drawn
        return self.rollouts.generate(self.rollout, n, policy=self.policy, stopper=stopper)

    def _reward(self, problems: list[dict], prompts: list[str], rollout: Rollout):
        """``(rewards [Q * G] fp32, scores by reward function, correct per completion)``."""
        return self.rollouts.reward(problems, prompts, rollout)

    def _select_and_pack(self, rewards: torch.Tensor, rollout: Rollout, filled=None) -> tuple[list[PackedBatch], int]:
        """This rank's micro-batches of retained completions (balanced over the ranks) and how many completions
        this rank's selection kept; ``filled``: dynamic sampling's selection, already made."""
        # advantages over each full group, then this rank's survivors of the scope's official count
        if filled is not None:  # dynamic sampling's, over the survivors where rows were stopped mid-generation
            kept, order = filled.rows(self.config.group_size).sort()  # ascending: a question's rows together
            kept_advantages = filled.selection.kept_advantages[order]
        elif rollout.stopped is not None and any(rollout.stopped):  # over the survivors of pruning while generating
            selected = step.Selection(*step.survivor_selection(rewards, rollout.stopped, self.pruning))
            kept, kept_advantages = selected.kept, selected.kept_advantages
        else:
            selected = self.pruning.select(rewards, seed=self._step_seed(rank=0), info=self.info)
            kept, kept_advantages = selected.kept, selected.kept_advantages  # [K] of [Q * G]
        self.kept_zero = int((kept_advantages == 0).sum())
        sampled = rollout.sampling_logprobs  # the engine's log-probs (vllm), for the mismatch correction
        samples = [
            step.Sample(rollout.prompt_ids[i], rollout.completion_ids[i], a, None if sampled is None else sampled[i])
            for i, a in zip(kept.tolist(), kept_advantages.tolist())
        ]
        # prefix sharing: a question's completions after its prompt once, balanced and packed as one unit
        shared = step.use_prefix_sharing(self.model, self.config.prefix_sharing)
        balanced = step.balance_samples(samples, info=self.info, prefix_sharing=shared)
        pack = step.pack_shared if shared else step.pack_all
        return pack(balanced, self.config.micro_batch_tokens, device=self.device), len(samples)

    def _fillers(self, batches: list[PackedBatch]) -> list[PackedBatch]:
        """Weight-0 repeats of a micro-batch so that every rank runs as many passes (DDP syncs in the last one, FSDP2
        gathers in every one). Every rank has a micro-batch: it holds >= 1 question keeping >= 1 completion, and the
        balancing gives each rank a sequence while any are left."""
        passes = distributed.max_across_ranks(len(batches), info=self.info)
        return [batches[0]] * (passes - len(batches))

    @torch.no_grad()
    def _logprobs(self, policy, batches: list[PackedBatch], *, entropy: bool = False) -> list[torch.Tensor]:
        """Per-token log-probs ``[T]`` (fp32) of each micro-batch's completion tokens under ``policy`` (``entropy``:
        their distributions' entropies ``[T]`` instead)."""
        out = []
        for b in batches:
            hidden, weight, bias = self._hidden_and_head(policy, b)
            head = dict(bias=bias, temperature=self.loss_config.temperature, **self.logit_transform.kwargs())
            values = fused_logprobs(hidden, weight, b.targets, compute_entropy=entropy, **head)
            out.append(values[1] if entropy else values)
        return out

    def _hidden_and_head(self, policy, b: PackedBatch):
        """``(hidden [T, H], LM-head weight [V, H], bias [V] or None)`` of micro-batch ``b`` under ``policy``, all in
        the compute dtype: the forward runs under autocast (the fp32 master weights cast on the fly, gradients
        flowing back to them through the casts)."""
        with autocast(self.device, self._autocast_dtype):
            hidden = policy(b.input_ids, b.position_ids, b.predict_index, b.prefix)  # [T, H]
        weight, bias = lm_head(distributed.unwrap_model(policy))  # after the forward: FSDP2 has unsharded it
        dtype = self.compute_dtype
        return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)

    def _update(self, passes: list[PackedBatch], old: list, ref: list, *, weights: step.StepWeights,
                into: torch.Tensor, importance: list | None = None) -> None:  # fmt: skip
        """One policy update's forward and backward over every pass (gradients synchronised in the last one), each
        loss scaled by its share of the step's loss (:func:`cppo.step.step_weights`; with ``top_entropy_quantile``
        a no-grad pass first finds the step's entropy cut under the policy of this update); adds each micro-batch's
        loss, kl, clip fraction and entropy times its share into ``into [4]`` (on the device: one host sync per step,
        after the updates)."""
        scale = distributed.grad_scale(parallelism=self.config.parallelism, info=self.info)
        importance = importance or [None] * len(passes)
        if self.loss_config.top_entropy_quantile < 1.0:  # the mask cuts at the step's quantile, under this policy
            entropies = self._logprobs(self.policy, passes, entropy=True)[: len(weights.metrics)]  # fillers too: FSDP2
            weights = weights.with_entropy_cut(entropies, info=self.info)
        for k, (b, old_b, ref_b, is_b) in enumerate(zip(passes, old, ref, importance)):
            with distributed.gradient_sync(self.policy, k == len(passes) - 1):
                loss, stats = self._policy_loss(b, old_b, ref_b, is_b, weights=weights, k=k)
                (loss * (weights.loss[k] * scale)).backward()
            if k < len(weights.metrics):  # not a filler
                share = weights.metrics[k]
                clip = stats["clip_fraction_low"] + stats["clip_fraction_high"]
                part = torch.stack([loss.detach(), stats["kl"], clip, stats["entropy"]]).double()
                into += part * part.new_tensor([weights.loss[k] / self.config.mu, share, share, share])

    def _policy_loss(self, b: PackedBatch, old: torch.Tensor | None, ref: torch.Tensor | None, importance=None, *,
                     weights: step.StepWeights | None = None, k: int = 0):  # fmt: skip
        """The fused loss of micro-batch ``b``, pass ``k`` of a step of ``weights`` (its loss options and entropy cut;
        None: the run's options); ``importance``: the mismatch correction's weights, ``[T]`` per token or ``[S]`` per
        sequence (the loss reads which from the shape), or None."""
        hidden, weight, bias = self._hidden_and_head(self.policy, b)
        extra = {} if importance is None else {"importance_weights": importance}
        config, cut = (self.loss_config, None) if weights is None else (weights.config_of(k), weights.threshold_fn())
        return fused_cppo_loss(
            hidden, weight, b.targets, b.advantages, cu_seqlens=b.cu_seqlens, old_logprobs=old, ref_logprobs=ref,
            bias=bias, config=config, entropy_threshold_fn=cut, **self.logit_transform.kwargs(), **extra,
        )  # fmt: skip

    def _optimizer_step(self) -> tuple[float, bool]:
        """Clip, step, schedule; then the rollout engine takes the new weights. A non-finite gradient is not applied
        (``max_skipped_updates`` of them in a row stop the run). Returns the gradient norm and whether it applied."""
        grad_norm, applied = step.optimizer_step(
            self.model, self.optimizer, self.scheduler, max_grad_norm=self.config.max_grad_norm
        )
        self.skips.record(applied, grad_norm=grad_norm, step=self.step + 1)
        if applied and self.queue is None:  # generating ahead: synced before the queue's next call (cppo.overlap)
            self.rollout.sync_weights()
        return grad_norm, applied

    def _step_metrics(self, problems: list[dict], rollout: Rollout, rewards: torch.Tensor, scores: dict, correct: list,
                      batches: list[PackedBatch], *, num_kept: int) -> dict:  # fmt: skip
        """The step's data metrics on this rank (rewards over all ranks); the losses, times etc. are added after."""
        cfg, lengths = self.config, rollout.lengths
        forward_passes = cfg.mu + (cfg.mu > 1) + (self.ref_policy is not None)
        all_rewards, _ = distributed.all_gather_varlen(rewards.to(self.device), info=self.info)  # [Q_all * G]
        return {
            "step": self.step,
            "reward_mean": float(all_rewards.mean()),
            "reward_std": float(all_rewards.std()) if all_rewards.numel() > 1 else 0.0,
            **{f"reward/{name}": sum(v) / len(v) for name, v in scores.items()},
            "accuracy": sum(correct) / len(correct),
            "kept_fraction": num_kept / len(lengths),
            "questions": len(problems),
            "completions": len(lengths),
            "completions_kept": num_kept,
            "completion_length": sum(lengths) / len(lengths),
            "tokens_trained": sum(b.num_tokens for b in batches) * cfg.mu,
            "tokens_forward": sum(b.num_input_tokens for b in batches) * forward_passes,
            **step.phase_tokens(rollout.prefill_positions, sum(lengths), batches, passes=forward_passes),
            "micro_batches": len(batches),
            "kept_zero_advantage": self.kept_zero,
        }

    # Loop, evaluation, checkpoints ----------------------------------------------------------------------------

    def train(self) -> list[dict]:
        """Runs until :meth:`stop_reason` (printed at the end): a progress bar; every ``log_every``-th, evaluated and
        last step's metrics to the ``report_to`` sinks of :attr:`run` (rank 0); checkpoints every ``save_every`` steps
        and at the end; and ``metrics.png`` (reward and phase times) over the whole run."""
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm  # a warning mid-run: a line of its own, above the bar

        cfg = self.config
        history, logged, bar = [], [], None
        try:
            self.run.start(cfg.to_dict(), step=self.step)  # the lock; a new run never mixes with one already there
            bar = tqdm(total=self.num_steps, initial=self.step, desc="cppo", disable=self.rank != 0, dynamic_ncols=True)
            with StopSignals() as stop, logging_redirect_tqdm(loggers=[logging.getLogger("cppo")]):
                while self.stop_reason() is None:
                    record = self._step_and_log(logged)
                    history.append(record)
                    bar.update(1)
                    bar.set_postfix(reward=f"{record['reward_mean']:.3f}", acc=f"{record['accuracy']:.2f}")
                    saved = cfg.save_every and self.step % cfg.save_every == 0
                    if saved:
                        self.save_checkpoint(self._checkpoint_path())
                    self._stop_if_signalled(stop, saved=bool(saved))
            bar.close()
            if self.rank == 0:
                print(f"cppo: stopped: {self.stop_reason()}", flush=True)
            if not cfg.save_every or self.step % cfg.save_every:
                self.save_checkpoint(self._checkpoint_path())
        finally:
            if bar is not None:
                bar.close()
            if self.queue is not None:
                self.queue.close()
            self.run.finish()
        if self.rank == 0:  # metrics.png over the whole run
            plot_run(cfg.output_dir, log_kept="jsonl" in self.run.sink_names, logged=logged)  # unless it failed
        return history

    def _step_and_log(self, logged: list[dict]) -> dict:
        """One step, its evaluation when due (every ``eval_every`` steps and after the last, as the official runs),
        and its record to the sinks when due."""
        cfg = self.config
        record = self.train_step()
        last = self.stop_reason() is not None  # the run's last step: evaluated and logged
        evaluated = bool(cfg.eval_every) and (self.step % cfg.eval_every == 0 or last)
        if evaluated:  # the counts to the sinks, the per-problem records to OUTPUT_DIR/eval/ (Run.save_evaluation)
            result = self.run.save_evaluation(self.evaluate(limit=cfg.eval_limit), self.step)
            record.update({f"eval/{k}": v for k, v in result.items()})
        if evaluated or self.step % cfg.log_every == 0 or last:
            logged.append(record)
            self.run.log(record, self.step)
        return record

    def _stop_if_signalled(self, stop: StopSignals, *, saved: bool) -> None:
        """At the safe point after a step: when any rank received SIGINT / SIGTERM, every rank saves this step (unless
        just saved) and raises :class:`cppo.run.interrupt.Interrupted` (the ranks agree, so none waits for another)."""
        signum = distributed.max_across_ranks(stop.received or 0, info=self.info)
        if not signum:
            return
        path = self._checkpoint_path()
        if not saved:
            self.save_checkpoint(path)
        raise Interrupted(signum, step=self.step, checkpoint=path)

    def stop_reason(self) -> str | None:
        """Why the run ends after this step (None: it goes on). ``num_steps`` set: after that many steps. Otherwise
        after the planned ``num_epochs`` passes' steps (``num_steps``, which the learning-rate schedule spans) or as
        soon as the question sampler has passed ``num_epochs`` epochs (GRESO's skips count as passed), whichever
        comes first: verl's epochs of the data. A plain step draws its fixed count, so the two agree; with
        ``filter_groups`` / ``greso`` a step passes more questions, the run ends early and the schedule is cut short
        (a truncated cosine). The sampler's position is the same on every rank, so every rank stops together."""
        cfg, n = self.config, self.sampler.num_questions
        if self.step >= self.num_steps:
            return f"{self.step} of {self.num_steps} planned steps done"
        passed = self.sampler.passed  # generating ahead: the questions of the draws trained, not of those queued
        passed = passed if self.queue is None or self.queue.taken_passed is None else self.queue.taken_passed
        if cfg.num_steps is None and passed >= cfg.num_epochs * n:
            return (
                f"num_epochs={cfg.num_epochs} epochs of the {n} questions used up after step {self.step} (planned "
                f"{self.num_steps} steps; the learning-rate schedule is cut short there)"
            )
        return None

    def _checkpoint_path(self) -> str:
        return os.path.join(self.config.output_dir, f"checkpoint-{self.step:06d}")

    def evaluate(self, limit: int | None = None) -> dict:
        """Greedy accuracy on the dataset's test split (``limit`` problems at most) under the official protocol of
        its kind (see :mod:`cppo.evaluate`), ``max_completion_length`` new tokens; ``distinct_problems`` counts the
        distinct questions among them. Under DDP the ranks split the
        problems and sum their counts; under FSDP2 every rank decodes all of them (the shards gather in step)."""
        cfg = self.config
        problems = load_problems(cfg.dataset, split="test", dataset_path=cfg.dataset_path, max_questions=limit)
        if self.queue is not None:  # the call generating ahead waited for, the engine on this policy
            self.queue.sync_for_use(self.step)
        rollout = self.rollout.for_evaluation()  # the engine's greedy decoder (the engine itself for hf and vllm)
        if self._sharded:
            with distributed.root_unsharded(self.policy):
                result = evaluate_model(rollout, self.tokenizer, problems, system_prompt=cfg.system_prompt)
        else:
            result = evaluate_split(rollout, self.tokenizer, problems, info=self.info, system_prompt=cfg.system_prompt)
        return {**result, "distinct_problems": len({p["question"] for p in problems})}

    def save_checkpoint(self, path: str) -> str:
        """Writes a checkpoint of the model, optimizer, scheduler, data position, RNG states and step (see
        :mod:`cppo.run.checkpoint`); call it on every rank. Returns its absolute path."""
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "config": self.config.to_dict()}
        for name, part in (("greso", self.greso), ("rollout_stop", self.stopping)):  # GRESO's history, the head
            state.update({name: part.state_dict()} if part is not None else {})  # (resumed as if never stopped)
        if self.queue is not None:  # each rank's draws generated ahead (rank 0 writes the state)
            state["rollout_queue"] = distributed.all_gather_objects(self.queue.state_dict(), info=self.info)
        self.last_checkpoint = save_checkpoint(
            path, module=self.policy, tokenizer=self.tokenizer, optimizer=self.optimizer, scheduler=self.scheduler,
            state=state, info=self.info,
        )  # fmt: skip
        return self.last_checkpoint

    def load_checkpoint(self, path: str) -> None:
        """Restores model weights, optimizer, scheduler, data position, RNG states and step from ``path`` (on every
        rank; a sharded FSDP2 checkpoint needs the world size that wrote it)."""
        state = load_checkpoint(
            path, module=self.policy, optimizer=self.optimizer, scheduler=self.scheduler, info=self.info,
            required=TRAINER_KEYS,
        )  # fmt: skip
        # lr, weight decay, schedule: this run's
        step.apply_settings(self.optimizer, self.scheduler, lr=self.config.lr, weight_decay=self.config.weight_decay)
        self.sampler.load_state_dict(state["sampler"])
        for name, part in (("greso", self.greso), ("rollout_stop", self.stopping)):
            if part is not None and name in state:
                part.load_state_dict(state[name])
        if self.queue is not None and "rollout_queue" in state:
            self.queue.load_state_dict(state["rollout_queue"], rank=self.rank, world_size=self.world_size)
        self.step = int(state["step"])
        self.rollout.sync_weights()
        if self.queue is not None:
            self.queue.engine_at(self.step)
