"""scape_hook: the DDP communication hook that all-reduces one compact buffer per bucket."""

# no `from __future__ import annotations`: DDP inspects the hook's real annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core import inflight, wire
from scape_core.layout import gather_spans, scatter_spans
from scape_core.masks import Mask
from scape_core.state import ScapeState


@dataclass
class BucketPlan:
    """One DDP bucket, resolved once: its parameters and their views in the bucket and in SCAPE's buffers."""

    names: tuple[str, ...]
    grads: list[Tensor]  # flat views of each parameter's gradient in the bucket buffer
    residuals: list[Tensor] = field(default_factory=list)  # the same parameters' residual views


def plan(state: ScapeState, bucket: dist.GradBucket) -> BucketPlan:
    """The bucket's plan, built at its first sight (and again after DDP rebuilds its buckets)."""
    buffer = bucket.buffer()
    key = (bucket.index(), buffer.data_ptr())
    found = state.buckets.get(key)
    if found is None:
        if buffer.is_sparse or not buffer.is_floating_point():
            names = [state.names[id(p)] for p in bucket.parameters()]
            raise TypeError(f"scape_hook needs dense floating-point gradients; {names} have "
                            f"{'sparse' if buffer.is_sparse else buffer.dtype} gradients (use nn.Embedding(sparse=False))")
        names, grads, rows, shifts = [], [], [], []
        layout = state.layout
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            name = state.names[id(p)]
            names.append(name)
            grads.append(g.view(-1))
            state.bucket_views[name] = g  # shaped like the parameter: the optimizer reads and writes through it
            offset = g.storage_offset() - buffer.storage_offset()  # where the gradient starts in the bucket
            first = layout.first_row[name]
            rows.append(torch.arange(first, first + layout.nrows[name]))
            shifts.append(torch.full((layout.nrows[name],), offset - first * layout.chunk))
        # flat index of a coordinate + shift of its row = its position in this bucket's buffer
        state.row_shift.index_copy_(0, torch.cat(rows).to(state.row_shift.device),
                                    torch.cat(shifts).to(state.row_shift.device))
        for stale in [k for k, old in state.buckets.items() if not set(old.names).isdisjoint(names)]:
            del state.buckets[stale]  # DDP rebuilt its buckets: the old plan would keep the old buffer alive
        found = state.buckets[key] = BucketPlan(tuple(names), grads)
    if state.residual_buffer is not None and not found.residuals:
        found.residuals = state.layout.views(state.residual_buffer, list(found.names))
    return found


@dataclass
class _Exchange:
    """A sparse exchange in flight: where its entries are, and what this rank keeps if it succeeds."""

    entries: Tensor  # flat indices into SCAPE's buffers
    positions: Tensor  # the same coordinates in the bucket buffer
    spans: list[tuple[int, int]]  # where the bucket's entries sit among the mask's entries
    total: int  # entries of the whole mask
    finite: Tensor  # this rank's gradients in the bucket are finite (0-dim bool)
    kept: Tensor | None  # a low-precision wire's rounding of what was sent, else None (nothing kept)
    plan: wire.WirePlan | None = None  # an encoded wire's shape (None: native values, one all-reduce)


def compact(state: ScapeState, p: BucketPlan, mask: Mask, buffer: Tensor) -> tuple[Tensor, _Exchange]:
    """The one buffer this rank sends on a sparse step: ``a_r[M] / W`` with ``a_r = g_r + e_r``
    (an encoded wire: ``a_r[M]`` encoded, ``(W, row_bytes)`` uint8, one segment per owner).

    Fixed shape (the mask's entries of this bucket), gathered with two ``index_select`` on flat
    buffers. A rank whose gradients are not finite sends NaN, so every rank skips the step.
    """
    layout = state.layout
    shape = layout.mask_shape(mask.density)
    spans = shape.ranges(p.names)
    entries = gather_spans(mask.flat(layout), spans)
    positions = entries + state.row_shift.index_select(0, torch.div(entries, layout.chunk, rounding_mode="floor"))
    lo, hi = torch.aminmax(buffer)
    finite = torch.isfinite(lo) & torch.isfinite(hi)  # NaN propagates, +-inf stays; no fp16 overflow
    picked = buffer.index_select(0, positions).float()
    if state.residual_buffer is not None:
        picked += state.residual_buffer.view(-1).index_select(0, entries)
    state.record_exchange(buffer, positions, spans)
    if state.config.resolved_wire != "native":
        plan = state.wire_plan(entries.numel())
        x = wire.pad(plan, picked.masked_fill_(~finite, float("nan")))  # (W, segment): one segment per owner
        send = wire.encode(plan, x)
        kept = x.sub_(wire.decode(plan, send)).view(-1)[:plan.entries]  # this rank's rounding stays here
        return send, _Exchange(entries, positions, spans, shape.entries, finite, kept, plan)
    send = picked.to(buffer.dtype, copy=True)
    kept = picked.sub_(send.float()) if buffer.dtype != torch.float32 else None  # the wire's rounding stays here
    send.div_(state.world_size).masked_fill_(~finite, float("nan"))
    return send, _Exchange(entries, positions, spans, shape.entries, finite, kept)


