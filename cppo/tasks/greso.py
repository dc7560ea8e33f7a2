"""GRESO's selective rollout (Zheng et al., arXiv 2506.02177): questions that cannot teach are not generated.

A question whose recent groups were all zero-variance (its G rewards all equal: every advantage 0) is likely to be
so again. Before rollout, a drawn question whose last ``z`` groups in a row were zero-variance is skipped with
probability ``1 - max(p ** z, min_explore)``: never while ``z = 0``, more likely the longer its streak, and never
with a probability above ``1 - min_explore`` (the exploration floor: a skipped question still comes back now and
then, and one non-zero-variance group resets its streak). ``p``, the exploration probability (0.5 at the start),
adapts after every draw to a target skip rate: when the draw skipped more than ``target_skip_rate`` of the
questions it considered, ``p`` rises by ``adjust_step`` (skip less), otherwise it falls by as much (skip more),
within ``[min_explore, 1]``. (The paper adapts one probability for all-correct and one for all-wrong questions to a
target share of zero-variance groups in the rollout; here one probability, to a target skip rate.)

Each skip decision is a uniform draw seeded by ``(seed, epoch, position in the epoch's order)``, so it depends only
on where the sampler stands and on this state: the streaks and ``p``, which :meth:`SelectiveRollout.state_dict`
holds for the checkpoint (a resumed run skips exactly what the uninterrupted one would). Every rank holds the same
state: the trainer gathers every rank's groups before :meth:`SelectiveRollout.observe`.
"""

from __future__ import annotations

import random

from cppo_kernels.config import check_float

__all__ = ["INITIAL_EXPLORE", "SelectiveRollout", "check_greso"]

#: The exploration probability ``p`` at the start of a run.
INITIAL_EXPLORE = 0.5


def check_greso(target_skip_rate: float, min_explore: float, adjust_step: float) -> None:
    """A ``ValueError`` naming the first bad GRESO setting."""
    check_float("greso_target_skip_rate", target_skip_rate)
    if not 0.0 <= target_skip_rate < 1.0:
        raise ValueError(f"greso_target_skip_rate must be in [0, 1), got {target_skip_rate}")
    check_float("greso_min_explore", min_explore)
    if not 0.0 < min_explore <= 1.0:
        raise ValueError(
            f"greso_min_explore must be in (0, 1] (a skipped question must be able to come back), got {min_explore}"
        )
    check_float("greso_adjust_step", adjust_step)
    if not 0.0 < adjust_step <= 1.0:
        raise ValueError(f"greso_adjust_step must be in (0, 1], got {adjust_step}")


class SelectiveRollout:
    """The skip rule and its history over ``num_questions`` questions (module docstring)."""

    def __init__(
        self,
        num_questions: int,
        *,
        seed: int = 0,
        target_skip_rate: float = 0.5,
        min_explore: float = 0.05,
        adjust_step: float = 0.01,
    ) -> None:
        check_greso(target_skip_rate, min_explore, adjust_step)
        self.seed, self.target, self.min_explore, self.adjust_step = seed, target_skip_rate, min_explore, adjust_step
        self.streaks = [0] * num_questions  # zero-variance groups in a row, most recent last
        self.explore = max(INITIAL_EXPLORE, min_explore)

    def skip_probability(self, question: int) -> float:
        z = self.streaks[question]
        return 0.0 if z == 0 else 1.0 - max(self.explore**z, self.min_explore)

    def skips(self, question: int, epoch: int, position: int) -> bool:
        """Whether to skip ``question``, drawn at ``position`` of ``epoch``'s order."""
        p = self.skip_probability(question)
        return p > 0.0 and random.Random(f"greso:{self.seed}:{epoch}:{position}").random() < p

    def adapt(self, skipped: int, considered: int) -> None:
        """After a draw that skipped ``skipped`` of the ``considered`` questions: ``p`` moves toward the target."""
        if considered <= 0:
            return
        step = self.adjust_step if skipped / considered > self.target else -self.adjust_step
        self.explore = min(1.0, max(self.min_explore, self.explore + step))

    def observe(self, questions: list[int], zero_variance: list[bool]) -> None:
        """Each generated group, in order: its question's streak grows when its rewards were all equal, else resets."""
        for q, zero in zip(questions, zero_variance):
            self.streaks[q] = self.streaks[q] + 1 if zero else 0

    def state_dict(self) -> dict:
        return {"streaks": list(self.streaks), "explore": float(self.explore)}

    def load_state_dict(self, state: dict) -> None:
        streaks = [int(z) for z in state["streaks"]]
        if len(streaks) != len(self.streaks):
            raise ValueError(
                f"the checkpoint's GRESO history covers {len(streaks)} questions, this run has {len(self.streaks)}"
            )
        self.streaks, self.explore = streaks, float(state["explore"])
