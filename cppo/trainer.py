"""The CPPO trainer: one step reads top to bottom in :meth:`Trainer.train_step`.

prompts -> rollouts (G each) -> rewards -> cppo_select (advantages over the full group, then prune) -> allocate
+ pack the retained completions -> old / reference log-probs (fused_logprobs) -> mu policy updates
(fused_cppo_loss, micro-batches weighted so that they sum to the whole batch's loss) -> optimizer.

Under torchrun (see :mod:`cppo.distributed`) each rank rolls out its share of the step's questions, selection is
per group, per rank ("batch") or over all ranks ("global"), the survivors are balanced across ranks by token count,
the loss is normalised by the global token / sequence counts and the gradients are synchronised by DDP or FSDP2,
so an update equals the single-process update of the concatenated batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import glob
import os
import time

import torch

from cppo_kernels import cppo_select, fused_cppo_loss, fused_logprobs, group_advantages, use_backend

from . import checkpoint, distributed, metrics
from .config import TrainConfig
from .data import QuestionSampler, build_prompt, load_problems
from .models import lm_head, load_model_and_tokenizer, packed_hidden, resolve_device
from .packing import PackedBatch, Sample, loss_weight, pack_all
from .rewards import FORMAT_RE, get_rewards, is_correct, score_all
from .rollout import HFRollout, make_rollout


class PhaseTimer:
    """Accumulates wall seconds per phase (synchronising CUDA so GPU work lands in the right phase)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds = device, {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


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
    environment (joining the process group) or is the single process on ``config.device``.
    """

    def __init__(self, config: TrainConfig, *, info: distributed.DistInfo | None = None) -> None:
        config.validate()
        self.info = info if info is not None else distributed.init_distributed(device=config.device)
        self.config, self.rank, self.world_size = config, self.info.rank, self.info.world_size
        world_size = self.world_size
        if config.questions_drawn % world_size:
            raise ValueError(f"questions per step ({config.questions_drawn}) must divide by world_size ({world_size})")
        self.device = self.info.device if self.info.distributed else resolve_device(config.device)
        self.problems = load_problems(
            config.dataset, split="train", dataset_path=config.dataset_path, max_questions=config.max_questions
        )
        self.reward_fns = get_rewards(config.rewards)
        self.sampler = QuestionSampler(len(self.problems), seed=config.seed, rank=self.rank, world_size=world_size)
        self.num_steps = config.num_steps or max(1, config.num_epochs * len(self.problems) // config.questions_drawn)

        self.model, self.tokenizer = load_model_and_tokenizer(
            config.model, model_config=config.model_config, dtype=config.dtype, device=self.device, seed=config.seed
        )
        self.model.train()
        self.ref_model = None
        if config.beta > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        # the modules the packed forward runs through: DDP / FSDP2 wrappers under torchrun, plain otherwise
        self.policy = self._wrap(self.model)
        self.ref_policy = self._wrap(self.ref_model, frozen=True) if self.ref_model is not None else None
        # after wrapping: FSDP2 replaces the parameters with sharded ones
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = _scheduler(self.optimizer, config, total=self.num_steps * config.mu)
        self.rollout = make_rollout(
            config.rollout_backend,
            self.model,
            self.tokenizer,
            model_name=config.model,
            max_prompt_length=config.max_prompt_length,
            max_completion_length=config.max_completion_length,
            temperature=config.temperature,
            top_p=config.top_p,
        )
        if self._sharded:
            if not isinstance(self.rollout, HFRollout):
                raise ValueError("parallelism='fsdp2' generates with transformers: set rollout_backend='hf'")
            self.rollout.synced_gpus = True  # the blocks gather their shards in every forward: ranks stay in step
        self.loss_options = dataclasses.asdict(config.loss_config)  # keyword options of fused_cppo_loss
        self.step = 0

    # ------------------------------------------------------------------------------------------------------
    # One step
    # ------------------------------------------------------------------------------------------------------

    @_on_kernel_backend
    def train_step(self) -> dict[str, float]:
        """One CPPO step; returns its metrics (docs/training.md lists them)."""
        cfg, G = self.config, self.config.group_size
        timer = PhaseTimer(self.device)
        start = time.perf_counter()
        torch.manual_seed(self._step_seed())  # sampling in generate draws from the global RNG: reproducible per step

        with timer("generate"):
            problems = [self.problems[i] for i in self.sampler.draw(cfg.questions_drawn)]  # this rank's share
            prompts = [build_prompt(self.tokenizer, p, system_prompt=cfg.system_prompt) for p in problems]
            with distributed.root_unsharded(self.policy):
                rollout = self.rollout.generate(prompts, G)

        with timer("reward"):
            rows = {key: [p[key] for p in problems for _ in range(G)] for key in ("answer", "kind")}
            scores = score_all(self.reward_fns, [p for p in prompts for _ in range(G)], rollout.texts, **rows)
            rewards = torch.tensor([sum(s) for s in zip(*scores.values())], dtype=torch.float32)  # [Q * G]
            correct = [is_correct(k, c, a) for k, c, a in zip(rows["kind"], rollout.texts, rows["answer"])]

        with timer("select"):
            advantages, kept = self._select(rewards)  # [Q * G], this rank's survivors
            samples = [
                Sample(rollout.prompt_ids[i], rollout.completion_ids[i], a)
                for i, a in zip(kept.tolist(), advantages[kept].tolist())
            ]
            num_kept = len(samples)
            samples = self._balance(samples)
            batches = pack_all(samples, cfg.micro_batch_tokens, device=self.device)
            num_real = len(batches)
            batches += self._fillers(batches)

        with timer("logprobs"):
            old = self._logprobs(self.policy, batches) if cfg.mu > 1 else [None] * len(batches)
            ref = self._logprobs(self.ref_policy, batches) if self.ref_policy is not None else [None] * len(batches)

        total_tokens, total_seqs = self._batch_counts(batches[:num_real])
        scale = distributed.grad_scale(parallelism=cfg.parallelism, info=self.info)
        # per micro-batch: its share of the batch loss (0 for a filler pass, which only keeps the ranks in step) and
        # of the token-mean metrics; the same in every one of the mu updates
        weights = [
            loss_weight(
                cfg.loss_agg,
                num_tokens=b.num_tokens,
                num_seqs=b.num_seqs,
                total_tokens=total_tokens,
                total_seqs=total_seqs,
            )
            if k < num_real
            else 0.0
            for k, b in enumerate(batches)
        ]
        shares = [b.num_tokens / max(total_tokens, 1) / cfg.mu for b in batches[:num_real]]
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss, kl, clip_fraction, entropy
        for _ in range(cfg.mu):
            with timer("update"):
                for k, (b, old_b, ref_b) in enumerate(zip(batches, old, ref)):
                    with distributed.gradient_sync(self.policy, k == len(batches) - 1):
                        loss, stats = self._policy_loss(b, old_b, ref_b)
                        (loss * (weights[k] * scale)).backward()
                    if k < num_real:  # summed on the device: one host sync per step, after the updates
                        clip = stats["clip_fraction_low"] + stats["clip_fraction_high"]
                        part = torch.stack([loss.detach(), stats["kl"], clip, stats["entropy"]]).double()
                        sums += part * part.new_tensor([weights[k] / cfg.mu, shares[k], shares[k], shares[k]])
            with timer("optimizer"):
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.rollout.sync_weights()

        self.step += 1
        passes = cfg.mu + (cfg.mu > 1) + (self.ref_model is not None)
        lengths = rollout.lengths
        all_rewards, _ = distributed.all_gather_varlen(rewards.to(self.device), info=self.info)  # [Q_all * G]
        result = {
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
            "tokens_trained": sum(b.num_tokens for b in batches[:num_real]) * cfg.mu,
            "tokens_forward": sum(b.num_input_tokens for b in batches[:num_real]) * passes,
            "micro_batches": num_real,
            **dict(zip(("loss", "kl", "clip_fraction", "entropy"), sums.tolist())),
            "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
        }
        result.update({f"time/{k}": v for k, v in timer.seconds.items()})
        result["time/step"] = time.perf_counter() - start
        return distributed.reduce_metrics(result, info=self.info, reductions=metric_reduction)

    # ------------------------------------------------------------------------------------------------------
    # Stages
    # ------------------------------------------------------------------------------------------------------

    def _step_seed(self, rank: int | None = None) -> int:
        """This step's seed for ``rank`` (default: this rank's)."""
        return (self.config.seed * 1_000_003 + self.step) * 64 + (self.rank if rank is None else rank)

    @property
    def _sharded(self) -> bool:
        return self.info.distributed and self.config.parallelism == "fsdp2"

    def _wrap(self, model, *, frozen: bool = False):
        """``model`` behind the packed forward, wrapped for the run's parallelism (a frozen model is only sharded, by
        FSDP2: it has no gradients to synchronise)."""
        if frozen and not self._sharded:
            return distributed.wrap_model(model, parallelism="none", info=distributed.DistInfo(), forward=_hidden)
        return distributed.wrap_model(model, parallelism=self.config.parallelism, info=self.info, forward=_hidden)

    def _select(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Advantages over each full group, then this rank's retained completions (ascending local indices)."""
        cfg = self.config
        if cfg.selection_scope == "global" and self.info.distributed:
            # every rank selects over the gathered batch: random scores must be drawn alike on all ranks
            gen = torch.Generator().manual_seed(self._step_seed(rank=0))
            advantages = group_advantages(rewards, cfg.group_size)  # [Q * G]
            kept = distributed.select_across_ranks(
                advantages,
                cfg.group_size,
                cfg.keep,
                scope="global",
                metric=cfg.selection_metric,
                generator=gen,
                info=self.info,
            )
            return advantages, kept
        scope = "batch" if cfg.selection_scope == "global" else cfg.selection_scope
        gen = torch.Generator().manual_seed(self._step_seed())
        return cppo_select(rewards, cfg.group_size, cfg.keep, scope=scope, metric=cfg.selection_metric, generator=gen)

    def _balance(self, samples: list[Sample]) -> list[Sample]:
        """The retained completions of all ranks, spread over the ranks by input-token count (a no-op alone)."""
        if not self.info.distributed:
            return samples
        ids = [s.prompt_ids + s.completion_ids for s in samples]
        local = distributed.SequenceShard(
            lengths=torch.tensor([len(x) for x in ids], dtype=torch.long),
            token_fields={"ids": torch.tensor([t for x in ids for t in x], dtype=torch.long)},
            seq_fields={
                "prompt_length": torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long),
                "advantage": torch.tensor([s.advantage for s in samples], dtype=torch.float64),
            },
        )
        costs = torch.tensor([s.num_input_tokens for s in samples], dtype=torch.long)
        mine = distributed.balance_sequences(local, info=self.info, costs=costs)
        flat, out, start = mine.token_fields["ids"].tolist(), [], 0  # one copy to the host, not one per sequence
        for n, p, a in zip(
            mine.lengths.tolist(), mine.seq_fields["prompt_length"].tolist(), mine.seq_fields["advantage"].tolist()
        ):
            out.append(Sample(flat[start : start + p], flat[start + p : start + n], a))
            start += n
        return out

    def _fillers(self, batches: list[PackedBatch]) -> list[PackedBatch]:
        """Weight-0 repeats of a micro-batch so that every rank runs as many passes (DDP syncs in the last one, FSDP2
        gathers in every one). Every rank has a micro-batch: it holds >= 1 question keeping >= 1 completion, and the
        balancing gives each rank a sequence while any are left."""
        passes = distributed.max_across_ranks(len(batches), info=self.info)
        return [batches[0]] * (passes - len(batches))

    def _batch_counts(self, batches: list[PackedBatch]) -> tuple[int, int]:
        """Completion tokens and sequences of the whole step's batch over all ranks (the loss normalisers), so that
        the ranks' micro-batch losses sum to the global loss."""
        counts = distributed.global_counts(
            num_tokens=sum(b.num_tokens for b in batches), num_seqs=sum(b.num_seqs for b in batches), info=self.info
        )
        return counts.tokens, counts.seqs

    @torch.no_grad()
    def _logprobs(self, policy, batches: list[PackedBatch]) -> list[torch.Tensor]:
        """Per-token log-probs ``[T]`` (fp32) of each micro-batch's completion tokens under ``policy``."""
        out = []
        for b in batches:
            hidden = policy(b.input_ids, b.position_ids, b.predict_index)  # [T, H]
            weight, bias = lm_head(distributed.unwrap_model(policy))  # after the forward: FSDP2 has unsharded it
            out.append(fused_logprobs(hidden, weight, b.targets, bias=bias, temperature=self.config.temperature))
        return out

    def _policy_loss(self, b: PackedBatch, old: torch.Tensor | None, ref: torch.Tensor | None):
        hidden = self.policy(b.input_ids, b.position_ids, b.predict_index)  # [T, H]
        weight, bias = lm_head(self.model)  # after the forward: FSDP2 has unsharded it
        return fused_cppo_loss(
            hidden,
            weight,
            b.targets,
            b.advantages,
            cu_seqlens=b.cu_seqlens,
            old_logprobs=old,
            ref_logprobs=ref,
            bias=bias,
            **self.loss_options,
        )

    # ------------------------------------------------------------------------------------------------------
    # Loop, evaluation, checkpoints
    # ------------------------------------------------------------------------------------------------------

    def train(self) -> list[dict]:
        """Runs until ``num_steps``: a progress bar, metrics.jsonl, checkpoints every ``save_every`` steps and at the
        end, and ``metrics.png`` (reward and phase times) over the whole run."""
        from tqdm.auto import tqdm

        cfg = self.config
        log_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        history = []
        if self.rank == 0 and os.path.isfile(log_path):
            # a resumed run drops what a killed run logged after its last checkpoint
            kept = [r for r in metrics.read_jsonl(log_path) if r["step"] <= self.step]
            metrics.write_jsonl(log_path, kept)
        bar = tqdm(total=self.num_steps, initial=self.step, desc="cppo", disable=self.rank != 0, dynamic_ncols=True)
        while self.step < self.num_steps:
            record = self.train_step()
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                record.update({f"eval/{k}": v for k, v in self.evaluate(limit=cfg.eval_limit).items()})
            history.append(record)
            if self.rank == 0 and (self.step % cfg.log_every == 0 or self.step == self.num_steps):
                metrics.append_jsonl(log_path, record)
            bar.update(1)
            bar.set_postfix(reward=f"{record['reward_mean']:.3f}", acc=f"{record['accuracy']:.2f}")
            if cfg.save_every and self.step % cfg.save_every == 0:
                self.save_checkpoint(self._checkpoint_path())
        bar.close()
        if not cfg.save_every or self.step % cfg.save_every:
            self.save_checkpoint(self._checkpoint_path())
        if self.rank == 0 and os.path.isfile(log_path):
            metrics.plot(metrics.read_jsonl(log_path), os.path.join(cfg.output_dir, "metrics.png"))
        return history

    def _checkpoint_path(self) -> str:
        return os.path.join(self.config.output_dir, f"checkpoint-{self.step:06d}")

    def evaluate(self, limit: int | None = None) -> dict:
        """Greedy accuracy on the dataset's test split (``limit`` problems at most). Under DDP the ranks split the
        problems and sum their counts; under FSDP2 every rank decodes all of them (the shards gather in step)."""
        cfg = self.config
        problems = load_problems(cfg.dataset, split="test", dataset_path=cfg.dataset_path, max_questions=limit)
        rollout = self.rollout
        if not isinstance(rollout, HFRollout):
            rollout = HFRollout(
                self.model,
                self.tokenizer,
                max_prompt_length=cfg.max_prompt_length,
                max_completion_length=cfg.max_completion_length,
            )
        if self._sharded or not self.info.distributed:
            with distributed.root_unsharded(self.policy):
                return evaluate_model(rollout, self.tokenizer, problems, system_prompt=cfg.system_prompt)
        mine = problems[distributed.question_slice(len(problems), info=self.info)]
        out = {"correct": 0, "total": 0, "formatted": 0.0}
        if mine:
            res = evaluate_model(rollout, self.tokenizer, mine, system_prompt=cfg.system_prompt)
            out = {"correct": res["correct"], "total": res["total"], "formatted": res["format_rate"] * res["total"]}
        out = distributed.reduce_metrics(out, info=self.info, reductions=lambda name: "sum")
        n = int(out["total"])
        return {
            "accuracy": out["correct"] / n,
            "correct": int(out["correct"]),
            "total": n,
            "format_rate": out["formatted"] / n,
        }

    def save_checkpoint(self, path: str) -> str:
        """Writes a checkpoint on every rank's behalf (call it on all ranks): the full model, optimizer and trainer
        state from rank 0, or under FSDP2 each rank's shards through ``torch.distributed.checkpoint``."""
        state = {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "config": self.config.to_dict(),
            "world_size": self.world_size,
        }
        if self._sharded:
            distributed.save_checkpoint(
                path, module=self.policy, optimizer=self.optimizer, scheduler=self.scheduler, meta=state, info=self.info
            )
            return os.path.abspath(path)
        if self.info.is_main:
            state.update(optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict())
            checkpoint.save(path, model=self.model, tokenizer=self.tokenizer, state=state)
        distributed.barrier(self.info)
        return os.path.abspath(path)

    def load_checkpoint(self, path: str) -> None:
        """Restores model weights, optimizer, scheduler, data position, RNG states and step from ``path`` (on every
        rank; a sharded FSDP2 checkpoint needs the world size that wrote it)."""
        if os.path.isfile(os.path.join(path, "meta.json")):
            meta, _ = distributed.load_checkpoint(
                path, module=self.policy, optimizer=self.optimizer, scheduler=self.scheduler, info=self.info
            )
            self.sampler.load_state_dict(meta["sampler"])
            self.step = int(meta["step"])
            return
        if self._sharded:
            raise ValueError(
                f"checkpoint {path!r} holds a full model (a single-process or DDP run): resume it with parallelism=ddp"
            )
        state = checkpoint.load_state(path)
        _load_weights(self.model, os.path.join(path, "model"))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.rollout.sync_weights()


