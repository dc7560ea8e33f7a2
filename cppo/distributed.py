"""Multi-process training under ``torchrun``: process groups, data split, selection, balancing, reductions,
model wrapping and checkpoints.

Every function takes a :class:`DistInfo` and is a no-op (or a plain local computation) in a single process, so the
trainer has one code path. The data flow of a distributed step:

1. each rank takes its contiguous block of the step's questions (:func:`question_slice`), so a question's G
   completions and their group advantages never straddle ranks;
2. selection (:func:`select_across_ranks`): ``"group"`` and ``"batch"`` are local (``"batch"`` pools per rank, as the
   official Open-R1 code), ``"global"`` gathers |A| from all ranks and keeps ``keep * total_groups`` over the
   concatenation in rank order (as the official verl recipe), each rank keeping its own survivors;
3. the survivors are spread over the ranks by token count (:func:`balance_sequences`, longest-processing-time greedy);
4. the loss of every micro-batch is normalised by all-reduced counts (:func:`global_counts`) and multiplied by
   :func:`grad_scale` because DDP and FSDP2 average gradients over ranks, so the update equals the single-process
   update of the concatenated batch;
5. metrics are reduced across ranks (:func:`reduce_metrics`) and only rank 0 prints and writes (``DistInfo.is_main``).

Collectives are tensor collectives on the rank's device (nccl on CUDA, gloo on CPU); the only object collective
runs when the ranks report different metric names, to name them in the error.
"""

from __future__ import annotations

import contextlib
import datetime
import heapq
import itertools
import json
import os
import pathlib
import shutil
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from cppo_kernels import select_completions

PARALLELISMS = ("none", "ddp", "fsdp2")
SELECTION_SCOPES = ("group", "batch", "global")
REDUCTIONS = ("sum", "mean", "min", "max")

