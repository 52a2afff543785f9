"""lightning_scape's FSDP2 strategy (strategy="scape_fsdp"): 4 gloo processes on CPU as 2 nodes x 2 devices
(tests/dist.py initializes the process group; each rank gets its node's LOCAL_RANK and NODE_RANK, so Lightning
finds its ranks launched). The LightningModule shards in configure_model on device_mesh["shard"]; the Trainer
matches scape_fsdp's own loop bit-for-bit, resumes bit-for-bit, and accumulates with one sync per step."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import lightning_scape
from lightning_scape import ScapeFabricModelParallelStrategy, ScapeModelParallelStrategy
from scape_core.fsdp import scape_fsdp
from tests.dist import failure, run_distributed, said
from tests.test_fsdp import _local, _same_across
from tests.test_resume import TinyTransformer

LR, WD = 3e-3, 0.1
SCHEDULE = dict(warmup_steps=4, ramp_steps=3)  # sparse from step 4
STEPS, EPOCH = 12, 6  # optimizer steps; an epoch is 6 batches of 4 sequences per rank
TOKENS = torch.randint(0, 64, (4 * 4 * EPOCH, 12), generator=torch.Generator().manual_seed(0))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


class Sharded(L.LightningModule):
    """TinyTransformer, sharded in configure_model: each block, then the whole, on the shard dimension."""

    def __init__(self, mesh_dims: str = "shard", by_step: bool = False) -> None:
        super().__init__()
        self.model = TinyTransformer()
        self.mesh_dims, self.by_step = mesh_dims, by_step
        self.batches: list[torch.Tensor] = []  # what this rank trained on, in order

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh if self.mesh_dims == "both" else self.device_mesh[self.mesh_dims]
        for layer in self.model.body.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        if self.by_step:  # the step's batch, whichever the loader gave
            batch = TOKENS[torch.arange(4) * 4 + self.global_rank + 16 * (self.global_step % EPOCH)]
        self.batches.append(batch.clone())
        return _loss(self.model, batch)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _trainer(tmp: str, strategy=None, **kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=2, num_nodes=2, max_steps=STEPS, max_epochs=-1, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                    num_sanity_val_steps=0, default_root_dir=tmp)
    strategy = strategy or ScapeModelParallelStrategy(sparsity=0.99, **SCHEDULE)
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


def _loader() -> DataLoader:
    return DataLoader(TOKENS, batch_size=4)  # Lightning puts a DistributedSampler over the 4 ranks in front


def _distinct(batches: list[torch.Tensor]) -> bool:
    """Each rank trained on its own sequences in every epoch (the sampler spans the 4 ranks)."""
    mine = torch.cat(batches[:EPOCH])
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.cat(every).unique(dim=0).shape[0] == TOKENS.unique(dim=0).shape[0] == len(TOKENS)


def _final(t: L.Trainer, module: Sharded) -> dict:
    opt, state = t.optimizers[0], t.strategy.scape_state
    return dict(param=_local(module.model).clone(), m=opt.momentum_buffer.clone(),
                residual=state.buffers.residual.clone(), windows=state.buffers.windows.clone(),
                lr=opt.param_groups[0]["lr"], step=state.step)


# ----------------------------------------------------------------------------------------
def _train_part(rank, tmp):
    module = Sharded()
    t = _trainer(tmp)
    with said() as heard:
        t.fit(module, _loader())
    opt, state = t.optimizers[0], t.strategy.scape_state
    replicate = t.strategy.device_mesh.get_group("replicate")
    out = dict(optimizer=type(opt).__name__, scheduler_bound=t.lr_scheduler_configs[0].scheduler.optimizer is opt,
               stats=state.stats(), groups=len(state.groups), global_step=t.global_step,
               identical=_same_across(_local(module.model), replicate) and _same_across(opt.momentum_buffer, replicate),
               final=_final(t, module), logged=sorted(k for k in t.callback_metrics if k.startswith("scape/")),
               lines=heard.lines)
    # the same run by hand with scape_fsdp, on the batches Lightning's (shuffling) sampler gave this rank
    mesh = t.strategy.device_mesh
    net = TinyTransformer()
    net, own = scape_fsdp(net, mesh, sparsity=0.99, lr=LR, weight_decay=WD, shard_modules=net.body.layers, **SCHEDULE)
    scheduler = torch.optim.lr_scheduler.StepLR(own, step_size=5, gamma=0.5)
    out["distinct"], out["batches"] = _distinct(module.batches), module.batches
    for tokens in module.batches:
        _loss(net, tokens).backward()
        own.step()
        own.zero_grad()
        scheduler.step()
    out["by_hand"] = dict(param=_local(net).clone(), m=own.momentum_buffer.clone(),
                          residual=own.scape.buffers.residual.clone(), windows=own.scape.buffers.windows.clone(),
                          lr=own.param_groups[0]["lr"], step=own.scape.step)
    return out


def test_the_trainer_trains_as_scape_fsdp_by_hand_and_replicas_stay_identical(ranks):
    for rank, r in enumerate(part(ranks, "train")):
        assert [line.endswith("; 12 steps in this run") for line in r["lines"][:1]] == ([True] if rank == 0 else [])
        # the end of fit: one line on whether SCAPE paid (4 warm-up steps are too few to time)
        assert [line.startswith("SCAPE: sparse steps ") for line in r["lines"][1:]] == ([True] if rank == 0 else [])
        assert r["optimizer"] == "ScapeFSDPAdamS" and r["scheduler_bound"]
        assert r["global_step"] == r["stats"]["steps"] == STEPS
        assert r["stats"]["hook_calls"] == STEPS * r["groups"]
        assert r["stats"]["compression"] > 2 and r["stats"]["skipped_steps"] == 0
        assert r["identical"] and r["distinct"]
        assert {"scape/bytes_sent", "scape/compression", "scape/step_compression"} <= set(r["logged"])
        got, want = r["final"], r["by_hand"]
        assert got["lr"] == want["lr"] == LR * 0.25 and got["step"] == want["step"] == STEPS
        for key in ("param", "m", "residual", "windows"):
            assert torch.equal(got[key], want[key]), key


# ----------------------------------------------------------------------------------------
def _resume_part(rank, tmp):
    """Saved by ModelCheckpoint at the first epoch's end, in the sparse steps (the masks of steps 6 and 7
    chosen). Each step's batch is chosen by the step: resumed there, Lightning's loops (2.6.6, this strategy)
    trained the next epoch's first batch, then started another epoch (set_epoch(2)), measured on the
    batches; that is about the loops' data, not SCAPE's state."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    finals = {}
    for name in ("whole", "half", "resumed"):
        module = Sharded(by_step=True)
        ckpt = ModelCheckpoint(dirpath=tmp, filename="epoch1")
        if name == "half":
            t = _trainer(tmp, max_steps=-1, max_epochs=1, enable_checkpointing=True, callbacks=[ckpt])
        else:
            t = _trainer(tmp)
        t.fit(module, _loader(), ckpt_path=str(Path(tmp) / "epoch1.ckpt") if name == "resumed" else None)
        finals[name] = dict(_final(t, module), global_step=t.global_step, batches=module.batches)
    path = Path(tmp) / "epoch1.ckpt"
    saved = sorted(p.name for p in path.iterdir()) if path.is_dir() else "not a folder"
    return dict(saved=saved, **finals)


