"""One sparse exchange: a step's gradient regions staged into a compact buffer, sent, and settled.

A *region* is one flat tensor of synchronized gradients with its parameters at known offsets
(:class:`~scape_core.buckets.BucketPlan`): a DDP bucket, or an FSDP2 parameter group's
reduce-scatter output. An exchange (a :class:`~scape_core.buckets.StepRecord`) covers some of a
mask's entries, in the layout rows of its regions, and runs once every region has joined, on the
caller's thread (:func:`run`), in three stages for DDP's hook and FSDP2's alike:

1. :func:`stage` (or :func:`stage_compiled`): ``a_r = g_r + e_r`` at the entries into the compact
   buffer ``send``, NaN everywhere if this rank's gradients are not all finite.
2. :func:`exchange_native` (one all-reduce) or :func:`exchange_encoded` (an encoded wire's two
   stages, :mod:`scape_core.wire`); this rank's rounding of what it sent is kept.
3. :func:`finish` (or :func:`finish_compiled`): the verdict (are the exchanged means finite, so on
   every rank), the residual's update (``e_r += g_r``, what was sent replaced by its rounding;
   nothing at all on a non-finite step), and the regions hold the mean on the mask, zeros elsewhere.

DDP exchanges every bucket of a step at once, when the last one is in (the others' futures complete
then): one exchange per step whatever the buckets, so the eager path is a fixed number of operators,
each over the whole layout or the mask's entries. On the CPU (fp32, DDP) :func:`stage` and :func:`finish`
run as C loops over the regions themselves (:mod:`scape_core.fused`); elsewhere the gradients pass through
one flat staging buffer in the layout's order (``ScapeStateBase.staging``), to and from the regions by one
multi-tensor copy each. FSDP2 exchanges each parameter group in its own hook and files it into the step's record
(:meth:`~scape_core.buckets.StepRecord.absorb`). A non-finite exchange drops its gradients whole: every
rank's residual stays as before, as a dense step or torch's GradScaler drops a step.

Nothing here runs in a collective's completion callback: with NCCL a ``wait()`` is a stream dependency
(the host does not block), and every kernel of the exchange runs on the caller's stream, in order, so
what the optimizer reads next is written first (a callback would run on a side stream).

The eager functions are the readable reference; the compiled ones (the passes below, compiled by
:mod:`scape_core.kernels`) are tested against them; a state chooses once (:func:`path`, from
``ScapeConfig.kernels``), as torch's ``adamw`` chooses between its single-tensor, foreach and fused
functions. Each function takes an :class:`Exchanger`: what an exchange reads and writes besides its
record (the state's buffers, regions, kernels and communicator), made once by the state.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core import fused, inflight, wire
from scape_core.buckets import Buckets, StepRecord, positions_in_regions
from scape_core.buffers import Buffers
from scape_core.communicator import Communicator
from scape_core.compat import all_gather_into_tensor
from scape_core.kernels import Kernels

Span = tuple[int, int, int]  # a region's entries (RegionSpan: region, lo, hi), at flat index + row shift


def all_finite(x: Tensor) -> Tensor:
    """Whether every value of ``x`` is finite, a 0-dim bool on its device: from its sum (NaN propagates,
    an infinity stays one or meets its opposite as NaN), one pass that writes nothing, then
    ``sum - sum == 0`` (three operators; ``isfinite(x).all()`` writes a mask first and is four operators
    before the reduction). Summed in fp32 whatever ``x``'s dtype (fp16 gradients summing past 65504 are
    finite); a finite ``x`` whose fp32 sum overflows (values near 3e38) counts as not finite: such a step
    is dropped, as torch's GradScaler drops an overflowing one.

    Example:
        >>> all_finite(torch.tensor([1.0, -2.0])), all_finite(torch.tensor([1.0, float("-inf")]))
        (tensor(True), tensor(False))
    """
    total = x.sum(dtype=torch.float32)
    return (total - total) == 0


def _rows(buffer: Tensor, rows: tuple[int, int] | None) -> Tensor:
    """The layout rows ``rows`` of a ``(rows, chunk)`` buffer (``None``: all of it, no view made)."""
    return buffer if rows is None else buffer[rows[0]:rows[1]]


class ExchangePath(NamedTuple):
    """The staging and finishing functions of a state's exchanges (one signature each, both paths)."""

    stage: Callable[..., None]
    finish: Callable[..., None]
    narrow: bool  # whether the entries are the layout's narrowest index dtype (compiled: int32 where it fits)


