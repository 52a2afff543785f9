"""A sparse step's passes over gradients and parameters where they are: C loops on the CPU.

The eager reference (:func:`scape_core.exchange.stage`, :func:`~scape_core.exchange.finish`,
``ScapeAdamS._sparse_flat``) moves every gradient through the state's staging buffer in the
layout's order: a multi-tensor copy in, a gather at the mask's entries, the means spread back over
the whole buffer, a copy out; then the optimizer copies ``p.grad`` in again, gathers the same entries,
zeroes the buffer, writes ``u`` into it and adds all of it to every parameter. On the CPU these
loops read and write the tensors themselves (DDP's buckets, ``p.grad``, the parameters), each
entry found through its layout row:

- :func:`stage`: ``g + e`` at the entries, read from the buckets (NaN throughout if this rank's
  gradients are not all finite), the finiteness checked in the same call;
- :func:`finish`: ``e += g`` over every gradient and the bucket zeroed in one pass, then the
  residual's rounding and the mean written at the entries;
- :func:`gather`: the optimizer's window sums, read from ``p.grad`` at the entries;
- :func:`update`: each parameter decayed and moved by ``-lr u`` at its entries, in one pass.

A step then moves about half the bytes (``docs/benchmarks.md``), and the results are the
reference's: the same values at the same places, but for the sign of a zero and the rounding of the
parameters' update (``p * decay`` then ``+ scale * u``, where torch may fuse the two), the same on
every rank (the replica guard checks that every rank runs the same kernels). Each is one torch
operator (``scape::...``), so the traffic and operator counters see it. fp32 tensors on the CPU
only: anything else runs the reference.

Example:
    >>> layout = FlatLayout({"w": torch.zeros(3), "b": torch.zeros(1)}, chunk=4)  # a row of 4 each
    >>> grads = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])]
    >>> shape = layout.mask_shape(0.5)                       # 2 picks in w's row, 1 in b's
    >>> gather(grads, RowTable.of(layout, ["w", "b"]), shape, torch.tensor([1, 2, 4]))
    tensor([2., 3., 4.])
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch
from torch import Tensor

from scape_core import native
from scape_core.layout import FlatLayout, MaskShape

SOURCE = r"""
/* Each function walks the tensors row by row of the layout: tensor i holds layout rows start[i] / chunk on,
   row r's slice of it is `len` values at r * chunk - start[i] (a parameter's last row is shorter: the rest of
   the layout's row is padding), and the row's entries are ranges[2r] .. ranges[2r] + ranges[2r + 1] of the
   mask's (each row's columns in one stretch, MaskShape.row_entries). A row's dense work and its entries are done
   while the row is in cache. `bare` lists the rows of no tensor here (their entries read 0). */
#define EACH_ROW(...)                                                                             \
    for (int64_t i = 0; i < n; i++) {                                                             \
        int64_t r0 = start[i] / chunk, r1 = (start[i] + numel[i] + chunk - 1) / chunk;            \
        for (int64_t r = r0; r < r1; r++) {                                                       \
            int64_t off = r * chunk - start[i];                                                   \
            int64_t len = numel[i] - off < chunk ? numel[i] - off : chunk;                        \
            float *row = t[i] + off;                                                              \
            int64_t p0 = ranges[2 * r], p1 = p0 + ranges[2 * r + 1];                              \
            __VA_ARGS__                                                                           \
        }                                                                                         \
    }

/* out[p] = the tensors' value at entries[p] (0 on padding), plus residual[entries[p]] if given; with `finite`:
   NaN throughout and *finite = 0 unless every value and their fp32 sum are finite (as
   scape_core.exchange.all_finite: a sum past fp32's range drops the step), summed in eight lanes. */
void scape_fused_gather(float **t, const int64_t *start, const int64_t *numel, int64_t n, int64_t chunk,
                        const int64_t *ranges, const int64_t *bare, int64_t n_bare, const float *residual,
                        const int64_t *entries, int64_t count, uint8_t *finite, float *out) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, total = 0.0f;
    EACH_ROW(
        if (finite) {
            int64_t j = 0;
            for (; j + 8 <= len; j += 8)
                for (int l = 0; l < 8; l++) acc[l] += row[j + l];
            for (; j < len; j++) acc[0] += row[j];
        }
        for (int64_t p = p0; p < p1; p++) {
            int64_t e = entries[p], col = e - r * chunk;
            float v = col < len ? row[col] : 0.0f;
            out[p] = residual ? v + residual[e] : v;
        }
    )
    for (int64_t b = 0; b < n_bare; b++) {
        int64_t r = bare[b];
        for (int64_t p = ranges[2 * r]; p < ranges[2 * r] + ranges[2 * r + 1]; p++)
            out[p] = residual ? 0.0f + residual[entries[p]] : 0.0f;
    }
    if (!finite) return;
    for (int l = 0; l < 8; l++) total += acc[l];
    *finite = total - total == 0.0f;
    if (!*finite) for (int64_t p = 0; p < count; p++) out[p] = NAN;
}