def test_a_trainer_checkpoint_resumes_bit_for_bit(ranks):
    for r in part(ranks, "resume"):
        got, want = r["resumed"], r["whole"]
        assert {"meta.pt", ".metadata", "__3_0.distcp"} <= set(r["saved"]), r["saved"]  # DCP, 4 ranks
        assert r["half"]["global_step"] == r["half"]["step"] == EPOCH
        assert got["global_step"] == STEPS and got["step"] == want["step"] == STEPS and got["lr"] == want["lr"]
        assert all(torch.equal(a, b) for a, b in zip(got["batches"], want["batches"][EPOCH:], strict=True))
        differ = {key: int((got[key] != want[key]).sum()) for key in ("param", "m", "residual", "windows")}
        assert differ == {"param": 0, "m": 0, "residual": 0, "windows": 0}, differ


# ----------------------------------------------------------------------------------------
def _accumulate_part(rank, tmp):
    module = Sharded()
    t = _trainer(tmp, max_steps=6, accumulate_grad_batches=2)
    t.fit(module, _loader())
    state = t.strategy.scape_state
    replicate = t.strategy.device_mesh.get_group("replicate")
    return dict(stats=state.stats(), groups=len(state.groups), identical=_same_across(_local(module.model), replicate))


def test_gradient_accumulation_syncs_once_per_optimizer_step(ranks):
    for r in part(ranks, "accumulate"):
        assert r["stats"]["steps"] == 6 and r["stats"]["hook_calls"] == 6 * r["groups"], r["stats"]
        assert r["identical"]


# ----------------------------------------------------------------------------------------
def _misuse_part(rank, tmp):
    return dict(hsdp=failure(lambda: _trainer(tmp, max_steps=1).fit(Sharded("both"), _loader())))


def test_sharding_on_the_whole_mesh_is_refused_naming_the_shard_dimension(ranks):
    for r in part(ranks, "misuse"):
        assert "HSDP" in r["hsdp"] and "mesh['shard']" in r["hsdp"], r["hsdp"]


