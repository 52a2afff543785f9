"""Property tests for the flat layout, fixed-shape masks and their top-k selection."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scape_core.kernels import Kernels
from scape_core.layout import FlatLayout, topk_count
from scape_core.masks import (
    Mask,
    age_momentum_score,
    entries_of,
    pick_compiled,
    pick_pass,
    select,
    select_groups,
    strided,
)
from tests import reference

densities = st.sampled_from([1e-6, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.999999])
sizes = st.lists(st.integers(1, 300), min_size=1, max_size=5)
chunks = st.sampled_from([16, 32, 64, 128])
SCORES = ["age_momentum", "momentum", "momentum_residual"]


def layout_of(numels: list[int], chunk: int) -> FlatLayout:
    return FlatLayout({f"p{i}": torch.zeros(n) for i, n in enumerate(numels)}, chunk)


@given(st.integers(0, 500), densities)
def test_topk_count_is_the_rounded_up_share(size, density):
    k = topk_count(size, density)
    assert 0 <= k <= size
    if size:  # ceil(density * size): at least the share, less than one coordinate more
        assert density * size - 1e-6 <= k < density * size + 1 and k >= 1


@given(sizes, chunks)
def test_views_tile_the_parameters_without_overlap(numels, chunk):
    layout = layout_of(numels, chunk)
    buffer = layout.zeros()
    for i, n in enumerate(numels):
        view = layout.view(buffer, f"p{i}")
        assert view.numel() == n and view.is_contiguous()
        view += i + 1
    assert int((buffer != 0).sum()) == sum(numels)  # every coordinate once, padding untouched
    assert layout.rows == sum(-(-n // chunk) for n in numels)
    for i, n in enumerate(numels):
        assert torch.all(layout.view(buffer, f"p{i}") == i + 1)


def _selected(rule, numels: list[int], chunk: int, density: float, seed: int, with_exclude: bool,
              ties: bool = False) -> tuple:
    """A random score (``ties``: three values), a random mask to exclude, and ``rule``'s mask of it,
    checked for its fixed shape: ``(layout, score, exclude, entries)``."""
    layout = layout_of(numels, chunk)
    shape = layout.mask_shape(density)
    g = torch.Generator().manual_seed(seed)
    score = torch.rand(layout.rows, chunk, generator=g)
    if ties:
        score = score.mul_(3).floor_()
    exclude = Mask(density, torch.randint(0, chunk, (layout.rows, shape.k), generator=g).to(torch.int16)) \
        if with_exclude else None
    mask = Mask(density, rule(score.clone(), layout, shape, exclude))
    assert mask.cols.shape == (layout.rows, shape.k) and mask.cols.dtype == torch.int16
    entries = mask.flat(layout)
    assert entries.numel() == shape.entries and entries.unique().numel() == entries.numel()
    return layout, score, exclude, entries


def _excluded_in(exclude: Mask | None, row: int, length: int) -> torch.Tensor | None:
    """The excluded columns of layout row ``row`` that are coordinates (inside its ``length``)."""
    if exclude is None:
        return None
    cols = exclude.cols[row].long()
    return cols[cols < length]


@settings(max_examples=60, deadline=None)
@given(sizes, chunks, densities, st.integers(0, 2**31 - 1), st.booleans())
def test_select_takes_the_best_of_every_row_and_the_entries_are_each_rows_share(numels, chunk, density, seed,
                                                                                with_exclude):
    layout, score, exclude, entries = _selected(select, numels, chunk, density, seed, with_exclude)
    for i, n in enumerate(numels):  # per parameter: each row's share, the best scores, the excluded last
        first = layout.first_row[f"p{i}"]
        for r in range(-(-n // chunk)):
            length = min(chunk, n - r * chunk)
            lo = (first + r) * chunk
            picked = entries[(entries >= lo) & (entries < lo + length)] - lo
            assert picked.numel() == topk_count(length, density)
            excluded = _excluded_in(exclude, first + r, length)
            # the best free ones; a row short of free coordinates: every free one, then the best excluded
            assert reference.topk_violation(score[first + r, :length], picked, picked.numel(), excluded) == 0.0


@settings(max_examples=60, deadline=None)
@given(sizes, chunks, densities, st.integers(0, 2**31 - 1), st.booleans(), st.booleans())
def test_groups_take_the_best_of_every_group_in_ascending_columns(numels, chunk, density, seed, with_exclude, ties):
    """``selection="groups"`` against the float64 reference: each row's share, one pick per group
    (its best free score, ties to the lowest column), columns ascending, the short rows over their own length."""
    layout, score, exclude, entries = _selected(select_groups, numels, chunk, density, seed, with_exclude, ties)
    for i, n in enumerate(numels):
        first = layout.first_row[f"p{i}"]
        for r in range(-(-n // chunk)):
            length = min(chunk, n - r * chunk)
            lo = (first + r) * chunk
            picked = entries[(entries >= lo) & (entries < lo + length)] - lo
            k = topk_count(length, density)
            assert torch.equal(picked, picked.sort().values)  # ascending
            excluded = _excluded_in(exclude, first + r, length)
            assert reference.groups_violation(score[first + r, :length], picked, k, excluded) == 0.0
            for (g_lo, g_hi), pick in zip(reference.group_bounds(length, k), picked.tolist()):  # ties: lowest
                row = score[first + r, g_lo:g_hi].clone()
                if excluded is not None:
                    out = excluded[(excluded >= g_lo) & (excluded < g_hi)] - g_lo
                    if out.unique().numel() < row.numel():
                        row[out] = -1.0
                assert pick == g_lo + int(torch.nonzero(row == row.max())[0])


@given(sizes, chunks, densities)
def test_strided_masks_have_every_rows_share(numels, chunk, density):
    layout = layout_of(numels, chunk)
    shape = layout.mask_shape(density)
    entries = strided(layout, shape).flat(layout)
    assert entries.numel() == shape.entries and entries.unique().numel() == entries.numel()
    real = torch.zeros(layout.rows * chunk, dtype=torch.bool)
    for i in range(len(numels)):
        layout.view(real.view(layout.rows, chunk), f"p{i}").fill_(True)
    assert real[entries].all()  # never a padding coordinate


@given(sizes, chunks, densities)
def test_bucket_ranges_cover_each_parameters_entries_once(numels, chunk, density):
    layout = layout_of(numels, chunk)
    shape = layout.mask_shape(density)
    names = tuple(f"p{i}" for i in range(len(numels)))
    halves = (names[::2], names[1::2])  # two "buckets" of interleaved parameters
    covered = torch.zeros(shape.entries, dtype=torch.int32)
    for bucket in halves:
        for lo, hi in shape.ranges(bucket):
            covered[lo:hi] += 1
    assert torch.all(covered == 1)
    assert shape.ranges(names) == ([(0, shape.entries)] if shape.entries else [])



@settings(max_examples=25, deadline=None)
@given(sizes, chunks, st.sampled_from([0.05, 0.25, 0.5]), st.integers(1, 5), st.sampled_from(SCORES),
       st.integers(0, 2 ** 16), st.sampled_from(["topk", "groups"]))
def test_selection_in_the_cpus_blocks_of_rows_equals_one_pass(numels, chunk, density, block_rows, kind, seed, rule):
    """The CPU scores and selects a block of rows at a time (a bounded scratch): the same columns as
    one pass, with the mask being flushed excluded, short rows, and for a partition of the rows."""
    import scape_core.selection as selection
    from scape_core.config import ScapeConfig

    layout = layout_of(numels + [2 * chunk + 3], chunk)  # at least 3 rows, one of them short
    config = ScapeConfig(sparsity=1 - density, warmup_steps=2, ramp_steps=0, wire="native", score=kind,
                         selection=rule)
    shape = layout.mask_shape(density)
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(layout.rows, chunk, generator=g).round_(decimals=1)  # ties, resolved alike in both
    residual = torch.randn(layout.rows, chunk, generator=g)
    windows = torch.randint(0, 6, (layout.rows, chunk), generator=g).float()
    flushed = Mask(density, select(torch.rand(layout.rows, chunk, generator=g), layout, shape))
    whole = selection.MaskSelector(layout, config)
    original = selection.CPU_SCORE_VALUES
    try:
        selection.CPU_SCORE_VALUES = block_rows * chunk
        blocked = selection.MaskSelector(layout, config)
    finally:
        selection.CPU_SCORE_VALUES = original
    assert len(blocked.blocks(slice(0, layout.rows))) == -(-layout.rows // block_rows)
    every = slice(0, layout.rows)
    one_pass = whole.pick(every, shape, flushed, m, residual, windows, target=7, beta1=0.9)
    assert torch.equal(blocked.pick(every, shape, flushed, m, residual, windows, target=7, beta1=0.9), one_pass)
    part = slice(1, layout.rows)  # a partition's rows: the buffers hold those rows only
    assert torch.equal(blocked.pick(part, shape, flushed, m[part], residual[part], windows[part], 7, 0.9),
                       one_pass[part])
    assert blocked.scratch is None or blocked.scratch.shape[0] <= block_rows


def _fused_case(numels: list[int], chunk: int, density: float, seed: int, flushed: bool, ties: bool):
    """``m``, windows and a groups mask being flushed (or None) for the compiled pick, with the columns and
    entries :func:`select_groups` gives from the same score."""
    layout = layout_of(numels, chunk)
    shape = layout.mask_shape(density)
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(layout.rows, chunk, generator=g)
    if ties:  # many equal scores, and zeros (a parameter whose momentum is zero)
        m = m.round_().clamp_(min=0)
    windows = torch.randint(0, 6, (layout.rows, chunk), generator=g).float()
    exclude = Mask(density, select_groups(torch.rand(layout.rows, chunk, generator=g), layout, shape),
                   groups=True) if flushed else None
    # windows of 1 to 7 steps at target 7; past 4 (FUSED_MAX_WINDOW) a coordinate is overdue
    want = Mask(density, select_groups(age_momentum_score(m, windows, 7, FUSED_MAX_WINDOW), layout, shape, exclude))
    return layout, shape, m, windows, exclude, want


FUSED_MAX_WINDOW = 4


@settings(max_examples=60, deadline=None)
@given(sizes, chunks, densities, st.integers(0, 2**31 - 1), st.booleans(), st.booleans(), st.integers(0, 4))
def test_the_fused_pick_chooses_the_groups_columns_and_entries(numels, chunk, density, seed, flushed, ties, cut):
    """:func:`scape_core.masks.pick_pass` (the compiled pick, run here as torch operators): the score,
    the exclusion of a groups mask of the same density and each group's best in one function give
    :func:`select_groups`'s columns and the mask's entries, also for a partition of the rows."""
    layout, shape, m, windows, exclude, want = _fused_case(numels, chunk, density, seed, flushed, ties)
    before, due = torch.tensor(6.0), torch.tensor(7.0 - FUSED_MAX_WINDOW)  # target 7
    rows = slice(min(cut, layout.rows - 1), layout.rows)
    excluded = None if exclude is None else exclude.cols[rows]
    entry_rows = (layout.full_rows, layout.partial_rows, shape.partial_index) if rows.start == 0 else None
    short = shape.short_rows(rows.start, rows.stop)
    cols, entries = pick_pass(m[rows], windows[rows], before, due, excluded, shape.k, short, shape.widest,
                              entry_rows, layout.index_dtype)
    assert torch.equal(cols, want.cols[rows]) and cols.dtype == torch.int16
    if rows.start == 0:
        assert entries.dtype == torch.int32 and torch.equal(entries.long(), want.flat(layout))
    else:
        assert entries is None


def test_the_compiled_pick_is_the_same_as_the_eager_one():
    """Through inductor: the score's bits, each group's best by one max of the widened keys, ties to the
    lowest column; a 4,096-wide layout at 99% int4's density (groups of 13 and 14) and a narrow one."""
    kernels = Kernels("compiled")
    for numels, chunk, density in (([3 * 4096 + 5, 300, 17], 4096, 0.0753), ([500, 64, 3], 64, 0.25)):
        for flushed in (True, False):
            layout, shape, m, windows, exclude, want = _fused_case(numels, chunk, density, 0, flushed, ties=True)
            excluded = None if exclude is None else exclude.cols
            cols, entries = pick_compiled(kernels, m, windows, 7, FUSED_MAX_WINDOW, excluded, layout, shape,
                                          slice(0, layout.rows), entries=True)
            assert torch.equal(cols, want.cols) and torch.equal(entries.long(), want.flat(layout))
    assert kernels.built == ("pick",)


