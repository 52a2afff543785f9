"""scape_hook: the DDP communication hook that exchanges one compact buffer per sparse step."""

# no `from __future__ import annotations`: DDP inspects the hook's real annotations

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core import inflight
from scape_core.buckets import BucketPlan, Exchange, StepRecord
from scape_core.compat import all_gather_into_tensor
from scape_core.layout import gather_spans, scatter_spans
from scape_core.masks import Mask
from scape_core.state import ScapeState


def stage(state: ScapeState, bucket: BucketPlan, mask: Mask, buffer: Tensor) -> Exchange:
    """Put this bucket's part of ``a_r[M]`` (``a_r = g_r + e_r``) into the step's compact buffer.

    Fixed shape (the mask's entries of this bucket), gathered with two ``index_select`` on flat
    buffers and written at the bucket's spans of the mask's entries, so where a value sits in
    what is sent never depends on DDP's buckets. A rank whose gradients in the bucket are not
    finite sends NaN there, so every rank skips the step.
    """
    shape = state.layout.mask_shape(mask.density)
    spans = shape.ranges(bucket.names)
    entries = gather_spans(mask.flat(state.layout), spans)
    positions = state.buckets.positions(entries)
    lo, hi = torch.aminmax(buffer)
    finite = torch.isfinite(lo) & torch.isfinite(hi)  # NaN propagates, +-inf stays; no fp16 overflow
    picked = buffer.index_select(0, positions).float()
    if state.residual_buffer is not None:
        picked += state.residual_buffer.view(-1).index_select(0, entries)
    exchange = Exchange(bucket, buffer, entries, positions, spans, finite)
    state.record.add_exchange(exchange, shape.entries)
    scatter_spans(state.record.send, spans, picked.masked_fill_(~finite, float("nan")))
    return exchange


def finish_bucket(state: ScapeState, exchange: Exchange, reduced: Tensor, kept: Tensor | None, ok: Tensor,
                  step_ok: Tensor) -> None:
    """After the exchange: the residual keeps the rest, the bucket holds the mean on the mask (zeros elsewhere).

    ``reduced`` and ``kept`` (this rank's rounding of what it sent, or None) are the bucket's
    entries; ``ok``: they are finite (on every rank); ``step_ok``: every bucket's are. Decided on
    the device: a bucket that is not finite drops this step's gradient from the residual (which
    stays as before the step) and holds zeros; on a step some bucket skips, the means the others
    exchanged go back into the residual (nothing sent is lost: the optimizer applies none).
    """
    buffer, entries, bucket = exchange.buffer, exchange.entries, exchange.bucket
    state.record.finite.append(ok)  # list appends are safe from gloo's thread
    mean = torch.where(ok, reduced, 0.0)
    if state.residual_buffer is not None:
        buffer.masked_fill_(~(ok & exchange.finite), 0.0)  # a dropped step adds nothing
        torch._foreach_add_(bucket.residuals(state.layout, state.residual_buffer), bucket.grads)  # e_r += g_r
        flat = state.residual_buffer.view(-1)
        returned = torch.where(step_ok, 0.0, mean)  # a skipped step: what was exchanged goes back
        now = returned if kept is None else kept + returned
        flat.index_copy_(0, entries, torch.where(ok, now, flat.index_select(0, entries)))
    buffer.zero_()
    buffer.index_copy_(0, exchange.positions, mean.to(buffer.dtype))
    scatter_spans(state.record.values, exchange.spans, mean)


def finish_step(state: ScapeState, record: StepRecord, reduced: Tensor, kept: Tensor | None) -> None:
    """Every bucket's share of the step's exchanged means (``reduced``, one per mask entry); then
    DDP's futures complete (their failure, if anything here raised). Compiled kernels: every
    bucket in one pass (:func:`scape_core.kernels.finish_pass`)."""
    try:
        if state.kernels.compiled:
            pieces, exchanges = record.staging.pieces, record.exchanges
            ok, good = state.kernels.verdicts(reduced, pieces, len(exchanges))
            if state.residual_buffer is not None:  # e_r += g_r where the bucket went through, a graph of its own
                residuals, grads, keep = [], [], []
                for j, x in enumerate(exchanges):
                    views = x.bucket.residuals(state.layout, state.residual_buffer)
                    residuals += views
                    grads += x.bucket.grads
                    keep += [ok[j] & x.finite] * len(views)
                # one compiled copy per set of buckets: the pass does not depend on the mask's density
                state.kernels.residual(residuals, grads, keep, hash(tuple(x.bucket.names for x in exchanges)))
            torch._foreach_zero_([x.buffer for x in exchanges])  # outside the graph: in place (finish_pass)
            record.values = state.kernels.finish([x.buffer for x in exchanges], state.residual_buffer, record.entries,
                                                 reduced, kept, ok, good, pieces)
            record.finite.extend(ok.unbind())
        else:
            parts = [gather_spans(reduced, x.spans) for x in record.exchanges]
            oks = [torch.isfinite(part).all() for part in parts]
            step_ok = torch.stack(oks).all()
            for x, part, ok in zip(record.exchanges, parts, oks):
                kept_here = None if kept is None else gather_spans(kept, x.spans)
                finish_bucket(state, x, part, kept_here, ok, step_ok)
    except BaseException as e:
        for x in record.exchanges:
            x.future.set_exception(e)
        raise
    for x in record.exchanges:
        x.future.set_result(x.buffer)


