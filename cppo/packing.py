"""Dynamic allocation of retained completions into token-budgeted micro-batches, and varlen packing.

A micro-batch is one row: each sequence's prompt and completion concatenated (the completion's last token is
not fed, since nothing predicts past it), ``position_ids`` restarting at 0 per sequence. Row t of the hidden
states predicts token t + 1, so a sequence with prompt length p and completion length c contributes the rows
``p - 1 .. p + c - 2`` of its segment, whose targets are its c completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One retained completion: token ids of its prompt and completion (cut after the first EOS)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float

    @property
    def num_input_tokens(self) -> int:
        """Tokens the model runs on for this sample: the prompt and all but the last completion token."""
        return len(self.prompt_ids) + len(self.completion_ids) - 1


@dataclass
class PackedBatch:
    """One packed micro-batch of S sequences and T completion tokens."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    predict_index: torch.Tensor  # [T] rows of the hidden states that predict the completion tokens
    targets: torch.Tensor  # [T] the completion tokens
    cu_seqlens: torch.Tensor  # [S + 1] offsets of each sequence's completion tokens, int32
    advantages: torch.Tensor  # [S] fp32
    sample_index: list[int]  # which samples (indices into the step's retained list) this micro-batch holds

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def num_seqs(self) -> int:
        return int(self.advantages.numel())

    @property
    def num_input_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def allocate(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: indices of ``lengths`` grouped into bins whose totals stay <= ``budget``.

    Items are placed longest first (ties: lower index first) into the first bin with room; each bin lists its
    indices in ascending order, and bins are ordered by their first placement. Deterministic.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    too_long = [n for n in lengths if n > budget]
    if too_long:
        raise ValueError(f"a sequence of {too_long[0]} tokens does not fit micro_batch_tokens={budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def pack(samples: list[Sample], index: list[int], *, device: torch.device | str = "cpu") -> PackedBatch:
    """Concatenates ``samples[i] for i in index`` into one row (see the module docstring)."""
    ids: list[int] = []
    pos: list[int] = []
    predict: list[int] = []
    targets: list[int] = []
    cu = [0]
    for i in index:
        s = samples[i]
        p, c = len(s.prompt_ids), len(s.completion_ids)
        if p < 1 or c < 1:
            raise ValueError(f"sample {i} needs a non-empty prompt and completion, got lengths {p} and {c}")
        start = len(ids)
        seq = s.prompt_ids + s.completion_ids[:-1]
        ids.extend(seq)
        pos.extend(range(len(seq)))
        predict.extend(range(start + p - 1, start + p + c - 1))
        targets.extend(s.completion_ids)
        cu.append(cu[-1] + c)
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([pos], dtype=torch.long, device=device),
        predict_index=torch.tensor(predict, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        advantages=torch.tensor([samples[i].advantage for i in index], dtype=torch.float32, device=device),
        sample_index=list(index),
    )


def pack_all(samples: list[Sample], budget: int, *, device: torch.device | str = "cpu") -> list[PackedBatch]:
    """Allocates ``samples`` by their input-token counts into micro-batches of at most ``budget`` tokens and packs
    each one."""
    bins = allocate([s.num_input_tokens for s in samples], budget)
    return [pack(samples, b, device=device) for b in bins]


def loss_weight(loss_agg: str, *, num_tokens: int, num_seqs: int, total_tokens: int, total_seqs: int) -> float:
    """Scale of one micro-batch's aggregated loss so that the scaled losses sum to the loss over the whole batch.

    ``token-mean``: tokens / total tokens; ``seq-mean-*``: sequences / total sequences. The totals are
    arguments so that a distributed run can pass all-reduced counts (and the local losses then sum, across
    ranks, to the global loss).
    """
    if loss_agg == "token-mean":
        return num_tokens / total_tokens if total_tokens else 0.0
    return num_seqs / total_seqs if total_seqs else 0.0
