"""Misuse through each way in: each case gives the correct result or an error naming the cause and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from scape_core import AdamS, ScapeAdamS, ScapeConfig, ScapeState, load_checkpoint, save_checkpoint, scape_hook
from scape_core.config import unread_environment
from tests.dist import failure, run_distributed, said
from tests.models import batch, loss_fn, make_model


def _train(ddp, opt, rank: int, steps: range) -> None:
    for t in steps:
        loss_fn(ddp, *batch(t, rank)).backward()
        opt.step()
        opt.zero_grad()


# ----- sparsity=0 with an encoded wire: dense DDP + AdamS --------------------------------------
def _dense_on_an_encoded_wire(rank: int, world: int) -> dict:
    out = {}
    for wire in ("int4", "int8", "bfloat16"):
        model = make_model()
        ddp = DDP(model)
        state = ScapeState(ddp, sparsity=0.0, wire=wire, warmup_steps=3, ramp_steps=0)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, lr=1e-2, weight_decay=0.1)
        reference = make_model()
        ref_ddp = DDP(reference)
        ref_opt = AdamS(ref_ddp.parameters(), lr=1e-2, weight_decay=0.1)
        _train(ddp, opt, rank, range(8))
        _train(ref_ddp, ref_opt, rank, range(8))
        out[wire] = dict(same=all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters())),
                         compression=state.stats()["compression"], density=state.config.density)
        state.wait()
    return out


def test_sparsity_zero_on_an_encoded_wire_is_dense_adams():
    for r in run_distributed(_dense_on_an_encoded_wire):
        for wire, got in r.items():
            assert got == dict(same=True, compression=1.0, density=1.0), (wire, got)


# ----- an optimizer over some of the parameters -------------------------------------------------
def _subset(rank: int, world: int) -> str:
    model = make_model()
    ddp = DDP(model)
    state = ScapeState(ddp, sparsity=0.9)
    return failure(lambda: ScapeAdamS(model[0].parameters(), state))


def test_an_optimizer_over_some_parameters_is_refused_at_construction_naming_those_left_out():
    message = run_distributed(_subset)[0]
    assert message.startswith("ValueError: ScapeAdamS must own every parameter its state synchronizes; 6 are "
                              "left out (['2.weight', '2.bias', '3.weight', '3.bias', '4.weight'], ...)"), message
    assert "Build it from ddp.parameters()" in message


# ----- resume across shard_optimizer with wire="auto" -------------------------------------------
def _across_sharding(rank: int, world: int, tmp: str) -> dict:
    out = {}
    for saved_sharded, wire in ((False, "auto"), (True, "auto"), (False, "native")):
        model = make_model()
        ddp = DDP(model)
        state = ScapeState(ddp, sparsity=0.99, warmup_steps=2, ramp_steps=0, wire=wire, shard_optimizer=saved_sharded)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, lr=1e-2)
        _train(ddp, opt, rank, range(4))
        path = Path(tmp) / f"{saved_sharded}{wire}.pt"
        save_checkpoint(path, state, model=model, optimizer=opt)
        state.wait()
        model = make_model()
        ddp = DDP(model)
        state = ScapeState(ddp, sparsity=0.99, warmup_steps=2, ramp_steps=0, wire=wire,
                           shard_optimizer=not saved_sharded)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, lr=1e-2)
        out[f"{'sharded' if saved_sharded else 'replicated'} {wire}"] = failure(
            lambda: load_checkpoint(path, state, model=model, optimizer=opt))
        state.wait()
    return out


def test_resume_across_shard_optimizer_with_the_auto_wire_is_refused_naming_the_wire(tmp_path):
    got = run_distributed(_across_sharding, str(tmp_path))[0]
    assert got["replicated auto"].startswith("ValueError: SCAPE state was saved on the int4 wire (wire='auto', "
                                             "shard_optimizer=False), this run would use the native wire"), got
    assert "Resume with wire='int4'" in got["replicated auto"]
    assert got["sharded auto"].startswith("ValueError: SCAPE state was saved on the native wire (wire='auto', "
                                          "shard_optimizer=True), this run would use the int4 wire"), got
    assert got["replicated native"] == "no error"  # the same wire: the documented bit-for-bit resume


# ----- a sparsity the layout cannot reach ------------------------------------------------------
def _out_of_reach(rank: int, world: int) -> dict:
    out = {}
    for sparsity, chunk in ((0.9999, 16), (0.9, 4096)):
        ddp = DDP(make_model())
        with said() as heard:
            state = ScapeState(ddp, sparsity=sparsity, chunk_size=chunk, wire="native")
            state.announce()
        out[sparsity] = dict(lines=heard.lines, warnings=heard.warnings, sent=state.sent_share())
    return out


def test_a_sparsity_out_of_reach_says_what_is_sent_and_warns():
    r = run_distributed(_out_of_reach)[0]
    far, near = r[0.9999], r[0.9]
    assert far["sent"] > 0.06  # every row of 16 sends one of its coordinates at least
    assert f"native wire, {far['sent'] * 100:.3g}% of dense bytes, not 0.01%: each row of chunk_size=16" in \
        far["lines"][0], far["lines"]
    assert any("sparsity=0.9999 is out of reach with chunk_size=16" in w for w in far["warnings"]), far["warnings"]
    assert "(native wire, 10% of dense bytes)" in near["lines"][0] and not near["warnings"], near


# ----- SCAPE_* variables where they are not read -----------------------------------------------
def test_a_scape_variable_set_but_not_read_is_named_with_the_value_used():
    config = ScapeConfig()
    assert unread_environment(config, {"SCAPE_SPARSITY": "0.99", "SCAPE_ERROR_FEEDBACK": "yes"}) is None
    said_ = unread_environment(config, {"SCAPE_SPARSITY": "0.5", "SCAPE_WIRE": "native", "SCAPE_KERNELS": "eager"})
    assert said_.startswith("SCAPE: SCAPE_SPARSITY=0.5, SCAPE_WIRE=native are set, but this run uses sparsity=0.99, "
                            "wire='auto': only accelerate_scape"), said_


def _env_unread(rank: int, world: int) -> list[str]:
    import os

    os.environ["SCAPE_SPARSITY"] = "0.5"
    with said() as heard:
        ScapeState(DDP(make_model()), sparsity=0.9)
    return heard.warnings


@pytest.mark.parametrize("world", [2])
def test_scape_state_warns_on_rank_0_of_a_variable_it_does_not_read(world):
    first, second = run_distributed(_env_unread, world_size=world)
    assert any("SCAPE_SPARSITY=0.5 is set, but this run uses sparsity=0.9" in w for w in first), first
    assert not any("SCAPE_SPARSITY" in w for w in second), second  # once, on rank 0