__all__ = [
    "PARALLELISMS",
    "SELECTION_SCOPES",
    "DistInfo",
    "init_distributed",
    "close_distributed",
    "barrier",
    "print_main",
    "question_slice",
    "all_gather_varlen",
    "select_across_ranks",
    "SequenceShard",
    "lpt_assign",
    "balance_sequences",
    "GlobalCounts",
    "global_counts",
    "grad_scale",
    "max_across_ranks",
    "reduce_metrics",
    "wrap_model",
    "unwrap_model",
    "gradient_sync",
    "root_unsharded",
    "save_checkpoint",
    "load_checkpoint",
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
    the backend is nccl when the device is CUDA (``"auto"`` means ``cuda:LOCAL_RANK`` when CUDA is available), gloo
    on the CPU. ``device`` is ``"auto"``, ``"cpu"`` or ``"cuda"`` (each rank takes ``cuda:LOCAL_RANK``); a single
    process also accepts ``"cuda:N"``. Idempotent: an already initialised group is reused.
    """
    if "WORLD_SIZE" not in os.environ:
        if device == "auto":
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        return DistInfo(device=torch.device(device))
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda' under torchrun (one GPU per rank), got {device!r}")
    world_size, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} CUDA devices")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
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
    """Destroys the process group if one is initialised."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _require_group(info: DistInfo) -> None:
    if info.distributed and not dist.is_initialized():
        raise RuntimeError(f"world_size={info.world_size} but no process group is initialised: call init_distributed()")


def barrier(info: DistInfo) -> None:
    """Waits for every rank (no-op in a single process)."""
    if info.distributed:
        _require_group(info)
        dist.barrier()


def print_main(*args, info: DistInfo, **kwargs) -> None:
    """``print`` on rank 0 only."""
    if info.is_main:
        print(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Splitting questions, gathering ragged tensors, selection across ranks
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


def all_gather_varlen(x: torch.Tensor, *, info: DistInfo) -> tuple[torch.Tensor, list[int]]:
    """Concatenation over ranks (in rank order) of tensors whose first dimension differs per rank.

    Returns ``(gathered [sum n_r, ...], [n_0, ..., n_{W-1}])``. Trailing dimensions and dtype must agree. ``x`` may
    live on any device: the collectives run on ``info.device`` and ``gathered`` comes back on ``x.device``.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor with at least one dimension, got {type(x).__name__}")
    if not info.distributed:
        return x, [x.shape[0]]
    _require_group(info)
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


def select_across_ranks(
    advantages: torch.Tensor,
    group_size: int,
    keep: int,
    *,
    scope: str,
    metric: str = "smallest",
    generator: torch.Generator | None = None,
    info: DistInfo,
) -> torch.Tensor:
    """Ascending local indices of this rank's retained completions (``advantages [N_r]``, group after group).

    ``"group"``: ``keep`` per question; ``"batch"``: ``keep * local groups`` pooled over this rank's batch (Open-R1);
    both local. ``"global"``: the advantages of all ranks are gathered and
    ``cppo_kernels.select_completions(scope="batch")`` keeps ``keep * total groups`` over their concatenation in rank
    order (higher score first, ties to the lower global index); each rank keeps its own survivors, so 2 ranks select
    exactly what one process selects with ``"batch"`` over the concatenated batch. With ``metric="random"`` and
    ``"global"`` every rank draws the global scores itself: ``generator`` must be seeded alike on all ranks.
    """
    if scope not in SELECTION_SCOPES:
        raise ValueError(f"scope must be one of {SELECTION_SCOPES}, got {scope!r}")
    if scope != "global" or not info.distributed:
        local_scope = "batch" if scope == "global" else scope
        return select_completions(advantages, group_size, keep, scope=local_scope, metric=metric, generator=generator)
    if not isinstance(advantages, torch.Tensor) or advantages.dim() != 1:
        raise ValueError("advantages must be a 1-D tensor [num_groups * group_size]")
    # gather before validating: every rank then sees the same data and raises the same error (no rank left waiting)
    gathered, sizes = all_gather_varlen(advantages.detach(), info=info)  # [N]
    bad = [r for r, s in enumerate(sizes) if s % group_size]
    if bad:
        raise ValueError(
            f"advantages on rank {bad[0]} have {sizes[bad[0]]} elements, not divisible by group_size={group_size}"
        )
    kept = select_completions(gathered, group_size, keep, scope="batch", metric=metric, generator=generator)
    start = sum(sizes[: info.rank])
    mine = kept[(kept >= start) & (kept < start + sizes[info.rank])]
    return (mine - start).to(advantages.device)


# --------------------------------------------------------------------------------------------
# Balancing the retained completions across ranks by token count
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
    cost_all = host_lengths if costs is None else _gather_known_sizes(costs.long(), seq_sizes, info=info).tolist()
    owner = lpt_assign(cost_all, info.world_size)
    return gathered.select([i for i, r in enumerate(owner) if r == info.rank])


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
    _require_group(info)
    t = torch.tensor([int(num_tokens), int(num_seqs)], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    tokens, seqs = t.tolist()  # one host sync
    return GlobalCounts(tokens=tokens, seqs=seqs)


def grad_scale(*, parallelism: str, info: DistInfo) -> float:
    """Factor on each rank's loss so that the synchronised gradient is the gradient of the global loss.

    DDP and FSDP2 average gradients over ranks, and each rank's loss is already a share of the global loss
    (normalised by :func:`global_counts`), so the average must be turned back into a sum: ``world_size``.
    """
    if parallelism not in PARALLELISMS:
        raise ValueError(f"parallelism must be one of {PARALLELISMS}, got {parallelism!r}")
    return float(info.world_size) if parallelism in ("ddp", "fsdp2") else 1.0


def max_across_ranks(value: int, *, info: DistInfo) -> int:
    """The largest ``value`` over ranks (e.g. the micro-batch count, so that every rank runs as many passes)."""
    if not info.distributed:
        return int(value)
    _require_group(info)
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
    _require_group(info)
    dev = info.device
    # the tensors below have one slot per name: check that every rank has the same names first (a mismatch would
    # hang or mix metrics); the max of (crc, -crc) over ranks shows whether all crcs agree
    crc = zlib.crc32("\n".join(names).encode())
    check = torch.tensor([crc, -crc], dtype=torch.int64, device=dev)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    hi, neg_lo = check.tolist()
    if hi != -neg_lo:  # every rank sees this: only now gather the names, to say which differ
        all_names: list = [None] * info.world_size
        dist.all_gather_object(all_names, names)
        differ = sorted(set().union(*map(set, all_names)) - set.intersection(*map(set, all_names)))
        raise ValueError(f"ranks report different metrics ({differ[:5]}): every rank must report the same names")
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


# --------------------------------------------------------------------------------------------
# Model wrapping
# --------------------------------------------------------------------------------------------


class ForwardModule(nn.Module):
    """Puts a custom forward (e.g. packed final hidden states, no logits) on a model, so that DDP and FSDP2 wrap a
    module whose ``forward`` is the pass the trainer differentiates. ``fn(model, *args, **kwargs)``."""

    def __init__(self, model: nn.Module, fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(self.model, *args, **kwargs)


def _fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: transformers' ``_no_split_modules`` classes, else the children of
    every ``nn.ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        blocks = [c for m in model.modules() if isinstance(m, nn.ModuleList) for c in m]
    return blocks


def wrap_model(
    model: nn.Module,
    *,
    parallelism: str,
    info: DistInfo,
    forward: Callable[..., torch.Tensor] | None = None,
    find_unused_parameters: bool = False,
) -> nn.Module:
    """The module to call for the differentiated forward: ``model`` (``forward=None``) or ``ForwardModule(model,
    forward)``, wrapped for ``parallelism``.

    - ``"none"``: unwrapped (one process only: with several, replicas would drift apart, so that is a ValueError);
    - ``"ddp"``: ``DistributedDataParallel`` (gradients all-reduced and averaged in backward);
    - ``"fsdp2"``: ``fully_shard`` on each block (see :func:`_fsdp_blocks`) and on the root, with the root kept
      unsharded after forward so that parameters used outside forward (the LM head of a fused loss, read *after*
      the forward) are whole tensors. Parameters are sharded in place: use :func:`unwrap_model` for the model.

    In a single process ``"ddp"`` and ``"fsdp2"`` also return the unwrapped module (nothing to synchronise).
    """
    if parallelism not in PARALLELISMS:
        raise ValueError(f"parallelism must be one of {PARALLELISMS}, got {parallelism!r}")
    module = model if forward is None else ForwardModule(model, forward)
    if not info.distributed:
        return module
    if parallelism == "none":
        raise ValueError(f"parallelism='none' with world_size={info.world_size}: use 'ddp' or 'fsdp2' under torchrun")
    _require_group(info)
    if parallelism == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [info.device.index] if info.device.type == "cuda" else None
        # broadcast_buffers=False: the ranks' buffers (e.g. rotary tables) are equal, and a broadcast in every forward
        # would tie the ranks' no-grad passes (old/ref log-probs) together
        return DistributedDataParallel(
            module, device_ids=device_ids, find_unused_parameters=find_unused_parameters, broadcast_buffers=False
        )
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:  # torch < 2.6
        raise ValueError("parallelism='fsdp2' needs torch >= 2.6 (torch.distributed.fsdp.fully_shard)") from e
    for block in _fsdp_blocks(model):
        fully_shard(block)
    root = fully_shard(module, reshard_after_forward=False)
    # make `module` the root now: a first forward through a block (e.g. in generate) would otherwise claim it
    root._get_fsdp_state()._lazy_init()
    return root


def unwrap_model(module: nn.Module) -> nn.Module:
    """The model inside :func:`wrap_model`'s result (DDP's ``.module``, then ``ForwardModule.model``)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        module = module.module
    return module.model if isinstance(module, ForwardModule) else module


@contextlib.contextmanager
def root_unsharded(module: nn.Module):
    """Context in which an FSDP2 root's own parameters (embeddings, final norm, LM head) are whole tensors, so that
    code outside its forward (``generate``, reading the LM head) can use them; the blocks still gather their
    parameters in their own forward, so every rank must run as many forward passes (``generate(synced_gpus=True)``).
    A no-op for other modules."""
    if not _is_fsdp2(module):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool):
    """Context in which backward passes synchronise gradients (``enabled``) or only accumulate them locally.

    Accumulate micro-batches with ``enabled=False`` and run the last one with ``enabled=True``; every rank must
    run the same number of synchronised backward passes (FSDP2: the same number of forward passes too).
    """
    from torch.nn.parallel import DistributedDataParallel

    if enabled:
        yield
    elif isinstance(module, DistributedDataParallel):
        with module.no_sync():
            yield
    elif hasattr(module, "set_requires_gradient_sync"):  # an FSDP2 module
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------