def test_narrow_entries_are_the_same_indices():
    layout = layout_of([70, 5], 16)
    mask = strided(layout, layout.mask_shape(0.25))
    wide, narrow = mask.flat(layout), mask.flat(layout, narrow=True)
    assert wide.dtype == torch.int64 and narrow.dtype == torch.int32 and torch.equal(narrow.long(), wide)
    assert mask.flat(layout, narrow=True) is narrow  # made once


@settings(max_examples=25, deadline=None)
@given(numels=st.lists(st.integers(1, 90), min_size=1, max_size=5), chunk=st.sampled_from([8, 16]),
       density=st.sampled_from([0.1, 0.25, 0.5]), seed=st.integers(0, 99), narrow=st.booleans())
def test_the_c_loops_entries_are_the_columns_gather(numels, chunk, density, seed, narrow):
    # the C loop writes each row's counted columns at the row's place; the torch form gathers the slots
    layout = layout_of(numels, chunk)
    shape = layout.mask_shape(density)
    g = torch.Generator().manual_seed(seed)
    cols = torch.randint(0, chunk, (layout.rows, shape.k), generator=g).to(torch.int16)
    want = cols.long().add_(layout.row_bases).view(-1).index_select(0, shape.slots)
    dtype = torch.int32 if narrow else torch.int64
    got = entries_of(cols, layout, density, dtype)
    assert got.dtype == dtype and torch.equal(got.long(), want)
    assert torch.equal(entries_of(cols.t().contiguous().t(), layout, density, dtype), got)  # strided: torch's form