/* After the exchange: if ok, residual += g over every tensor and residual[e] = kept[p] (0 if kept is NULL) at
   the entries; every tensor zeroed, then mean[p] at its entries. */
void scape_fused_finish(float **t, const int64_t *start, const int64_t *numel, int64_t n, int64_t chunk,
                        const int64_t *ranges, const int64_t *bare, int64_t n_bare, float *residual,
                        const int64_t *entries, const float *mean, const float *kept, const uint8_t *ok) {
    int add = residual && *ok;
    EACH_ROW(
        if (add) {
            float *res = residual + r * chunk;
            for (int64_t j = 0; j < len; j++) { res[j] += row[j]; row[j] = 0.0f; }
        } else {
            memset(row, 0, (size_t)len * sizeof(float));
        }
        for (int64_t p = p0; p < p1; p++) {
            int64_t e = entries[p], col = e - r * chunk;
            if (add) residual[e] = kept ? kept[p] : 0.0f;
            if (col < len) row[col] = mean[p];
        }
    )
    for (int64_t b = 0; b < n_bare && add; b++) {
        int64_t r = bare[b];
        for (int64_t p = ranges[2 * r]; p < ranges[2 * r] + ranges[2 * r + 1]; p++)
            residual[entries[p]] = kept ? kept[p] : 0.0f;
    }
}

/* theta *= decay (1 + alpha[k] keep, its group k's, where has_decay[k]) and theta[e] += scale[k] * u[p] at the
   entries, row by row. */
void scape_fused_update(float **t, const int64_t *start, const int64_t *numel, int64_t n, int64_t chunk,
                        const int64_t *ranges, const int32_t *group, const float *alpha, const uint8_t *has_decay,
                        const float *scale, const uint8_t *keep, const int64_t *entries, const float *u) {
    float kept = *keep ? 1.0f : 0.0f;
    EACH_ROW(
        int32_t k = group[i];
        if (has_decay[k]) {
            float d = 1.0f + alpha[k] * kept;
            for (int64_t j = 0; j < len; j++) row[j] *= d;
        }
        for (int64_t p = p0; p < p1; p++) {
            int64_t col = entries[p] - r * chunk;
            if (col < len) row[col] = row[col] + scale[k] * u[p];
        }
    )
}
"""
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
native.register(SOURCE, {
    "scape_fused_gather": (None, [_P, _P, _P, _I64, _I64, _P, _P, _I64, _P, _P, _I64, _P, _P]),
    "scape_fused_finish": (None, [_P, _P, _P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _P]),
    "scape_fused_update": (None, [_P, _P, _P, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _P]),
})


class RowTable:
    """Where the flat layout's coordinates sit in a list of tensors: tensor ``i`` holds layout indices
    ``start[i] .. start[i] + numel[i]`` (a parameter's rows, row-aligned; the rest of its last row is padding),
    and the rows of no tensor in the list (``bare``). Built once per list of parameters.

    Example:
        >>> RowTable([0, 8], [5, 2], rows=4, chunk=4).bare.tolist()
        [3]
    """

    def __init__(self, start: Sequence[int], numel: Sequence[int], rows: int, chunk: int) -> None:
        self.start = torch.tensor(list(start), dtype=torch.long)
        self.numel = torch.tensor(list(numel), dtype=torch.long)
        self.chunk = chunk
        covered = torch.zeros(rows, dtype=torch.bool)
        for s, n in zip(start, numel):
            covered[s // chunk:(s + n + chunk - 1) // chunk] = True
        self.bare = (~covered).nonzero().view(-1)

    @classmethod
    def of(cls, layout: FlatLayout, names: Sequence[str]) -> "RowTable":
        """The table of the tensors of parameters ``names`` (each shaped like its parameter) in ``layout``."""
        return cls([layout.first_row[n] * layout.chunk for n in names], [layout.numel[n] for n in names],
                   layout.rows, layout.chunk)


def runs_here(tensors: Sequence[Tensor], *others: Tensor | None) -> bool:
    """Whether the C loops take these: fp32 tensors on the CPU, each one dense block, ``others`` (the
    residual, the indices, ...) on the CPU and contiguous, and the C kernels built."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
            and all(o is None or (o.device.type == "cpu" and o.is_contiguous()) for o in others)
            and native.library() is not None)


def gather(tensors: Sequence[Tensor], table: RowTable, shape: MaskShape, entries: Tensor) -> Tensor:
    """The tensors' values at the flat layout ``entries`` (int64, a mask's of ``shape``, in its order), 0 on
    padding."""
    return torch.ops.scape.fused_gather(list(tensors), table.start, table.numel, table.bare, table.chunk,
                                        shape.row_entries, entries)


