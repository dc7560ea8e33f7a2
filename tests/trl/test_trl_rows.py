"""cppo.trl.rows: the kept rows of TRL's batch, padded to the longest kept prompt and completion."""

from __future__ import annotations

import pytest
import torch

from cppo.trl.rows import keep_rows, pass_tokens


def batch() -> dict:
    """4 rows: prompts of 1, 3, 2, 4 tokens (left-padded to 4), completions of 5, 2, 0, 3 tokens (right-padded to 5)."""
    prompt_mask = (torch.arange(4) >= 4 - torch.tensor([1, 3, 2, 4])[:, None]).long()
    completion_mask = (torch.arange(5) < torch.tensor([5, 2, 0, 3])[:, None]).long()
    return {
        "prompt_ids": torch.arange(16).view(4, 4), "prompt_mask": prompt_mask,
        "completion_ids": torch.arange(20).view(4, 5), "completion_mask": completion_mask,
        "advantages": torch.tensor([0.5, -1.0, 0.0, 2.0]), "ref_per_token_logps": -torch.rand(4, 5),
        "importance_sampling_ratio": torch.rand(4, 1), "num_items_in_batch": torch.tensor(10),
    }  # fmt: skip


def test_kept_rows_are_trimmed_to_the_longest_kept():
    full = batch()
    out = keep_rows(full, torch.tensor([1, 2]))
    assert out["prompt_ids"].tolist() == [[5, 6, 7], [9, 10, 11]]  # the longest kept prompt: 3 tokens
    assert out["completion_ids"].tolist() == [[5, 6], [10, 11]]  # the longest kept completion: 2 tokens
    assert out["completion_mask"].tolist() == [[1, 1], [0, 0]]
    assert torch.equal(out["ref_per_token_logps"], full["ref_per_token_logps"][[1, 2], :2])
    assert torch.equal(out["importance_sampling_ratio"], full["importance_sampling_ratio"][[1, 2]])  # per sequence
    assert out["advantages"].tolist() == [-1.0, 0.0] and out["num_items_in_batch"] is full["num_items_in_batch"]
    assert pass_tokens(out) == 2 * (3 + 2) and pass_tokens(full) == 4 * (4 + 5)


def test_trimming_rounds_up_to_pad_to_multiple_of_and_keeps_one_column():
    out = keep_rows(batch(), torch.tensor([2]), pad_to_multiple_of=4)
    assert out["prompt_ids"].shape == (1, 4) and out["completion_ids"].shape == (1, 4)  # 2 -> 4; an empty one -> 1 -> 4
    assert keep_rows(batch(), torch.tensor([2]))["completion_ids"].shape == (1, 1)
    assert keep_rows(batch(), torch.arange(4))["completion_ids"].shape == (4, 5)  # all kept: nothing trimmed


def test_an_entry_it_cannot_prune_is_refused():
    with pytest.raises(ValueError, match="cannot prune the batch entry 'tool_mask'"):
        keep_rows({**batch(), "tool_mask": torch.ones(4, 5)}, torch.tensor([0]))
    with pytest.raises(ValueError, match="'pixel_values'"):
        keep_rows({**batch(), "pixel_values": torch.ones(4, 3)}, torch.tensor([0]))
