"""``CPPOConfig``: TRL's ``GRPOConfig`` plus the CPPO settings, validated when the config is built."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from cppo_kernels.config import METRICS, check_choice

from ..step import SCOPES, Pruning

__all__ = ["CPPOConfig"]


@dataclass
class CPPOConfig(GRPOConfig):
    """``trl.GRPOConfig`` with CPPO's completion pruning (``pruning_rate=0`` trains exactly as GRPO).

    A generation's completions get TRL's own advantages (``scale_rewards`` / ``multi_objective_aggregation``
    honoured); then the ``int(N * pruning_rate)`` of a pool of N with the smallest |advantage| are dropped before the
    old-policy, reference and policy passes. See :class:`cppo.step.selection.Pruning` for the rule.
    """

    pruning_rate: float = field(
        default=0.0,
        metadata={"help": "Share of each pool's completions pruned before the training passes, in [0, 1); 0 = GRPO."},
    )
    pruning_metric: str = field(
        default="smallest",
        metadata={
            "help": "Which completions are pruned: 'smallest' |advantage| (CPPO), 'largest', or 'random' (a "
            "generator seeded from `seed`, never the global RNG).",
            "choices": list(METRICS),
        },
    )
    allocation: bool = field(
        default=False,
        metadata={
            "help": "Draw ceil(1 / (1 - pruning_rate)) times more prompts per generation, so that the kept "
            "completions are as many as GRPO trains (the CPPO paper's dynamic allocation)."
        },
    )
    selection_scope: str = field(
        default="batch",
        metadata={
            "help": "The pool pruned: 'batch' = each process's generation batch (the official code), 'group' = each "
            "question's num_generations completions, 'global' = the generation batch of all processes.",
            "choices": list(SCOPES),
        },
    )
    prefix_sharing: bool = field(
        default=True,
        metadata={
            "help": "Run the old-policy, reference and policy passes on packed rows holding each prompt once, then "
            "its kept completions (a block-causal mask: each completion sees its prompt and itself); the same "
            "log-probs, loss and gradients as TRL's padded rows within fp32 rounding. A model whose attention "
            "cannot take the mask (e.g. flash_attention_2) falls back to the padded rows with one warning; so does "
            "TRL's own loss (a setting fused_cppo_loss cannot express)."
        },
    )

    prefill_once: bool = field(
        default=True,
        metadata={
            "help": "When TRL generates with transformers (no vLLM, no continuous batching), run each distinct "
            "prompt's forward once and copy its KV cache to its num_generations rows before decoding: the same "
            "tokens and random draws as TRL's G prefills. Off by itself when the generation settings cannot share "
            "a cache (cache_implementation, beams) or a dropout fires in the training-mode forward (e.g. LoRA's)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("prefix_sharing", "prefill_once"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_choice("pruning_metric", self.pruning_metric, METRICS)
        if self.pruning_metric == "max-variance" and self.selection_scope != "group":
            raise ValueError(
                "pruning_metric='max-variance' keeps each question's subset of largest variance, which needs "
                f"selection_scope='group', got {self.selection_scope!r}: set selection_scope='group'"
            )
        self.pruning  # noqa: B018  a bad pruning_rate / selection_scope / allocation is one ValueError naming it

    @property
    def pruning(self) -> Pruning:
        """The pruning policy of these settings; ``questions_per_step`` is one generation batch's prompts (over
        all processes), so ``Pruning.questions_drawn`` is what a generation draws with ``allocation``. Built and
        validated once, when the config is, and the same object on every read (:class:`cppo.trl.CPPOTrainer` asks
        it every count); built anew only when one of those settings has been assigned since
        (:meth:`Pruning.held_by`)."""
        return Pruning.held_by(
            self,
            group_size=self.num_generations,
            pruning_rate=self.pruning_rate,
            scope=self.selection_scope,
            metric=self.pruning_metric,
            allocation=self.allocation,
            questions_per_step=self.generation_batch_size // self.num_generations,
        )
