"""Balancing a step's retained completions over the ranks of a ``torchrun`` job by the tokens the model will run on:
the policy (longest-processing-time greedy, :func:`lpt_assign`), the units it moves (a completion alone, or with
prefix sharing all of a question's completions with their prompt counted once) and the exchange
(:func:`cppo.distributed.gather_sequences`). In a single process every function returns its input: the trainer has
one code path. A batch goes: selection (:mod:`cppo.step.selection`) -> :func:`balance_samples` -> packing
(:mod:`cppo.step.packing`)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from ..distributed import DistInfo, SequenceShard, gather_sequences
from .packing import Sample, prompt_groups, shared_tokens

__all__ = ["lpt_assign", "balance_sequences", "split_units", "balance_samples"]


def lpt_assign(costs: Sequence[int], num_bins: int) -> list[int]:
    """Longest-processing-time greedy: the bin of each item, spreading ``costs`` so that bin totals are even.

    Items go longest first (ties: lower index first) to the bin with the smallest total so far (ties: lower bin).
    Deterministic; the largest total is at most ``sum / num_bins + max(costs)``.
    """
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be an int >= 1, got {num_bins!r}")
    if any(c < 0 for c in costs):
        raise ValueError("costs must be >= 0")
    heap = [(0, b) for b in range(num_bins)]
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, b = heapq.heappop(heap)
        owner[i] = b
        heapq.heappush(heap, (load + int(costs[i]), b))
    return owner


def balance_sequences(local: SequenceShard, *, info: DistInfo, costs: torch.Tensor | None = None) -> SequenceShard:
    """Redistributes the sequences of all ranks so that each rank gets about the same number of tokens.

    Every rank gathers all sequences (in rank order: the global order), assigns them with :func:`lpt_assign` on
    ``costs [S]`` (default: ``lengths``) and keeps the ones assigned to it, in global order. The result is a
    partition: each sequence lands on exactly one rank. A rank gets nothing only when there are fewer sequences
    than ranks. In a single process the input comes back unchanged.
    """
    if costs is not None and tuple(costs.shape) != (local.num_seqs,):
        raise ValueError(f"costs must have shape [S] = ({local.num_seqs},), got {tuple(costs.shape)}")
    if not info.distributed:
        return local
    gathered, cost_all = gather_sequences(local, info=info, costs=costs)
    owner = lpt_assign(gathered.lengths.tolist() if cost_all is None else cost_all, info.world_size)
    return gathered.select([i for i, r in enumerate(owner) if r == info.rank])


def split_units(units: list[list[int]], num_bins: int) -> list[list[int]]:
    """``units`` (lists of items that should stay together), the one with the most items (ties: the first) halved
    until there are ``num_bins`` of them or every unit is one item, so that every bin can get one."""
    units = [list(u) for u in units]
    while len(units) < num_bins and any(len(u) > 1 for u in units):
        k = max(range(len(units)), key=lambda j: (len(units[j]), -j))
        half = (len(units[k]) + 1) // 2
        units[k : k + 1] = [units[k][:half], units[k][half:]]
    return units


def _sample_shard(samples: list[Sample]) -> SequenceShard:
    """The samples as a :class:`SequenceShard`: token ids (prompt then completion), prompt length and advantage."""
    ids = [s.prompt_ids + s.completion_ids for s in samples]
    return SequenceShard(
        lengths=torch.tensor([len(x) for x in ids], dtype=torch.long),
        token_fields={"ids": torch.tensor([t for x in ids for t in x], dtype=torch.long)},
        seq_fields={
            "prompt_length": torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long),
            "advantage": torch.tensor([s.advantage for s in samples], dtype=torch.float64),
        },
    )


def _shard_samples(shard: SequenceShard) -> list[Sample]:
    """The :class:`Sample` list of a shard built by :func:`_sample_shard`."""
    flat, out, start = shard.token_fields["ids"].tolist(), [], 0  # one copy to the host, not one per sequence
    for n, p, a in zip(
        shard.lengths.tolist(), shard.seq_fields["prompt_length"].tolist(), shard.seq_fields["advantage"].tolist()
    ):
        out.append(Sample(flat[start : start + p], flat[start + p : start + n], a))
        start += n
    return out


def balance_samples(samples: list[Sample], *, info: DistInfo, prefix_sharing: bool = False) -> list[Sample]:
    """The retained completions of all ranks, spread over the ranks by the tokens the model will run on (each sample
    moves with its prompt, completion and advantage); a no-op alone.

    Without ``prefix_sharing`` each sample is placed alone by its input-token count (:func:`balance_sequences`).
    With it, the samples of one prompt (:func:`cppo.step.packing.prompt_groups`, over all ranks) move as one unit
    costing its shared token count (the prompt once), placed by :func:`lpt_assign`; a unit is split
    (:func:`split_units`, each part re-sending the prompt) only while there are fewer units than ranks. A rank keeps its
    units' samples in global order."""
    if not info.distributed:
        return samples
    local = _sample_shard(samples)
    if not prefix_sharing:
        costs = torch.tensor([s.num_input_tokens for s in samples], dtype=torch.long)
        return _shard_samples(balance_sequences(local, info=info, costs=costs))
    everything = _shard_samples(gather_sequences(local, info=info)[0])
    units = split_units(prompt_groups(everything), info.world_size)
    owner = lpt_assign([shared_tokens(everything, u) for u in units], info.world_size)
    return [everything[i] for i in sorted(i for u, r in zip(units, owner) if r == info.rank for i in u)]
