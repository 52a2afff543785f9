"""Flat buffers: every parameter's coordinates in rows of ``chunk`` values, with named views.

SCAPE keeps one value per coordinate in several buffers (the residual, ``m``, the update rule's
statistics, the windows). Each is one ``(rows, chunk)`` tensor laid out by :class:`FlatLayout`:
parameters in model order, each starting a new row and taking ``ceil(numel / chunk)`` rows, its
last row padded when ``numel`` is not a multiple of ``chunk``. A parameter's coordinates are one
contiguous view of the flat buffer (:meth:`FlatLayout.view`), so checkpoints stay keyed by name
and multi-tensor kernels act on every parameter at once.

Masks pick coordinates per row (:class:`MaskShape`): ``k = ceil(density * chunk)`` per full row,
``ceil(density * len)`` in a parameter's shorter last row, so every parameter exchanges its
share whatever its size, and a mask has the same shape at every step.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

MAX_CHUNK = 32_768  # chunk-local columns fit int16


class ParamPiece(NamedTuple):
    """Entries ``[lo, hi)`` of a mask belong to parameter ``param`` (an index into a list of names or
    tensors); a flat index minus its row's :attr:`FlatLayout.row_start` is the coordinate's index in
    the parameter itself."""

    param: int
    lo: int
    hi: int


def row_of(entries: Tensor, chunk: int) -> Tensor:
    """The layout row of each flat index (a shift where ``chunk`` is a power of two, the default 4,096:
    an integer division costs the CPU several times more).

    Example:
        >>> row_of(torch.tensor([0, 4095, 4096, 9000]), 4096).tolist(), row_of(torch.tensor([7, 12]), 6).tolist()
        ([0, 0, 1, 2], [1, 2])
    """
    return entries >> (chunk.bit_length() - 1) if chunk & (chunk - 1) == 0 else entries // chunk


def topk_count(size: int, density: float) -> int:
    """Coordinates a row of ``size`` exchanges: ``ceil(density * size)``, at most ``size``.

    Example:
        >>> topk_count(4096, 0.01), topk_count(64, 0.01), topk_count(0, 0.5)
        (41, 1, 0)
    """
    if size <= 0 or density <= 0.0:
        return 0
    return min(size, math.ceil(density * size - 1e-9))  # 1e-9: 0.01 * 100 is 1.0000000000000002


def gather_spans(values: Tensor, spans: list[tuple[int, int]]) -> Tensor:
    """``values[lo:hi]`` of every span, concatenated (a view when there is one span).

    Example:
        >>> gather_spans(torch.arange(6), [(0, 2), (4, 6)])
        tensor([0, 1, 4, 5])
    """
    return values[spans[0][0]:spans[0][1]] if len(spans) == 1 else torch.cat([values[lo:hi] for lo, hi in spans])


def scatter_spans(out: Tensor, spans: list[tuple[int, int]], values: Tensor) -> None:
    """The inverse of :func:`gather_spans`: ``values`` written into ``out``'s spans, in order.

    Example:
        >>> out = torch.zeros(6, dtype=torch.long)
        >>> scatter_spans(out, [(0, 2), (4, 6)], torch.tensor([1, 2, 3, 4]))
        >>> out
        tensor([1, 2, 0, 0, 3, 4])
    """
    offset = 0
    for lo, hi in spans:
        out[lo:hi].copy_(values[offset:offset + hi - lo])
        offset += hi - lo


def short_group_index(length: Tensor, count: Tensor, k: int, widest: int, chunk: int) -> Tensor:
    """The groups of shorter rows for ``selection="groups"``: row ``p`` of ``length[p]`` columns picks
    ``count[p]``; group ``i < count`` is ``length // count`` or one more contiguous columns (the wider
    first), padded with its first column to ``widest``; slots past the count point at the padding
    column ``chunk - 1``. Returns ``(P, k, widest)`` int64 (torch operators only: a compiled pick
    builds it from the lengths and counts instead of reading it).

    Example:
        >>> short_group_index(torch.tensor([5]), torch.tensor([3]), k=4, widest=2, chunk=8).tolist()
        [[[0, 1], [2, 3], [4, 4], [7, 7]]]
    """
    slot = torch.arange(k, device=length.device)
    length, count = length[:, None], count[:, None]
    size, wider = length // count.clamp(min=1), length % count.clamp(min=1)
    start = (slot * size + torch.minimum(slot, wider))[..., None]
    width = (size + (slot < wider).long())[..., None]
    offset = torch.arange(widest, device=length.device)
    index = torch.where(offset < width, start + offset, start)
    return torch.where((slot < count)[..., None], index, chunk - 1)


class FlatLayout:
    """Where each parameter's coordinates sit in SCAPE's ``(rows, chunk)`` buffers.

    Example:
        >>> layout = FlatLayout({"w": torch.zeros(3, 4), "b": torch.zeros(3)}, chunk=8)
        >>> layout.rows, layout.first_row, layout.partial_len
        (3, {'w': 0, 'b': 2}, [4, 3])
        >>> buffer = layout.zeros()
        >>> layout.view(buffer, "b").fill_(1.0).shape, int(buffer.sum())
        (torch.Size([3]), 3)
    """

    def __init__(self, params: dict[str, Tensor], chunk: int) -> None:
        if not params:
            raise ValueError("no parameters to lay out")
        devices = {p.device for p in params.values()}
        if len(devices) > 1:
            raise ValueError(f"SCAPE needs every parameter on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self.chunk = chunk
        self.numel = {n: p.numel() for n, p in params.items()}
        self.first_row: dict[str, int] = {}
        self.nrows: dict[str, int] = {}
        full, partial, self.partial_len = [], [], []
        row = 0
        for name, numel in self.numel.items():
            whole, rest = divmod(numel, chunk)
            self.first_row[name], self.nrows[name] = row, whole + (rest > 0)
            full.extend(range(row, row + whole))
            if rest:
                partial.append(row + whole)
                self.partial_len.append(rest)
            row += self.nrows[name]
        self.rows = row
        self._full_list, self._partial_list = full, partial  # sorted row numbers (for shard arithmetic)
        self.full_rows = torch.tensor(full, dtype=torch.long, device=self.device)
        self.partial_rows = torch.tensor(partial, dtype=torch.long, device=self.device)
        self.row_base = torch.arange(self.rows, device=self.device) * chunk  # flat index of each row's start
        self.row_bases = self.row_base[:, None]  # the same as a column (added to a mask's (rows, k) columns)
        # flat index of the first coordinate of each row's parameter: an entry minus its row's is its index there
        self.row_start = torch.tensor([self.first_row[n] * chunk for n in self.numel for _ in range(self.nrows[n])],
                                      dtype=torch.long, device=self.device)
        lens = torch.tensor(self.partial_len, dtype=torch.long, device=self.device)
        self.padding = torch.arange(chunk, device=self.device) >= lens[:, None]  # (partial rows, chunk)
        # where each parameter's rows sit in a mask's entries: full rows first, then the shorter ones
        self._full_pos, self._partial_pos = {}, {}
        f = p = 0
        for name, numel in self.numel.items():
            self._full_pos[name] = (f, f + numel // chunk)
            f += numel // chunk
            self._partial_pos[name] = (p, p + (numel % chunk > 0))
            p += numel % chunk > 0
        self._shapes: dict[float, MaskShape] = {}
        self._partial_in: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor] | None] = {}

    def partial_rows_in(self, start: int, stop: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """The shorter rows inside rows ``[start, stop)``: their index there, their padding columns
        and their position among all shorter rows (``None`` if there are none). Cached: the first
        call per range reads the device once, so :class:`~scape_core.ScapeState` warms it at setup."""
        key = (start, stop)
        if key not in self._partial_in:
            which = ((self.partial_rows >= start) & (self.partial_rows < stop)).nonzero().view(-1)
            self._partial_in[key] = None if not which.numel() else (
                self.partial_rows.index_select(0, which) - start, self.padding.index_select(0, which), which)
        return self._partial_in[key]

    @property
    def index_dtype(self) -> torch.dtype:
        """The narrowest integer dtype that holds every flat index (int32 up to 2^31 coordinates): a
        mask's entries as the compiled passes read them (:meth:`scape_core.masks.Mask.flat`).

        Example:
            >>> FlatLayout({"w": torch.zeros(3, 4)}, chunk=8).index_dtype
            torch.int32
        """
        return torch.int32 if self.rows * self.chunk <= 2 ** 31 - 1 else torch.int64

    def zeros(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """A new ``(rows, chunk)`` buffer of zeros on the parameters' device."""
        return torch.zeros(self.rows, self.chunk, dtype=dtype, device=self.device)

    def view(self, buffer: Tensor, name: str) -> Tensor:
        """The flat, contiguous view of ``name``'s coordinates in a ``(rows, chunk)`` buffer."""
        start = self.first_row[name] * self.chunk
        return buffer.view(-1)[start:start + self.numel[name]]

    def views(self, buffer: Tensor, names: list[str]) -> list[Tensor]:
        """:meth:`view` for each of ``names`` (for multi-tensor kernels)."""
        return [self.view(buffer, n) for n in names]

    def mask_shape(self, density: float) -> "MaskShape":
        """The fixed shape of every mask of ``density`` (built once per density)."""
        if density not in self._shapes:
            self._shapes[density] = MaskShape(self, density)
        return self._shapes[density]

    def keep_shapes(self, densities: tuple[float, ...]) -> None:
        """Drop the shapes of other densities (a ramp's past stages: their index tensors are the largest)."""
        self._shapes = {d: shape for d, shape in self._shapes.items() if d in densities}

    def block(self, world: int) -> int:
        """Rows of each rank's block when ``world`` ranks share the rows: ``ceil(rows / world)``."""
        return -(-self.rows // world)

    def shard(self, rank: int, world: int) -> "Shard":
        """Rank ``rank``'s block of rows: ``[rank * block, (rank + 1) * block)``, cut at ``rows``.

        Equal blocks, so an all-gather of every rank's block (padded to ``block`` rows) is the
        whole buffer in layout order, no reordering. The last ranks may hold fewer rows, or none.

        Example:
            >>> layout = FlatLayout({"w": torch.zeros(5, 8)}, chunk=8)
            >>> [(s.start, s.stop) for s in (layout.shard(r, 2) for r in range(2))]
            [(0, 3), (3, 5)]
        """
        block = self.block(world)
        return Shard(self, min(rank * block, self.rows), min((rank + 1) * block, self.rows))


class Shard:
    """Rows ``[start, stop)`` of a :class:`FlatLayout`: the part of SCAPE's buffers one rank owns.

    A shard's buffers are ``(stop - start, chunk)``; :meth:`view` gives the coordinates of a
    parameter that fall inside it (a parameter may straddle two shards). The whole layout is
    the shard ``[0, rows)``, whose views are :meth:`FlatLayout.view`'s.

    Example:
        >>> layout = FlatLayout({"w": torch.zeros(20), "b": torch.zeros(3)}, chunk=8)   # rows: 3 + 1
        >>> shard = Shard(layout, 1, 4)
        >>> shard.span["w"], shard.span["b"], shard.zeros().shape
        ((8, 20), (0, 3), torch.Size([3, 8]))
    """

    def __init__(self, layout: FlatLayout, start: int, stop: int) -> None:
        self.layout, self.start, self.stop = layout, start, stop
        self.rows = stop - start
        self.whole = start == 0 and stop == layout.rows
        self.span: dict[str, tuple[int, int]] = {}  # each parameter's coordinates inside: [lo, hi) of its own
        for name, numel in layout.numel.items():
            first = layout.first_row[name] * layout.chunk
            lo = min(max(start * layout.chunk - first, 0), numel)
            self.span[name] = (lo, max(lo, min(stop * layout.chunk - first, numel)))
        self.names = [n for n, (lo, hi) in self.span.items() if hi > lo]  # parameters with coordinates here

    def zeros(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """A new ``(rows, chunk)`` buffer of zeros for this shard."""
        return torch.zeros(self.rows, self.layout.chunk, dtype=dtype, device=self.layout.device)

    def view(self, buffer: Tensor, name: str) -> Tensor:
        """The flat view of ``name``'s coordinates inside this shard (``span[name]`` of them; may be empty)."""
        lo, hi = self.span[name]
        at = self.layout.first_row[name] * self.layout.chunk + lo - self.start * self.layout.chunk
        return buffer.view(-1)[at:at + hi - lo] if hi > lo else buffer.view(-1)[:0]

    def part(self, full: Tensor, name: str) -> Tensor:
        """The coordinates of a whole parameter's tensor ``full`` that this shard holds (flat)."""
        lo, hi = self.span[name]
        return full.reshape(-1)[lo:hi]


@dataclass
class _Ranges:
    spans: list[tuple[int, int]]  # [lo, hi) entry ranges, merged where adjacent

    @property
    def size(self) -> int:
        return sum(hi - lo for lo, hi in self.spans)


class MaskShape:
    """What a mask of one density looks like: ``k`` slots per row, and where its entries go.

    A mask's *entries* are the flat indices of its picks in a fixed order: every full row's
    ``k`` picks (rows in order), then each shorter last row's ``count`` picks. The slots of a
    shorter row beyond its count are not entries (they point at a padding column).
    """

    def __init__(self, layout: FlatLayout, density: float) -> None:
        self.density = density
        self.k = topk_count(layout.chunk, density)
        counts = [topk_count(n, density) for n in layout.partial_len]
        self.partial_counts = counts
        device = layout.device
        slots = torch.arange(self.k, device=device)
        self.partial_valid = slots < torch.tensor(counts, dtype=torch.long, device=device)[:, None]  # (P, k)
        self.partial_index = self.partial_valid.view(-1).nonzero().view(-1)  # once per density, off the step
        self.full_entries = layout.full_rows.numel() * self.k
        # the widest group of a shorter row (selection="groups": each is cut into its own count of groups)
        self.widest = max([-(-n // c) for n, c in zip(layout.partial_len, counts) if c] or [1])
        self.entries = self.full_entries + sum(counts)
        self._layout = layout
        self._offsets = [0]
        for c in counts:
            self._offsets.append(self._offsets[-1] + c)
        self._ranges: dict[tuple[str, ...], _Ranges] = {}
        self._group_index: Tensor | None = None
        self._short: dict[tuple[int, int, bool], tuple[Tensor, Tensor, Tensor] | None] = {}
        self._pieces: dict[tuple[str, ...], tuple[ParamPiece, ...]] = {}
        self._slots: Tensor | None = None
        self._row_entries: Tensor | None = None

    @property
    def slots(self) -> Tensor:
        """Where each entry's slot is in a mask's flattened ``(rows, k)`` columns, in the entries' order
        (every full row's ``k``, then each shorter row's counted ones): a mask's entries are one gather
        of its columns (:meth:`~scape_core.masks.Mask.flat`). Built once, at its first use.

        Example:
            >>> layout = FlatLayout({"w": torch.zeros(20), "b": torch.zeros(3)}, chunk=8)   # rows: 8, 8, 4 | 3
            >>> layout.mask_shape(0.25).slots.tolist()                # k = 2; the short rows pick 1 each
            [0, 1, 2, 3, 4, 6]
        """
        if self._slots is None:
            layout, k = self._layout, self.k
            offsets = torch.arange(k, device=layout.device)
            full = (layout.full_rows[:, None] * k + offsets).view(-1)
            partial = (layout.partial_rows[:, None] * k + offsets).view(-1).index_select(0, self.partial_index)
            slots = torch.cat([full, partial])
            self._slots = slots.to(torch.int32) if layout.rows * k < 2 ** 31 else slots
        return self._slots

    @property
    def row_entries(self) -> Tensor:
        """Where each row's entries are among a mask's: ``(rows, 2)`` int64, the first entry's position and the
        count (a full row's ``k``, a shorter row's own), on the CPU: what the C loops walk row by row
        (:mod:`scape_core.fused`). Built once.

        Example:
            >>> layout = FlatLayout({"w": torch.zeros(20), "b": torch.zeros(3)}, chunk=8)   # rows: 8, 8, 4 | 3
            >>> layout.mask_shape(0.25).row_entries.tolist()
            [[0, 2], [2, 2], [4, 1], [5, 1]]
        """
        if self._row_entries is None:
            layout, ranges = self._layout, torch.zeros(self._layout.rows, 2, dtype=torch.long)
            full = layout.full_rows.cpu()
            ranges[full, 0] = torch.arange(full.numel()) * self.k
            ranges[full, 1] = self.k
            partial = layout.partial_rows.cpu()
            ranges[partial, 0] = self.full_entries + torch.tensor(self._offsets[:-1], dtype=torch.long)
            ranges[partial, 1] = torch.tensor(self.partial_counts, dtype=torch.long)
            self._row_entries = ranges
        return self._row_entries

    @property
    def group_index(self) -> Tensor:
        """The columns of every group of each shorter row for ``selection="groups"``: ``(P, k, G)``
        int64, group ``i < count`` of a row of ``len`` columns is ``len // count`` or one more
        contiguous columns (the wider first), padded with its first column to the widest ``G``;
        slots past the row's count point at the padding column ``chunk - 1``. Built once.

        Example:
            >>> layout = FlatLayout({"w": torch.zeros(13)}, chunk=8)   # a short row of 5
            >>> layout.mask_shape(0.5).group_index.tolist()         # k = 4, count 3: groups of 2, 2, 1
            [[[0, 1], [2, 3], [4, 4], [7, 7]]]
        """
        if self._group_index is None:
            layout = self._layout
            lens = torch.tensor(layout.partial_len, dtype=torch.long, device=layout.device)
            counts = torch.tensor(self.partial_counts, dtype=torch.long, device=layout.device)
            self._group_index = short_group_index(lens, counts, self.k, self.widest, layout.chunk)
        return self._group_index

    def short_rows(self, start: int, stop: int, host: bool = False) -> tuple[Tensor, Tensor, Tensor] | None:
        """The shorter rows inside rows ``[start, stop)`` for a compiled or C pick: their index there, their
        lengths and their picks (``None`` if there are none); :attr:`group_index`'s groups follow from
        these. ``host``: as int32 on the CPU (what :func:`~scape_core.rowselect.top_columns` reads). Cached:
        the first call per range reads the device once.

        Example:
            >>> layout = FlatLayout({"w": torch.zeros(13), "b": torch.zeros(3)}, chunk=8)   # rows: 8, 5 | 3
            >>> [t.tolist() for t in layout.mask_shape(0.5).short_rows(1, 3)]
            [[0, 1], [5, 3], [3, 2]]
        """
        key = (start, stop, host)
        if key not in self._short:
            found = self._layout.partial_rows_in(start, stop)
            if found is None:
                self._short[key] = None
            elif host:
                self._short[key] = tuple(t.to(device="cpu", dtype=torch.int32).contiguous()
                                         for t in self.short_rows(start, stop))
            else:
                local, _, which = found
                lens = torch.tensor(self._layout.partial_len, device=local.device).index_select(0, which)
                counts = torch.tensor(self.partial_counts, device=local.device).index_select(0, which)
                self._short[key] = (local, lens, counts)
        return self._short[key]

    def ranges(self, names: tuple[str, ...]) -> list[tuple[int, int]]:
        """The entry ranges of the parameters ``names`` (e.g. one DDP bucket's), merged."""
        if names not in self._ranges:
            spans = []
            for name in names:
                lo, hi = self._layout._full_pos[name]
                spans.append((lo * self.k, hi * self.k))
            for name in names:
                lo, hi = self._layout._partial_pos[name]
                spans.append((self.full_entries + self._offsets[lo], self.full_entries + self._offsets[hi]))
            merged: list[tuple[int, int]] = []
            for lo, hi in sorted(s for s in spans if s[1] > s[0]):
                if merged and merged[-1][1] == lo:
                    merged[-1] = (merged[-1][0], hi)
                else:
                    merged.append((lo, hi))
            self._ranges[names] = _Ranges(merged)
        return self._ranges[names].spans

    def pieces(self, names: list[str]) -> tuple[ParamPiece, ...]:
        """Where each parameter of ``names`` sits among the entries, in entry order: a
        :class:`ParamPiece` ``(i, lo, hi)`` for entries ``[lo, hi)`` of ``names[i]`` (its full rows,
        then its shorter last row).

        Example:
            >>> layout = FlatLayout({"w": torch.zeros(20), "b": torch.zeros(3)}, chunk=8)   # rows: 8, 8, 4 | 3
            >>> layout.mask_shape(0.25).pieces(["w", "b"])            # k = 2; the short rows pick 1 each
            (ParamPiece(param=0, lo=0, hi=5), ParamPiece(param=1, lo=5, hi=6))
        """
        key = tuple(names)
        if key not in self._pieces:  # once per set of parameters: a sparse step asks every time
            found = sorted((lo, i, hi) for i, name in enumerate(names) for lo, hi in self.ranges((name,)))
            self._pieces[key] = tuple(ParamPiece(i, lo, hi) for lo, i, hi in found)
        return self._pieces[key]

    def rows_spans(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The entry ranges of rows ``[start, stop)`` (e.g. a shard's): its full rows' entries, then its shorter rows'.

        Example:
            >>> layout = FlatLayout({"w": torch.zeros(20), "b": torch.zeros(3)}, chunk=8)   # rows: 8, 8, 4 | 3
            >>> shape = layout.mask_shape(0.25)                      # k = 2; the short rows pick 1 each
            >>> shape.rows_spans(1, 4), shape.entries
            ([(2, 4), (4, 6)], 6)
        """
        full, partial = self._layout._full_list, self._layout._partial_list
        f_lo, f_hi = bisect.bisect_left(full, start), bisect.bisect_left(full, stop)
        p_lo, p_hi = bisect.bisect_left(partial, start), bisect.bisect_left(partial, stop)
        return [(f_lo * self.k, f_hi * self.k),
                (self.full_entries + self._offsets[p_lo], self.full_entries + self._offsets[p_hi])]