def test_registration_and_arguments():
    assert isinstance(L.Trainer(strategy="scape_fsdp", accelerator="cpu", devices=1).strategy,
                      ScapeModelParallelStrategy)
    s = ScapeModelParallelStrategy(sparsity=0.9, warmup_steps=7, replicate_size=2, shard_size=4)
    assert (s.scape_config.sparsity, s.scape_config.warmup_steps) == (0.9, 7)
    assert (s._data_parallel_size, s._tensor_parallel_size) == (2, 4)
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        ScapeModelParallelStrategy(save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match="shard_optimizer"):
        ScapeModelParallelStrategy(shard_optimizer=True)
    with pytest.raises(TypeError, match="unknown argument"):
        ScapeModelParallelStrategy(data_parallel_size=2)
    assert lightning_scape.ScapeModelParallelStrategy is ScapeModelParallelStrategy


# ----------------------------------------------------------------------------------------
def _shard(model: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    for layer in model.body.layers:
        fully_shard(layer, mesh=mesh["shard"])
    return fully_shard(model, mesh=mesh["shard"])


def _fabric_part(rank, tmp):
    """Fabric: 12 steps by hand-picked batches, saved at 6 and resumed; against scape_fsdp by hand."""
    def batch(step):
        return TOKENS[torch.arange(4) * 4 + rank + 16 * (step % EPOCH)]

    def run(start, stop, save=None, load=None):
        fabric = L.Fabric(accelerator="cpu", devices=2, num_nodes=2,
                          strategy=ScapeFabricModelParallelStrategy(_shard, sparsity=0.99, max_steps=STEPS,
                                                                    **SCHEDULE))
        fabric.launch()
        with said() as heard:
            model = fabric.setup_module(TinyTransformer())
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD,
                                                        betas=(0.9, 0.95)))
        state = {"model": model, "optimizer": opt, "step": 0}
        if load:
            fabric.load(load, state)
        for step in range(start, stop):
            with fabric.no_backward_sync(model, enabled=False):
                fabric.backward(_loss(model, batch(step)))
            opt.step()
            opt.zero_grad()
            if save and step + 1 == EPOCH:
                fabric.save(save, {**state, "step": step + 1})
        s = fabric.strategy.scape_state
        return dict(param=_local(model).clone(), residual=s.buffers.residual.clone(), step=s.step,
                    optimizer=type(opt.optimizer).__name__, loaded_step=state["step"], stats=s.stats(),
                    lines=heard.lines)

    path = str(Path(tmp) / "fabric_ckpt")
    whole = run(0, STEPS, save=path)
    resumed = run(EPOCH, STEPS, load=path)
    mesh = _mesh_of_fabric()
    net = TinyTransformer()
    net, own = scape_fsdp(net, mesh, sparsity=0.99, lr=LR, weight_decay=WD, shard_modules=net.body.layers, **SCHEDULE)
    for step in range(STEPS):
        _loss(net, batch(step)).backward()
        own.step()
        own.zero_grad()
    return dict(whole=whole, resumed=resumed, by_hand=_local(net).clone())


def _mesh_of_fabric():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def test_fabric_trains_as_scape_fsdp_by_hand_and_resumes_bit_for_bit(ranks):
    for rank, r in enumerate(part(ranks, "fabric")):
        whole, resumed = r["whole"], r["resumed"]
        assert whole["lines"] == ([
            "SCAPE: warmup_steps=4, ramp_steps=3 (the rest default); steps 0-3 dense (warm-up), sparse "
            "from step 4 at density 0.25, at the target density 0.0753 (int4 wire, 1% of dense bytes) from step 5; 12 "
            "steps in this run"] if rank == 0 else [])
        assert whole["optimizer"] == "ScapeFSDPAdamS" and whole["step"] == resumed["step"] == STEPS
        assert resumed["loaded_step"] == EPOCH and whole["stats"]["compression"] > 2
        assert torch.equal(whole["param"], r["by_hand"])
        assert torch.equal(whole["param"], resumed["param"]) and torch.equal(whole["residual"], resumed["residual"])


# ----------------------------------------------------------------------------------------
PARTS = {"train": _train_part, "resume": _resume_part, "accumulate": _accumulate_part, "misuse": _misuse_part,
         "fabric": _fabric_part}


def _all_parts(rank, world, tmp):
    """Every check in one launch of 4 processes (importing Lightning costs most); 2 nodes x 2 devices."""
    torch.manual_seed(0)
    os.environ.update(LOCAL_RANK=str(rank % 2), NODE_RANK=str(rank // 2))
    shared = Path(tmp)
    out = {}
    for name, fn in PARTS.items():
        path = shared / name
        path.mkdir(exist_ok=True)
        try:
            out[name] = fn(rank, str(path))
        except Exception:  # noqa: BLE001 - reported by the tests of that part
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_all_parts, str(tmp_path_factory.mktemp("fsdp_lightning")), world_size=4, timeout=600)


def part(ranks: list[dict], name: str) -> list[dict]:
    for rank, r in enumerate(ranks):
        if "error" in r[name]:
            pytest.fail(f"rank {rank} failed in {name!r}:\n{r[name]['error']}")
    return [r[name] for r in ranks]
