"""The processes of a ``torchrun`` job and what passes between them: the process group, collectives, the split of
the questions, gathering ragged tensors and sequences, global counts and metric reductions.

Model wrapping and gradient synchronisation are in :mod:`cppo.distributed.parallel`, checkpoints in
:mod:`cppo.run.checkpoint`, the balancing policy of the retained completions in :mod:`cppo.step.balance`.
Every function takes a :class:`DistInfo` and is a no-op (or a plain local computation) in a single process, so the
trainer has one code path. The data flow of a distributed step:

1. each rank takes its contiguous block of the step's questions (:func:`question_slice`), so a question's G
   completions and their group advantages never straddle ranks;
2. selection (:mod:`cppo.step.selection`): ``"group"`` and ``"batch"`` are local (``"batch"`` pools per rank, as the
   official Open-R1 code), ``"global"`` gathers |A| from all ranks (:func:`all_gather_varlen`) and keeps the step's
   official count over the concatenation in rank order, each rank keeping its own survivors;
3. the survivors are spread over the ranks by token count (:func:`cppo.step.balance.balance_samples`,
   longest-processing-time greedy over sequences gathered by :func:`gather_sequences`; with prefix sharing a
   question's survivors move together, their prompt counted once);
4. the loss of every micro-batch is normalised by all-reduced counts (:func:`global_counts`) and multiplied by
   :func:`cppo.distributed.parallel.grad_scale` because DDP and FSDP2 average gradients over ranks, so the update equals
   the single-process update of the concatenated batch;
5. metrics are reduced across ranks (:func:`reduce_metrics`) and only rank 0 prints and writes (``DistInfo.is_main``).

Collectives are tensor collectives on the rank's device (nccl on CUDA, gloo on CPU); the only object collective
runs when the ranks report different metric names, to name them in the error.
"""

from __future__ import annotations

import datetime
import gc
import itertools
import os
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .device import resolve_device

#: How :func:`reduce_metrics` combines a metric over ranks (``mean`` may name a weight metric).
REDUCTIONS = ("sum", "mean", "min", "max")

__all__ = [
    "DistInfo",
    "init_distributed",
    "close_distributed",
    "require_group",
    "barrier",
    "print_main",
    "question_slice",
    "all_gather_varlen",
    "SequenceShard",
    "gather_sequences",
    "GlobalCounts",
    "global_counts",
    "max_across_ranks",
    "reduce_metrics",
]


# --------------------------------------------------------------------------------------------
# Process group
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size`` processes, ``local_rank`` on its node, its ``device``.

    The default is the single process on the CPU; collectives short-circuit when ``world_size == 1``.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that prints, logs and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one process (collectives then need an initialised process group)."""
        return self.world_size > 1


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"environment variable {name} must be an int (torchrun sets it), got {raw!r}") from None


def init_distributed(*, device: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Joins the process group described by torchrun's environment, or returns the single-process :class:`DistInfo`.

    Under torchrun (``WORLD_SIZE`` set; ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` read by torch)
    the backend is nccl when the device is CUDA, gloo on the CPU. ``device`` is resolved by
    :func:`cppo.distributed.device.resolve_device`: ``"auto"``, ``"cpu"`` or ``"cuda"`` (each rank takes
    ``cuda:LOCAL_RANK``); a single process also accepts ``"cuda:N"``. Idempotent: an already initialised group is
    reused.
    """
    if "WORLD_SIZE" not in os.environ:
        return DistInfo(device=resolve_device(device))
    world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
    dev = resolve_device(device, local_rank=local_rank)
    use_cuda = dev.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(dev)
    info = DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return info


