"""Dynamic allocation of retained completions into token-budgeted micro-batches, and varlen packing.

A micro-batch is one row. Without prefix sharing, each sequence's prompt and completion are concatenated (the
completion's last token is not fed, since nothing predicts past it), ``position_ids`` restarting at 0 per sequence.
Row t of the hidden states predicts token t + 1, so a sequence with prompt length p and completion length c
contributes the rows ``p - 1 .. p + c - 2`` of its segment, whose targets are its c completion tokens.

With prefix sharing (:func:`pack_shared`), the completions of one prompt form a *group*: the prompt once, then each
completion's fed tokens, their ``position_ids`` continuing from p for every completion. A completion attends to its
prompt and to its own earlier tokens only (:class:`SharedPrefix` describes that block-causal mask), so its hidden
states equal those of the unshared layout; the first token of every completion is predicted from the prompt's last
row, the others from the completion's own rows. A group is one unit: it stays in one micro-batch unless its tokens
exceed the budget, and then it is cut into consecutive chunks of completions, each re-sending the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cppo_kernels.config import LOSS_AGG_UNITS


@dataclass
class Sample:
    """One retained completion: token ids of its prompt and completion (cut after the first EOS)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    #: each completion token's log-prob under the engine that sampled it (vllm), or None
    sampling_logprobs: list[float] | None = None

    @property
    def num_input_tokens(self) -> int:
        """Tokens the model runs on for this sample: the prompt and all but the last completion token."""
        return len(self.prompt_ids) + len(self.completion_ids) - 1


@dataclass(frozen=True)
class SharedPrefix:
    """Rows of a prefix-shared micro-batch of ``length`` rows: ``groups[j] = (first row, prompt length, fed lengths of
    its completions)``, the groups one after another. Row q attends to row k <= q of its own group iff k is a prompt
    row or a row of q's own completion (a prompt row attends causally to the prompt)."""

    groups: tuple[tuple[int, int, tuple[int, ...]], ...]
    length: int

    def dense_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[1, 1, L, L]`` bool, True where a row (query) may attend to a row (key): block by block, O(L^2) bytes."""
        mask = torch.zeros(self.length, self.length, dtype=torch.bool, device=device)  # [L, L]
        longest = max((n for _, p, fed in self.groups for n in (p, *fed)), default=0)
        tri = torch.ones(longest, longest, dtype=torch.bool, device=device).tril_()  # [n, n] causal
        for start, p, fed in self.groups:
            mask[start : start + p, start : start + p] = tri[:p, :p]
            row = start + p
            for n in fed:
                mask[row : row + n, start : start + p] = True
                mask[row : row + n, row : row + n] = tri[:n, :n]
                row += n
        return mask[None, None]

    def row_ids(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(group [L], branch [L])`` int32: the group of each row and its branch (0: the prompt, k: the k-th
        completion); q attends to k iff ``k <= q``, same group, and branch[k] is 0 or branch[q]."""
        group, branch = [], []
        for g, (_, p, fed) in enumerate(self.groups):
            group += [g] * (p + sum(fed))
            branch += [0] * p + [k + 1 for k, n in enumerate(fed) for _ in range(n)]
        return tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (group, branch))


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
    prefix: SharedPrefix | None = None  # the block-causal layout when prompts are shared; None: one per sequence
    sampling_logprobs: torch.Tensor | None = None  # [T] fp32, the sampling engine's, when every sample has them

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