def stage(tensors: Sequence[Tensor], table: RowTable, shape: MaskShape, residual: Tensor | None,
          entries: Tensor) -> tuple[Tensor, Tensor]:
    """``g + e`` at the entries and whether every value of ``tensors`` is finite (0-dim bool); NaN throughout if not."""
    return torch.ops.scape.fused_stage(list(tensors), table.start, table.numel, table.bare, table.chunk,
                                       shape.row_entries, residual, entries)


def finish(tensors: Sequence[Tensor], table: RowTable, shape: MaskShape, residual: Tensor | None, entries: Tensor,
           mean: Tensor, kept: Tensor | None, ok: Tensor) -> None:
    """If ``ok``: ``e += g`` everywhere, then ``kept`` (or 0) at the entries; the tensors zeroed, then ``mean``
    at the entries."""
    torch.ops.scape.fused_finish(list(tensors), table.start, table.numel, table.bare, table.chunk,
                                 shape.row_entries, residual, entries, mean, kept, ok)


def update(params: Sequence[Tensor], table: RowTable, shape: MaskShape, group: Tensor, alpha: Tensor,
           has_decay: Tensor, scale: Tensor, keep: Tensor, entries: Tensor, u: Tensor) -> None:
    """``theta *= 1 + alpha keep`` (per group, where it decays), then ``theta += scale u`` at the entries."""
    torch.ops.scape.fused_update(list(params), table.start, table.numel, table.chunk, shape.row_entries, group,
                                 alpha, has_decay, scale, keep, entries, u)


def _pointers(tensors: Sequence[Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * max(1, len(tensors)))(*[t.data_ptr() for t in tensors])


def _p(t: Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


@torch.library.custom_op("scape::fused_gather", mutates_args=(), device_types="cpu")
def _gather_op(tensors: list[Tensor], start: Tensor, numel: Tensor, bare: Tensor, chunk: int, ranges: Tensor,
               entries: Tensor) -> Tensor:
    out = torch.empty(entries.numel())
    native.library().scape_fused_gather(_pointers(tensors), _p(start), _p(numel), len(tensors), chunk, _p(ranges),
                                        _p(bare), bare.numel(), None, _p(entries), entries.numel(), None, _p(out))
    return out


@torch.library.custom_op("scape::fused_stage", mutates_args=(), device_types="cpu")
def _stage_op(tensors: list[Tensor], start: Tensor, numel: Tensor, bare: Tensor, chunk: int, ranges: Tensor,
              residual: Optional[Tensor], entries: Tensor) -> tuple[Tensor, Tensor]:
    out, finite = torch.empty(entries.numel()), torch.empty((), dtype=torch.bool)
    native.library().scape_fused_gather(_pointers(tensors), _p(start), _p(numel), len(tensors), chunk, _p(ranges),
                                        _p(bare), bare.numel(), _p(residual), _p(entries), entries.numel(),
                                        _p(finite), _p(out))
    return out, finite


@torch.library.custom_op("scape::fused_finish", mutates_args=("tensors", "residual"), device_types="cpu")
def _finish_op(tensors: list[Tensor], start: Tensor, numel: Tensor, bare: Tensor, chunk: int, ranges: Tensor,
               residual: Optional[Tensor], entries: Tensor, mean: Tensor, kept: Optional[Tensor], ok: Tensor) -> None:
    native.library().scape_fused_finish(_pointers(tensors), _p(start), _p(numel), len(tensors), chunk, _p(ranges),
                                        _p(bare), bare.numel(), _p(residual), _p(entries), _p(mean), _p(kept), _p(ok))


@torch.library.custom_op("scape::fused_update", mutates_args=("params",), device_types="cpu")
def _update_op(params: list[Tensor], start: Tensor, numel: Tensor, chunk: int, ranges: Tensor, group: Tensor,
               alpha: Tensor, has_decay: Tensor, scale: Tensor, keep: Tensor, entries: Tensor, u: Tensor) -> None:
    native.library().scape_fused_update(_pointers(params), _p(start), _p(numel), len(params), chunk, _p(ranges),
                                        _p(group), _p(alpha), _p(has_decay), _p(scale), _p(keep), _p(entries), _p(u))


@_gather_op.register_fake
def _(tensors: list[Tensor], start: Tensor, numel: Tensor, bare: Tensor, chunk: int, ranges: Tensor,
      entries: Tensor) -> Tensor:
    return entries.new_empty(entries.numel(), dtype=torch.float32)


@_stage_op.register_fake
def _(tensors: list[Tensor], start: Tensor, numel: Tensor, bare: Tensor, chunk: int, ranges: Tensor,
      residual: Optional[Tensor], entries: Tensor) -> tuple[Tensor, Tensor]:
    return entries.new_empty(entries.numel(), dtype=torch.float32), entries.new_empty((), dtype=torch.bool)