def _hidden(model, input_ids: torch.Tensor, position_ids: torch.Tensor, predict_index: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[T, H]`` of the rows that predict completion tokens: the forward DDP / FSDP2 wrap."""
    return packed_hidden(model, input_ids, position_ids)[predict_index]


_SUMMED = {"questions", "completions", "completions_kept", "tokens_trained", "tokens_forward", "micro_batches"}
# each rank's share of a global token-mean (normalised by the global token count): the shares add up
_SUMMED |= {"loss", "kl", "clip_fraction", "entropy"}
# equal on every rank (computed from gathered or synchronised values) or a wall time (the slowest rank's)
_MAXED = {"step", "reward_mean", "reward_std", "grad_norm", "lr"}


def metric_reduction(name: str) -> str:
    """How :func:`cppo.distributed.reduce_metrics` combines a step metric over ranks: counts and loss shares add
    up, times take the slowest rank, per-completion means are weighted by each rank's completions."""
    if name in _SUMMED:
        return "sum"
    if name in _MAXED or name.startswith("time/"):
        return "max"
    return "mean:completions"


def _scheduler(optimizer, config: TrainConfig, *, total: int):
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    warmup = int(round(config.warmup_ratio * total))
    if config.lr_schedule == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup, total)
    if config.lr_schedule == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total)
    return get_constant_schedule_with_warmup(optimizer, warmup)


