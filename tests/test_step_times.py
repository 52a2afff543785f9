"""Whether SCAPE paid: the step times ``stats()`` reports (dense warm-up, sparse at the target density)
against the times measured outside the library, and the wording of the line that ends a run."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scape_core import ScapeAdamS, ScapeConfig, ScapeState, scape_hook
from scape_core.step_times import SETTLE_STEPS, StepTimes, summary_line
from tests.dist import run_distributed, said

WARMUP, STEPS = 8, 16
PAUSE = {"dense": 0.06, "sparse": 0.015}  # seconds each step of the phase waits, as a slower exchange would


def _short_run(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)),
                                  gradient_as_bucket_view=True)
    state = ScapeState(ddp, sparsity=0.9, warmup_steps=WARMUP, ramp_steps=0, wire="native")
    ddp.register_comm_hook(state, scape_hook)
    opt = ScapeAdamS(ddp.parameters(), state, lr=1e-3)
    ends, started = [], []
    with said() as heard:
        for step in range(STEPS):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            ddp(x).square().mean().backward()
            started.append(state.sparse_started)
            time.sleep(PAUSE["dense" if state.is_dense(step) else "sparse"])
            opt.step()
            opt.zero_grad()
            ends.append(time.perf_counter())  # outside the library: the end of each optimizer step
        stats = state.stats()
        state.log_summary()
    state.wait()
    # the same steps the library times: each phase's after its first SETTLE_STEPS intervals
    dense = [ends[t] - ends[t - 1] for t in range(1 + SETTLE_STEPS, WARMUP)]
    sparse = [ends[t] - ends[t - 1] for t in range(WARMUP + SETTLE_STEPS, STEPS)]
    return dict(stats=stats, outside=dict(dense=statistics.median(dense), sparse=statistics.median(sparse)),
                lines=[line for line in heard.lines if "sent instead of" in line], sparse_steps=sum(started))


@pytest.fixture(scope="module")
def short_run() -> list[dict]:
    return run_distributed(_short_run, world_size=2)


def test_stats_hold_the_step_times_measured_outside(short_run):
    for r in short_run:
        assert r["sparse_steps"] == STEPS - WARMUP
        dense, sparse = r["stats"]["step_seconds_dense"], r["stats"]["step_seconds_sparse"]
        assert dense > 0 and sparse > 0
        # the same boundaries, read a few statements apart: a loaded machine shifts both alike
        assert dense == pytest.approx(r["outside"]["dense"], rel=0.3)
        assert sparse == pytest.approx(r["outside"]["sparse"], rel=0.3)
        assert dense >= PAUSE["dense"] and sparse >= PAUSE["sparse"]
        assert dense > 1.5 * sparse  # each phase's own steps, none of the other's


def test_rank_0_says_whether_scape_paid_in_one_line(short_run):
    assert len(short_run[0]["lines"]) == 1 and short_run[1]["lines"] == []
    line = short_run[0]["lines"][0]
    assert line.startswith("SCAPE: sparse steps ") and "for the dense warm-up: " in line and "x faster; " in line
    assert "\n" not in line


def test_each_phase_leaves_out_its_first_steps_and_the_ramp():
    config = ScapeConfig(sparsity=0.99, warmup_steps=6, ramp_steps=6, wire="native")  # ramp: steps 6-11
    times = StepTimes(config)
    assert [times.phase(t) for t in (0, 5, 6, 11, 12)] == ["dense", "dense", None, None, "sparse"]
    for step in range(20):
        times.tick(step)
    assert len(times.seconds["dense"]) == 5 - SETTLE_STEPS  # steps 1-5 have an interval; 1-3 settle
    assert len(times.seconds["sparse"]) == 8 - SETTLE_STEPS  # steps 12-19
    times.restart()  # a load, a dropped step: the next interval is not a step's, and the phase settles again
    times.tick(20)
    assert len(times.seconds["sparse"]) == 8 - SETTLE_STEPS


STATS = dict(bytes_sent=308.4e6, dense_bytes=2769.7e6)


def test_the_line_when_sparse_steps_are_faster():
    line = summary_line(dict(STATS, step_seconds_dense=1.2, step_seconds_sparse=0.41), ScapeConfig())
    assert line == ("SCAPE: sparse steps 0.41 s against 1.20 s for the dense warm-up: 2.9x faster; "
                    "308 MB sent instead of 2,770 MB")


def test_the_line_when_sparse_steps_are_slower_names_what_would_help():
    slower = dict(STATS, step_seconds_dense=0.5, step_seconds_sparse=0.62)
    line = summary_line(slower, ScapeConfig(sparsity=0.99))
    assert "for the dense warm-up: slower (0.81x)" in line and "308 MB sent instead of 2,770 MB" in line
    for hint in ('wire="native"', "sparsity above 0.99", 'kernels="compiled"'):
        assert hint in line
    # only what is not chosen yet; with everything chosen, dense DDP is the answer
    assert 'wire="native"' not in summary_line(slower, ScapeConfig(sparsity=0.99, wire="native"))
    done = summary_line(slower, ScapeConfig(sparsity=0.999, wire="native", kernels="compiled"))
    assert done.endswith("on this link dense DDP (sparsity=0) is the faster choice")
    same = summary_line(dict(STATS, step_seconds_dense=0.5, step_seconds_sparse=0.49), ScapeConfig())
    assert "not faster (1.02x)" in same and 'kernels="compiled"' in same


def test_the_line_when_a_phase_was_not_timed():
    config = ScapeConfig(sparsity=0.9, warmup_steps=2, ramp_steps=0)
    no_dense = summary_line(dict(STATS, step_seconds_dense=0.0, step_seconds_sparse=0.004), config)
    assert no_dense.startswith("SCAPE: sparse steps 4.0 ms; the dense warm-up was not timed")
    no_sparse = summary_line(dict(STATS, step_seconds_dense=0.2, step_seconds_sparse=0.0), ScapeConfig())
    assert "no sparse step at the target density was timed (it starts at step 100" in no_sparse
    dense = summary_line(dict(bytes_sent=5e6, dense_bytes=5e6, step_seconds_dense=0.2), ScapeConfig(sparsity=0))
    assert dense == ("SCAPE: sparsity=0, every step dense (DDP + AdamS): steps 0.20 s each; "
                     "5.0 MB sent instead of 5.0 MB")
