"""The kept completions of a TRL generation batch, as a batch of the same layout (torch only, no TRL).

``GRPOTrainer._generate_and_score_completions`` returns a dict of per-completion tensors (rows): prompts padded on
the left, completions (and their per-token log-probs) padded on the right to the longest of the batch. Keeping some
rows keeps every per-completion entry's rows, then trims the columns no kept row uses, so the training passes run on
the kept completions padded to the longest *kept* one (rounded up to ``pad_to_multiple_of`` as TRL pads).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ROW_KEYS", "TOKEN_KEYS", "check_keys", "keep_rows", "pass_tokens"]

#: Entries with one row per completion (every one TRL 1.16 returns for a text-only, tool-free batch).
ROW_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "old_per_token_logps",
    "importance_sampling_ratio",
    "sampling_per_token_logps",
    "ref_per_token_logps",
)
#: Row entries with one column per completion token (``importance_sampling_ratio`` is ``[B, 1]`` per sequence).
TOKEN_KEYS = ("completion_ids", "completion_mask", *ROW_KEYS[5:])
#: Entries that are the same for every row.
SCALAR_KEYS = ("num_items_in_batch",)


def check_keys(batch: dict) -> None:
    """A ``ValueError`` naming the first entry this module does not know how to prune (multimodal inputs, the tool
    mask of tool calling): pruning must never leave an entry unpruned."""
    unknown = [k for k in batch if k not in ROW_KEYS and k not in SCALAR_KEYS]
    if unknown:
        raise ValueError(
            f"CPPOTrainer cannot prune the batch entry {unknown[0]!r} (multimodal inputs and tool calling are not "
            "supported); use trl.GRPOTrainer for this run"
        )


def _width(used: Tensor, multiple: int | None) -> int:
    """Columns to keep of a ``[W]`` bool "some kept row uses this column" vector, from the padded side's far end:
    at least 1, rounded up to ``multiple``, never more than ``W``."""
    cols = torch.nonzero(used).flatten()
    width = int(cols.max() - cols.min() + 1) if cols.numel() else 1
    if multiple:
        width = -(-width // multiple) * multiple
    return min(width, used.numel())


def keep_rows(batch: dict, kept: Tensor, *, pad_to_multiple_of: int | None = None) -> dict:
    """A new batch of rows ``kept`` (int64 ``[K]`` indices, in the order given) of every per-completion entry of
    ``batch``, prompts trimmed on the left and completions on the right to the columns a kept row uses; scalar
    entries are copied as they are (recount them over the kept rows where they depend on them)."""
    check_keys(batch)
    out = {k: (v[kept] if k in ROW_KEYS and v is not None else v) for k, v in batch.items()}
    prompt = _width(out["prompt_mask"].bool().any(0), pad_to_multiple_of)  # left-padded: keep the last columns
    out["prompt_ids"] = out["prompt_ids"][:, out["prompt_ids"].size(1) - prompt :]
    out["prompt_mask"] = out["prompt_mask"][:, out["prompt_mask"].size(1) - prompt :]
    used = out["completion_mask"].bool().any(0)  # [C] right-padded: keep the first columns
    used[0] = True  # the completions start at column 0 (an all-masked batch keeps one column)
    width, full = _width(used, pad_to_multiple_of), batch["completion_ids"].size(1)
    for key in TOKEN_KEYS:
        value = out.get(key)
        if value is not None and value.dim() == 2 and value.size(1) == full:
            out[key] = value[:, :width]
    return out


def pass_tokens(batch: dict) -> int:
    """Positions one forward pass over ``batch`` processes: rows x (prompt width + completion width)."""
    return batch["prompt_ids"].numel() + batch["completion_ids"].numel()
