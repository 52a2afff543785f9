"""The top-k pick is exactly ``torch.topk``'s: on random, tied, short and excluded rows, with and without
the C radix select, with the score fused into it or stored first."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scape_core import native, rowselect
from scape_core.masks import (
    INT32_MIN,
    Mask,
    age_momentum_score,
    excluded_key,
    select,
    select_age,
)
from tests import reference
from tests.test_masks import layout_of

ROWS = st.sampled_from(["random", "few values", "all equal", "sentinels"])


def keys_of(kind: str, rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    """int32 keys of ``rows`` rows: random bits, three values, one value, or free keys among the
    selector's sentinels (excluded and padding keys, negative)."""
    if kind == "random":
        return torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, n), generator=g, dtype=torch.int64).to(torch.int32)
    if kind == "few values":
        return torch.rand(rows, n, generator=g).mul_(3).floor_().view(torch.int32)
    if kind == "all equal":
        return torch.zeros(rows, n, dtype=torch.int32)
    keys = torch.rand(rows, n, generator=g).view(torch.int32).clone()
    keys[:, ::3] = INT32_MIN  # padding
    keys[:, 1::4] = excluded_key(keys[:, 1::4].contiguous())
    return keys


def check_is_torch_topk(keys: torch.Tensor, cols: torch.Tensor, k: int) -> None:
    """``cols`` (ascending) hold the same keys as ``torch.topk`` picks, and among equal keys the lowest columns."""
    assert cols.shape == (keys.shape[0], k) and cols.dtype == torch.int16
    assert torch.all(cols[:, 1:] > cols[:, :-1])  # ascending, no column twice
    ours = keys.gather(1, cols.long()).sort(dim=1).values
    theirs = keys.topk(k, dim=1).values.sort(dim=1).values
    assert torch.equal(ours, theirs)
    kth = theirs[:, :1]  # each row's k-th key: its ties are taken lowest columns first
    at_kth = (keys == kth).cumsum(1)
    taken_at_kth = (keys.gather(1, cols.long()) == kth).sum(1, keepdim=True)
    expected = (keys > kth) | ((keys == kth) & (at_kth <= taken_at_kth))
    picked = torch.zeros_like(keys, dtype=torch.bool).scatter_(1, cols.long(), True)
    assert torch.equal(picked, expected)


@settings(max_examples=60, deadline=None)
@given(ROWS, st.integers(1, 9), st.integers(1, 600), st.floats(0.0, 1.0), st.integers(0, 2 ** 31))
def test_the_pick_is_torch_topks_with_ties_lowest_columns_first(kind, rows, n, share, seed):
    g = torch.Generator().manual_seed(seed)
    keys = keys_of(kind, rows, n, g)
    k = max(1, round(share * n))
    fast = rowselect.top_columns(keys, k)
    check_is_torch_topk(keys, fast, k)
    assert torch.equal(fast, rowselect.reference_columns(keys, k))


def test_the_c_pick_is_in_use_on_this_cpu():
    assert native.available()  # CI has a C compiler: the fast path is the one tested


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=4), st.sampled_from([16, 64, 128]),
       st.sampled_from([0.01, 0.1, 0.3, 0.75]), st.booleans(), st.booleans(), st.integers(0, 2 ** 31))
def test_short_and_excluded_rows_take_the_best_the_fused_score_the_same(numels, chunk, density, excluded, ties, seed):
    """select(): each row's best (an excluded coordinate only where a row has too few others; a short row's
    count best first), and select_age() on the same score picks the same columns without storing it."""
    layout, g = layout_of(numels, chunk), torch.Generator().manual_seed(seed)
    shape = layout.mask_shape(density)
    m = torch.randn(layout.rows, chunk, generator=g)
    if ties:
        m = m.mul_(2).round_()  # many equal scores, zeros among them
    windows = torch.randint(0, 40, (layout.rows, chunk), generator=g).float()
    flushed = Mask(density, select(torch.rand(layout.rows, chunk, generator=g), layout, shape)) if excluded else None
    for limit in (None, 30):
        score = age_momentum_score(m, windows, 45, limit)
        cols = select(score.clone(), layout, shape, flushed)
        assert torch.equal(select_age(m, windows, 45, limit, layout, shape, flushed), cols)
        for r in range(layout.rows):
            full = r not in set(layout.partial_rows.tolist())
            length = chunk if full else layout.partial_len[layout.partial_rows.tolist().index(r)]
            count = shape.k if full else shape.partial_counts[layout.partial_rows.tolist().index(r)]
            picked = cols[r, :count].long()
            assert torch.all(picked < length)
            out = None if flushed is None else flushed.cols[r][flushed.cols[r] < length].long().unique()
            assert reference.topk_violation(score[r, :length].double(), picked, count, out) == 0.0
    assert torch.equal(select_age(m, None, 45, None, layout, shape, flushed), select(m.abs(), layout, shape, flushed))