def _load_weights(model, folder: str) -> None:
    """Loads ``save_pretrained`` safetensors into ``model`` in place; parameters tied to a loaded one may be absent."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"checkpoint {folder!r} has no .safetensors weights")
    loaded: set[str] = set()
    for f in files:
        part = load_file(f)
        unexpected = model.load_state_dict(part, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"checkpoint {f!r} has weights the model lacks: {unexpected[:3]}")
        loaded.update(part)
    state = model.state_dict()
    loaded_ptrs = {state[k].data_ptr() for k in loaded}
    missing = [k for k in state if k not in loaded and state[k].data_ptr() not in loaded_ptrs]
    if missing:
        raise ValueError(f"checkpoint {folder!r} lacks weights: {missing[:3]}")


def evaluate_model(
    rollout: HFRollout, tokenizer, problems: list[dict], *, system_prompt: str | None = None, batch_size: int = 32
) -> dict:
    """Greedy decoding of one completion per problem; accuracy = correct / total."""
    correct = formatted = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        out = rollout.generate([build_prompt(tokenizer, p, system_prompt=system_prompt) for p in chunk], 1, greedy=True)
        for p, text in zip(chunk, out.texts):
            correct += is_correct(p["kind"], text, p["answer"])
            formatted += bool(FORMAT_RE.match(text))
    n = len(problems)
    return {"accuracy": correct / n, "correct": correct, "total": n, "format_rate": formatted / n}
