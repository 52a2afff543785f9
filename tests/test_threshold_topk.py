"""The negative results of ``benchmarks/experiments/threshold_topk.py`` stay exact, so their timings mean something."""

from __future__ import annotations

import torch

from benchmarks.experiments.threshold_topk import bit_search_mask, threshold_topk


def rows_with_ties() -> torch.Tensor:
    """int32 keys as the selector ranks them: fp32 score bits, ties, excluded (-1) and padding (-2)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(16, 512, generator=g).abs().view(torch.int32).clone()
    keys[:, :40] = keys[:, -1:]  # a 40-way tie, one of them in the last column
    keys[:4] = torch.randint(0, 3, (4, 512), generator=g, dtype=torch.int32)  # three distinct keys
    keys[4:6, 10:] = -1  # a row of mostly excluded keys
    keys[6, 5:] = -2
    return keys


def test_bit_search_picks_exactly_k_of_the_top_and_ties_lowest_columns_first():
    keys = rows_with_ties()
    for k in (1, 7, 38, 300, 512):
        picked = bit_search_mask(keys, k)
        assert torch.equal(picked.sum(1), torch.full((16,), k)), k
        want = keys.topk(k, dim=1).values.sort(1).values
        got = torch.where(picked, keys, torch.iinfo(torch.int32).min).topk(k, dim=1).values.sort(1).values
        assert torch.equal(got, want), k
        kth = want[:, :1]
        for row, t, took in zip(keys, kth, picked):
            ties = (row == t).nonzero().view(-1)
            taken = (took & (row == t)).nonzero().view(-1)
            assert torch.equal(taken, ties[:taken.numel()]), k


def test_sampled_threshold_picks_the_values_of_a_full_top_k():
    keys = torch.randn(64, 4096, generator=torch.Generator().manual_seed(1)).abs().view(torch.int32)
    mine, _ = threshold_topk(keys, 41)
    full = keys.topk(41, dim=1).indices
    assert torch.equal(keys.gather(1, mine).sort(1).values, keys.gather(1, full).sort(1).values)
