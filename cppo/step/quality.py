"""Pruning while generating (issue 38): the quality head that predicts, at a checkpoint mid-rollout, whether a
completion will end correct, the scorers it is compared with, and the rule that picks the completions to stop.

**The head** is a logistic regression on the policy's final hidden state at the checkpoint (the state that produced
the checkpoint's last token, :class:`cppo.engines.PartialRollout`), detached from the policy's graph, with its own
Adam optimizer, trained online on the completions that ran to the end: their state at the checkpoint and whether
they ended correct. The features are standardised by running moments (Chan's parallel update over every state
seen), so a scale the policy drifts to does not stall it. Its AUC and Brier score against the true outcomes of the
completions it scored are logged every step.

**The rule** is CPPO's own, applied to predicted advantages: within each group the predicted success probability
of the unfinished rows (and the true reward of the rows that already ended, where known) is normalised, and the
``stop`` unfinished rows with the smallest predicted ``|A|`` stop (ties: the later row). After generation CPPO's
exact selection runs on the true rewards of the survivors.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["SCORERS", "QualityHead", "auc", "brier", "choose_stops", "stops_per_group"]

#: ``rollout_stop.scorer``: the learned head, and two baselines for ablation (``random``: uniform draws;
#: ``length``: the shorter partial text in characters scores higher).
SCORERS = ("learned", "random", "length")


class QualityHead:
    """Online logistic head ``P(correct | h)`` over hidden states ``h [N, H]`` (see the module docstring)."""

    def __init__(self, hidden_size: int, *, lr: float = 1e-2, updates: int = 25, weight_decay: float = 1e-3):
        if hidden_size < 1 or not lr > 0 or updates < 1:
            raise ValueError(f"QualityHead: hidden_size >= 1, lr > 0, updates >= 1, got {hidden_size}, {lr}, {updates}")
        self.linear = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.optimizer = torch.optim.Adam(self.linear.parameters(), lr=lr, weight_decay=weight_decay)
        self.updates = updates
        self.count = torch.zeros((), dtype=torch.float64)
        self.mean = torch.zeros(hidden_size, dtype=torch.float64)
        self.m2 = torch.zeros(hidden_size, dtype=torch.float64)  # sum of squared deviations

    @property
    def trained(self) -> bool:
        return bool(self.count > 0)

    def _standardise(self, hidden: torch.Tensor) -> torch.Tensor:
        std = (self.m2 / self.count.clamp(min=1)).sqrt().clamp(min=1e-6)
        return ((hidden.double().cpu() - self.mean) / std).float()

    @torch.no_grad()
    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 ``[N]`` success probabilities of the states ``hidden [N, H]`` (0.5 before any update)."""
        if hidden.numel() == 0:
            return torch.zeros(0)
        return torch.sigmoid(self.linear(self._standardise(hidden))).squeeze(-1)

    def update(self, hidden: torch.Tensor, correct: torch.Tensor) -> float:
        """Folds ``hidden [N, H]`` into the feature moments, then ``updates`` Adam steps of the logistic loss on them
        against ``correct [N]`` (0 / 1); returns the last loss (nan when ``N`` is 0)."""
        if hidden.numel() == 0:
            return float("nan")
        x64 = hidden.detach().double().cpu()
        n, batch_mean = x64.shape[0], x64.mean(0)
        delta, total = batch_mean - self.mean, self.count + n
        self.m2 += ((x64 - batch_mean) ** 2).sum(0) + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.count = total
        x, y = self._standardise(x64), correct.detach().float().cpu().reshape(-1, 1)
        loss = torch.zeros(())
        with torch.enable_grad():
            for _ in range(self.updates):
                self.optimizer.zero_grad(set_to_none=True)
                loss = nn.functional.binary_cross_entropy_with_logits(self.linear(x), y)
                loss.backward()
                self.optimizer.step()
        return float(loss.detach())

    def state_dict(self) -> dict:
        """A copy of the weights, Adam's moments and the feature moments (nothing shared with the live head)."""
        return copy.deepcopy({"linear": self.linear.state_dict(), "optimizer": self.optimizer.state_dict(),
                              "count": self.count, "mean": self.mean, "m2": self.m2})  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.linear.load_state_dict(state["linear"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.count, self.mean, self.m2 = state["count"].clone(), state["mean"].clone(), state["m2"].clone()


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """The area under the ROC curve of ``scores`` for ``labels`` (0 / 1): the chance that a random positive scores
    above a random negative, ties counting half (Mann-Whitney); None without both classes."""
    scores, labels = scores.double().flatten(), labels.bool().flatten()
    pos, neg = scores[labels], scores[~labels]
    if not len(pos) or not len(neg):
        return None
    above = (pos[:, None] > neg[None, :]).double().sum() + 0.5 * (pos[:, None] == neg[None, :]).double().sum()
    return float(above / (len(pos) * len(neg)))


def brier(probabilities: torch.Tensor, labels: torch.Tensor) -> float | None:
    """The mean squared error of ``probabilities`` against ``labels`` (0 / 1): calibration and sharpness in one
    number (0.25 for a constant 0.5); None when empty."""
    if probabilities.numel() == 0:
        return None
    return float(((probabilities.double() - labels.double()) ** 2).mean())


def stops_per_group(rate: float, group_size: int) -> int:
    """Completions of a group to stop at the checkpoint: ``int(G * rate)`` (the official pruning count's rounding)."""
    return int(group_size * rate)


def choose_stops(
    predicted: torch.Tensor,
    finished: list[bool],
    *,
    group_size: int,
    stop: int,
    known: torch.Tensor | None = None,
    eps: float = 1e-4,
) -> list[bool]:
    """Which rows to stop: per group of ``group_size`` (rows laid out group after group), the ``stop`` unfinished
    rows with the smallest ``|predicted - mean| / (std + eps)``, the group's moments over its unfinished rows'
    ``predicted`` values and its finished rows' ``known`` rewards (NaN or None: left out). Fewer when fewer rows are
    unfinished. Ties stop the later row."""
    n = len(finished)
    if predicted.shape != (n,) or n % group_size:
        raise ValueError(f"choose_stops: predicted [{n}] in groups of {group_size}, got {tuple(predicted.shape)}")
    if not bool(predicted.isfinite().all()):
        raise ValueError("choose_stops: the predicted values must be finite")
    values = predicted.double().clone()
    done = torch.tensor(finished, dtype=torch.bool)
    values[done] = float("nan") if known is None else known.double()[done]
    grouped = values.reshape(-1, group_size)  # [Q, G]
    seen = ~grouped.isnan()
    count = seen.sum(1, keepdim=True)  # [Q, 1]
    mean = torch.where(seen, grouped, 0.0).sum(1, keepdim=True) / count.clamp(min=1)
    var = torch.where(seen, (grouped - mean) ** 2, 0.0).sum(1, keepdim=True) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), 0.0)
    score = (grouped - mean).abs() / (std + eps)  # [Q, G]
    score = torch.where(done.reshape(-1, group_size), float("inf"), score)  # an ended row is never stopped
    # smallest score first, ties to the later row: a stable sort of each group read backwards
    order = torch.sort(score.flip(1), dim=1, stable=True).indices[:, :stop]  # [Q, stop], into the flipped group
    picked = score.flip(1).gather(1, order).isfinite()
    rows = (group_size - 1 - order) + torch.arange(0, n, group_size)[:, None]  # [Q, stop]
    out = torch.zeros(n, dtype=torch.bool)
    out[rows[picked]] = True
    return out.tolist()