class Exchanger(NamedTuple):
    """What an exchange reads and writes besides its record, made once per state: the functions of its path
    (:func:`path`), the buffers (the residual, the staging scratch), the regions' plans and the wire's
    (:class:`Buckets`), the kernels, and the communicator (group, rank, counters)."""

    path: ExchangePath
    buffers: Buffers
    buckets: Buckets
    kernels: Kernels
    comm: Communicator


def run(ex: Exchanger, record: StepRecord) -> None:
    """Stage, exchange and finish ``record`` (every region joined), then complete the regions' futures
    (with the failure, if anything here raised). An interrupt (``KeyboardInterrupt``, ``SystemExit``)
    propagates as itself; the futures, which take only an ``Exception``, fail with one naming it."""
    try:
        path = ex.path
        path.stage(ex, record)
        encoded = ex.buckets.wire_name != "native"
        reduced, kept = (exchange_encoded if encoded else exchange_native)(ex, record)
        path.finish(ex, record, reduced, kept)
    except BaseException as e:  # the futures fail, then it propagates as itself
        failed = e if isinstance(e, Exception) else RuntimeError(f"SCAPE's exchange was interrupted ({e!r})")
        for x in record.exchanges:
            x.future.set_exception(failed)
        raise
    for x in record.exchanges:
        x.future.set_result(x.buffer)


def stage(ex: Exchanger, record: StepRecord) -> None:
    """The compact buffer ``record.send`` of every region at once (eager): the regions' gradients
    copied into the staging buffer (one multi-tensor copy, in the layout's order), their finiteness
    (one pass), and ``g + e`` gathered at the entries, NaN everywhere if this rank's are not finite
    (so every rank drops the exchange). Where a value sits in what is sent never depends on how the
    regions are cut."""
    record.regions = table = _fused_table(ex, record)  # finish walks the same
    if table is not None:  # on the CPU: read where the gradients are (scape_core.fused)
        shape = ex.buffers.layout.mask_shape(record.density)
        record.send, finite = fused.stage(table[0], table[1], shape, ex.buffers.residual, record.entries)
        record.local.append(finite)
        return
    staging = ex.buffers.staging()
    grads, views = record.grads_and_staging(ex.buffers.layout, staging)
    torch._foreach_copy_(views, grads)
    finite = all_finite(_rows(staging, record.rows))
    send = ex.buffers.flat(staging).index_select(0, record.entries)  # index_select: twice take's speed on the CPU
    if ex.buffers.residual is not None:
        send += ex.buffers.flat(ex.buffers.residual).index_select(0, record.entries)
    record.send = send.mul_(torch.where(finite, 1.0, float("nan")))  # x * 1 is x; a 0-dim factor: one cheap pass
    record.local.append(finite)


def _fused_table(ex: Exchanger, record: StepRecord) -> tuple[list[Tensor], fused.RowTable] | None:
    """The regions' gradient views and their :class:`~scape_core.fused.RowTable` where the C loops run
    (fp32 on the CPU, the exchange covering every row: DDP's), else ``None``."""
    if record.rows is not None:
        return None
    plans = tuple(x.bucket for x in record.exchanges)
    grads = [g for plan in plans for g in plan.grads]
    if record.entries.dtype != torch.int64 or not fused.runs_here(grads, ex.buffers.residual, record.entries):
        return None
    return grads, ex.buckets.row_table(plans)


def stage_compiled(ex: Exchanger, record: StepRecord) -> None:
    """:func:`stage` compiled: the compact buffer read from every region's buffer at once
    (:func:`stage_pass`, no staging copy), NaN in a region whose gradients are not
    finite (so every rank drops the exchange)."""
    shape = ex.buffers.layout.mask_shape(record.density)
    record.staging = ex.buckets.staging(tuple(x.bucket for x in record.exchanges), shape, record.base)
    spans = record.staging.spans
    record.send, finite = ex.kernels.get("stage", stage_pass, hash(spans))(
        [x.buffer for x in record.exchanges], ex.buffers.residual, record.entries, ex.buckets.row_shift, spans,
        ex.buffers.layout.chunk)
    record.local.append(finite.all())


