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
    >>> grads = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])]
    >>> table = RowTable([0, 4], [3, 1], rows=2, chunk=4)   # each tensor's own row of 4
    >>> gather(grads, table, torch.tensor([1, 2, 4, 7]))     # entry 7: the second row's padding
    tensor([2., 3., 4., 0.])
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch
from torch import Tensor

from scape_core import native
from scape_core.layout import FlatLayout

SOURCE = r"""
/* Where flat layout index e sits: tensor row_tensor[e / chunk] (-1: none of these tensors), at e - start[t];
   beyond numel[t] it is the row's padding. NULL for padding or a row of no tensor here. */
static inline float *at_entry(float **t, const int64_t *start, const int64_t *numel, const int32_t *row_tensor,
                              int64_t chunk, int64_t e) {
    int32_t i = row_tensor[(chunk & (chunk - 1)) == 0 ? e >> __builtin_ctzll((unsigned long long)chunk) : e / chunk];
    if (i < 0) return 0;
    int64_t off = e - start[i];
    return off < numel[i] ? t[i] + off : 0;
}

/* Whether the n tensors' values are finite and their fp32 sum too (as scape_core.exchange.all_finite: a sum
   past fp32's range drops the step), summed in eight lanes. */
static int all_finite_values(float **t, const int64_t *numel, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, total = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float *v = t[i];
        int64_t j = 0;
        for (; j + 8 <= numel[i]; j += 8)
            for (int l = 0; l < 8; l++) acc[l] += v[j + l];
        for (; j < numel[i]; j++) acc[0] += v[j];
    }
    for (int l = 0; l < 8; l++) total += acc[l];
    return total - total == 0.0f;
}

/* out[i] = the tensors' value at entries[i] (0 on padding), plus residual[entries[i]] if given; NaN
   throughout and *finite = 0 if `check` and a value of the tensors is not finite. */
void scape_fused_gather(float **t, const int64_t *start, const int64_t *numel, int64_t n, const int32_t *row_tensor,
                        int64_t chunk, const float *residual, const int64_t *entries, int64_t count, int check,
                        uint8_t *finite, float *out) {
    int ok = check ? all_finite_values(t, numel, n) : 1;
    if (finite) *finite = (uint8_t)ok;
    for (int64_t i = 0; i < count; i++) {
        int64_t e = entries[i];
        float *g = at_entry(t, start, numel, row_tensor, chunk, e);
        float v = g ? *g : 0.0f;
        out[i] = residual ? v + residual[e] : v;
    }
    if (!ok) for (int64_t i = 0; i < count; i++) out[i] = NAN;
}

/* After the exchange: if ok, residual += g over every tensor and residual[e] = kept[i] (0 if kept is NULL) at
   the entries; every tensor zeroed, then mean[i] at its entries. */
void scape_fused_finish(float **t, const int64_t *start, const int64_t *numel, int64_t n, const int32_t *row_tensor,
                        int64_t chunk, float *residual, const int64_t *entries, int64_t count, const float *mean,
                        const float *kept, const uint8_t *ok) {
    for (int64_t i = 0; i < n; i++) {
        float *g = t[i];
        if (residual && *ok) {
            float *r = residual + start[i];
            for (int64_t j = 0; j < numel[i]; j++) { r[j] += g[j]; g[j] = 0.0f; }
        } else {
            memset(g, 0, (size_t)numel[i] * sizeof(float));
        }
    }
    for (int64_t i = 0; i < count; i++) {
        int64_t e = entries[i];
        if (residual && *ok) residual[e] = kept ? kept[i] : 0.0f;
        float *g = at_entry(t, start, numel, row_tensor, chunk, e);
        if (g) *g = mean[i];
    }
}

/* theta *= decay (1 + alpha[k] keep, its group k's, where has_decay[k]) over every tensor, then
   theta[e] += scale[k] * u[i] at the entries. */
void scape_fused_update(float **t, const int64_t *start, const int64_t *numel, int64_t n, const int32_t *row_tensor,
                        int64_t chunk, const int32_t *group, const float *alpha, const uint8_t *has_decay,
                        const float *scale, const uint8_t *keep, const int64_t *entries, int64_t count,
                        const float *u) {
    float kept = *keep ? 1.0f : 0.0f;
    for (int64_t i = 0; i < n; i++) {
        int32_t k = group[i];
        if (!has_decay[k]) continue;
        float d = 1.0f + alpha[k] * kept, *p = t[i];
        for (int64_t j = 0; j < numel[i]; j++) p[j] *= d;
    }
    for (int64_t i = 0; i < count; i++) {
        int64_t e = entries[i];
        float *p = at_entry(t, start, numel, row_tensor, chunk, e);
        if (p) *p = *p + scale[group[row_tensor[e / chunk]]] * u[i];
    }
}
"""
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
native.register(SOURCE, {
    "scape_fused_gather": (None, [_P, _P, _P, _I64, _P, _I64, _P, _P, _I64, ctypes.c_int, _P, _P]),
    "scape_fused_finish": (None, [_P, _P, _P, _I64, _P, _I64, _P, _P, _I64, _P, _P, _P]),
    "scape_fused_update": (None, [_P, _P, _P, _I64, _P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P]),
})


