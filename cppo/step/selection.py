"""The CPPO pruning step, whole: from a step's rewards to ``(advantages, kept indices)``.

This is the one module of :mod:`cppo` that calls the selection kernels of :mod:`cppo_kernels`; the trainer,
``cppo train --dry-run``, ``benchmarks/speedup.py`` and the TRL drop-in (:mod:`cppo.trl`) all go through
:class:`Pruning`. The rule, as the official CPPO code has it:

- advantages are normalised over each question's **full** group of G completions, before any pruning
  (``(r - mean_g) / (std_g + eps)``, Bessel-corrected std; ``scale`` as TRL's ``scale_rewards``);
- of a pool of N completions, the ``int(N * P)`` with the smallest |advantage| are pruned and ``N - int(N * P)``
  kept (Python's float product, truncated; ties to the lower index), where the pool is (``scope``):

  * ``"group"``: each question's G completions (``G - int(G * P)`` kept per question; no communication);
  * ``"batch"``: the whole step of this process, all questions pooled (the official Open-R1 code: under torchrun
    each process prunes its own share);
  * ``"global"``: the whole step over all processes (the official verl recipe pools the global batch; its count is
    ``int(N * (1 - P))``, which differs from ``N - int(N * P)`` when ``N * P`` is not an integer: this project
    keeps the Open-R1 count in every scope). Every rank gathers |A| and selects exactly what one process selects
    with ``"batch"`` over the concatenated step, then keeps its own survivors.

- ``metric``: ``"smallest"`` prunes the smallest |A| (CPPO), ``"largest"`` the largest, ``"random"`` a uniform
  draw, ``"max-variance"`` keeps each question's subset of largest reward variance (PODS; ``scope="group"`` only).
  Random draws come from a generator seeded by the caller's ``seed``: plus the rank for the local scopes,
  alike on every rank for ``"global"`` (every rank draws the global scores itself).
- allocation (``allocation=True``): a step draws ``ceil(questions_per_step / (1 - P))`` questions (rounded up, so
  a step never trains fewer completions than GRPO would), else ``questions_per_step``.

A run builds its :class:`Pruning` once: a config's ``pruning`` (:class:`cppo.config.HoldsPruning`, shared by
``TrainConfig`` and ``CPPOConfig``) keeps the one it built and validated, and builds a new one only when a pruning
setting has been assigned since. The policy checks its settings and their rules itself, naming each setting as the
config that built it names it (``names``).

The vocabulary is the kernels' (:data:`cppo_kernels.config.SCOPES`, :data:`cppo_kernels.config.METRICS`) plus
``"global"``, which is the kernels' ``"batch"`` over the gathered step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from cppo_kernels import cppo_select, group_advantages, select_completions
from cppo_kernels.config import METRICS, SCALES, check_choice, check_float, check_int
from cppo_kernels.config import SCOPES as KERNEL_SCOPES

from ..distributed import DistInfo, all_gather_varlen

__all__ = ["SCOPES", "METRICS", "Pruning", "Selection", "kept_count"]

#: How a :class:`Pruning`'s messages name its fields by default: ``cppo train``'s settings.
SETTING_NAMES = {"scope": "selection_scope", "metric": "selection_metric"}

#: ``selection_scope``: per question, pooled over this process's step, or pooled over all processes' step.
SCOPES = (*KERNEL_SCOPES, "global")


def kept_count(num_completions: int, pruning_rate: float) -> int:
    """Completions kept of a pool of ``num_completions``: the official ``N - int(N * P)``."""
    return num_completions - int(num_completions * pruning_rate)


@dataclass(frozen=True)
class Selection:
    """One step's selection on this process: ``advantages`` fp32 ``[N]`` over every local completion (group after
    group) and ``kept`` int64 ``[K]``, the ascending local indices of the retained completions."""

    advantages: torch.Tensor
    kept: torch.Tensor

    @property
    def kept_advantages(self) -> torch.Tensor:
        return self.advantages[self.kept]  # [K]


@dataclass(frozen=True)
class Pruning:
    """The pruning policy of a run: the counts (kept per step, questions drawn) and the selection itself.

    ``pruning_rate=0`` keeps every completion (GRPO). Construction validates every option and the rule between
    them (``ValueError`` naming the setting by the config's name: ``names`` maps a field to it where it is not
    ``cppo train``'s, e.g. ``{"metric": "pruning_metric"}``; not compared).
    """

    group_size: int
    pruning_rate: float = 0.0
    scope: str = "batch"
    metric: str = "smallest"
    allocation: bool = True
    questions_per_step: int = 1
    scale: str = "group"
    eps: float = 1e-4
    names: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, check in self._checks():
            try:
                check()
            except ValueError as e:  # marked with the setting (as cppo.config's checks mark theirs)
                e.settings = (self._named(name),)
                raise

    def _checks(self) -> list[tuple[str, Callable[[], object]]]:
        """Each field's check, in order, with the rule between the metric and the scope."""
        return [
            ("group_size", lambda: check_int(self._named("group_size"), self.group_size, low=1)),
            ("pruning_rate", lambda: check_float(self._named("pruning_rate"), self.pruning_rate, low=0.0)),
            ("pruning_rate", self._check_rate_below_one),
            ("scope", lambda: check_choice(self._named("scope"), self.scope, SCOPES)),
            ("metric", lambda: check_choice(self._named("metric"), self.metric, METRICS)),
            ("metric", self._check_max_variance),
            ("scale", lambda: check_choice(self._named("scale"), self.scale, SCALES)),
            ("allocation", self._check_allocation),
            (
                "questions_per_step",
                lambda: check_int(self._named("questions_per_step"), self.questions_per_step, low=1),
            ),
        ]

    def _check_rate_below_one(self) -> None:
        if not self.pruning_rate < 1.0:
            raise ValueError(f"{self._named('pruning_rate')} must be in [0, 1), got {self.pruning_rate}")

    def _check_max_variance(self) -> None:
        """PODS' rule keeps each question's subset of largest variance: a per-question rule."""
        if self.metric == "max-variance" and self.scope != "group":
            raise ValueError(
                f"{self._named('metric')}='max-variance' keeps each question's subset of largest variance, which "
                f"needs {self._named('scope')}='group', got {self.scope!r}: set {self._named('scope')}='group'"
            )

    def _check_questions(self) -> None:
        check_int(self._named("questions_per_step"), self.questions_per_step, low=1)

    def _check_allocation(self) -> None:
        if not isinstance(self.allocation, bool):
            raise ValueError(f"{self._named('allocation')} must be true or false, got {self.allocation!r}")

    def _named(self, name: str) -> str:
        """The setting a field of this policy came from, as its config names it."""
        return self.names.get(name) or SETTING_NAMES.get(name, name)

    @classmethod
    def from_config(cls, config) -> Pruning:
        """The policy of a config (a :class:`cppo.config.HoldsPruning`: ``TrainConfig`` or ``CPPOConfig``), built
        anew; a config's own ``pruning`` is built once."""
        return cls(**config.pruning_fields(), names=dict(config.pruning_names))

    # ---------------------------------------------------------------------------------------------------------
    # Counts
    # ---------------------------------------------------------------------------------------------------------

    def kept_count(self, num_completions: int) -> int:
        """Completions kept of a pool of ``num_completions``: ``N - int(N * P)``."""
        return kept_count(num_completions, self.pruning_rate)

    @property
    def keep(self) -> int:
        """Completions kept per question with ``scope="group"``: ``G - int(G * P)``."""
        return self.kept_count(self.group_size)

    @property
    def questions_drawn(self) -> int:
        """Questions a step draws (over all processes): ``ceil(questions_per_step / (1 - P))`` with allocation."""
        if not self.allocation:
            return self.questions_per_step
        # round() first so that e.g. 2 / (1 - 0.75) = 8.000000001 does not become 9
        return math.ceil(round(self.questions_per_step / (1.0 - self.pruning_rate), 9))

    @property
    def completions_per_step(self) -> int:
        """Completions a step generates (over all processes): ``questions_drawn * G``."""
        return self.questions_drawn * self.group_size

    def kept_of_local(self, num_completions: int) -> int:
        """Completions one rank's own selection keeps of its pool of ``num_completions`` (whole groups): ``keep``
        per question with ``scope="group"``, else ``N - int(N * P)`` (``global`` on one process is ``batch``)."""
        if self.scope == "group":
            return self.keep * (num_completions // self.group_size)
        return self.kept_count(num_completions)

    @property
    def kept_per_step(self) -> int:
        """Completions a step trains in one process (``batch`` and ``global`` pool the whole step; under torchrun
        ``batch`` pools each rank's share, which can keep a few more when the shares' counts truncate)."""
        if self.scope == "group":
            return self.keep * self.questions_drawn
        return self.kept_count(self.completions_per_step)

    # ---------------------------------------------------------------------------------------------------------
    # Selection
    # ---------------------------------------------------------------------------------------------------------

    def pools_ranks(self, info: DistInfo | None = None) -> bool:
        """Whether the pool spans every rank (``scope="global"`` on more than one process: one selection over the
        gathered step, alike on every rank, each keeping its own survivors); else each rank prunes its own."""
        return self.scope == "global" and info is not None and info.distributed

    def questions_per_rank(self, info: DistInfo | None = None) -> int:
        """Questions one generation call of a step gives each rank: its share of :attr:`questions_drawn`."""
        return self.questions_drawn // (info.world_size if info is not None else 1)

    def completions_per_rank(self, info: DistInfo | None = None) -> int:
        """Completions a step generates on each rank: its share of :attr:`completions_per_step` (a group may
        straddle ranks)."""
        return self.completions_per_step // (info.world_size if info is not None else 1)

    def kept_budget(self, info: DistInfo | None = None) -> int:
        """Completions a step keeps without dynamic sampling: this rank's for ``group`` and ``batch``, all ranks'
        together for ``global`` under torchrun. Dynamic sampling (:mod:`cppo.step.dynamic`) keeps exactly this many
        of its pool, whatever the pool's size, so that the counts stay those of the plain rule."""
        if self.pools_ranks(info):
            return self.kept_count(self.completions_per_step)
        return self.kept_of_local(self.questions_per_rank(info) * self.group_size)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N]``: the advantages of ``rewards [N]`` over each full group (the selection's own)."""
        return group_advantages(rewards, self.group_size, scale=self.scale, eps=self.eps)

    def select(
        self, rewards: torch.Tensor, *, seed: int = 0, info: DistInfo | None = None, num_kept: int | None = None
    ) -> Selection:
        """Advantages over each full group of this process's ``rewards [N]`` (group after group), then the retained
        completions of the scope (see the module docstring). ``seed`` seeds the ``"random"`` metric's draws (the
        same on every rank: the local scopes add the rank). ``num_kept`` (``batch`` / ``global`` scopes): keep that
        many of the pool (this rank's, or all ranks' with ``global``) instead of the rule's ``N - int(N * P)``:
        dynamic sampling's budget over a pool of another size (:meth:`kept_budget`)."""
        info = info if info is not None else DistInfo()
        if num_kept is not None and self.scope == "group":
            raise ValueError("num_kept applies to the pooled scopes (batch, global), not to selection_scope group")
        if self.pools_ranks(info):
            advantages = group_advantages(rewards, self.group_size, scale=self.scale, eps=self.eps)  # [N]
            return Selection(advantages, self.prune(advantages, seed=seed, info=info, num_kept=num_kept))
        count = self._local_count(rewards.numel())
        if num_kept is not None:
            count["num_kept"] = min(int(num_kept), rewards.numel())
        advantages, kept = cppo_select(
            rewards, self.group_size, scale=self.scale, eps=self.eps, generator=self._generator(seed, info), **count
        )
        return Selection(advantages, kept)

    def prune(
        self, advantages: torch.Tensor, *, seed: int = 0, info: DistInfo | None = None, num_kept: int | None = None
    ) -> torch.Tensor:
        """The retained completions given advantages already computed (e.g. by TRL's own normalisation):
        ascending local indices of ``advantages [N]``. ``"global"`` under torchrun gathers |A| over the ranks.
        ``num_kept``: as in :meth:`select`."""
        info = info if info is not None else DistInfo()
        if not self.pools_ranks(info):
            count = self._local_count(len(advantages))
            if num_kept is not None and "num_kept" in count:
                count["num_kept"] = min(int(num_kept), len(advantages))
            return select_completions(advantages, self.group_size, generator=self._generator(seed, info), **count)
        return self._prune_global(advantages, seed=seed, info=info, num_kept=num_kept)

    def prune_pooled(
        self, gathered: torch.Tensor, sizes: list[int], rank: int, *, seed: int = 0, num_kept: int | None = None
    ) -> torch.Tensor:
        """``scope="global"`` with the ranks' advantages already gathered (``gathered [sum(sizes)]``, rank after
        rank, ``sizes`` each rank's count): the whole pool pruned as one process prunes ``batch`` (the same draws on
        every rank), then ``rank``'s survivors as ascending local indices. ``num_kept``: as in :meth:`select`."""
        count = self.kept_count(len(gathered)) if num_kept is None else min(int(num_kept), len(gathered))
        generator = self._generator(seed, DistInfo())  # the global draws: the same seed on every rank
        kept = select_completions(
            gathered, self.group_size, num_kept=count, scope="batch", metric=self.metric, generator=generator
        )
        start = sum(sizes[:rank])
        return kept[(kept >= start) & (kept < start + sizes[rank])] - start

    def _local_count(self, num_completions: int) -> dict:
        """The kernels' count arguments for a pool held by one process (``global`` in one process is ``batch``)."""
        if self.scope == "group":
            return {"keep": self.keep, "scope": "group", "metric": self.metric}
        return {"num_kept": self.kept_of_local(num_completions), "scope": "batch", "metric": self.metric}

    def _generator(self, seed: int, info: DistInfo) -> torch.Generator | None:
        if self.metric != "random":
            return None
        return torch.Generator().manual_seed(seed + (0 if self.pools_ranks(info) else info.rank))

    def _prune_global(
        self, advantages: torch.Tensor, *, seed: int, info: DistInfo, num_kept: int | None = None
    ) -> torch.Tensor:
        if not isinstance(advantages, torch.Tensor) or advantages.dim() != 1:
            raise ValueError("advantages must be a 1-D tensor [num_groups * group_size]")
        # gather before validating: every rank then sees the same data and raises the same error (no rank waits)
        gathered, sizes = all_gather_varlen(advantages.detach(), info=info)  # [N over all ranks]
        bad = [r for r, s in enumerate(sizes) if s % self.group_size]
        if bad:
            raise ValueError(
                f"advantages on rank {bad[0]} have {sizes[bad[0]]} elements, not divisible by "
                f"group_size={self.group_size}"
            )
        return self.prune_pooled(gathered, sizes, info.rank, seed=seed, num_kept=num_kept).to(advantages.device)