def test_without_a_compiler_it_says_so_and_picks_the_same_columns(monkeypatch, tmp_path):
    keys = keys_of("few values", 5, 300, torch.Generator().manual_seed(1))
    fast = rowselect.top_columns(keys, 40)
    layout, g = layout_of([300, 45, 7], 64), torch.Generator().manual_seed(2)  # short rows
    shape = layout.mask_shape(0.1)
    score = torch.rand(layout.rows, 64, generator=g).mul_(4).floor_()
    flushed = Mask(0.1, select(torch.rand(layout.rows, 64, generator=g), layout, shape))
    fast_mask = select(score.clone(), layout, shape, flushed)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_unavailable", None)
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("SCAPE_CACHE", str(tmp_path))
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.warns(UserWarning, match="C kernels could not be built.*no C compiler"):
        slow = rowselect.top_columns(keys, 40)
    assert torch.equal(slow, fast)
    assert torch.equal(select(score.clone(), layout, shape, flushed), fast_mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert rowselect.fused_age_columns(torch.ones(2, 8), None, 5, None, 2.0 ** 100, None, 2) is None


def test_rows_split_over_threads_pick_the_same(monkeypatch):
    g = torch.Generator().manual_seed(3)
    keys = keys_of("few values", 300, 128, g)
    short = tuple(torch.tensor(v, dtype=torch.int32) for v in ([5, 130, 299], [17, 128, 1], [2, 40, 1]))
    one = rowselect.top_columns(keys, 20, short)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)  # three parts of 100 rows, one short row in each
    assert torch.equal(rowselect.top_columns(keys, 20, short), one)
    assert torch.equal(one, rowselect.reference_columns(keys, 20, short))


def test_a_forked_child_splits_rows_over_its_own_threads(monkeypatch):
    import multiprocessing

    keys = keys_of("random", 300, 64, torch.Generator().manual_seed(4))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    want = rowselect.top_columns(keys, 9)  # the parent's pool exists now
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:  # the child's pool is its own: the parent's threads do not exist there
        got = pool.apply_async(rowselect.top_columns, (keys, 9)).get(timeout=60)
    assert torch.equal(got, want)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 9), st.integers(2, 300), st.floats(0.0, 1.0), st.integers(0, 2 ** 31))
def test_the_device_pick_takes_the_same_columns_where_no_ties_meet_the_kth(rows, n, share, seed):
    """What CUDA runs (torch.topk over the int32 keys), run here: the same columns as the CPU's pick on
    distinct keys, shorter rows included."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randperm(rows * n, generator=g).view(rows, n).to(torch.int32)  # distinct
    k = max(1, round(share * n))
    short = tuple(torch.tensor(v, dtype=torch.int32) for v in ([rows - 1], [max(1, n // 2)], [max(1, min(k, n // 4))]))
    for s in (None, short):
        assert torch.equal(rowselect.reference_columns(keys, k, s, unique=False), rowselect.top_columns(keys, k, s))


def test_the_age_pick_started_from_the_last_picks_bound_stays_exact():
    """The C age pick keeps a bound per row from its last pick (rowselect._hint): picks over scores that drift,
    jump up, and collapse below every bound (each row then selected whole) equal the stored score's, steps on."""
    layout, g = layout_of([4096 * 6 + 1000, 3000], 4096), torch.Generator().manual_seed(7)
    shape = layout.mask_shape(0.075)
    m = torch.randn(layout.rows, 4096, generator=g)
    windows = torch.randint(0, 13, (layout.rows, 4096), generator=g).float()
    flushed = None
    for t in range(14, 24):
        if t == 19:
            m.mul_(1e-3)  # every score far below every row's bound
        if t == 21:
            m.mul_(1e6)
        cols = select_age(m, windows, t, 30, layout, shape, flushed)
        assert torch.equal(cols, select(age_momentum_score(m, windows, t, 30), layout, shape, flushed)), t
        assert sum(int(h.count_nonzero()) for h in rowselect._hints.values()) >= layout.rows  # bounds to start from
        flushed = Mask(0.075, cols)
        windows.view(-1).index_fill_(0, flushed.flat(layout), float(t))


@pytest.mark.parametrize("levels", [4, 256, None])
def test_the_age_pick_near_its_bound_ranks_ties_at_the_kth_exactly(levels):
    """Bounded picks whose k-th key lies just above the row's bound (the pick ranks the keys of the k-th's bin
    alone): with momenta of a few values (over 64 ties at the k-th, some taken), a few hundred values (a few ties
    in the k-th's bin) and continuous ones, the columns equal the stored score's, steps on."""
    layout, g = layout_of([4096 * 5 + 700, 2000], 4096), torch.Generator().manual_seed(11)
    shape = layout.mask_shape(0.075)
    m = torch.randn(layout.rows, 4096, generator=g)
    if levels is not None:
        m = m.mul_(levels / 8).round_().div_(levels / 8)
    windows = torch.randint(0, 5, (layout.rows, 4096), generator=g).float()
    flushed = None
    for t in range(8, 16):
        cols = select_age(m, windows, t, 400, layout, shape, flushed)
        assert torch.equal(cols, select(age_momentum_score(m, windows, t, 400), layout, shape, flushed)), t
        flushed = Mask(0.075, cols)
        windows.view(-1).index_fill_(0, flushed.flat(layout), float(t))
        m.view(-1).index_fill_(0, flushed.flat(layout), 0.5)