class RowTable:
    """Where the flat layout's coordinates sit in a list of tensors: tensor ``i`` holds layout indices
    ``start[i] .. start[i] + numel[i]`` (a parameter's rows, then its padding), and each layout row's
    tensor (-1: none of these). Built once per list of parameters.

    Example:
        >>> RowTable([0, 8], [5, 2], rows=3, chunk=4).row_tensor.tolist()
        [0, 0, 1]
    """

    def __init__(self, start: Sequence[int], numel: Sequence[int], rows: int, chunk: int) -> None:
        self.start = torch.tensor(list(start), dtype=torch.long)
        self.numel = torch.tensor(list(numel), dtype=torch.long)
        self.chunk = chunk
        self.row_tensor = torch.full((rows,), -1, dtype=torch.int32)
        for i, (s, n) in enumerate(zip(start, numel)):
            self.row_tensor[s // chunk:(s + n + chunk - 1) // chunk] = i

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


def gather(tensors: Sequence[Tensor], table: RowTable, entries: Tensor) -> Tensor:
    """The tensors' values at the flat layout ``entries`` (int64), 0 on padding."""
    return torch.ops.scape.fused_gather(list(tensors), table.start, table.numel, table.row_tensor, table.chunk,
                                        entries)


def stage(tensors: Sequence[Tensor], table: RowTable, residual: Tensor | None, entries: Tensor) -> tuple[Tensor,
                                                                                                          Tensor]:
    """``g + e`` at the entries and whether every value of ``tensors`` is finite (0-dim bool); NaN throughout if not."""
    return torch.ops.scape.fused_stage(list(tensors), table.start, table.numel, table.row_tensor, table.chunk,
                                       residual, entries)


def finish(tensors: Sequence[Tensor], table: RowTable, residual: Tensor | None, entries: Tensor, mean: Tensor,
           kept: Tensor | None, ok: Tensor) -> None:
    """If ``ok``: ``e += g`` everywhere, then ``kept`` (or 0) at the entries; the tensors zeroed, then ``mean``
    at the entries."""
    torch.ops.scape.fused_finish(list(tensors), table.start, table.numel, table.row_tensor, table.chunk, residual,
                                 entries, mean, kept, ok)


def update(params: Sequence[Tensor], table: RowTable, group: Tensor, alpha: Tensor, has_decay: Tensor,
           scale: Tensor, keep: Tensor, entries: Tensor, u: Tensor) -> None:
    """``theta *= 1 + alpha keep`` (per group, where it decays), then ``theta += scale u`` at the entries."""
    torch.ops.scape.fused_update(list(params), table.start, table.numel, table.row_tensor, table.chunk, group, alpha,
                                 has_decay, scale, keep, entries, u)


def _pointers(tensors: Sequence[Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * max(1, len(tensors)))(*[t.data_ptr() for t in tensors])


def _p(t: Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


@torch.library.custom_op("scape::fused_gather", mutates_args=(), device_types="cpu")
def _gather_op(tensors: list[Tensor], start: Tensor, numel: Tensor, row_tensor: Tensor, chunk: int,
               entries: Tensor) -> Tensor:
    out = torch.empty(entries.numel())
    native.library().scape_fused_gather(_pointers(tensors), _p(start), _p(numel), len(tensors), _p(row_tensor), chunk,
                                        None, _p(entries), entries.numel(), 0, None, _p(out))
    return out


@torch.library.custom_op("scape::fused_stage", mutates_args=(), device_types="cpu")
def _stage_op(tensors: list[Tensor], start: Tensor, numel: Tensor, row_tensor: Tensor, chunk: int,
              residual: Optional[Tensor], entries: Tensor) -> tuple[Tensor, Tensor]:
    out, finite = torch.empty(entries.numel()), torch.empty((), dtype=torch.bool)
    native.library().scape_fused_gather(_pointers(tensors), _p(start), _p(numel), len(tensors), _p(row_tensor), chunk,
                                        _p(residual), _p(entries), entries.numel(), 1, _p(finite), _p(out))
    return out, finite


@torch.library.custom_op("scape::fused_finish", mutates_args=("tensors", "residual"), device_types="cpu")
def _finish_op(tensors: list[Tensor], start: Tensor, numel: Tensor, row_tensor: Tensor, chunk: int,
               residual: Optional[Tensor], entries: Tensor, mean: Tensor, kept: Optional[Tensor], ok: Tensor) -> None:
    native.library().scape_fused_finish(_pointers(tensors), _p(start), _p(numel), len(tensors), _p(row_tensor), chunk,
                                        _p(residual), _p(entries), entries.numel(), _p(mean), _p(kept), _p(ok))


@torch.library.custom_op("scape::fused_update", mutates_args=("params",), device_types="cpu")
def _update_op(params: list[Tensor], start: Tensor, numel: Tensor, row_tensor: Tensor, chunk: int, group: Tensor,
               alpha: Tensor, has_decay: Tensor, scale: Tensor, keep: Tensor, entries: Tensor, u: Tensor) -> None:
    native.library().scape_fused_update(_pointers(params), _p(start), _p(numel), len(params), _p(row_tensor), chunk,
                                        _p(group), _p(alpha), _p(has_decay), _p(scale), _p(keep), _p(entries),
                                        entries.numel(), _p(u))


@_gather_op.register_fake
def _(tensors: list[Tensor], start: Tensor, numel: Tensor, row_tensor: Tensor, chunk: int, entries: Tensor) -> Tensor:
    return entries.new_empty(entries.numel(), dtype=torch.float32)


@_stage_op.register_fake
def _(tensors: list[Tensor], start: Tensor, numel: Tensor, row_tensor: Tensor, chunk: int, residual: Optional[Tensor],
      entries: Tensor) -> tuple[Tensor, Tensor]:
    return entries.new_empty(entries.numel(), dtype=torch.float32), entries.new_empty((), dtype=torch.bool)
