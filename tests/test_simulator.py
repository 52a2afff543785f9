"""The one-process simulator (benchmarks/simulator.py) against the real 2-process SCAPE hook."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.simulator import SimulatedScape, SimulatedTopK, rank_gradients
from scape_core import ScapeAdamS, ScapeConfig, ScapeState, scape_hook
from tests.dist import run_distributed
from tests.models import batch, loss_fn, make_model

STEPS = 20
LR, WD = 1e-2, 0.1
CONFIGS = {  # ramp_steps=0 runs at the named sparsity; "ramp" tests the ramp (6-step stages)
    "default": dict(sparsity=0.9, warmup_steps=3, ramp_steps=0),
    "ramp": dict(sparsity=0.99, warmup_steps=3, ramp_steps=18, wire="native"),
    "delay0_momentum_refresh2": dict(sparsity=0.9, warmup_steps=3, mask_delay=0, score="momentum", mask_refresh=2,
                                     ramp_steps=0),
    "no_warmup": dict(sparsity=0.9, warmup_steps=0, ramp_steps=0),
    "linear": dict(sparsity=0.99, warmup_steps=3, update="linear", ramp_steps=0, wire="native"),
    "catchup": dict(sparsity=0.9, warmup_steps=3, update="catchup", ramp_steps=0),
    # encoded wires: every bucket's two-stage exchange, its rounding kept, its bytes (blocks of 16: several)
    "bfloat16": dict(sparsity=0.9, warmup_steps=3, ramp_steps=0, wire="bfloat16"),
    "int8": dict(sparsity=0.8, warmup_steps=3, ramp_steps=0, wire="int8", wire_block=16),
    "int4_ramp": dict(sparsity=0.99, warmup_steps=3, ramp_steps=18, wire="int4", wire_block=16),
    "auto99": dict(sparsity=0.99, warmup_steps=3, ramp_steps=0),  # the default wire: int4 from 97% up
    # lazy's score reads each rank's residual, so rank r selects its partition of the rows: 11 rows of
    # 1024 on 2 ranks (6 + 5) pin the core's ceil blocks, where rows * r // W would give 5 + 6
    "lazy_odd_rows": dict(sparsity=0.9, warmup_steps=3, update="lazy", ramp_steps=0, chunk_size=1024),
}


def _real(rank: int, world: int) -> dict:
    out = {}
    for name, cfg in CONFIGS.items():
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets, as a real model would have
        state = ScapeState(ddp, config=ScapeConfig(**cfg))
        buckets = {}

        def hook(state, bucket, buckets=buckets):  # the buckets of the last step, as the simulator takes them
            buckets[bucket.index()] = tuple(state.names[id(p)] for p in bucket.parameters())
            return scape_hook(state, bucket)

        ddp.register_comm_hook(state, hook)
        opt = ScapeAdamS(ddp.parameters(), state, lr=LR, weight_decay=WD)
        for step in range(STEPS):
            loss_fn(ddp, *batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
        out[name] = ([p.detach().clone() for p in model.parameters()], state.stats(), list(buckets.values()))
    return out


def _simulated(cfg: dict, world: int = 2) -> tuple[list[torch.Tensor], dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (tests/dist.py): the same matmul sums, so the same last bits
    try:
        model = make_model()
        sim = SimulatedScape(model, world, ScapeConfig(**cfg), lr=LR, weight_decay=WD)
        for step in range(STEPS):
            grads, _ = rank_gradients(model, loss_fn, [batch(step, r) for r in range(world)])
            sim.step(grads)
    finally:
        torch.set_num_threads(threads)
    return [p.detach().clone() for p in model.parameters()], sim.counters.as_dict()


@pytest.fixture(scope="module")
def real():
    return run_distributed(_real)


def test_lazy_odd_rows_partitions_unevenly():
    layout = SimulatedScape(make_model(), 2, ScapeConfig(**CONFIGS["lazy_odd_rows"])).layout
    assert layout.rows == 11 and ScapeConfig(**CONFIGS["lazy_odd_rows"]).resolved_score == "momentum_residual"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_simulator_matches_real_hook(real, name):
    params, stats = _simulated(CONFIGS[name])  # one exchange per step: the same whatever the real run's buckets
    assert len(real[0][name][2]) > 1  # several buckets
    for rank in (0, 1):
        ref, ref_stats, _ = real[rank][name]
        diff = max((p - q).abs().max().item() for p, q in zip(params, ref))
        # last-bit float differences (the rules see 1 ulp, about 1e-7 here) grow a little through
        # catchup's replay; a wrong mask, window or formula moves parameters by 1e-3 or more. An
        # encoded wire's rounding would turn a last-bit difference into a different value sent: with
        # one thread on both sides there is none, and the wires must match exactly
        bound = 0.0 if ScapeConfig(**CONFIGS[name]).resolved_wire != "native" else 2e-6
        assert diff <= bound, f"{name}: simulator and rank {rank} differ by {diff}"
        for key in ("steps", "values_sent", "bytes_sent", "mask_bytes", "dense_bytes"):
            assert stats[key] == ref_stats[key], (name, key, stats[key], ref_stats[key])
    start = [p.detach() for p in make_model().parameters()]
    assert max((p - q).abs().max().item() for p, q in zip(params, start)) > 1e-3  # it trained


def test_topk_sends_union_and_conserves_gradient_mass():
    model = make_model()
    n = sum(p.numel() for p in model.parameters())
    topk = SimulatedTopK(model, world_size=4, density=0.05, warmup_steps=0, lr=0.0)
    total = {name: torch.zeros(p.numel()) for name, p in model.named_parameters()}
    applied = {name: torch.zeros(p.numel()) for name, p in model.named_parameters()}
    for step in range(5):  # lr=0: the gradients are the same function of the same parameters
        grads, _ = rank_gradients(model, loss_fn, [batch(step, r) for r in range(4)])
        topk.step(grads)
        for name, g in grads.items():
            total[name] += g.mean(0)
            applied[name] += topk.last_synced[name]
    for name in total:  # all-reduced plus the mean residual is every mean gradient: nothing lost
        torch.testing.assert_close(applied[name] + topk.residuals[name].mean(0), total[name])
    assert 0.05 <= min(topk.union_fraction) and max(topk.union_fraction) <= 4 * 0.06
    c = topk.counters
    assert c.bytes_sent == c.values_sent * 4 + c.mask_bytes
    assert c.mask_bytes == 5 * 4 * sum(-(-p.numel() * 5 // 100) for p in model.parameters())
    assert c.dense_bytes == 5 * 4 * n
