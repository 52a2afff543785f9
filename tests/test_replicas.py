"""The replica guard (scape_core/replicas.py): ranks whose replicated state drifts apart are stopped, naming what
differs; correct runs are never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from scape_core import ScapeAdamS, ScapeState, load_checkpoint, native, save_checkpoint, scape_hook
from scape_core.replicas import ReplicaMismatch
from tests.dist import run_distributed
from tests.models import batch, loss_fn, make_model


def _setup(**fields):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = ScapeState(ddp, **{"sparsity": 0.9, "warmup_steps": 2, "ramp_steps": 0, **fields})
    ddp.register_comm_hook(state, scape_hook)
    return model, ddp, state, ScapeAdamS(ddp.parameters(), state, lr=1e-2, weight_decay=0.1)


def _step(ddp, opt, t: int, rank: int) -> None:
    loss_fn(ddp, *batch(t, rank)).backward()
    opt.step()
    opt.zero_grad()


def _nudged(rank: int, world: int) -> dict:
    model, ddp, state, opt = _setup(replica_check_every=4)
    for t in range(12):
        if t == 5 and rank == 1:  # after the warm-up, a few ulps of one coordinate on one rank (one ulp
            with torch.no_grad():  # can round away in the decay's product, and then nothing differs)
                w = model[2].weight
                for _ in range(4):
                    w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(float("inf")))
        try:
            _step(ddp, opt, t, rank)
        except ReplicaMismatch as e:
            return {"step": state.step, "error": str(e)}
    return {"step": None, "error": None}


def test_a_few_ulps_on_one_rank_are_caught_within_one_interval_naming_the_parameter():
    for r in run_distributed(_nudged):
        assert r["step"] == 8, r  # nudged before step 5's update: the check after step 8 sees it
        assert "parameters of parameter '2.weight'" in r["error"] and "rank(s) [1]" in r["error"], r["error"]
        assert "after optimizer step 8" in r["error"] and "nondeterministic kernel" in r["error"]


def _other_checkpoints(rank: int, world: int, tmp: str) -> dict:
    model, ddp, state, opt = _setup()
    for t in range(4):
        _step(ddp, opt, t, rank)
    save_checkpoint(Path(tmp) / "a.pt", state, model=model, optimizer=opt)
    for t in range(4, 7):
        _step(ddp, opt, t, rank)
    save_checkpoint(Path(tmp) / "b.pt", state, model=model, optimizer=opt)
    state.wait()
    model, ddp, state, opt = _setup()
    load_checkpoint(Path(tmp) / ("a.pt" if rank == 0 else "b.pt"), state, model=model, optimizer=opt)
    try:
        _step(ddp, opt, 7, rank)
    except ReplicaMismatch as e:
        return {"step": state.step, "error": str(e)}
    return {"step": None, "error": None}


def test_a_rank_that_loaded_another_checkpoint_is_caught_at_the_first_check(tmp_path):
    for r in run_distributed(_other_checkpoints, str(tmp_path)):
        assert r["error"] is not None and "rank(s) [1] differ from rank 0" in r["error"], r
        assert "parameters of parameter '0.weight'" in r["error"], r["error"]  # the first that differs


def _kernels_differ(rank: int, world: int) -> dict:
    if rank == 1:  # as a rank where no C compiler works: torch's operators, which round the update otherwise
        native._library, native._unavailable = None, "no C compiler (test)"
    model, ddp, state, opt = _setup(replica_check_every=100)
    try:
        _step(ddp, opt, 0, rank)
    except ReplicaMismatch as e:
        return {"step": state.step, "error": str(e)}
    return {"step": None, "error": None}


def test_ranks_that_run_different_cpu_kernels_are_stopped_at_the_first_step():
    for r in run_distributed(_kernels_differ):
        assert r["step"] == 1 and "the CPU kernels in use" in r["error"] and "rank(s) [1]" in r["error"], r


CORRECT = {"default": {}, "int4": dict(wire="int4", sparsity=0.99), "sharded": dict(shard_optimizer=True),
           "topk ramp": dict(selection="topk", ramp_steps=6), "lazy": dict(update="lazy")}


def _correct(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for name, fields in CORRECT.items():
        model, ddp, state, opt = _setup(replica_check_every=1, **fields)
        for t in range(10):
            _step(ddp, opt, t, rank)
        save_checkpoint(Path(tmp) / f"{name}.pt", state, model=model, optimizer=opt)  # a check before it too
        out[name] = state.stats()["steps"]
        state.wait()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_correct_run_checked_every_step_is_never_stopped(world, tmp_path):
    for r in run_distributed(_correct, str(tmp_path), world_size=world):
        assert r == {name: 10 for name in CORRECT}
