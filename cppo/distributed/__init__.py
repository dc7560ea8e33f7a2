"""The processes of a run and their devices: the process group and collectives (processes.py), DDP / FSDP2 around
the model (parallel.py), the device and its autocast (device.py); every function is a no-op in a single process."""

from .device import DEVICES, autocast, check_device, resolve_device  # noqa: I001  (grouped, as __all__)
from .parallel import (
    PARALLELISMS, ForwardModule, grad_scale, gradient_sync, is_fsdp2, is_sharded, keep_gathered_after_forward,
    mixed_precision, root_unsharded, unwrap_model, wrap_model,
)  # fmt: skip
from .processes import (
    REDUCTIONS, DistInfo, GlobalCounts, SequenceShard, all_gather_objects, all_gather_varlen, barrier,
    close_distributed, gather_sequences, global_counts, init_distributed, max_across_ranks, print_main, question_slice,
    reduce_metrics, require_group, sum_across_ranks,
)  # fmt: skip

__all__ = [
    "DEVICES", "autocast", "check_device", "resolve_device", "PARALLELISMS", "ForwardModule", "grad_scale",
    "gradient_sync", "is_fsdp2", "is_sharded", "keep_gathered_after_forward", "mixed_precision", "root_unsharded",
    "unwrap_model", "wrap_model", "REDUCTIONS", "DistInfo", "GlobalCounts", "SequenceShard", "all_gather_objects",
    "all_gather_varlen", "barrier", "close_distributed", "gather_sequences", "global_counts", "init_distributed",
    "max_across_ranks", "print_main", "question_slice", "reduce_metrics", "require_group", "sum_across_ranks",
]  # fmt: skip
