"""Uneven inputs, interrupts, plain checkpoints and refused calls: each case gives the correct result or
an error naming the cause and the fix (docs/reliability.md has the table)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from scape_core import ScapeAdamS, ScapeState, scape_hook
from tests.dist import failure, run_distributed, said
from tests.models import batch, loss_fn, make_model


def _setup(model, sparsity=0.9, warmup=2, ddp_kwargs=None, **cfg):
    ddp = DDP(model, **(ddp_kwargs or {}))
    state = ScapeState(ddp, sparsity=sparsity, warmup_steps=warmup, ramp_steps=0, **cfg)
    ddp.register_comm_hook(state, scape_hook)
    opt = ScapeAdamS(ddp.parameters(), state, lr=1e-2, weight_decay=0.1)
    return ddp, state, opt


def replicated(state, opt) -> dict[str, torch.Tensor]:
    """Everything SCAPE keeps alike on every rank, by name (parameters, m, statistics, windows, masks, step)."""
    out = {f"param {n}": p.detach().clone() for n, p in state.params.items()}
    out["m"] = opt.momentum_buffer.clone()
    out.update({f"statistic {k}": b.clone() for k, b in opt.statistics.items()})
    if state.window_buffer is not None:
        out["windows"] = state.window_buffer.clone()
    out.update({f"mask {t}": m.cols.clone() for t, m in state.masks.items()})
    out["step"] = torch.tensor(state.step)
    return out


def same_everywhere(replicas: list[dict[str, torch.Tensor]]) -> list[str]:
    """The entries of ``replicas`` (one dict per rank) that differ from rank 0's."""
    return [k for r in replicas[1:] for k in replicas[0] if k not in r or not torch.equal(r[k], replicas[0][k])]


# ----- ddp.join() with uneven inputs -------------------------------------------------------------
def _joined(rank: int, batches: int, warmup: int, **ddp_kwargs) -> dict:
    ddp, state, opt = _setup(make_model(), warmup=warmup, replica_check_every=2, ddp_kwargs=ddp_kwargs)
    steps = batches + rank * 3  # rank 1 has three batches more
    with said() as heard:
        error = failure(lambda: _join_loop(ddp, opt, rank, steps))
    return dict(error=error, replicas=replicated(state, opt), step=state.step, warnings=heard.warnings,
                skipped=state.skipped_steps)


def _join_loop(ddp, opt, rank: int, steps: int) -> None:
    with ddp.join():
        for t in range(steps):
            loss_fn(ddp, *batch(t, rank)).backward()
            opt.step()
            opt.zero_grad()


def _uneven(rank: int, world: int) -> dict:
    return dict(sparse=_joined(rank, batches=5, warmup=2),  # rank 0 joins at step 5: shadows 3 sparse steps
                dense=_joined(rank, batches=1, warmup=3),  # rank 0 joins in the warm-up, shadows steps 1-3
                unused=_joined(rank, batches=3, warmup=2, find_unused_parameters=True))


def test_join_with_uneven_inputs_ends_with_identical_replicas(uneven):
    for case in ("sparse", "dense"):
        ranks = [r[case] for r in uneven]
        assert [r["error"] for r in ranks] == ["no error", "no error"], (case, ranks)
        assert [r["step"] for r in ranks] == [8 if case == "sparse" else 4] * 2
        assert not same_everywhere([r["replicas"] for r in ranks]), (case, same_everywhere([r["replicas"]
                                                                                            for r in ranks]))
        assert not any("differs" in w for r in ranks for w in r["warnings"])
        assert [r["skipped"] for r in ranks] == [0, 0]


def test_join_with_find_unused_parameters_is_refused_on_every_rank(uneven):
    for r in uneven:
        error = r["unused"]["error"]
        assert error.startswith("RuntimeError: SCAPE does not support ddp.join() with find_unused_parameters=True")
        assert "DistributedSampler(drop_last=True)" in error
        assert r["unused"]["step"] == 0


# ----- Ctrl-C inside the exchange ---------------------------------------------------------------
def _interrupted(rank: int) -> dict:
    """A KeyboardInterrupt raised inside a sparse step's exchange (on every rank, before its collective)."""
    ddp, state, opt = _setup(make_model(), warmup=1)
    for t in range(2):
        loss_fn(ddp, *batch(t, rank)).backward()
        opt.step()
        opt.zero_grad()
    path = state.exchange_path

    def stage(*args):
        raise KeyboardInterrupt

    state.exchange_path = path._replace(stage=stage)
    try:
        loss_fn(ddp, *batch(2, rank)).backward()
        caught = "nothing raised"
    except KeyboardInterrupt:
        caught = "KeyboardInterrupt"
    except BaseException as e:  # noqa: BLE001 - what came out instead is the finding
        caught = f"{type(e).__name__}: {e}"
    futures = [x.future.done() for x in state.record.exchanges]
    return dict(caught=caught, futures_done=futures)


def test_ctrl_c_inside_the_exchange_is_a_keyboard_interrupt(launch):
    for r in launch:
        assert r["interrupted"]["caught"] == "KeyboardInterrupt", r["interrupted"]
        assert r["interrupted"]["futures_done"] and all(r["interrupted"]["futures_done"])  # nothing left waiting


def _launch(rank: int, world: int) -> dict:
    return dict(uneven=_uneven(rank, world), interrupted=_interrupted(rank))


@pytest.fixture(scope="module")
def launch():
    return run_distributed(_launch)


@pytest.fixture(scope="module")
def uneven(launch):
    return [r["uneven"] for r in launch]

