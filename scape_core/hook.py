"""scape_hook: the DDP communication hook that exchanges one compact buffer per sparse step."""

# no `from __future__ import annotations`: DDP inspects the hook's real annotations

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core import exchange, inflight
from scape_core.state import ScapeState


def scape_hook(state: ScapeState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: all-reduce only the masked coordinates of ``grad + residual``.

    Versus plain DDP: on a sparse step each bucket joins the step's one exchange, and once the last
    bucket is in, each rank adds its gradients to its residual, gathers the coordinates of the step's
    mask (the same on every rank) into one compact buffer and exchanges that buffer alone (values, no
    indices): one all-reduce per step, or an all-to-all and an all-gather on an encoded ``wire``
    (:mod:`scape_core.exchange`). Every bucket then holds the mean on the mask and zeros elsewhere;
    the unsent rest stays in this rank's residual. One exchange per step in the mask's order keeps
    every value's sum order and rounding independent of DDP's buckets (which DDP rebuilds after each
    process's first iteration), so a run resumes bit-for-bit, and makes its cost a fixed number of
    operators whatever the buckets. Warm-up steps (and ``sparsity=0``) are plain averaging
    all-reduces per bucket. Needs :class:`ScapeAdamS`.

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
        send = buffer.div_(state.comm.world_size)
        state.record.count(send.numel(), dense_bytes, dense_bytes)
        work = inflight.hold(dist.all_reduce(send, group=state.comm.process_group, async_op=True))
        return work.get_future().then(lambda f: exchange.finish_dense(state.record, f.value()[0]))
    if not state.sparse_started:
        state.start_sparse()
    record = state.record
    record.open(mask, state.layout, narrow=state.exchanger.path.narrow)
    part = record.add_region(plan, buffer)
    record.count(0, 0, dense_bytes)
    if bucket.is_last():  # every bucket is in: the step's one exchange
        exchange.run(state.exchanger, record)
    return part.future