def prompt_groups(samples: list[Sample]) -> list[list[int]]:
    """Indices of ``samples`` grouped by identical prompt ids (a question's kept completions), each group ascending,
    groups in the order of their first sample."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(s.prompt_ids), []).append(i)
    return list(groups.values())


def shared_tokens(samples: list[Sample], group: list[int]) -> int:
    """Rows the model runs on for ``group`` (samples of one prompt) packed with its prompt once: the prompt and all
    but the last token of each completion."""
    return len(samples[group[0]].prompt_ids) + sum(len(samples[i].completion_ids) - 1 for i in group)


def split_group(samples: list[Sample], group: list[int], budget: int) -> list[list[int]]:
    """``group`` cut into consecutive chunks of at most ``budget`` shared tokens, each re-sending the prompt (one
    chunk when it fits; a completion too long even alone is left to :func:`allocate` to refuse)."""
    chunks: list[list[int]] = []
    for i in group:
        if chunks and shared_tokens(samples, chunks[-1] + [i]) <= budget:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def _pack_units(
    samples: list[Sample], units: list[list[int]], *, device: torch.device | str, shared: bool
) -> PackedBatch:
    """One row of ``units`` (lists of sample indices of one prompt), each unit's prompt once (see the module
    docstring); ``shared`` records the block-causal layout (needed as soon as a unit holds two completions)."""
    ids: list[int] = []
    pos: list[int] = []
    predict: list[int] = []
    targets: list[int] = []
    cu = [0]
    groups = []
    for unit in units:
        prompt = samples[unit[0]].prompt_ids
        start, p = len(ids), len(prompt)
        ids.extend(prompt)
        pos.extend(range(p))
        fed = []
        for i in unit:
            c = samples[i].completion_ids
            if p < 1 or not c:
                raise ValueError(f"sample {i} needs a non-empty prompt and completion, got lengths {p} and {len(c)}")
            if samples[i].prompt_ids != prompt:
                raise ValueError(f"sample {i} does not share the prompt of sample {unit[0]}, the first of its unit")
            predict.append(start + p - 1)  # the first completion token, from the prompt's last row
            predict.extend(range(len(ids), len(ids) + len(c) - 1))
            ids.extend(c[:-1])
            pos.extend(range(p, p + len(c) - 1))
            targets.extend(c)
            cu.append(cu[-1] + len(c))
            fed.append(len(c) - 1)
        groups.append((start, p, tuple(fed)))
    index = [i for unit in units for i in unit]
    sampled = [samples[i].sampling_logprobs for i in index]
    if all(x is not None for x in sampled):
        sampled = torch.tensor([lp for x in sampled for lp in x], dtype=torch.float32, device=device)  # [T]
    else:
        sampled = None
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([pos], dtype=torch.long, device=device),
        predict_index=torch.tensor(predict, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        advantages=torch.tensor([samples[i].advantage for i in index], dtype=torch.float32, device=device),
        sample_index=index,
        prefix=SharedPrefix(tuple(groups), len(ids)) if shared else None,
        sampling_logprobs=sampled,
    )


def pack(samples: list[Sample], index: list[int], *, device: torch.device | str = "cpu") -> PackedBatch:
    """Concatenates ``samples[i] for i in index`` into one row, each with its own prompt (see the module docstring)."""
    return _pack_units(samples, [[i] for i in index], device=device, shared=False)


def pack_all(samples: list[Sample], budget: int, *, device: torch.device | str = "cpu") -> list[PackedBatch]:
    """Allocates ``samples`` by their input-token counts into micro-batches of at most ``budget`` tokens and packs
    each one."""
    bins = allocate([s.num_input_tokens for s in samples], budget)
    return [pack(samples, b, device=device) for b in bins]


def pack_shared(samples: list[Sample], budget: int, *, device: torch.device | str = "cpu") -> list[PackedBatch]:
    """Prefix-shared micro-batches of at most ``budget`` rows: the samples grouped by prompt (:func:`prompt_groups`),
    a group over the budget cut by :func:`split_group`, the units allocated by their shared token counts
    (:func:`allocate`) and packed with each prompt once."""
    units = [chunk for group in prompt_groups(samples) for chunk in split_group(samples, group, budget)]
    bins = allocate([shared_tokens(samples, u) for u in units], budget)
    return [_pack_units(samples, [units[u] for u in b], device=device, shared=True) for b in bins]


def loss_weight(loss_agg: str, *, num_tokens: int, num_seqs: int, total_tokens: int, total_seqs: int) -> float:
    """Scale of one micro-batch's aggregated loss so that the scaled losses sum to the loss over the whole batch.

    A mean over tokens (``token-mean``): tokens / total tokens; over sequences (``seq-mean-*``): sequences / total
    sequences (:data:`cppo_kernels.config.LOSS_AGG_UNITS` says which). The totals are arguments so that a
    distributed run can pass all-reduced counts (and the local losses then sum, across ranks, to the global loss).
    """
    if LOSS_AGG_UNITS[loss_agg] == "tokens":
        return num_tokens / total_tokens if total_tokens else 0.0
    return num_seqs / total_seqs if total_seqs else 0.0


def phase_tokens(prefill: int, decoded: int, batches: list[PackedBatch], *, passes: int) -> dict[str, int]:
    """A step's token positions per phase (the ``tokens/*`` metrics): generation's ``prefill`` positions and
    ``decoded`` tokens, and the training passes' prompt and completion positions (``tokens_forward`` split: each of
    the ``passes`` forwards runs every micro-batch; a shared prefix counted once)."""
    trained = sum(b.num_tokens for b in batches)
    return {
        "tokens/generate_prompt": prefill,
        "tokens/generate_completion": decoded,
        "tokens/train_prompt": (sum(b.num_input_tokens for b in batches) - trained) * passes,
        "tokens/train_completion": trained * passes,
    }