def stage_step(state: ScapeState, record: StepRecord, mask: Mask) -> None:
    """Compiled kernels: the step's compact buffer from every bucket at once, once the last is in
    (:func:`scape_core.kernels.stage_pass`); each bucket's own verdict is kept for the finish."""
    shape = state.layout.mask_shape(mask.density)
    record.staging = state.buckets.staging(tuple(x.bucket for x in record.exchanges), shape)
    record.send, finite = state.kernels.stage([x.buffer for x in record.exchanges], state.residual_buffer,
                                              record.entries, record.staging.pieces)
    for x, verdict in zip(record.exchanges, finite.unbind()):
        x.finite = verdict


def finish_dense(state: ScapeState, buffer: Tensor) -> Tensor:
    """After a dense all-reduce the bucket holds the mean; its finiteness decides the step."""
    state.record.finite.append(torch.isfinite(buffer).all())
    return buffer


def scape_hook(state: ScapeState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: all-reduce only the masked coordinates of ``grad + residual``.

    Versus plain DDP: on a sparse step each rank adds its gradient to its residual, gathers the
    coordinates of the step's mask (the same on every rank) into one compact buffer, bucket by
    bucket, and exchanges that buffer alone (values, no indices) once the last bucket is in: one
    all-reduce per step, or an all-to-all and an all-gather on an encoded ``wire``
    (:func:`exchange_encoded`). Every bucket then holds the mean on the mask and zeros
    elsewhere; the unsent rest stays in this rank's residual. One exchange per step in the
    mask's order keeps every value's sum order and rounding independent of DDP's buckets
    (which DDP rebuilds after each process's first iteration), so a run resumes bit-for-bit.
    Warm-up steps (and ``sparsity=0``) are plain averaging all-reduces per bucket. Needs
    :class:`ScapeAdamS`.

    Example::

        state = ScapeState(ddp, sparsity=0.99)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, lr=3e-4)
    """
    buffer = bucket.buffer()
    plan = state.buckets.plan(bucket)
    state.record.sync(plan.names)
    state.counters["hook_calls"] += 1
    mask = state.current_mask()
    dense_bytes = buffer.numel() * buffer.element_size()
    if mask is None:
        send = buffer.div_(state.world_size)
        state.count(send.numel(), dense_bytes, dense_bytes)
        work = inflight.hold(dist.all_reduce(send, group=state.process_group, async_op=True))
        return work.get_future().then(lambda f: finish_dense(state, f.value()[0]))
    if not state.sparse_started:
        state.start_sparse()
    if state.kernels.compiled:  # staged all at once at the last bucket
        exchange = Exchange(plan, buffer, None, None, state.layout.mask_shape(mask.density).ranges(plan.names), None)
        state.record.exchanges.append(exchange)
        state.record.entries = mask.flat(state.layout)
        if bucket.is_last():
            stage_step(state, state.record, mask)
    else:
        exchange = stage(state, plan, mask, buffer)
    state.count(0, 0, dense_bytes)
    if bucket.is_last():  # the step's compact buffer is complete: exchange it
        (exchange_encoded if state.config.resolved_wire != "native" else exchange_native)(state, state.record)
    return exchange.future


def exchange_native(state: ScapeState, record: StepRecord) -> None:
    """One all-reduce of the step's compact buffer in the gradients' dtype (its rounding kept)."""
    sent = record.send.to(state.buckets.dtype, copy=True)
    kept = record.send.sub_(sent.float()) if sent.dtype != torch.float32 else None  # the wire's rounding stays
    sent.div_(state.world_size)
    state.count(sent.numel(), sent.numel() * sent.element_size(), 0)
    work = inflight.hold(dist.all_reduce(sent, group=state.process_group, async_op=True))
    # its callback runs on gloo's thread: exit waits for the work (see inflight)
    work.get_future().then(lambda f: finish_step(state, record, f.value()[0], kept))


def exchange_encoded(state: ScapeState, record: StepRecord) -> None:
    """The two stages of an encoded wire (:mod:`scape_core.wire`): all-to-all the segments, the owner
    sums its segment in fp32 and encodes the mean, all-gather the means.

    The second stage needs the first's result, so it is issued here, on the hook's thread, after
    waiting for the first: with NCCL that wait is a stream dependency (the host does not block);
    with gloo it blocks the end of the backward (the last bucket) until the all-to-all is done.
    Issuing it from the first stage's callback instead would let ranks order their collectives
    differently.
    """
    plan = state.buckets.wire_plan(record.send.numel())
    group, kernels = state.process_group, state.kernels
    send, kept = kernels.wire_send(plan, record.send)  # this rank's rounding stays in kept
    state.count(plan.entries, plan.nbytes, 0)  # as one all-reduce of the encoded buffer (see scape_core.wire)
    received = torch.empty_like(send)
    inflight.hold(dist.all_to_all_single(received, send, group=group, async_op=True)).wait()
    own, rounded = kernels.wire_own(plan, received)  # this rank's segment's mean, encoded
    lo = state.rank * plan.segment  # the owner keeps W times its encoding's rounding: the mean residual holds it
    hi = min(lo + plan.segment, plan.entries)
    if hi > lo:
        kept[lo:hi] += rounded[:hi - lo]
    gathered = send.new_empty(send.numel())  # flat: gloo's all-gather wants it so
    work = inflight.hold(all_gather_into_tensor(gathered, own, group=group, async_op=True))
    work.get_future().then(lambda f: finish_step(
        state, record, kernels.wire_decode(plan, gathered.view(send.shape)), kept))
