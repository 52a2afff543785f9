"""scape_hook: the DDP communication hook that all-reduces one compact buffer per bucket."""

# no `from __future__ import annotations`: DDP inspects the hook's real annotations

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core import inflight, wire
from scape_core.buckets import BucketPlan, Exchange
from scape_core.compat import all_gather_into_tensor
from scape_core.layout import gather_spans, scatter_spans
from scape_core.masks import Mask
from scape_core.state import ScapeState


def compact(state: ScapeState, bucket: BucketPlan, mask: Mask, buffer: Tensor) -> tuple[Tensor, Exchange]:
    """The one buffer this rank sends on a sparse step: ``a_r[M] / W`` with ``a_r = g_r + e_r``
    (an encoded wire: ``a_r[M]`` encoded, ``(W, row_bytes)`` uint8, one segment per owner).

    Fixed shape (the mask's entries of this bucket), gathered with two ``index_select`` on flat
    buffers. A rank whose gradients are not finite sends NaN, so every rank skips the step.
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
    if state.config.resolved_wire != "native":
        plan = state.buckets.wire_plan(entries.numel())
        segments = wire.pad(plan, picked.masked_fill_(~finite, float("nan")))  # (W, segment): one per owner
        send = wire.encode(plan, segments)
        kept = segments.sub_(wire.decode(plan, send)).view(-1)[:plan.entries]  # this rank's rounding stays here
        exchange = Exchange(buffer, entries, positions, spans, finite, kept, plan)
    else:
        send = picked.to(buffer.dtype, copy=True)
        kept = picked.sub_(send.float()) if buffer.dtype != torch.float32 else None  # the wire's rounding stays here
        send.div_(state.world_size).masked_fill_(~finite, float("nan"))
        exchange = Exchange(buffer, entries, positions, spans, finite, kept)
    state.record.add_exchange(exchange, shape.entries)
    return send, exchange


def finish_sparse(state: ScapeState, bucket: BucketPlan, exchange: Exchange, reduced: Tensor) -> Tensor:
    """After the exchange: the residual keeps the rest, the bucket holds the mean on the mask (zeros elsewhere).

    Decided on the device: if the exchange was not finite on any rank, this step's gradient is
    dropped from the residual (which stays as before the step) and the bucket holds zeros.
    """
    buffer, entries = exchange.buffer, exchange.entries
    ok = torch.isfinite(reduced).all()
    state.record.finite.append(ok)  # list appends are safe from gloo's thread
    if state.residual_buffer is not None:
        buffer.masked_fill_(~(ok & exchange.finite), 0.0)  # a dropped step adds nothing
        torch._foreach_add_(bucket.residuals(state.layout, state.residual_buffer), bucket.grads)  # e_r += g_r
        flat = state.residual_buffer.view(-1)
        kept = 0.0 if exchange.kept is None else exchange.kept
        flat.index_copy_(0, entries, torch.where(ok, kept, flat.index_select(0, entries)))
    mean = torch.where(ok, reduced, 0.0)
    buffer.zero_()
    buffer.index_copy_(0, exchange.positions, mean.to(buffer.dtype))
    scatter_spans(state.record.values, exchange.spans, mean)
    return buffer


def finish_dense(state: ScapeState, buffer: Tensor) -> Tensor:
    """After a dense all-reduce the bucket holds the mean; its finiteness decides the step."""
    state.record.finite.append(torch.isfinite(buffer).all())
    return buffer


def scape_hook(state: ScapeState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: all-reduce only the masked coordinates of ``grad + residual``.

    Versus plain DDP: on a sparse step each rank adds its gradient to its residual, gathers the
    coordinates of the step's mask (the same on every rank) into one compact buffer, and
    all-reduces that buffer alone (values, no indices). The bucket comes back holding the mean
    on the mask and zeros elsewhere; the unsent rest stays in this rank's residual. Warm-up
    steps (and ``sparsity=0``) are plain averaging all-reduces. With an encoded ``wire``
    (``ScapeConfig.wire``) the compact buffer travels in 16, 8 or 4 bits per value through an
    all-to-all and an all-gather instead (:func:`exchange_encoded`). Needs :class:`ScapeAdamS`.

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
    send, exchange = compact(state, plan, mask, buffer)
    if exchange.plan is not None:  # counted as one all-reduce of the encoded buffer (see scape_core.wire)
        state.count(exchange.plan.entries, exchange.plan.nbytes, dense_bytes)
        return exchange_encoded(state, plan, exchange, send)
    state.count(send.numel(), send.numel() * send.element_size(), dense_bytes)
    work = inflight.hold(dist.all_reduce(send, group=state.process_group, async_op=True))
    fut = work.get_future()  # its callback runs on gloo's thread: exit waits for the work (see inflight)
    return fut.then(lambda f: finish_sparse(state, plan, exchange, f.value()[0]))


def exchange_encoded(state: ScapeState, bucket: BucketPlan, exchange: Exchange,
                     send: Tensor) -> torch.futures.Future[Tensor]:
    """The two stages of an encoded wire (:mod:`scape_core.wire`): all-to-all the segments, the owner
    sums its segment in fp32 and encodes the mean, all-gather the means.

    The second stage needs the first's result, so it is issued here, on the hook's thread, after
    waiting for the first: with NCCL that wait is a stream dependency (the host does not block);
    with gloo it blocks the backward until the all-to-all is done. Issuing it from the first
    stage's callback instead would let ranks order their collectives differently.
    """
    plan, group = exchange.plan, state.process_group
    received = torch.empty_like(send)
    inflight.hold(dist.all_to_all_single(received, send, group=group, async_op=True)).wait()
    mean = wire.owner_mean(plan, received)  # this rank's segment
    own = wire.encode(plan, mean)
    lo = state.rank * plan.segment  # the owner keeps W times its encoding's rounding: the mean residual holds it
    hi = min(lo + plan.segment, plan.entries)
    if hi > lo:
        exchange.kept[lo:hi] += mean.sub_(wire.decode(plan, own))[:hi - lo].mul_(plan.world)
    gathered = send.new_empty(send.numel())  # flat: gloo's all-gather wants it so
    work = inflight.hold(all_gather_into_tensor(gathered, own, group=group, async_op=True))
    return work.get_future().then(lambda f: finish_sparse(
        state, bucket, exchange, wire.decode(plan, gathered.view(send.shape)).view(-1)[:plan.entries]))
