"""scape_hook: the DDP communication hook that exchanges one compact buffer per sparse step."""

# no `from __future__ import annotations`: DDP inspects the hook's real annotations

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core import exchange, inflight
from scape_core.state import ScapeState


def scape_hook(state: ScapeState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: all-reduce only the masked coordinates of ``grad + residual``.

    Versus plain DDP: on a sparse step each rank adds its gradient to its residual, gathers the
    coordinates of the step's mask (the same on every rank) into one compact buffer, bucket by
    bucket, and exchanges that buffer alone (values, no indices) once the last bucket is in: one
    all-reduce per step, or an all-to-all and an all-gather on an encoded ``wire``
    (:func:`scape_core.exchange.exchange_encoded`). Every bucket then holds the mean on the mask and zeros
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
    mask = state.current_mask()
    dense_bytes = buffer.numel() * buffer.element_size()
    if mask is None:
        send = buffer.div_(state.world_size)
        state.count(send.numel(), dense_bytes, dense_bytes)
        work = inflight.hold(dist.all_reduce(send, group=state.process_group, async_op=True))
        return work.get_future().then(lambda f: exchange.finish_dense(state.record, f.value()[0]))
    if not state.sparse_started:
        state.start_sparse()
    record, path = state.record, state.exchange_path
    record.open(mask, state.layout, staged=path.staged, narrow=path.narrow)
    part = path.stage(state, record, plan, buffer, record.spans(plan.names), bucket.is_last())
    state.count(0, 0, dense_bytes)
    if bucket.is_last():  # the step's compact buffer is complete: exchange it
        exchange.send(state, record)
    return part.future
