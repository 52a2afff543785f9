"""Accelerate 1.15 with SCAPE's FSDP2 path, 4 gloo processes on CPU as 2 replicas x 2 shards.

What works: the model and optimizer from ``scape_fsdp`` stay outside ``accelerator.prepare`` (Accelerate
prepares the data loaders, runs ``backward``, logs); the run is bit-identical to the same loop by hand.
What does not, measured: on CPU Accelerate ignores ``FullyShardedDataParallelPlugin(fsdp_version=2)``
(``distributed_type`` stays ``MULTI_CPU``) and ``prepare(model, optimizer)`` wraps the FSDP2 model in
DDP, whose first broadcast fails on DTensor parameters. (On GPUs its FSDP2 path returns an
``FSDPModule`` unchanged; its own HSDP, ``ParallelismConfig(dp_replicate_size=...)``, shards on the 2-D
mesh, where FSDP2 all-reduces across replicas itself before any all-reduce hook runs.)"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from scape_core.fsdp import scape_fsdp
from tests.dist import failure, run_distributed
from tests.test_fsdp import LR, SCHEDULE, WD, _local, _mesh
from tests.test_resume import TinyTransformer

TOKENS = torch.randint(0, 64, (4 * 4 * 10, 12), generator=torch.Generator().manual_seed(0))


def _scape(mesh):
    net = TinyTransformer()
    return scape_fsdp(net, mesh, sparsity=0.99, lr=LR, weight_decay=WD, shard_modules=net.body.layers, **SCHEDULE)


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _accelerate(rank: int, world: int) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    mesh = _mesh()
    model, opt = _scape(mesh)
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(TOKENS, batch_size=4))  # each rank its quarter of every batch of 16
    seen = []
    for tokens in loader:
        seen.append(tokens.clone())
        accelerator.backward(_loss(model, tokens))
        opt.step()
        opt.zero_grad()
    ref, ref_opt = _scape(mesh)
    for tokens in seen:
        _loss(ref, tokens).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    plugin = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), cpu=True)
    other, other_opt = _scape(mesh)
    return dict(steps=opt.scape.stats()["steps"], compression=opt.scape.stats()["compression"],
                equal=torch.equal(_local(model), _local(ref)), distinct=len({t[0, 0].item() for t in seen}),
                plugin_type=str(plugin.distributed_type), prepared=failure(lambda: plugin.prepare(other, other_opt)))


@pytest.mark.slow  # 30 s; the FSDP2 core and Lightning paths stay in the default suite
def test_accelerate_runs_the_loop_around_scape_fsdp_and_its_fsdp2_plugin_does_not_apply_on_cpu():
    for out in run_distributed(_accelerate, world_size=4):
        assert out["steps"] == 10 and out["compression"] > 2 and out["equal"], out
        assert out["plugin_type"] == "DistributedType.MULTI_CPU", out["plugin_type"]
        assert "broadcast" in out["prepared"] and "sharding strategy" in out["prepared"], out["prepared"]
