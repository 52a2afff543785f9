"""Masks: fixed-shape top-k selection per row of the flat layout, on the device, no host round trip.

A :class:`Mask` holds, for every row of the :class:`~scape_core.layout.FlatLayout`, ``k``
chunk-local columns (int16): the coordinates the step exchanges. Selection scores every
coordinate on a ``(rows, chunk)`` view and takes each row's ``k`` best in one batched pick
(:mod:`scape_core.rowselect`; on the CPU the default score is computed inside it); the
mask exchanged at the step before is excluded (its coordinates are being flushed), padding
columns rank last. With a replicated score (``|m| (n - 1)``, the default) every rank selects
the whole mask itself; a score that reads the rank's residual is computed per partition of
rows and the partitions are all-gathered (``ScapeState`` does that).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from scape_core import native, rowselect
from scape_core.kernels import Kernels
from scape_core.layout import FlatLayout, MaskShape, short_group_index

# fp32 scores are ranked by their bits as int32 (the same order for every score >= 0: what the radix select
# of scape_core.rowselect reads); an excluded key is its bits or-ed with INT32_MIN
# (negative: after every free one, and the excluded keep their order among themselves, so a row short of free
# coordinates takes the best of them), at least INT32_MIN + 1, so that padding (INT32_MIN) ranks last
EXCLUDED, PADDING = -1.0, -2.0  # float scores are >= 0: excluded coordinates rank after every free one, padding last
INT32_MIN = -2 ** 31
# the age score reads an overdue coordinate's |m| (a window past ScapeConfig.max_window) as OVERDUE: it scores
# OVERDUE (n - 1), above every other coordinate whose |m| is below it, the longest-waiting first (exact in fp32)
OVERDUE_EXPONENT = 100
OVERDUE = 2.0 ** OVERDUE_EXPONENT


ENTRIES_SOURCE = r"""
/* A mask's entries from its columns: row r's first ranges[2r + 1] columns at ranges[2r] on (the shape's order),
   each r * chunk + its column, as int64 or (narrow) int32. */
void scape_mask_entries(const int16_t *cols, int64_t rows, int64_t k, int64_t chunk, const int64_t *ranges,
                        int narrow, void *out) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t p0 = ranges[2 * r], count = ranges[2 * r + 1], base = r * chunk;
        const int16_t *c = cols + r * k;
        if (narrow) for (int64_t j = 0; j < count; j++) ((int32_t *)out)[p0 + j] = (int32_t)(base + c[j]);
        else for (int64_t j = 0; j < count; j++) ((int64_t *)out)[p0 + j] = base + c[j];
    }
}
"""
native.register(ENTRIES_SOURCE, {"scape_mask_entries": (None, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                              ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                                              ctypes.c_void_p])})


@dataclass
class Mask:
    """The coordinates one sparse step exchanges.

    ``cols[r]`` are row ``r``'s picks as columns inside the row; in a parameter's shorter last
    row, slots past its count hold a padding column and are not entries.
    """

    density: float
    cols: Tensor  # (rows, k) int16
    _flat: Tensor | None = field(default=None, repr=False)  # the entries as int64
    groups: bool = False  # one pick per group of each row (select_groups): a compiled pick excludes it group by group
    _narrow: Tensor | None = field(default=None, repr=False)  # the entries as the layout's index_dtype

    def flat(self, layout: FlatLayout, narrow: bool = False) -> Tensor:
        """The entries: flat indices into a ``(rows, chunk)`` buffer, in the shape's order; int64 (what
        eager ``index_copy_`` takes), or ``narrow``: the layout's :attr:`~FlatLayout.index_dtype` (int32
        up to 2^31 coordinates, half the bytes: what the compiled passes read). Each made once: on the CPU
        by one C loop over the columns (:func:`entries_of`), elsewhere as torch operators.

        Example:
            >>> layout = FlatLayout({"w": torch.zeros(20), "b": torch.zeros(3)}, chunk=8)   # rows: 8, 8, 4 | 3
            >>> cols = torch.tensor([[1, 5], [0, 7], [2, 3], [0, 1]], dtype=torch.int16)    # short rows: 1 each
            >>> Mask(0.25, cols).flat(layout).tolist()
            [1, 5, 8, 15, 18, 24]
        """
        if narrow:
            if self._narrow is None:
                dtype = layout.index_dtype
                self._narrow = (entries_of(self.cols, layout, self.density, dtype) if self._flat is None
                                else self._flat.to(dtype))
            return self._narrow
        if self._flat is None:
            self._flat = (self._narrow.long() if self._narrow is not None
                          else entries_of(self.cols, layout, self.density, torch.int64))
        return self._flat


def entries_of(cols: Tensor, layout: FlatLayout, density: float, dtype: torch.dtype) -> Tensor:
    """A mask's entries (:meth:`Mask.flat`) as ``dtype`` (int64 or int32) from its ``(rows, k)`` int16 columns:
    one C loop on the CPU, writing each entry once; elsewhere (or without the C kernels) a gather of the
    columns plus their rows' bases, in torch operators (the same values)."""
    shape = layout.mask_shape(density)
    if c_entries(cols):
        return torch.ops.scape.mask_entries(cols, shape.row_entries, layout.chunk, shape.entries,
                                            dtype == torch.int32)
    return cols.long().add_(layout.row_bases).reshape(-1).index_select(0, shape.slots).to(dtype)