def survivor_advantages(
    rewards: torch.Tensor, stopped: torch.Tensor, *, group_size: int, scale: str, eps: float
) -> torch.Tensor:
    """fp32 ``[N]`` advantages over each group's survivors (the rows not ``stopped``): ``(r - mean) / (std + eps)``
    with the mean and Bessel-corrected std of the group's survivors (``scale="batch"``: one std over every
    survivor; ``"none"``: the mean only); a stopped row gets 0, a group with one survivor 0 (in fp64, then fp32)."""
    r = rewards.double().reshape(-1, group_size)  # [Q, G]
    alive = (~stopped.bool()).reshape(-1, group_size)  # [Q, G]
    n = alive.sum(1, keepdim=True).clamp(min=1)  # [Q, 1]
    mean = (r * alive).sum(1, keepdim=True) / n
    dev = (r - mean) * alive
    if scale == "group":
        std = ((dev**2).sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    elif scale == "batch":
        m = alive.sum()
        pooled = r[alive]
        std = (((pooled - pooled.mean()) ** 2).sum() / max(int(m) - 1, 1)).sqrt() if int(m) else torch.zeros(())
    else:
        std = torch.zeros(())
    adv = dev / (std + eps) if scale != "none" else dev
    adv = torch.where(n > 1, adv, torch.zeros_like(adv)) * alive
    return adv.reshape(-1).float()


def survivor_selection(
    rewards: torch.Tensor, stopped, pruning, *, num_kept: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPPO's exact selection over the survivors (``pruning``: a :class:`cppo.step.Pruning` with the ``smallest``
    metric, the ``group`` or ``batch`` scope; ``stopped``: a bool per row, list or tensor): the advantages over each
    group's survivors, then the official count of the completions with the largest ``|A|`` (per group ``keep``;
    pooled ``N - int(N * P)``, or ``num_kept``: dynamic sampling's budget over a pool of another size), ties to the
    lower index, never a stopped row. ``(advantages [N], kept [K] ascending)``."""
    mask = torch.as_tensor(stopped, dtype=torch.bool).cpu()
    stopped = mask.tolist()
    adv = survivor_advantages(rewards, mask, group_size=pruning.group_size, scale=pruning.scale, eps=pruning.eps)
    score = torch.where(mask, torch.full_like(adv, -1.0, dtype=torch.float64), adv.double().abs())  # [N]
    n = len(stopped)
    # the largest |A| first, ties to the lower index: a stable sort of -|A|
    if pruning.scope == "group":
        g = pruning.group_size
        order = torch.sort(-score.reshape(-1, g), dim=1, stable=True).indices[:, : pruning.keep]  # [Q, keep]
        kept = (order + torch.arange(0, n, g)[:, None]).reshape(-1).tolist()
    else:
        count = pruning.kept_count(n) if num_kept is None else num_kept
        kept = torch.sort(-score, stable=True).indices[:count].tolist()
    if any(stopped[i] for i in kept):  # what the settings' rule (rollout_stop.rate <= pruning_rate) rules out
        raise ValueError(
            f"survivor_selection: {sum(stopped)} of {n} completions were stopped, more than the selection leaves out "
            f"(it keeps {len(kept)})"
        )
    return adv, torch.tensor(sorted(kept), dtype=torch.long)


class RolloutStopping:
    """Pruning while generating in a run (the ``rollout_stop`` section): each step's :class:`Stopper` (none during
    the warm-up's steps, whose rollouts only train the head), the head trained on what ran to the end, the metrics,
    the selection over the survivors, and the head's state for the checkpoint. Every rank trains the same head on
    the rows of all ranks (gathered), so the ranks stop alike."""

    def __init__(self, config, *, hidden_size: int, tokenizer, info=None) -> None:
        from ..engines import checkpoint_tokens

        stop = config.rollout_stop  # the section: rate, at, scorer, warmup
        self.rate, self.scorer, self.warmup = stop["rate"], stop["scorer"], stop["warmup"]
        self.at = checkpoint_tokens(stop["at"], config.max_completion_length)
        self.group_size, self.tokenizer, self.info = config.group_size, tokenizer, info
        self.max_length = config.max_completion_length
        self.stop = stops_per_group(self.rate, self.group_size)
        self.head = QualityHead(hidden_size) if self.scorer == "learned" else None
        self.step: int | None = None
        #: This step's generation calls, call after call: each checkpoint's rows and their scores.
        self.calls: list[tuple] = []

    def stopper(self, step: int, seed: int):
        """A :class:`Stopper` for one generation call of step ``step`` (a step of dynamic sampling makes several): it
        records the checkpoint's rows and their scores for :meth:`observe`; during the warm-up it stops nothing."""
        from ..engines import Stopper

        if step != self.step:
            self.step, self.calls = step, []
        learning, call = step < self.warmup, len(self.calls)
        call_seed = seed if call == 0 else hash((seed, call)) % 2**62  # the random scorer's draws differ per call

        def choose(partial) -> list[bool]:
            predicted = self._scores(partial, call_seed)
            self.calls.append((partial, predicted))
            if learning:
                return [False] * len(partial.finished)
            return choose_stops(predicted, partial.finished, group_size=self.group_size, stop=self.stop)

        return Stopper(at=self.at, choose=choose, needs_hidden=self.head is not None)  # the baselines read none

    def _recorded(self, num_rows: int):
        """``(finished [N], predicted [N], hidden [N, H] or None)`` of this step's calls (None when no call asked
        its stopper); a RuntimeError when they do not cover exactly the step's ``num_rows`` rows."""
        calls, self.calls = self.calls, []
        if not calls:
            return None
        recorded = sum(len(p.finished) for p, _ in calls)
        if recorded != num_rows:  # every call asks its stopper once: anything else is an engine's bug
            raise RuntimeError(f"rollout_stop: the step's stoppers saw {recorded} rows, its rollout has {num_rows}")
        finished = sum((list(p.finished) for p, _ in calls), [])
        predicted = torch.cat([x.float().cpu() for _, x in calls])
        hidden = [p.hidden for p, _ in calls]
        return finished, predicted, None if any(h is None for h in hidden) else torch.cat(hidden)

    def _scores(self, partial, seed: int) -> torch.Tensor:
        n = len(partial.finished)
        if self.scorer == "learned":
            return self.head.predict(partial.hidden) if partial.hidden is not None else torch.full((n,), 0.5)
        if self.scorer == "random":
            return torch.rand(n, generator=torch.Generator().manual_seed(seed))
        texts = self.tokenizer.batch_decode(partial.completion_ids, skip_special_tokens=True)
        return torch.tensor([-float(len(t)) for t in texts])  # length: the shorter partial text scores higher

    def observe(self, rollout, correct: list[bool], rewards: torch.Tensor) -> dict[str, float]:
        """After the step's rewards: the head's AUC and Brier score over the rows it scored that ran to the end
        (predictions made before this step's update), the head updated on them, and the counts; with rows stopped,
        ``reward_mean``, ``reward_std`` and ``accuracy`` over the completions that ran to the end (all ranks'), which
        replace the step's (a stopped completion has no final reward)."""
        from ..distributed import DistInfo, all_gather_varlen

        info = self.info if self.info is not None else DistInfo()
        stopped = rollout.stopped or [False] * len(correct)
        out = {"rollout_stop/stopped": float(sum(stopped)), "rollout_stop/fraction": sum(stopped) / len(stopped),
               # tokens a stopped completion would have decoded at most (it might have ended sooner)
               "rollout_stop/tokens_saved_max": float(sum(stopped) * (self.max_length - self.at))}  # fmt: skip
        alive = torch.tensor([not x for x in stopped])
        ran = torch.stack([rewards.float().cpu(), torch.tensor(correct, dtype=torch.float32)], 1)[alive]  # [n, 2]
        every, _ = all_gather_varlen(ran, info=info)
        if len(every) < len(stopped) * info.world_size:  # a rank stopped rows
            out.update(reward_mean=float(every[:, 0].mean()), accuracy=float(every[:, 1].mean()),
                       reward_std=float(every[:, 0].std()) if len(every) > 1 else 0.0)  # fmt: skip
        recorded = self._recorded(len(stopped))
        if recorded is None:
            return out
        finished, predicted, hidden = recorded
        ran = torch.tensor([not f and not s for f, s in zip(finished, stopped)])  # [N]
        label = torch.tensor(correct, dtype=torch.float32)[ran]
        pred, _ = all_gather_varlen(predicted[ran].reshape(-1, 1), info=info)
        label_all, _ = all_gather_varlen(label.reshape(-1, 1), info=info)
        area = auc(pred.flatten(), label_all.flatten())
        score = brier(pred.flatten(), label_all.flatten()) if self.scorer != "length" else None  # not a probability
        out.update({"rollout_stop/auc": float("nan") if area is None else area,
                    "rollout_stop/brier": float("nan") if score is None else score})  # fmt: skip
        if self.head is not None and hidden is not None:
            hidden, _ = all_gather_varlen(hidden.float()[ran.to(hidden.device)], info=info)
            self.head.update(hidden, label_all.flatten())
        return out

    def state_dict(self) -> dict:
        return {"head": None if self.head is None else self.head.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.head is not None and state.get("head") is not None:
            self.head.load_state_dict(state["head"])