def stage_pass(buffers: list[Tensor], residual: Tensor | None, entries: Tensor, row_shift: Tensor,
               spans: Sequence[Span], chunk: int) -> tuple[Tensor, Tensor]:
    """A sparse step's compact buffer from every bucket at once: ``g + e`` at the mask's entries (fp32,
    in entry order), NaN where this rank's bucket is not finite; returns it and the buckets' verdicts.
    ``spans``: :attr:`scape_core.buckets.Staging.spans`; ``row_shift``:
    :attr:`~scape_core.buckets.Buckets.row_shift`."""
    finite = torch.stack([torch.isfinite(b).all() for b in buffers])
    at = positions_in_regions(entries, row_shift, chunk)
    parts = []
    for j, lo, hi in spans:  # per span: in a graph, a per-entry mask (a cat of expanded verdicts) is 4x slower
        part = buffers[j].index_select(0, at[lo:hi]).float()
        if residual is not None:
            part = part + residual.view(-1).index_select(0, entries[lo:hi])
        parts.append(torch.where(finite[j], part, float("nan")))
    return torch.cat(parts), finite


def residual_pass(residuals: list[Tensor], grads: list[Tensor], keep: Tensor) -> None:
    """``e_r += g_r`` per parameter if the step went through (``keep``, 0-dim bool), in place: the
    non-finite drop and the add in one loop. ``residuals`` are views of one buffer that do not
    overlap, passed as inputs: the graph writes nothing else of that buffer, so each is written in
    place (``finish_pass``)."""
    for e, g in zip(residuals, grads):
        e.copy_(torch.where(keep, e + g.float(), e))


def finish_pass(buffers: list[Tensor], residual: Tensor | None, entries: Tensor, reduced: Tensor,
                kept: Tensor | None, ok: Tensor, row_shift: Tensor, spans: Sequence[Span], chunk: int) -> Tensor:
    """After the exchange, the residual's add of the gradients and the buckets' zeroing, every bucket
    at once: if the step went through (``ok``), the residual keeps ``kept`` (or 0) at the entries and
    every bucket gets the mean there; if not, the residual stays and the buckets hold zeros. Returns
    the means (fp32; 0 on a dropped step). As :func:`finish`. ``entries`` may be
    int32 (a mask's narrow entries, :meth:`~scape_core.masks.Mask.flat`), as in every pass that takes them.

    The residual's add is a graph of its own (:func:`residual_pass`) and the zeroing an eager
    multi-tensor operator. In this graph an add into each parameter's slice of the residual (which
    it also writes at the entries) is functionalized into copies of the whole buffer (measured at
    10M parameters: 0.5-2 s a step instead of 20-35 ms; ``docs/benchmarks.md``), and a bucket zeroed
    and then written at the entries in one graph is written through a temporary of its size,
    copied back at the end (inductor's generated code).
    """
    mean = torch.where(ok, reduced, 0.0)
    if residual is not None:  # one write: several index_copy_ into one input would go through a copy of it
        flat, index = residual.view(-1), entries.long()  # index_copy_ takes int64 (converted as it reads)
        now = torch.zeros_like(mean) if kept is None else kept
        flat.index_copy_(0, index, torch.where(ok, now, flat.index_select(0, index)))
    at = positions_in_regions(entries, row_shift, chunk)
    for j, lo, hi in spans:
        buffers[j].index_copy_(0, at[lo:hi], mean[lo:hi].to(buffers[j].dtype))
    return mean.float()


def exchange_native(ex: Exchanger, record: StepRecord) -> tuple[Tensor, Tensor | None]:
    """One all-reduce of the compact buffer in the gradients' dtype; returns the means (fp32) and
    this rank's rounding of what it sent (``None`` in fp32)."""
    sent = record.send.to(record.dtype or ex.buckets.dtype, copy=True)
    kept = record.send.sub_(sent.float()) if sent.dtype != torch.float32 else None  # the wire's rounding stays
    sent.div_(ex.comm.world_size)
    record.count(sent.numel(), sent.numel() * sent.element_size(), 0)
    inflight.hold(dist.all_reduce(sent, group=ex.comm.process_group, async_op=True)).wait()
    return sent.float(), kept


def exchange_encoded(ex: Exchanger, record: StepRecord) -> tuple[Tensor, Tensor]:
    """The two stages of an encoded wire (:mod:`scape_core.wire`): all-to-all the segments, the owner
    sums its segment in fp32 and encodes the mean, all-gather the means; returns the decoded means
    and this rank's rounding (the owner's of its segment's mean added).

    The second stage needs the first's result, so each is waited for where it is issued (with NCCL a
    stream dependency; with gloo the host waits, at the end of the backward, as DDP's own
    ``finalize_backward`` would)."""
    plan = ex.buckets.wire_plan(record.send.numel())
    codec = wire.stages(ex.kernels, plan, ex.comm.rank, record.send.device)
    sent, kept = codec.send(record.send)  # this rank's rounding stays in kept
    record.count(plan.entries, plan.nbytes, 0)  # as one all-reduce of the encoded buffer (see scape_core.wire)
    inflight.hold(dist.all_to_all_single(codec.received, sent, group=ex.comm.process_group, async_op=True)).wait()
    own = codec.own_mean()  # this rank's segment's mean, encoded; the owner keeps W times its rounding
    inflight.hold(all_gather_into_tensor(codec.gathered, own, group=ex.comm.process_group, async_op=True)).wait()
    return codec.decode_gathered(), kept