def finish_sparse(state: ScapeState, p: BucketPlan, x: _Exchange, buffer: Tensor, reduced: Tensor) -> Tensor:
    """After the exchange: the residual keeps the rest, the bucket holds the mean on the mask (zeros elsewhere).

    Decided on the device: if the exchange was not finite on any rank, this step's gradient is
    dropped from the residual (which stays as before the step) and the bucket holds zeros.
    """
    ok = torch.isfinite(reduced).all()
    state.record_finite(ok)
    if state.residual_buffer is not None:
        buffer.masked_fill_(~(ok & x.finite), 0.0)  # a dropped step adds nothing
        torch._foreach_add_(p.residuals, p.grads)  # e_r += g_r: the residual now holds a_r
        flat = state.residual_buffer.view(-1)
        flat.index_copy_(0, x.entries, torch.where(ok, 0.0 if x.kept is None else x.kept, flat.index_select(0, x.entries)))
    mean = torch.where(ok, reduced, 0.0)
    buffer.zero_()
    buffer.index_copy_(0, x.positions, mean.to(buffer.dtype))
    scatter_spans(state.step_values(x.total), x.spans, mean)
    return buffer


def finish_dense(state: ScapeState, buffer: Tensor) -> Tensor:
    """After a dense all-reduce the bucket holds the mean; its finiteness decides the step."""
    state.record_finite(torch.isfinite(buffer).all())
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
    p = plan(state, bucket)
    state.record_sync(list(p.names))
    mask = state.current_mask()
    dense_bytes = buffer.numel() * buffer.element_size()
    if mask is None:
        send = buffer.div_(state.world_size)
        state.count(send.numel(), dense_bytes, dense_bytes)
        work = inflight.hold(dist.all_reduce(send, group=state.process_group, async_op=True))
        return work.get_future().then(lambda f: finish_dense(state, f.value()[0]))
    if not state.sparse_started:
        state.start_sparse()
        p = plan(state, bucket)
    send, exchange = compact(state, p, mask, buffer)
    if exchange.plan is not None:  # counted as one all-reduce of the encoded buffer (see scape_core.wire)
        state.count(exchange.plan.entries, exchange.plan.nbytes, dense_bytes)
        return exchange_encoded(state, p, exchange, buffer, send)
    state.count(send.numel(), send.numel() * send.element_size(), dense_bytes)
    work = inflight.hold(dist.all_reduce(send, group=state.process_group, async_op=True))
    fut = work.get_future()  # its callback runs on gloo's thread: exit waits for the work (see inflight)
    return fut.then(lambda f: finish_sparse(state, p, exchange, buffer, f.value()[0]))


def exchange_encoded(state: ScapeState, p: BucketPlan, x: _Exchange, buffer: Tensor,
                     send: Tensor) -> torch.futures.Future[Tensor]:
    """The two stages of an encoded wire (:mod:`scape_core.wire`): all-to-all the segments, the owner
    sums its segment in fp32 and encodes the mean, all-gather the means.

    The second stage needs the first's result, so it is issued here, on the hook's thread, after
    waiting for the first: with NCCL that wait is a stream dependency (the host does not block);
    with gloo it blocks the backward until the all-to-all is done. Issuing it from the first
    stage's callback instead would let ranks order their collectives differently.
    """
    plan, group = x.plan, state.process_group
    received = torch.empty_like(send)
    inflight.hold(dist.all_to_all_single(received, send, group=group, async_op=True)).wait()
    mean = wire.owner_mean(plan, received)  # this rank's segment
    own = wire.encode(plan, mean)
    lo = state.rank * plan.segment  # the owner keeps W times its encoding's rounding: the mean residual holds it
    hi = min(lo + plan.segment, plan.entries)
    if hi > lo:
        x.kept[lo:hi] += mean.sub_(wire.decode(plan, own))[:hi - lo].mul_(plan.world)
    gathered = send.new_empty(send.numel())  # flat: gloo's all-gather wants it so
    work = inflight.hold(dist.all_gather_into_tensor(gathered, own, group=group, async_op=True))
    return work.get_future().then(lambda f: finish_sparse(
        state, p, x, buffer, wire.decode(plan, gathered.view(send.shape)).view(-1)[:plan.entries]))
