"""``CPPOConfig``: TRL's ``GRPOConfig`` plus the CPPO settings, validated when the config is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from trl import GRPOConfig

from cppo_kernels.config import METRICS

from ..config import HoldsPruning, pruning_setting
from ..step import SCOPES

__all__ = ["CPPOConfig"]


@dataclass
class CPPOConfig(GRPOConfig, HoldsPruning):
    """``trl.GRPOConfig`` with CPPO's completion pruning (``pruning_rate=0`` trains exactly as GRPO).

    A generation's completions get TRL's own advantages (``scale_rewards`` / ``multi_objective_aggregation``
    honoured); then the ``int(N * pruning_rate)`` of a pool of N with the smallest |advantage| are dropped before the
    old-policy, reference and policy passes. See :class:`cppo.step.Pruning` for the rule. The pruning settings are
    ``cppo train``'s (:mod:`cppo.config.pruning`: one help text each), the metric under TRL's name ``pruning_metric``.
    """

    pruning_names: ClassVar[dict[str, str]] = {"group_size": "num_generations", "metric": "pruning_metric"}

    pruning_rate: float = pruning_setting("pruning_rate")  # the pruning settings: one declaration, cppo.config's
    pruning_metric: str = pruning_setting("selection_metric", choices=list(METRICS))
    allocation: bool = pruning_setting("allocation", default=False)  # off by default, as GRPO
    selection_scope: str = pruning_setting("selection_scope", choices=list(SCOPES))
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
        self.pruning  # noqa: B018  a bad pruning_rate / selection_scope / allocation is one ValueError naming it

    def pruning_fields(self) -> dict:
        """The fields of :attr:`pruning` (:class:`cppo.config.HoldsPruning`: built and validated once, when the
        config is, the same object on every read; :class:`cppo.trl.CPPOTrainer` asks it every count):
        ``questions_per_step`` is one generation batch's prompts (over all processes), so ``Pruning.questions_drawn``
        is what a generation draws with ``allocation``."""
        return dict(
            group_size=self.num_generations, pruning_rate=self.pruning_rate, scope=self.selection_scope,
            metric=self.pruning_metric, allocation=self.allocation,
            questions_per_step=self.generation_batch_size // self.num_generations,
        )  # fmt: skip