def finish(ex: Exchanger, record: StepRecord, reduced: Tensor, kept: Tensor | None) -> None:
    """After the exchange (eager): the residual keeps the rest, the regions hold the mean on the mask
    (zeros elsewhere).

    ``reduced`` and ``kept`` (this rank's rounding of what it sent, or None) are the exchange's
    entries. Decided on the device: when the means are finite (so every rank's gradients were),
    ``e_r += g_r`` everywhere and what was sent is replaced by its rounding; when not, the step's
    gradients are dropped (every residual as before the step) and the regions hold zeros. The
    staging buffer still holds the gradients :func:`stage` copied; it is left holding the means.
    """
    ok = all_finite(reduced)
    mean = reduced.masked_fill(~ok, 0.0)
    table = record.regions  # stage's
    if table is not None:
        fused.finish(table[0], table[1], ex.buffers.layout.mask_shape(record.density), ex.buffers.residual,
                     record.entries, mean, kept, ok)
        record.values = mean
        record.finite.append(ok)
        return
    staging, entries = ex.buffers.staging(), record.entries
    region = _rows(staging, record.rows)
    if ex.buffers.residual is not None:  # e_r += g_r, a dropped step adding 0 (its gradients made finite first)
        _rows(ex.buffers.residual, record.rows).addcmul_(region.nan_to_num_(0.0, 0.0, 0.0), ok.float())
        residual = ex.buffers.flat(ex.buffers.residual)
        before = residual.index_select(0, entries)  # where sent: its rounding (fp32: 0) if the step went through
        now = before.masked_fill_(ok, 0.0) if kept is None else torch.where(ok, kept, before)
        residual.index_copy_(0, entries, now)
    region.zero_()
    ex.buffers.flat(staging).index_copy_(0, entries, mean)
    grads, views = record.grads_and_staging(ex.buffers.layout, staging)
    torch._foreach_copy_(grads, views)
    record.values = mean
    record.finite.append(ok)


def finish_compiled(ex: Exchanger, record: StepRecord, reduced: Tensor, kept: Tensor | None) -> None:
    """:func:`finish` compiled: every region in one pass (:func:`finish_pass`), the
    residual's add a graph of its own (:func:`residual_pass`)."""
    spans, exchanges = record.staging.spans, record.exchanges
    ok = all_finite(reduced)
    if ex.buffers.residual is not None:  # e_r += g_r if the step went through
        residuals, grads = [], []
        for x in exchanges:
            residuals += x.bucket.residuals(ex.buffers.layout, ex.buffers.residual)
            grads += x.bucket.grads
        # one compiled copy per set of regions: the pass does not depend on the mask's density
        key = hash(tuple(x.bucket.names for x in exchanges))
        ex.kernels.get("residual", residual_pass, key)(residuals, grads, ok)
    torch._foreach_zero_([x.buffer for x in exchanges])  # outside the graph: in place (finish_pass)
    record.values = ex.kernels.get("finish", finish_pass, hash(spans))(
        [x.buffer for x in exchanges], ex.buffers.residual, record.entries, reduced, kept, ok,
        ex.buckets.row_shift, spans, ex.buffers.layout.chunk)
    record.finite.append(ok)


def finish_dense(record: StepRecord, buffer: Tensor) -> Tensor:
    """After a dense all-reduce the region holds the mean; its finiteness decides the step."""
    record.finite.append(all_finite(buffer))
    return buffer


def path(kernels: str) -> ExchangePath:
    """The exchange's functions for ``ScapeConfig.kernels`` (chosen once per state).

    Example:
        >>> path("eager").finish.__name__, path("compiled").stage.__name__
        ('finish', 'stage_compiled')
    """
    if kernels == "compiled":
        return ExchangePath(stage_compiled, finish_compiled, narrow=True)
    return ExchangePath(stage, finish, narrow=False)
