"""Balancing the retained completions over the ranks: longest-processing-time greedy (a balanced partition, ties
to the lower index and bin) and what one process does with it (nothing). Across processes:
tests/cppo/distributed/test_multiproc.py and tests/cppo/step/test_prefix_sharing.py."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cppo import distributed as D
from cppo.step import balance as B

SINGLE = D.DistInfo()


@given(st.lists(st.integers(0, 50), max_size=30), st.integers(1, 5))
def test_lpt_assign_is_a_balanced_partition(costs, num_bins):
    owner = B.lpt_assign(costs, num_bins)
    assert len(owner) == len(costs) and all(0 <= b < num_bins for b in owner)
    loads = [sum(c for c, b in zip(costs, owner) if b == k) for k in range(num_bins)]
    assert sum(loads) == sum(costs)
    assert max(loads) <= sum(costs) / num_bins + max(costs, default=0)
    assert B.lpt_assign(costs, num_bins) == owner


def test_lpt_assign_example_and_ties():
    # longest first, to the emptiest bin, ties to the lower index and the lower bin
    assert B.lpt_assign([3, 5, 5, 2, 1], 2) == [0, 0, 1, 1, 1]  # 5->0, 5->1, 3->0, 2->1, 1->1
    assert B.lpt_assign([4, 4, 4, 4], 2) == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="num_bins"):
        B.lpt_assign([1], 0)
    with pytest.raises(ValueError, match="costs"):
        B.lpt_assign([1, -1], 2)


def test_balance_sequences_rejects_costs_of_the_wrong_shape():
    shard = D.SequenceShard(lengths=torch.tensor([1, 2]), token_fields={"t": torch.tensor([7, 8, 9])})
    with pytest.raises(ValueError, match="costs"):
        B.balance_sequences(shard, info=SINGLE, costs=torch.tensor([1, 2, 3]))


def test_one_process_keeps_its_sequences():
    shard = D.SequenceShard(lengths=torch.tensor([1, 2]), token_fields={"t": torch.tensor([7, 8, 9])})
    assert B.balance_sequences(shard, info=SINGLE) is shard
    samples = ["a", "b"]
    assert B.balance_samples(samples, info=SINGLE) is samples and B.split_units([[0, 1]], 1) == [[0, 1]]