def close_distributed() -> None:
    """Destroys the process group if one is initialised. Call it after the last reference to a DDP module is gone:
    a DDP reducer that outlives the group destroys it on deallocation while holding the GIL, which can deadlock
    with a Gloo thread that needs the GIL to free the last all-reduce's tensors. Reference cycles that still hold
    such a module are collected first."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def require_group(info: DistInfo) -> None:
    """``RuntimeError`` when ``info`` spans several processes but no process group is initialised."""
    if info.distributed and not dist.is_initialized():
        raise RuntimeError(f"world_size={info.world_size} but no process group is initialised: call init_distributed()")


def barrier(info: DistInfo) -> None:
    """Waits for every rank (no-op in a single process)."""
    if info.distributed:
        require_group(info)
        dist.barrier()


def print_main(*args, info: DistInfo, **kwargs) -> None:
    """``print`` on rank 0 only."""
    if info.is_main:
        print(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Splitting questions, gathering ragged tensors
# --------------------------------------------------------------------------------------------


def question_slice(num_questions: int, *, info: DistInfo) -> slice:
    """This rank's contiguous block of a step's ``num_questions`` questions (sizes differ by at most one).

    Concatenating the blocks in rank order gives the step's questions in order, so "the same global batch" in a
    single process is the concatenation of the ranks' batches. Splitting by question keeps each question's G
    completions, and so its group advantages, on one rank.
    """
    if isinstance(num_questions, bool) or not isinstance(num_questions, int) or num_questions < 0:
        raise ValueError(f"num_questions must be an int >= 0, got {num_questions!r}")
    w, r = info.world_size, info.rank
    return slice(r * num_questions // w, (r + 1) * num_questions // w)


def all_gather_objects(obj, *, info: DistInfo) -> list:
    """Every rank's ``obj`` (picklable plain data), in rank order, on every rank; ``[obj]`` in a single process."""
    if not info.distributed:
        return [obj]
    require_group(info)
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def all_gather_varlen(x: torch.Tensor, *, info: DistInfo) -> tuple[torch.Tensor, list[int]]:
    """Concatenation over ranks (in rank order) of tensors whose first dimension differs per rank.

    Returns ``(gathered [sum n_r, ...], [n_0, ..., n_{W-1}])``. Trailing dimensions and dtype must agree. ``x`` may
    live on any device: the collectives run on ``info.device`` and ``gathered`` comes back on ``x.device``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor with at least one dimension, got {type(x).__name__}")
    if not info.distributed:
        return x, [x.shape[0]]
    require_group(info)
    n = torch.tensor([x.shape[0]], dtype=torch.int64, device=info.device)
    sizes_t = [torch.zeros_like(n) for _ in range(info.world_size)]
    dist.all_gather(sizes_t, n)
    sizes = torch.cat(sizes_t).tolist()  # one host sync for all ranks
    return _gather_known_sizes(x, sizes, info=info), sizes


def _gather_known_sizes(x: torch.Tensor, sizes: list[int], *, info: DistInfo) -> torch.Tensor:
    """:func:`all_gather_varlen` when every rank's row count ``sizes`` is already known (one collective).

    The collective runs on ``info.device`` (nccl takes CUDA tensors only, gloo CPU ones); the result comes back on
    ``x.device``."""
    padded = x.new_zeros((max(sizes),) + tuple(x.shape[1:]), device=info.device)  # [max n, ...]
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(info.world_size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)]).to(x.device)


# --------------------------------------------------------------------------------------------
# Ragged sequences across ranks (balancing them: cppo.step.balance)
# --------------------------------------------------------------------------------------------


@dataclass
class SequenceShard:
    """Variable-length sequences held by one rank, as tensors that collectives can move.

    ``lengths [S]`` int64; ``token_fields``: name -> ``[T, ...]`` with ``T = lengths.sum()`` (the sequences one
    after another, e.g. token ids, old log-probs); ``seq_fields``: name -> ``[S, ...]`` (e.g. prompt length,
    advantage, the completion's global id). Field names, dtypes and trailing shapes must agree across ranks.
    """

    lengths: torch.Tensor  # [S] int64
    token_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [T, ...]
    seq_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [S, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.lengths, torch.Tensor) or self.lengths.dim() != 1 or self.lengths.is_floating_point():
            raise ValueError("lengths must be a 1-D integer tensor [S]")
        if self.lengths.numel() and int(self.lengths.min()) < 0:
            raise ValueError("lengths must be >= 0")
        s, t = self.lengths.numel(), int(self.lengths.sum())
        for name, x in self.token_fields.items():
            if x.dim() < 1 or x.shape[0] != t:
                raise ValueError(f"token_fields[{name!r}] must have {t} rows (lengths.sum()), got {tuple(x.shape)}")
        for name, x in self.seq_fields.items():
            if x.dim() < 1 or x.shape[0] != s:
                raise ValueError(f"seq_fields[{name!r}] must have {s} rows (one per sequence), got {tuple(x.shape)}")

    @property
    def num_seqs(self) -> int:
        return self.lengths.numel()

    def select(self, index: Sequence[int] | torch.Tensor) -> SequenceShard:
        """The sequences ``index`` (in that order)."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.lengths.device)  # [K]
        lengths = self.lengths.long()
        starts = torch.cumsum(lengths, 0) - lengths  # [S] first row of each sequence
        picked = lengths[index]  # [K]
        out_starts = torch.cumsum(picked, 0) - picked  # [K] first row of each picked sequence in the result
        total = int(picked.sum())
        # row j of picked sequence k (output row out_starts[k] + j) is input row starts[index[k]] + j
        shift = torch.repeat_interleave(starts[index] - out_starts, picked, output_size=total)  # [T']
        rows = shift + torch.arange(total, device=lengths.device)  # [T']
        return SequenceShard(
            lengths=self.lengths[index],
            token_fields={k: v[rows.to(v.device)] for k, v in self.token_fields.items()},
            seq_fields={k: v[index.to(v.device)] for k, v in self.seq_fields.items()},
        )


def gather_sequences(local: SequenceShard, *, info: DistInfo, costs: torch.Tensor | None = None):
    """``(all ranks' sequences in rank order (the global order), their costs [S_all] as a list or None)``: every field
    gathered in one collective; ``costs [S]`` (this rank's, optional) gathered with them."""
    require_group(info)
    lengths, seq_sizes = all_gather_varlen(local.lengths.long(), info=info)  # [S_all]
    host_lengths = lengths.tolist()
    bounds = list(itertools.accumulate(seq_sizes, initial=0))
    tok_sizes = [sum(host_lengths[a:b]) for a, b in zip(bounds, bounds[1:])]  # tokens per rank
    # every rank's row counts are known now: each field takes one collective (fields in the same order on all ranks)
    gathered = SequenceShard(
        lengths=lengths,
        token_fields={k: _gather_known_sizes(v, tok_sizes, info=info) for k, v in sorted(local.token_fields.items())},
        seq_fields={k: _gather_known_sizes(v, seq_sizes, info=info) for k, v in sorted(local.seq_fields.items())},
    )
    cost_all = None if costs is None else _gather_known_sizes(costs.long(), seq_sizes, info=info).tolist()
    return gathered, cost_all


# --------------------------------------------------------------------------------------------
# Global counts for loss normalisation, metric reduction
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GlobalCounts:
    """Completion tokens and sequences of the whole step, summed over ranks."""

    tokens: int
    seqs: int


def global_counts(*, num_tokens: int, num_seqs: int, info: DistInfo) -> GlobalCounts:
    """All-reduced (summed) token and sequence counts: the denominators of ``token-mean`` and the sequence means."""
    if not info.distributed:
        return GlobalCounts(tokens=int(num_tokens), seqs=int(num_seqs))
    require_group(info)
    t = torch.tensor([int(num_tokens), int(num_seqs)], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    tokens, seqs = t.tolist()  # one host sync
    return GlobalCounts(tokens=tokens, seqs=seqs)


def sum_across_ranks(values: list[int], *, info: DistInfo) -> list[int]:
    """Each of ``values`` summed over ranks (one collective; every rank passes as many)."""
    if not info.distributed:
        return [int(v) for v in values]
    require_group(info)
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def max_across_ranks(value: int, *, info: DistInfo) -> int:
    """The largest ``value`` over ranks (e.g. the micro-batch count, so that every rank runs as many passes)."""
    if not info.distributed:
        return int(value)
    require_group(info)
    t = torch.tensor([int(value)], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _parse_reduction(name: str, spec: str) -> tuple[str, str | None]:
    op, _, weight = spec.partition(":")
    if op not in REDUCTIONS or (weight and op != "mean"):
        raise ValueError(
            f"reduction of metric {name!r} must be one of {REDUCTIONS} or 'mean:<weight metric>', got {spec!r}"
        )
    return op, weight or None


def _check_same_names(names: list[str], *, info: DistInfo) -> None:
    """``ValueError`` on every rank, naming the differences, unless every rank reports the same metric ``names``.

    The reductions have one tensor slot per name: a mismatch would hang or mix metrics. The max of (crc, -crc) over
    ranks shows whether all crcs agree; only then are the names themselves gathered, to say which differ."""
    crc = zlib.crc32("\n".join(names).encode())
    check = torch.tensor([crc, -crc], dtype=torch.int64, device=info.device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    hi, neg_lo = check.tolist()
    if hi != -neg_lo:  # every rank sees this
        all_names: list = [None] * info.world_size
        dist.all_gather_object(all_names, names)
        differ = sorted(set().union(*map(set, all_names)) - set.intersection(*map(set, all_names)))
        raise ValueError(f"ranks report different metrics ({differ[:5]}): every rank must report the same names")


def reduce_metrics(
    metrics: Mapping[str, float],
    *,
    info: DistInfo,
    reductions: Mapping[str, str] | Callable[[str], str] = lambda name: "mean",
) -> dict[str, float]:
    """Metrics of the whole step from each rank's local metrics (every rank gets the result).

    ``reductions`` maps a metric name (a mapping, or a function of the name) to ``"sum"``, ``"min"``, ``"max"``,
    ``"mean"`` (plain mean over ranks) or ``"mean:<w>"``: the mean weighted by the local value of metric ``<w>``
    (e.g. a local token-mean weighted by the local token count gives the global token-mean; when the weights sum
    to 0 the plain mean is used). Sums, minima and maxima of ints stay ints. Every rank must pass the same names; a
    mismatch raises ``ValueError``.
    """
    names = sorted(metrics)
    spec_of = reductions if callable(reductions) else (lambda n: reductions.get(n, "mean"))
    specs = {n: _parse_reduction(n, spec_of(n)) for n in names}
    for n, (_, w) in specs.items():
        if w is not None and w not in metrics:
            raise ValueError(f"metric {n!r} is weighted by {w!r}, which is not among the metrics")
    values = {n: float(metrics[n]) for n in names}
    if not info.distributed:
        return dict(metrics)
    require_group(info)
    _check_same_names(names, info=info)
    dev = info.device
    k = len(names)
    local = [values[n] for n in names]
    weights = [values[specs[n][1]] if specs[n][1] else 1.0 for n in names]
    # [plain sums | weighted sums | weight sums] and [minima | -maxima]: two collectives, one host sync each
    sums = torch.tensor(local + [v * w for v, w in zip(local, weights)] + weights, dtype=torch.float64, device=dev)
    mins = torch.tensor(local + [-v for v in local], dtype=torch.float64, device=dev)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(mins, op=dist.ReduceOp.MIN)
    sums_l, mins_l = sums.tolist(), mins.tolist()
    out = {}
    for i, n in enumerate(names):
        op, w = specs[n]
        if op == "sum":
            out[n] = sums_l[i]
        elif op == "min":
            out[n] = mins_l[i]
        elif op == "max":
            out[n] = -mins_l[k + i]
        elif w is not None and sums_l[2 * k + i] != 0.0:
            out[n] = sums_l[k + i] / sums_l[2 * k + i]
        else:
            out[n] = sums_l[i] / info.world_size
        if op != "mean" and isinstance(metrics[n], int) and not isinstance(metrics[n], bool):
            out[n] = int(round(out[n]))
    return {n: out[n] for n in metrics}  # in the caller's order