def c_entries(cols: Tensor) -> bool:
    """Whether :func:`entries_of` takes ``cols`` in its C loop: contiguous int16 on the CPU, the C kernels built."""
    return (cols.device.type == "cpu" and cols.dtype == torch.int16 and cols.is_contiguous()
            and native.library() is not None)


@torch.library.custom_op("scape::mask_entries", mutates_args=(), device_types="cpu")
def _entries_op(cols: Tensor, ranges: Tensor, chunk: int, count: int, narrow: bool) -> Tensor:
    out = torch.empty(count, dtype=torch.int32 if narrow else torch.int64)
    native.library().scape_mask_entries(cols.data_ptr(), cols.shape[0], cols.shape[1], chunk, ranges.data_ptr(),
                                        int(narrow), out.data_ptr())
    return out


@_entries_op.register_fake
def _(cols: Tensor, ranges: Tensor, chunk: int, count: int, narrow: bool) -> Tensor:
    return cols.new_empty(count, dtype=torch.int32 if narrow else torch.int64)


def age_momentum_score(m: Tensor, synced_at: Tensor | None, target: int, max_window: int | None = None,
                       out: Tensor | None = None, late: Tensor | None = None) -> Tensor:
    """``|m| (n - 1)``, ``n = target - synced_at`` the window a coordinate will have at ``target``; a
    coordinate whose window would pass ``max_window`` is overdue: its ``|m|`` reads as :data:`OVERDUE`,
    so it scores above every other (any ``|m|`` below ``OVERDUE``), the longest-waiting first.

    Every input is replicated, so every rank computes the same score. Before the first sparse
    step (no windows yet) the score is ``|m|``. ``out``, ``late``: buffers to write the score and
    the overdue-weighted ``m`` into (no temporary of the buffers' size is made, which on the CPU
    costs more than the arithmetic). ``max_window=None``: no limit (a coordinate whose ``m`` is 0
    then scores 0, and is never picked while its row has ``k`` others).

    Example:
        >>> age_momentum_score(torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 1.0]]), target=5)
        tensor([[1., 6.]])
        >>> s = age_momentum_score(torch.tensor([[0.0, 0.0, 5.0]]), torch.tensor([[-1.0, 0.0, 3.0]]), target=5,
        ...                        max_window=5)   # windows 6, 5 and 2: the first is overdue
        >>> bool(s[0, 0] == 5 * OVERDUE), s[0, 1:].tolist()
        (True, [0.0, 5.0])
    """
    if synced_at is None:
        return torch.abs(m, out=out)
    score = torch.sub(synced_at, target - 1, out=out if out is not None else torch.empty_like(m))  # -(n - 1)
    if max_window is not None:  # last exchanged before target - max_window: overdue
        m = torch.where(synced_at < target - max_window, _overdue(m.device), m,
                        out=late if late is not None else torch.empty_like(m))
    return score.mul_(m).abs_()


