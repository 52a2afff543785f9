"""scape_hook: the DDP communication hook that all-reduces one compact buffer per bucket."""

# no `from __future__ import annotations`: DDP inspects the hook's real annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core import inflight
from scape_core.state import ScapeState


@dataclass
class _Bucket:
    """One bucket's gradients, what each rank adds to them, and what goes on the wire."""

    names: list[str]
    grads: list[Tensor]  # flat views into the bucket buffer: this rank's gradients until `finish`
    accumulated: list[Tensor]  # a_r = g_r + e_r: the residual itself, updated in place (or g_r)
    mask: dict[str, Tensor] | None  # None: dense step
    finite: bool  # this rank's gradients are finite
    picked: list[Tensor] | None = None  # a_r[M] in fp32, to restore the residual if the step is skipped


def accumulate(state: ScapeState, bucket: dist.GradBucket) -> _Bucket:
    """``a_r = g_r + e_r`` for each parameter: in the residual (sparse) or in the bucket (dense)."""
    names = [state.names[id(p)] for p in bucket.parameters()]
    buffer = bucket.buffer()
    if buffer.is_sparse or not buffer.is_floating_point():
        raise TypeError(f"scape_hook needs dense floating-point gradients; {names} have "
                        f"{'sparse' if buffer.is_sparse else buffer.dtype} gradients (use nn.Embedding(sparse=False))")
    state.record_sync(names)
    grads = [g.view(-1) for g in bucket.gradients()]
    mask = state.current_mask()
    finite = True  # dense steps need no local check: a non-finite input makes the reduced sum non-finite
    if mask is not None:
        lo, hi = torch.aminmax(buffer)  # NaN propagates, +-inf stays; unlike a sum, no fp16 overflow
        finite = bool(torch.isfinite(lo) & torch.isfinite(hi))
    accumulated = []
    for name, g in zip(names, grads):
        if mask is None:  # dense: the whole bucket goes out, a_r is built in the bucket
            e = state.residuals.get(name)
            accumulated.append(g if e is None else g.add_(e))
        elif state.config.error_feedback and finite:  # the residual becomes a_r (never touched if non-finite)
            accumulated.append(state.residual(name).add_(g))
        else:
            accumulated.append(g)
    return _Bucket(names, grads, accumulated, mask, finite)


def compact(state: ScapeState, b: _Bucket, buffer: Tensor) -> Tensor:
    """The one buffer this rank sends: the whole bucket (dense) or ``a_r[M]`` (sparse).

    On a sparse step the residual keeps what is not sent: ``e_r = a_r`` with ``M`` zeroed
    (for a low-precision wire, ``M`` keeps the rounding of what was sent).
    """
    if b.mask is None:
        return buffer
    b.picked = [a.index_select(0, b.mask[n]).float() for n, a in zip(b.names, b.accumulated)]
    send = torch.cat(b.picked).to(buffer.dtype) if b.picked else buffer.new_zeros(0)
    if not b.finite:
        return send.fill_(float("nan"))  # every rank then sees a non-finite sum and skips the step
    if state.config.error_feedback:
        offset = 0
        for name, e, picked in zip(b.names, b.accumulated, b.picked):
            idx = b.mask[name]
            e.index_copy_(0, idx, picked - send[offset:offset + idx.numel()].float())  # 0 for fp32
            offset += idx.numel()
    return send


def finish(state: ScapeState, b: _Bucket, buffer: Tensor, reduced: Tensor) -> Tensor:
    """Write the mean gradient into the bucket; on a non-finite result, undo the residual update."""
    if not bool(torch.isfinite(reduced).all()):
        state.record_nonfinite()  # this bucket's gradient is dropped on every rank
        if b.mask is not None:
            if state.config.error_feedback and b.finite:  # e_r = a_r - g_r: back as before (up to rounding)
                for name, e, g, picked in zip(b.names, b.accumulated, b.grads, b.picked):
                    e.index_copy_(0, b.mask[name], picked).sub_(g)
            buffer.fill_(float("nan"))
        return buffer
    if b.mask is None:  # dense: everything went out, the bucket already holds the mean
        for name in b.names:
            if name in state.residuals:
                state.residuals[name].zero_()
        return buffer
    offset = 0
    for name, g in zip(b.names, b.grads):
        idx = b.mask[name]
        values = reduced[offset:offset + idx.numel()]
        offset += idx.numel()
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
    send = compact(state, b, buffer).div_(state.world_size)
    state.count(send.numel(), send.numel() * send.element_size(), buffer.numel() * buffer.element_size())
    work = inflight.hold(dist.all_reduce(send, group=state.process_group, async_op=True))
    fut = work.get_future()  # its callback runs on gloo's thread: exit waits for the work (see inflight)
    return fut.then(lambda f: finish(state, b, buffer, f.value()[0]))
