"""The private names of torch's FSDP2 and of Lightning that SCAPE reads (no public one exists): each
is pinned here, so an upgrade that moves one fails this test by name instead of a training run."""

from __future__ import annotations

import math

import torch
from torch import nn

from tests.dist import run_distributed


def _fsdp2_internals(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    fully_shard(model, mesh=mesh)
    groups = model._get_fsdp_state()._fsdp_param_groups  # what scape_core.fsdp._param_groups reads
    group = groups[0]
    params = group.fsdp_params
    return dict(groups=len(groups), mesh_dims=group.mesh_info.mesh.ndim,
                replicate_dim=getattr(group.mesh_info, "replicate_mesh_dim", None),
                shard_group=group.mesh_info.shard_process_group is not None,
                placements=[p.fsdp_placement == Shard(0) for p in params],
                sizes=[(p.sharded_param._local_tensor.numel(), math.prod(p.padded_sharded_param_size)) for p in params],
                trainable=[p.sharded_param.requires_grad for p in params])


def test_fsdp2_parameter_groups_are_where_scape_reads_them():
    out = run_distributed(_fsdp2_internals, world_size=1)[0]
    assert out["groups"] == 1 and out["mesh_dims"] == 1 and out["replicate_dim"] is None and out["shard_group"]
    assert out["placements"] == [True] * 4 and out["trainable"] == [True] * 4
    assert [n for n, _ in out["sizes"]] == [15, 5, 10, 2] and all(p >= n for n, p in out["sizes"]), out["sizes"]


def test_lightning_private_names_exist(tmp_path):
    from lightning.fabric.utilities.types import _Stateful

    from lightning_scape.fsdp import PRIVATE_LIGHTNING

    is_sharded, metadata_name, stateful = PRIVATE_LIGHTNING
    assert isinstance(metadata_name, str) and metadata_name
    assert not is_sharded(tmp_path / "missing")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / metadata_name).write_bytes(b"")
    assert is_sharded(tmp_path / "ckpt")  # a folder holding Lightning's metadata file is a sharded checkpoint
    assert stateful is _Stateful and isinstance(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), stateful)