_META = "meta.json"
_FULL = "state.pt"
_DCP = "dcp"
_SCHED = "scheduler.pt"


def _is_fsdp2(module: nn.Module) -> bool:
    return hasattr(module, "set_requires_gradient_sync") and hasattr(module, "reshard")


def _sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(module)}
    model_sd, optim_sd = get_state_dict(module, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def save_checkpoint(
    path: str | os.PathLike,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    meta: Mapping | None = None,
    rank_state: Mapping | None = None,
    info: DistInfo,
) -> None:
    """Writes a checkpoint directory atomically (a temporary sibling renamed into place by rank 0).

    DDP or a single process: rank 0 saves the full state (``state.pt``: model state dict without wrapper prefixes,
    optimizer, scheduler). FSDP2: every rank saves its shards with ``torch.distributed.checkpoint`` (``dcp/``) and
    rank 0 the scheduler. ``meta`` (JSON-able, e.g. step) goes to ``meta.json`` with the world size and format;
    ``rank_state`` (e.g. RNG states) is saved per rank. Several nodes need a shared filesystem.
    """
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(info)
    sharded = _is_fsdp2(module)
    if sharded:
        import torch.distributed.checkpoint as dcp

        state = _sharded_state(module, optimizer)
        dcp.save(state, checkpoint_id=str(tmp / _DCP))
        if info.is_main and scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / _SCHED)
    elif info.is_main:
        state = {"model": unwrap_model(module).state_dict()}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        torch.save(state, tmp / _FULL)
    if rank_state is not None:
        torch.save(dict(rank_state), tmp / f"rank{info.rank}.pt")
    if info.is_main:
        record = {"world_size": info.world_size, "format": "dcp" if sharded else "full", **(meta or {})}
        (tmp / _META).write_text(json.dumps(record, indent=2), encoding="utf-8")
    barrier(info)
    if info.is_main:
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    barrier(info)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    info: DistInfo,
) -> tuple[dict, dict | None]:
    """Restores what :func:`save_checkpoint` wrote, in place; returns ``(meta, this rank's rank_state or None)``.

    The checkpoint must come from the same world size when it holds per-rank state (resume continues each rank's
    RNG streams) or FSDP2 shards; a full (DDP) checkpoint without rank state loads at any world size.
    """
    path = pathlib.Path(path)
    meta_file = path / _META
    if not meta_file.is_file():
        raise ValueError(f"checkpoint {str(path)!r} has no {_META}: not a checkpoint directory")
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    has_rank_state = (path / "rank0.pt").is_file()
    if (meta["format"] == "dcp" or has_rank_state) and meta["world_size"] != info.world_size:
        raise ValueError(
            f"checkpoint {str(path)!r} was written by {meta['world_size']} processes; resume it with "
            f"--nproc-per-node/--nnodes giving world_size={meta['world_size']}, not {info.world_size}"
        )
    sharded = _is_fsdp2(module)
    if sharded != (meta["format"] == "dcp"):
        raise ValueError(
            f"checkpoint {str(path)!r} is in the {meta['format']!r} format; load it with parallelism "
            f"{'fsdp2' if meta['format'] == 'dcp' else 'ddp or none'}"
        )
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        state = _sharded_state(module, optimizer)
        dcp.load(state, checkpoint_id=str(path / _DCP))
        if optimizer is None:
            set_model_state_dict(module, state["model"])
        else:
            set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(torch.load(path / _SCHED, map_location="cpu", weights_only=False))
    else:
        # our own files (optimizer and scheduler states hold plain Python objects)
        state = torch.load(path / _FULL, map_location=info.device, weights_only=False)
        unwrap_model(module).load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
    rank_file = path / f"rank{info.rank}.pt"
    rank_state = torch.load(rank_file, map_location="cpu", weights_only=False) if rank_file.is_file() else None
    return meta, rank_state