@functools.lru_cache(maxsize=8)
def _overdue(device: torch.device) -> Tensor:
    """:data:`OVERDUE` as a 0-dim tensor (``torch.where``'s operand), made once per device."""
    return torch.full((), 1.0, device=device).ldexp_(torch.tensor(OVERDUE_EXPONENT, device=device))


def momentum_residual_score(m: Tensor, residual: Tensor | None, beta1: float) -> Tensor:
    """The contract's first score ``|beta1 m + (1 - beta1) e_r|``; it reads this rank's residual.

    Example:
        >>> momentum_residual_score(torch.tensor([1.0, -1.0]), torch.tensor([1.0, 9.0]), beta1=0.5)
        tensor([1., 4.])
    """
    if residual is None:
        return m.abs()
    return torch.lerp(m, residual, 1 - beta1).abs_()


def excluded_key(keys: Tensor) -> Tensor:
    """Keys (a score's int32 bits, or the score itself) moved below every free key (scores are >= 0),
    in their own order, and above padding; out of place (a compiled pass may call it).

    Example:
        >>> excluded_key(torch.tensor([0, 5], dtype=torch.int32)).tolist()   # INT32_MIN + 1, INT32_MIN + 5
        [-2147483647, -2147483643]
    """
    if keys.dtype == torch.int32:
        return (keys | INT32_MIN).clamp(min=INT32_MIN + 1)
    return -1 / (1 + keys)  # in [-1, 0): above PADDING


def _rows_of(cols: Tensor, start: int, stop: int) -> Tensor:
    """Rows ``[start, stop)`` of a mask's columns (all of them without a view)."""
    return cols if start == 0 and stop == cols.shape[0] else cols[start:stop]


def _rank_excluded_last(keys: Tensor, at: Tensor) -> None:
    """Move the keys of columns ``at`` (per row) below every free one, in place (:func:`excluded_key`)."""
    keys.scatter_(1, at, excluded_key(keys.gather(1, at)))


def select(score: Tensor, layout: FlatLayout, shape: MaskShape, exclude: Mask | None = None,
           rows: slice = slice(None)) -> Tensor:
    """The ``k`` best columns of every row of ``score`` (rows ``rows`` of the layout), ascending; overwrites
    a float32 ``score`` (another dtype is ranked as float32).

    The ``k`` largest scores of each row, ties taken lowest columns first
    (:func:`~scape_core.rowselect.top_columns`: a radix select on the CPU). Coordinates of ``exclude`` are
    taken only if a row has not enough others (the best of them); padding never before a real coordinate.
    Returns ``(rows, k)`` int16 columns; in a shorter last row the ``count`` best come first (ascending) and
    the other slots hold a padding column.

    Example:
        >>> layout = FlatLayout({"w": torch.zeros(6)}, chunk=4)        # rows: 4 + 2 (padded)
        >>> score = torch.tensor([[0.1, 3.0, 2.0, 5.0], [7.0, 1.0, 0.0, 0.0]])
        >>> select(score, layout, layout.mask_shape(0.5)).tolist()    # k = 2; the short row has 1
        [[1, 3], [0, 3]]
    """
    start = rows.start or 0
    stop = layout.rows if rows.stop is None else rows.stop
    keys = (score if score.dtype == torch.float32 else score.float()).view(torch.int32)  # bits order scores >= 0
    if exclude is not None:  # below every free score, in their own order: a short row takes the best of them
        _rank_excluded_last(keys, _rows_of(exclude.cols, start, stop).long())
    return rowselect.top_columns(keys, shape.k, shape.short_rows(start, stop, host=True))


