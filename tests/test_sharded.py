"""Sharded SCAPE (``shard_optimizer=True``): each rank keeps m, sq and the windows of its block of rows.

Against the replicated mode on the same model and batches: the same masks and bit-identical
parameters at every step (2 and 4 gloo ranks, the defaults: warm-up, ramp, target density),
the state each rank allocates, the bytes each step hands to collectives, checkpoints that
resume exactly at the same world size and keep the global state at another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scape_core import ScapeAdamS, ScapeState, scape_hook
from tests.dist import run_distributed


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def setup(sharded: bool, seed: int = 0, ddp_kwargs: dict | None = None, **config):
    model = make_model(seed)
    ddp = DDP(model, **(ddp_kwargs or {}))
    state = ScapeState(ddp, shard_optimizer=sharded, **config)
    ddp.register_comm_hook(state, scape_hook)
    opt = ScapeAdamS(ddp.parameters(), state, lr=1e-2, weight_decay=0.1)
    return model, ddp, state, opt


def train(ddp, opt, rank, steps, start=0, record=None):
    state = opt.scape
    for t in range(start, start + steps):
        x, y = batch(t, rank)
        (ddp(x) - y).pow(2).mean().backward()
        if record is not None:
            mask = None if state.is_dense(t) else state.masks[t].cols.clone()
            record.append(mask)
        opt.step()
        opt.zero_grad()
        if record is not None:
            record[-1] = (record[-1], [p.detach().clone() for p in ddp.module.parameters()])


# ----------------------------------------------------------------------------------------
def _both_modes(rank, world, steps, cases):
    out = {}
    for case, (config, ddp_kwargs) in cases.items():
        for sharded in (False, True):
            model, ddp, state, opt = setup(sharded, ddp_kwargs=ddp_kwargs, **config)
            if sharded:  # really sharded: this rank's block of rows, not every row
                assert opt.momentum_buffer.shape[0] == state.shard.rows < state.layout.rows
            record = []
            train(ddp, opt, rank, steps, record=record)
            out[case, sharded] = record
    return out


def _check_identical(results, case, steps):
    sparse = 0
    for t in range(steps):
        (mask0, params0) = results[0][case, False][t]
        for rank, res in enumerate(results):
            for sharded in (False, True):
                mask, params = res[case, sharded][t]
                where = f"{case}: step {t} rank {rank} sharded={sharded}"
                assert (mask is None) == (mask0 is None), where
                if mask is not None:
                    assert torch.equal(mask, mask0), f"{where}: mask differs"
                assert all(torch.equal(a, b) for a, b in zip(params, params0)), f"{where}: parameters differ"
        sparse += mask0 is not None
    return sparse


STEPS = 120  # the defaults: 50 dense steps, the ramp's 25% stage for 50 (90%: the only stage denser), then 10%


def test_sharded_is_bit_identical_to_replicated_at_2_ranks_with_the_defaults():
    results = run_distributed(_both_modes, STEPS, {"defaults": ({}, {"bucket_cap_mb": 0.01})}, world_size=2)
    assert _check_identical(results, "defaults", STEPS) == 70


def test_sharded_is_bit_identical_to_replicated_at_4_ranks():
    cases = {
        "defaults": ({}, {}),
        # 89 rows of 64: blocks cut parameters in two; 99%: 25%, 6.25%, 1.5625% for 20 steps each, then 1%
        "99%, chunk 64": (dict(sparsity=0.99, warmup_steps=20, ramp_steps=60, chunk_size=64), {"bucket_cap_mb": 0.01}),
    }
    results = run_distributed(_both_modes, STEPS, cases, world_size=4)
    assert _check_identical(results, "defaults", STEPS) == 70
    assert _check_identical(results, "99%, chunk 64", STEPS) == 100
