"""scape_hook: the DDP communication hook that all-reduces one compact buffer per bucket."""

# no `from __future__ import annotations`: DDP inspects the hook's real annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core.state import ScapeState


@dataclass
class _Bucket:
    """One bucket's gradients, what each rank adds to them, and what goes on the wire."""

    names: list[str]
    grads: list[Tensor]  # flat views into the bucket buffer
    accumulated: list[Tensor]  # grad + residual (aliases `grads` for fp32 gradients)
    mask: dict[str, Tensor] | None  # None: dense step


def accumulate(state: ScapeState, bucket: dist.GradBucket) -> _Bucket:
    """``a_r = g_r + e_r`` for each parameter of the bucket (in place when the grad is fp32)."""
    names = [state.names[id(p)] for p in bucket.parameters()]
    buffer = bucket.buffer()
    if buffer.is_sparse or not buffer.is_floating_point():
        raise TypeError(f"scape_hook needs dense floating-point gradients; {names} have "
                        f"{'sparse' if buffer.is_sparse else buffer.dtype} gradients (use nn.Embedding(sparse=False))")
    state.record_sync(names)
    grads = [g.view(-1) for g in bucket.gradients()]
    mask = state.current_mask()
    accumulated = []
    for name, g in zip(names, grads):
        e = state.residuals.get(name)
        if e is None:
            accumulated.append(g)
        elif g.dtype == torch.float32:
            accumulated.append(g.add_(e))
        else:  # keep the residual's fp32 precision
            accumulated.append(g.float().add_(e))
    return _Bucket(names, grads, accumulated, mask)


def compact(b: _Bucket, buffer: Tensor) -> Tensor:
    """The one buffer this rank sends: the whole bucket (dense) or ``a_r[M]`` (sparse)."""
    if b.mask is None:
        for g, a in zip(b.grads, b.accumulated):
            if a is not g:
                g.copy_(a)
        send = buffer
    else:
        parts = [a.index_select(0, b.mask[n]) for n, a in zip(b.names, b.accumulated)]
        send = torch.cat(parts).to(buffer.dtype) if parts else buffer.new_zeros(0)
    if not all(bool(torch.isfinite(a).all()) for a in b.accumulated):
        send.fill_(float("nan"))  # every rank then sees a non-finite sum and skips the step
    return send


def finish(state: ScapeState, b: _Bucket, buffer: Tensor, reduced: Tensor) -> Tensor:
    """Keep what was not sent in the residuals and write the mean gradient into the bucket."""
    if not bool(torch.isfinite(reduced).all()):
        state.record_nonfinite()  # residuals untouched: this bucket's gradient is dropped
        if b.mask is not None:
            buffer.fill_(float("nan"))
        return buffer
    if b.mask is None:  # dense: everything went out, the bucket already holds the mean
        for name in b.names:
            if name in state.residuals:
                state.residuals[name].zero_()
        return buffer
    offset = 0
    for name, g, a in zip(b.names, b.grads, b.accumulated):
        idx = b.mask[name]
        values = reduced[offset:offset + idx.numel()]
        offset += idx.numel()
        if state.config.error_feedback:
            e = state.residual(name)
            sent = a.index_select(0, idx)
            e.copy_(a)
            e.index_copy_(0, idx, sent.float() - sent.to(reduced.dtype).float())  # 0 for fp32
        g.zero_()
        g.index_copy_(0, idx, values.to(g.dtype))
        state.record_sent(name, idx, values)
    return buffer


def scape_hook(state: ScapeState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: all-reduce only the masked coordinates of ``grad + residual``.

    Versus plain DDP: on a sparse step each rank adds its residual to its gradient, gathers
    the coordinates of the step's mask (common to every rank) into one compact buffer, and
    all-reduces that buffer alone (values, no indices). The bucket comes back holding the mean
    on the mask and zeros elsewhere; the unsent rest stays in this rank's residual. Warm-up
    steps (and ``sparsity=0``) are plain averaging all-reduces. Needs :class:`ScapeAdamS`.

    Example::

        state = ScapeState(ddp, sparsity=0.99)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, lr=3e-4)
    """
    buffer = bucket.buffer()
    b = accumulate(state, bucket)
    send = compact(b, buffer).div_(state.world_size)
    state.count(send.numel(), send.numel() * send.element_size(), buffer.numel() * buffer.element_size())
    fut = dist.all_reduce(send, group=state.process_group, async_op=True).get_future()
    return fut.then(lambda f: finish(state, b, buffer, f.value()[0]))
