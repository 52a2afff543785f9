"""The hook under contention: gloo with 8 worker threads, one DDP bucket per layer (12),
every completion callback and every sparse finish slowed (a sleep that lets other threads run) so
that they interleave with the backward, many steps with skips, repeated.

What runs where (``scape_core/exchange.py``): a dense bucket's callback appends its verdict to
``record.finite`` (several run at once, on gloo's threads or inline on the hook's); a sparse step has
no callback: its one exchange is staged, sent and finished on the hook's thread when the last bucket
is in, and completes DDP's futures after it wrote every bucket."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scape_core import ScapeAdamS, ScapeState, exchange, scape_hook
from tests.dist import run_distributed
from tests.test_core_ddp import conservation_error

NAN_AT = (2, 9, 13)  # rank 1's gradients are non-finite: a dense step and two sparse ones


def slowed(finish):
    def run(*args, **kwargs):
        time.sleep(0.0005)  # releases the GIL: the other callbacks and the backward run meanwhile
        return finish(*args, **kwargs)
    return run


def _stress(rank, world, repeats, steps):
    options = dist.ProcessGroupGloo._Options()
    options._threads = 8
    group = dist.new_group(backend="gloo", pg_options=options)
    exchange.finish_dense, exchange.finish = slowed(exchange.finish_dense), slowed(exchange.finish)
    out = []
    for repeat in range(repeats):
        torch.manual_seed(repeat)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])
        # 26 floats a bucket: a weight each (a bias joins the next)
        ddp = DDP(model, process_group=group, bucket_cap_mb=1e-4)
        state = ScapeState(ddp, sparsity=0.75, warmup_steps=4, ramp_steps=0, chunk_size=16)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, lr=1e-2)
        params = list(model.parameters())
        applied = [torch.zeros_like(p) for p in params]
        mean_grads = [torch.zeros_like(p) for p in params]
        verdicts, lost = [], 0
        for t in range(steps):
            g = torch.Generator().manual_seed(100 * t + rank)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
            scale = float("nan") if rank == 1 and t in NAN_AT else 1.0
            local = torch.autograd.grad((model(x) - y).pow(2).mean() * scale, params)
            ((ddp(x) - y).pow(2).mean() * scale).backward()
            record = state.record
            sparse = record.values is not None
            # a dense step: one verdict per bucket (the step's calls); a sparse one: the exchange's
            verdicts.append(len(record.finite) == (1 if sparse else record.counts["hook_calls"]))
            if sparse and t not in NAN_AT:  # every bucket holds the step's means at its entries
                grads = state.layout.zeros()
                for name, p in state.params.items():
                    state.layout.view(grads, name).copy_(p.grad.view(-1))
                lost += not torch.equal(torch.take(grads, record.entries), record.values)
            if t not in NAN_AT:
                for s, a, p, lg in zip(mean_grads, applied, params, local):
                    lg = lg.clone()
                    dist.all_reduce(lg, group=group)
                    s.add_(lg / world)
                    a.add_(p.grad)
            opt.step()
            opt.zero_grad()
        flat = torch.cat([p.detach().view(-1) for p in params])
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat, group=group)
        out.append(dict(buckets=len(state.buckets.plans), verdicts=all(verdicts), lost=lost,
                        skipped=state.skipped_steps, error=conservation_error(state, applied, mean_grads),
                        replicas=all(torch.equal(every[0], e) for e in every)))
    return out


def test_callbacks_finishing_together_lose_nothing():
    for results in run_distributed(_stress, 3, 16):
        for r in results:
            assert r["buckets"] == 12 and r["verdicts"] and r["lost"] == 0, r
            assert r["skipped"] == len(NAN_AT) and r["replicas"] and r["error"] < 1e-5, r
