"""Property tests for partitioning, top-k selection and the mask encoding."""

import torch
from hypothesis import given, settings, strategies as st

from scape_core.masks import (MaskLayout, decode_picks, encode_picks, encoded_bytes, mask_encoding,
                              partition_bounds, select_topk, topk_count)

numels = st.integers(min_value=0, max_value=3000)
worlds = st.integers(min_value=1, max_value=64)
densities = st.sampled_from([1e-6, 0.001, 0.01, 0.1, 0.5, 0.999999, 1.0])


@given(numels, worlds)
def test_partitions_tile_the_parameter(numel, world):
    bounds = partition_bounds(numel, world)
    assert len(bounds) == world and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1


@given(st.integers(0, 500), densities)
def test_topk_count_is_the_rounded_up_share(size, density):
    k = topk_count(size, density)
    assert 0 <= k <= size
    if size:  # ceil(density * size): at least the share, less than one coordinate more
        assert density * size - 1e-6 <= k < density * size + 1 and k >= 1


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 400), densities, st.integers(0, 2**31 - 1))
def test_encoding_round_trips_and_is_the_smaller(size, density, seed):
    k = topk_count(size, density)
    g = torch.Generator().manual_seed(seed)
    picks = torch.randperm(size, generator=g)[:k].sort().values
    data = encode_picks(picks, size, k)
    assert data.dtype == torch.uint8 and data.numel() == encoded_bytes(size, k)
    assert encoded_bytes(size, k) == min(4 * k, (size + 7) // 8)
    assert mask_encoding(size, k) == ("indices" if 4 * k <= (size + 7) // 8 else "bitmap")
    assert torch.equal(decode_picks(data, size, k), picks)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(0, 300), st.integers(0, 2**31 - 1))
def test_select_topk_picks_the_largest_outside_exclude(size, k, seed):
    k = min(k, size)
    g = torch.Generator().manual_seed(seed)
    score = torch.rand(size, generator=g)
    exclude = torch.randperm(size, generator=g)[: size // 3]
    got = select_topk(score, k, exclude)
    assert got.numel() == k and torch.equal(got, got.sort().values) and got.unique().numel() == k
    free = torch.ones(size, dtype=torch.bool)
    free[exclude] = False
    if k <= int(free.sum()):
        assert free[got].all()
        if k:  # every pick scores at least as high as every free coordinate left out
            left = free.clone()
            left[got] = False
            if left.any():
                assert score[got].min() >= score[left].max()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 700), min_size=1, max_size=5), worlds, densities, st.integers(0, 2**31 - 1))
def test_layout_gathers_every_ranks_picks(sizes, world, density, seed):
    numels = {f"p{i}": n for i, n in enumerate(sizes)}
    layout = MaskLayout(numels, world, density)
    g = torch.Generator().manual_seed(seed)
    payloads, want = [], {n: [] for n in numels}
    for r in range(world):
        picks = {}
        for slot in layout.partition(r):
            picks[slot.name] = torch.randperm(slot.size, generator=g)[: slot.k].sort().values
            want[slot.name].append(picks[slot.name] + slot.start)
        payload = layout.encode(r, picks)
        assert payload.numel() == layout.payload_bytes
        payloads.append(payload)
    got = layout.decode(payloads)
    for n in numels:
        expect = torch.cat(want[n]) if want[n] else torch.empty(0, dtype=torch.long)
        assert torch.equal(got[n], expect)
        assert got[n].numel() == layout.k(n)
        assert got[n].numel() == 0 or int(got[n].max()) < numels[n]
    strided = layout.strided()
    assert all(strided[n].numel() == layout.k(n) and strided[n].unique().numel() == layout.k(n) for n in numels)


def test_sampled_topk_picks_the_same_set_as_a_full_topk():
    g = torch.Generator().manual_seed(0)
    for n, density in ((300_000, 0.1), (300_000, 0.01), (300_000, 0.001), (40_000, 0.01), (40_000, 0.2)):
        k = topk_count(n, density)
        score = torch.rand(n, generator=g) ** 4
        score[: n // 3] = 0.0  # many ties at zero, as for coordinates with no momentum yet
        exclude = torch.randperm(n, generator=g)[: n // 20].sort().values
        want = score.clone()
        want[exclude] = -1.0
        want = want.topk(k).indices.sort().values
        got = select_topk(score.clone(), k, exclude)
        assert torch.equal(got, want), density
