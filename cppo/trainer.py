"""The CPPO trainer: one step reads top to bottom in :meth:`Trainer.train_step`.

prompts -> rollouts (G each) -> rewards -> cppo_select (advantages over the full group, then prune) -> allocate
+ pack the retained completions -> old / reference log-probs (fused_logprobs) -> mu policy updates
(fused_cppo_loss, micro-batches weighted so that they sum to the whole batch's loss) -> optimizer.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import os
import time

import torch

from cppo_kernels import cppo_select, fused_cppo_loss, fused_logprobs

from . import checkpoint, metrics
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


class Trainer:
    """CPPO training of ``config.model``. ``rank`` / ``world_size`` split each step's questions across processes
    (the single-process trainer uses 0 / 1)."""

    def __init__(self, config: TrainConfig, *, rank: int = 0, world_size: int = 1) -> None:
        config.validate()
        self.config, self.rank, self.world_size = config, rank, world_size
        if config.questions_drawn % world_size:
            raise ValueError(f"questions per step ({config.questions_drawn}) must divide by world_size ({world_size})")
        if config.kernel_backend != "auto":
            os.environ["CPPO_KERNELS_BACKEND"] = config.kernel_backend
        self.device = resolve_device(config.device)
        self.problems = load_problems(
            config.dataset, split="train", dataset_path=config.dataset_path, max_questions=config.max_questions
        )
        self.reward_fns = get_rewards(config.rewards)
        self.sampler = QuestionSampler(len(self.problems), seed=config.seed, rank=rank, world_size=world_size)
        self.num_steps = config.num_steps or max(1, config.num_epochs * len(self.problems) // config.questions_drawn)

        self.model, self.tokenizer = load_model_and_tokenizer(
            config.model, model_config=config.model_config, dtype=config.dtype, device=self.device, seed=config.seed
        )
        self.model.train()
        self.ref_model = None
        if config.beta > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
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
        self.loss_options = {
            "temperature": config.temperature,
            "epsilon_low": config.epsilon_low,
            "epsilon_high": config.epsilon_high,
            "beta": config.beta,
            "kl_estimator": config.kl_estimator,
            "loss_agg": config.loss_agg,
            "max_completion_length": config.max_completion_length,
            "compute_entropy": True,
        }
        self.step = 0

    # ------------------------------------------------------------------------------------------------------
    # One step
    # ------------------------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One CPPO step; returns its metrics (docs/training.md lists them)."""
        cfg, G = self.config, self.config.group_size
        timer = PhaseTimer(self.device)
        start = time.perf_counter()
        torch.manual_seed(self._step_seed())  # sampling in generate draws from the global RNG: reproducible per step

        with timer("generate"):
            problems = [self.problems[i] for i in self.sampler.draw(cfg.questions_drawn)]
            prompts = [build_prompt(self.tokenizer, p, system_prompt=cfg.system_prompt) for p in problems]
            rollout = self.rollout.generate(prompts, G)

        with timer("reward"):
            rows = {key: [p[key] for p in problems for _ in range(G)] for key in ("answer", "kind")}
            scores = score_all(self.reward_fns, [p for p in prompts for _ in range(G)], rollout.texts, **rows)
            rewards = torch.tensor([sum(s) for s in zip(*scores.values())], dtype=torch.float32)  # [Q * G]
            correct = [is_correct(k, c, a) for k, c, a in zip(rows["kind"], rollout.texts, rows["answer"])]

        with timer("select"):
            advantages, kept = self._select(rewards)  # [Q * G], [Q * keep]
            samples = [
                Sample(rollout.prompt_ids[i], rollout.completion_ids[i], float(advantages[i])) for i in kept.tolist()
            ]
            batches = pack_all(samples, cfg.micro_batch_tokens, device=self.device)

        with timer("logprobs"):
            old = self._logprobs(self.model, batches) if cfg.mu > 1 else [None] * len(batches)
            ref = self._logprobs(self.ref_model, batches) if self.ref_model is not None else [None] * len(batches)

        total_tokens, total_seqs = self._batch_counts(batches)
        sums = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0}
        for _ in range(cfg.mu):
            with timer("update"):
                for b, old_b, ref_b in zip(batches, old, ref):
                    weight = loss_weight(
                        cfg.loss_agg,
                        num_tokens=b.num_tokens,
                        num_seqs=b.num_seqs,
                        total_tokens=total_tokens,
                        total_seqs=total_seqs,
                    )
                    loss, stats = self._policy_loss(b, old_b, ref_b)
                    (loss * weight).backward()
                    sums["loss"] += float(loss.detach()) * weight / cfg.mu
                    share = b.num_tokens / max(total_tokens, 1) / cfg.mu
                    sums["kl"] += float(stats["kl"]) * share
                    sums["clip_fraction"] += float(stats["clip_fraction_low"] + stats["clip_fraction_high"]) * share
                    sums["entropy"] += float(stats["entropy"]) * share
            with timer("optimizer"):
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.rollout.sync_weights()

        self.step += 1
        passes = cfg.mu + (cfg.mu > 1) + (self.ref_model is not None)
        lengths = rollout.lengths
        result = {
            "step": self.step,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            **{f"reward/{name}": sum(v) / len(v) for name, v in scores.items()},
            "accuracy": sum(correct) / len(correct),
            "kept_fraction": len(samples) / len(lengths),
            "questions": len(problems),
            "completions": len(lengths),
            "completions_kept": len(samples),
            "completion_length": sum(lengths) / len(lengths),
            "tokens_trained": total_tokens * cfg.mu,
            "tokens_forward": sum(b.num_input_tokens for b in batches) * passes,
            "micro_batches": len(batches),
            "loss": sums["loss"],
            "kl": sums["kl"],
            "clip_fraction": sums["clip_fraction"],
            "entropy": sums["entropy"],
            "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
        }
        result.update({f"time/{k}": v for k, v in timer.seconds.items()})
        result["time/step"] = time.perf_counter() - start
        return result

    # ------------------------------------------------------------------------------------------------------
    # Stages
    # ------------------------------------------------------------------------------------------------------

    def _step_seed(self) -> int:
        return (self.config.seed * 1_000_003 + self.step) * 64 + self.rank

    def _select(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Advantages over each full group, then the retained completions' indices (ascending)."""
        cfg = self.config
        gen = torch.Generator().manual_seed(self._step_seed())
        return cppo_select(
            rewards, cfg.group_size, cfg.keep, scope=cfg.selection_scope, metric=cfg.selection_metric, generator=gen
        )

    def _batch_counts(self, batches: list[PackedBatch]) -> tuple[int, int]:
        """Completion tokens and sequences of the whole step's batch (the loss normalisers). A distributed trainer
        all-reduces these so that every rank's micro-batch losses sum to the global loss."""
        return sum(b.num_tokens for b in batches), sum(b.num_seqs for b in batches)

    @torch.no_grad()
    def _logprobs(self, model, batches: list[PackedBatch]) -> list[torch.Tensor]:
        """Per-token log-probs ``[T]`` (fp32) of each micro-batch's completion tokens under ``model``."""
        weight, bias = lm_head(model)
        out = []
        for b in batches:
            hidden = packed_hidden(model, b.input_ids, b.position_ids)[b.predict_index]  # [T, H]
            out.append(fused_logprobs(hidden, weight, b.targets, bias=bias, temperature=self.config.temperature))
        return out

    def _policy_loss(self, b: PackedBatch, old: torch.Tensor | None, ref: torch.Tensor | None):
        weight, bias = lm_head(self.model)
        hidden = packed_hidden(self.model, b.input_ids, b.position_ids)[b.predict_index]  # [T, H]
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
        if self.rank == 0:
            if not cfg.save_every or self.step % cfg.save_every:
                self.save_checkpoint(self._checkpoint_path())
            if os.path.isfile(log_path):
                metrics.plot(metrics.read_jsonl(log_path), os.path.join(cfg.output_dir, "metrics.png"))
        return history

    def _checkpoint_path(self) -> str:
        return os.path.join(self.config.output_dir, f"checkpoint-{self.step:06d}")

    def evaluate(self, limit: int | None = None) -> dict:
        """Greedy accuracy on the dataset's test split (``limit`` problems at most)."""
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
        return evaluate_model(rollout, self.tokenizer, problems, system_prompt=cfg.system_prompt)

    def save_checkpoint(self, path: str) -> str:
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "config": self.config.to_dict(),
        }
        return checkpoint.save(path, model=self.model, tokenizer=self.tokenizer, state=state)

    def load_checkpoint(self, path: str) -> None:
        """Restores model weights, optimizer, scheduler, data position, RNG states and step from ``path``."""
        state = checkpoint.load_state(path)
        _load_weights(self.model, os.path.join(path, "model"))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        checkpoint.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.rollout.sync_weights()


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
