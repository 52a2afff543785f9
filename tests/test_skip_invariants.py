"""What a skipped step (a non-finite gradient on one rank) must leave alone, on paths the contract tests of
``test_arithmetic.py`` do not cover: the ``lazy`` rule, a streak inside the dense warm-up, and FSDP2's
per-group exchanges (2 gloo processes each)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from tests.dist import run_distributed, said
from tests.models import batch, loss_fn, make_model

SKIPPED = 5  # a sparse step (warm-up 3)
DENSE_SKIPS = (1, 2, 3)  # inside a warm-up of 8: a streak of 3


def _lazy_skipped_step(rank: int, kernels: str) -> dict:
    """10 steps of the ``lazy`` rule at 90%, rank 1's loss times inf at step :data:`SKIPPED`; what each step
    changed of the parameters and ``m``."""
    from tests.test_core_ddp import scape_setup

    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9, warmup=3, update="lazy", kernels=kernels, wire="native")
    moved = []
    for step in range(10):
        before = [t.clone() for p in model.parameters() for t in (p.detach(), opt.state[p]["exp_avg"])]
        loss = loss_fn(ddp, *batch(step, rank))
        if step == SKIPPED and rank == 1:
            loss = loss * float("inf")
        loss.backward()
        opt.step()
        opt.zero_grad()
        after = [t for p in model.parameters() for t in (p.detach(), opt.state[p]["exp_avg"])]
        moved.append(not all(torch.equal(a, b) for a, b in zip(before, after)))
    return dict(moved=moved, skipped=state.skipped_steps, dense=[state.is_dense(t) for t in range(10)])


def _dense_streak(rank: int) -> dict:
    """Rank 1's loss times inf at steps :data:`DENSE_SKIPS` of an 8-step warm-up (streak limit 3); rank 0's
    gradients are finite throughout. What each rank warns."""
    from tests.test_core_ddp import scape_setup

    model = make_model()
    with said() as heard:
        ddp, state, opt = scape_setup(model, 0.9, warmup=8, skip_streak_warning=3)
        for step in range(5):
            loss = loss_fn(ddp, *batch(step, rank))
            if step in DENSE_SKIPS and rank == 1:
                loss = loss * float("inf")
            loss.backward()
            opt.step()
            opt.zero_grad()
        stats = state.stats()  # reads the streak and warns
    return dict(warnings=heard.warnings, skipped=stats["skipped_steps"], dense=state.is_dense(4))


def _skip_launch(rank: int, world: int) -> dict:
    import scape_core.kernels

    scape_core.kernels.compile_kernel = lambda fn, name: fn  # the compiled path's passes, uncompiled
    return dict(lazy={k: _lazy_skipped_step(rank, k) for k in ("eager", "compiled")}, streak=_dense_streak(rank))


@pytest.fixture(scope="module")
def skip_runs() -> list[dict]:
    return run_distributed(_skip_launch)


@pytest.mark.parametrize("kernels", ["eager", "compiled"])
def test_the_lazy_rule_moves_nothing_on_a_skipped_step(skip_runs, kernels):
    """A skipped sparse step under ``update="lazy"`` leaves every parameter and ``m`` bit-identical: its ``u``
    (``m / sqrt(v)``, not 0 where the step is not applied, unlike the linear rule's ``s / d`` with ``s = 0``)
    must be zeroed there (:func:`scape_core.update_rules.masked_update_pass`). ``compiled``: the compiled path's
    passes, run uncompiled."""
    for out in skip_runs:
        got = out["lazy"][kernels]
        assert got["skipped"] == 1 and not got["dense"][SKIPPED]
        assert got["moved"] == [step != SKIPPED for step in range(10)], got["moved"]


def test_a_dense_warmup_streak_names_no_rank_whose_gradients_were_finite(skip_runs):
    """A dense step knows only that the mean was not finite, not whose gradients were: a streak inside the
    warm-up warns on rank 0 without naming a rank, and rank 0, whose gradients were finite at every step,
    never names itself."""
    for rank, out in enumerate(skip_runs):
        got = out["streak"]
        assert got["skipped"] == len(DENSE_SKIPS) and got["dense"]
        assert not [w for w in got["warnings"] if re.search(r"\brank 0\b", w)], got["warnings"]
        streak = [w for w in got["warnings"] if "consecutive" in w and "skipped" in w]
        assert len(streak) == (1 if rank == 0 else 0), got["warnings"]


# ----------------------------------------------------------------------------------------
def _fsdp_conservation(rank: int, world: int) -> dict:
    """FSDP2 on a (2, 1) mesh at 90% (native wire), 10 steps; at step :data:`SKIPPED` one coordinate of the
    first parameter group's reduce-scattered gradient is +inf on rank 1, so that group's exchange is not
    finite and the other groups' are: the step is skipped everywhere, the first group's gradients are dropped,
    and the other groups' stay in the residuals (their exchanged means go back). Returns the largest
    ``|applied + mean residual - sum of the mean gradients kept|`` and the skipped steps."""
    from torch.distributed.device_mesh import init_device_mesh

    from scape_core.fsdp import scape_fsdp
    from tests.test_fsdp import _loss
    from tests.test_resume import TinyTransformer

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    replicate = mesh.get_group("replicate")
    net = TinyTransformer()
    model, opt = scape_fsdp(net, mesh, sparsity=0.9, lr=3e-3, weight_decay=0.1, shard_modules=net.body.layers,
                            wire="native", warmup_steps=2, ramp_steps=0)
    state = opt.scape
    mean_grad = {name: torch.zeros(state.layout.numel[name], dtype=torch.float64) for name in state.params}
    applied = {name: torch.zeros_like(mean_grad[name]) for name in state.params}
    captured: dict[str, torch.Tensor] = {}

    def hook(output: torch.Tensor, g) -> None:
        for name, piece in zip(g.names, output.split(g.split)[::2]):  # one shard: no padding
            captured[name] = piece.detach().double().clone()
        if state.step == SKIPPED and rank == 1 and g.index == 0:
            output[0] = float("inf")
        state.reduce(g, output)

    for g in state.groups:
        g.module.set_all_reduce_hook(lambda output, g=g: hook(output, g))
    for step in range(10):
        skipped_before = state.skipped_steps
        _loss(model, step, rank).backward()
        opt.step()
        skipped = state.skipped_steps > skipped_before
        for name, p in state.params.items():
            if skipped and name in state.groups[0].names:  # the non-finite exchange: dropped
                continue
            if not skipped:
                applied[name] += p.grad._local_tensor.detach().reshape(-1).double()
            mean = captured[name].clone()
            dist.all_reduce(mean, group=replicate)
            mean_grad[name] += mean / world
        opt.zero_grad()
    err = 0.0
    for name in state.params:
        residual = state.layout.view(state.buffers.residual, name).double().clone()
        dist.all_reduce(residual, group=replicate)
        err = max(err, float((applied[name] + residual / world - mean_grad[name]).abs().max()))
    held = float(state.buffers.residual.abs().sum())
    return dict(err=err, skipped=state.skipped_steps, groups=len(state.groups), held=held)


def test_fsdp2_conserves_the_gradient_across_a_step_skipped_by_one_group():
    """FSDP2 exchanges each parameter group on its own, so on a step skipped for one group's non-finite
    gradient the other groups' exchanges went through: their means must go back into the residuals (the
    optimizer's :meth:`~scape_core.buckets.StepRecord.return_unapplied`), which keep those groups' gradients
    of the step, while the non-finite group's are dropped. Over the run, applied plus the replicas' mean
    residual equals the sum of the mean gradients kept. Means left unreturned lose what was sent."""
    for out in run_distributed(_fsdp_conservation):
        assert out["skipped"] == 1 and out["groups"] > 1 and out["held"] > 0, out
        assert out["err"] < 1e-5, out