def select_age(m: Tensor, windows: Tensor | None, target: int, max_window: int | None, layout: FlatLayout,
               shape: MaskShape, exclude: Mask | None = None, rows: slice = slice(None)) -> Tensor | None:
    """:func:`select` of :func:`age_momentum_score` (``|m|`` without ``windows``) with no stored score: the
    C pick scores each row as it selects it (:func:`~scape_core.rowselect.fused_age_columns`), the same
    columns. ``None`` where it does not run (not the CPU, no C compiler): score, then :func:`select`.

    Example:
        >>> layout = FlatLayout({"w": torch.zeros(6)}, chunk=4)        # rows: 4 + 2 (padded)
        >>> m, w = torch.tensor([[0.1, 3.0, 2.0, 5.0], [7.0, 1.0, 0.0, 0.0]]), torch.full((2, 4), 3.0)
        >>> select_age(m, w, 5, None, layout, layout.mask_shape(0.5)).tolist()   # |m| * 1
        [[1, 3], [0, 3]]
    """
    start = rows.start or 0
    stop = layout.rows if rows.stop is None else rows.stop
    excluded = None if exclude is None else _rows_of(exclude.cols, start, stop)
    return rowselect.fused_age_columns(m, windows, target, max_window, OVERDUE, excluded, shape.k,
                                       shape.short_rows(start, stop, host=True))


def group_argmax(keys: Tensor, size: int, k: int) -> Tensor:
    """The column of the largest key in each of ``k`` contiguous groups of the rows' first ``size``
    columns: the first ``size % k`` groups hold ``size // k + 1`` columns, the others ``size // k``;
    ties go to the lowest column. Reads ``keys`` through views (no copy); returns ``(rows, k)`` int64.

    Example:
        >>> group_argmax(torch.tensor([[5, 1, 1, 7, 2, 2, 0]]), 7, 3)   # groups [0, 3), [3, 5), [5, 7)
        tensor([[0, 3, 5]])
    """
    g, r = divmod(size, k)
    wide = r * (g + 1)
    wider, narrower = _group_starts(size, k, keys.device)
    parts = []
    if r:
        parts.append(keys[:, :wide].unflatten(1, (r, g + 1)).argmax(-1).add_(wider))
    if k - r:
        parts.append(keys[:, wide:size].unflatten(1, (k - r, g)).argmax(-1).add_(narrower))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


