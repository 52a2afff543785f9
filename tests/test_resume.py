"""Exact resume with the defaults: a checkpoint loaded into fresh processes, a fresh
process group and a fresh DDP continues bit-for-bit like the run that never stopped, at 2 and 4
ranks, on the default wire at 99% (int4) and at 90% (native). DDP rebuilds its buckets after
each process's first iteration, so the resumed run's first sparse step travels in other buckets
than the uninterrupted run's same step: the test checks that it does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scape_core import ScapeAdamS, ScapeState, load_checkpoint, save_checkpoint, scape_hook
from tests.dist import run_distributed

CONFIGS = {"int4_99": dict(sparsity=0.99), "native_90": dict(sparsity=0.9)}  # the defaults' wires
SCHEDULE = dict(warmup_steps=6, ramp_steps=6, replica_check_every=4)  # the replica check never fires
SAVE_AT, STEPS = 18, 30


class TinyTransformer(nn.Module):
    """Two encoder layers: parameters become ready in another order than they were registered,
    so DDP's rebuilt buckets group them differently from its first ones."""

    def __init__(self, vocab: int = 64, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1000 * step + rank))


def _setup(config: dict):
    model = TinyTransformer()
    ddp = DDP(model, bucket_cap_mb=0.02)  # several buckets
    state = ScapeState(ddp, **config, **SCHEDULE)
    layouts: list[tuple[tuple[str, ...], ...]] = []

    def hook(state, bucket):  # scape_hook, noting which parameters share each bucket
        if bucket.index() == 0:
            layouts.append(())
        layouts[-1] += (tuple(state.names[id(p)] for p in bucket.parameters()),)
        return scape_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    opt = ScapeAdamS(ddp.parameters(), state, lr=3e-3, weight_decay=0.1)
    return model, ddp, state, opt, layouts


def _train(ddp, opt, rank: int, steps: range) -> None:
    for step in steps:
        tokens = _tokens(step, rank)
        logits = ddp(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()


def _uninterrupted(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for name, config in CONFIGS.items():
        model, ddp, state, opt, layouts = _setup(config)
        _train(ddp, opt, rank, range(SAVE_AT))
        save_checkpoint(Path(tmp) / f"{name}.pt", state, model=model, optimizer=opt)
        _train(ddp, opt, rank, range(SAVE_AT, STEPS))
        out[name] = dict(params=[p.detach().clone() for p in model.parameters()], layouts=layouts,
                         wire=state.config.resolved_wire, stats=state.stats())
    state.wait()
    return out


def _resumed(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for name, config in CONFIGS.items():
        model, ddp, state, opt, layouts = _setup(config)
        load_checkpoint(Path(tmp) / f"{name}.pt", state, model=model, optimizer=opt)
        _train(ddp, opt, rank, range(SAVE_AT, STEPS))
        out[name] = dict(params=[p.detach().clone() for p in model.parameters()], layouts=layouts,
                         stats=state.stats())
    state.wait()
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: 23 s
def test_resume_in_fresh_processes_is_bit_for_bit_with_the_defaults(world, tmp_path):
    full = run_distributed(_uninterrupted, str(tmp_path), world_size=world)
    resumed = run_distributed(_resumed, str(tmp_path), world_size=world)
    for name in CONFIGS:
        assert full[0][name]["wire"] == {"int4_99": "int4", "native_90": "native"}[name]
        first, second = resumed[0][name]["layouts"][:2]
        assert len(second) > 1 and first != second  # DDP rebuilt its buckets inside the resumed steps
        assert second == full[0][name]["layouts"][SAVE_AT]  # the uninterrupted run's layout by then
        for rank in range(world):
            for p, q in zip(full[rank][name]["params"], resumed[rank][name]["params"]):
                assert torch.equal(p, q), f"{name}, rank {rank}: max |diff| {(p - q).abs().max().item():.3g}"
            for key in ("steps", "values_sent", "bytes_sent", "dense_bytes", "skipped_steps"):  # hook_calls: buckets
                assert resumed[rank][name]["stats"][key] == full[rank][name]["stats"][key], key
            for p, q in zip(full[0][name]["params"], full[rank][name]["params"]):
                assert torch.equal(p, q)  # replicas bit-identical