@functools.lru_cache(maxsize=64)
def _group_starts(size: int, k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The first column of each wider group and of each narrower one (:func:`group_argmax`), made once."""
    g, r = divmod(size, k)
    wide = r * (g + 1)
    return torch.arange(0, wide, g + 1, device=device), torch.arange(wide, size, g, device=device)


def select_groups(score: Tensor, layout: FlatLayout, shape: MaskShape, exclude: Mask | None = None,
                  rows: slice = slice(None)) -> Tensor:
    """One pick per group: each row of ``chunk`` columns cut into ``k`` contiguous groups
    (:func:`group_argmax`), and in each the column with the largest score (ties: the lowest); a
    parameter's shorter last row is cut into its own ``count`` groups over its own length (its
    other slots hold a padding column). Overwrites ``score``; ``exclude``'s coordinates (the mask
    being flushed) are taken only where a group has no other, the best of them. A reduction, not
    a top-k; columns ascend in every row.

    Example:
        >>> layout = FlatLayout({"w": torch.zeros(6)}, chunk=4)        # rows: 4 + 2 (padded)
        >>> score = torch.tensor([[0.1, 3.0, 2.0, 5.0], [7.0, 1.0, 0.0, 0.0]])
        >>> select_groups(score, layout, layout.mask_shape(0.5)).tolist()  # groups [0, 2), [2, 4); the short row [0, 2)
        [[1, 3], [0, 3]]
    """
    start = rows.start or 0
    stop = layout.rows if rows.stop is None else rows.stop
    keys = score.view(torch.int32) if score.dtype == torch.float32 else score  # the bits order scores >= 0
    if exclude is not None:  # below every free score, in their own order: a group with no other takes its best
        _rank_excluded_last(keys, _rows_of(exclude.cols, start, stop).long())
    cols = group_argmax(keys, layout.chunk, shape.k)
    partial = layout.partial_rows_in(start, stop)
    if partial is not None:  # short rows: their own groups, gathered through a fixed index
        local, _, which = partial
        index = shape.group_index.index_select(0, which)  # (short rows, k, widest group)
        short = keys.index_select(0, local).gather(1, index.flatten(1)).view(index.shape)
        cols.index_copy_(0, local, index.gather(2, short.argmax(-1, keepdim=True)).squeeze(-1))
    return cols.to(torch.int16)


def age_score(m: Tensor, synced_at: Tensor, before: Tensor, due: Tensor | None) -> Tensor:
    """:func:`age_momentum_score` as one expression (a compiled pass writes it nowhere):
    ``|(synced_at - before) m|``, ``before = target - 1``, with ``|m|`` read as ``OVERDUE`` for a
    coordinate last exchanged before ``due = target - max_window`` (0-dim tensors)."""
    if due is not None:
        m = m.masked_fill(synced_at < due, OVERDUE)
    return ((synced_at - before) * m).abs()


def age_momentum_pass(m: Tensor, synced_at: Tensor, before: Tensor, due: Tensor | None, out: Tensor) -> Tensor:
    """The age score (:func:`age_score`) into ``out``."""
    return out.copy_(age_score(m, synced_at, before, due))


def best_in_groups(keys: Tensor) -> Tensor:
    """The position of the largest int32 key along the last dimension, ties to the lowest, as one max:
    each key widened to int64 with its reversed position in the low bits. Exact; in a compiled pass a
    max reduces faster than an argmax (no index carried), and the widened keys are never stored.

    Example:
        >>> best_in_groups(torch.tensor([[3, 7, 7], [-5, -5, -9]], dtype=torch.int32))
        tensor([1, 0])
    """
    width = keys.shape[-1]
    back = (width - 1) - torch.arange(width, device=keys.device)
    best = ((keys.long() << 32) | back).amax(-1)
    return (width - 1) - (best & 0xFFFFFFFF)


def pick_pass(m: Tensor, synced_at: Tensor, before: Tensor, due: Tensor | None, excluded: Tensor | None, k: int,
              short: tuple[Tensor, Tensor, Tensor] | None, widest: int,
              entry_rows: tuple[Tensor, Tensor, Tensor] | None,
              index_dtype: torch.dtype = torch.int64) -> tuple[Tensor, Tensor | None]:
    """``selection="groups"`` of the age score (:func:`age_score`) in one pass over ``m`` and the windows:
    the score, the exclusion and each group's best, without writing the score. As
    :func:`select_groups` (the same columns), for ``excluded`` (the mask being
    flushed, ``(rows, k)`` columns) ``None`` or a groups mask of the same ``k``: its column of group
    ``j`` lies in group ``j``, so the exclusion is a comparison in each group, not a scatter.

    ``short``: the shorter rows' ``(index in these rows, length, picks)``
    (:meth:`~scape_core.layout.MaskShape.short_rows`), cut into their own groups here (``widest``:
    the widest); ``entry_rows``: ``(full rows, short rows, short slots that are entries)`` to return
    the mask's entries too (every row selected), as ``index_dtype``. Returns ``(columns (rows, k) int16,
    entries or None)``.
    """
    rows, chunk = m.shape
    keys = age_score(m, synced_at, before, due).view(torch.int32)  # the bits order scores >= 0
    size, wider = divmod(chunk, k)  # the first `wider` groups hold size + 1 columns
    parts = []
    for lo, hi, first, n, width in ((0, wider * (size + 1), 0, wider, size + 1),
                                    (wider * (size + 1), chunk, wider, k - wider, size)):
        if not n:
            continue
        starts = torch.arange(lo, hi, width, device=m.device)
        part = keys[:, lo:hi].unflatten(1, (n, width))
        if excluded is not None:
            own = excluded[:, first:first + n].long() - starts  # each group's excluded offset
            hit = torch.arange(width, device=m.device) == own[..., None]
            part = torch.where(hit, excluded_key(part), part)
        parts.append(best_in_groups(part) + starts)
    cols = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    if short is not None:  # each shorter row: `count` groups over its `length`, computed here, not read
        local, length, count = short
        index = short_group_index(length, count, k, widest, chunk)
        short_keys = keys.index_select(0, local).gather(1, index.flatten(1)).view(index.shape)
        if excluded is not None:
            hit = index == excluded.index_select(0, local).long()[..., None]
            short_keys = torch.where(hit, excluded_key(short_keys), short_keys)
        picked = index.gather(2, best_in_groups(short_keys)[..., None]).squeeze(-1)
        cols = cols.index_copy(0, local, picked)
    entries = None
    if entry_rows is not None:  # Mask.flat: every full row's picks, then the shorter rows' counted ones
        full_rows, short_rows, short_slots = entry_rows
        full = (cols.index_select(0, full_rows) + full_rows[:, None] * chunk).view(-1)
        rest = (cols.index_select(0, short_rows) + short_rows[:, None] * chunk).view(-1).index_select(0, short_slots)
        entries = torch.cat([full, rest]).to(index_dtype)
    return cols.to(torch.int16), entries


def age_steps(kernels: Kernels, target: int, max_window: int | None) -> tuple[Tensor, Tensor | None]:
    """The age score's 0-dim inputs for the mask of ``target`` (read by the compiled passes): ``target - 1``
    and, with a ``max_window``, ``target - max_window`` (fp32, exact: windows are fp32 steps)."""
    cpu = torch.device("cpu")
    due = None if max_window is None else kernels.scalar("due", target - max_window, cpu, torch.float32)
    return kernels.scalar("before", target - 1, cpu, torch.float32), due


def age_momentum_compiled(kernels: Kernels, m: Tensor, synced_at: Tensor, target: int, max_window: int | None,
                          out: Tensor) -> Tensor:
    """:func:`age_momentum_score` into ``out`` in one compiled pass (:func:`age_momentum_pass`)."""
    before, due = age_steps(kernels, target, max_window)
    key = (tuple(m.shape), due is None)  # the CPU's blocks
    return kernels.get("score", age_momentum_pass, key)(m, synced_at, before, due, out)


def pick_compiled(kernels: Kernels, m: Tensor, synced_at: Tensor, target: int, max_window: int | None,
                  excluded: Tensor | None, layout: FlatLayout, shape: MaskShape, rows: slice,
                  entries: bool) -> tuple[Tensor, Tensor | None]:
    """:func:`pick_pass` compiled, for rows ``rows`` of ``layout`` (``m`` and ``synced_at`` hold those rows):
    the mask of step ``target`` (one compiled copy per density, rows and exclusion)."""
    before, due = age_steps(kernels, target, max_window)
    short = shape.short_rows(rows.start, rows.stop)
    entry_rows = (layout.full_rows, layout.partial_rows, shape.partial_index) if entries else None
    key = (tuple(m.shape), shape.density, rows.start, rows.stop, excluded is None, entries, due is None)
    return kernels.get("pick", pick_pass, key)(m, synced_at, before, due, excluded, shape.k, short, shape.widest,
                                               entry_rows, layout.index_dtype)


SELECTIONS = {"topk": select, "groups": select_groups}  # ScapeConfig.selection -> the rule


def strided(layout: FlatLayout, shape: MaskShape) -> Mask:
    """Evenly spaced picks in every row: the mask of steps no earlier step could select for.

    Example:
        >>> layout = FlatLayout({"w": torch.zeros(10)}, chunk=8)
        >>> strided(layout, layout.mask_shape(0.25)).cols.tolist()
        [[0, 4], [0, 7]]
    """
    slots = torch.arange(shape.k, device=layout.device)
    cols = (slots * layout.chunk // max(shape.k, 1)).expand(layout.rows, shape.k).clone()
    if layout.partial_rows.numel():
        lens = torch.tensor(layout.partial_len, device=layout.device)
        counts = torch.tensor(shape.partial_counts, device=layout.device).clamp(min=1)
        short = (slots * lens[:, None]) // counts[:, None]
        cols.index_copy_(0, layout.partial_rows, short.masked_fill_(~shape.partial_valid, layout.chunk - 1))
    return Mask(shape.density, cols.to(torch.int16))
