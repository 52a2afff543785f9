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
    if state.buffers.windows is not None:
        out["windows"] = state.buffers.windows.clone()
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
    _train(ddp, opt, rank, range(2))
    exchanger = state.exchanger

    def stage(*args):
        raise KeyboardInterrupt

    state.exchanger = exchanger._replace(path=exchanger.path._replace(stage=stage))
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


# ----- a refused add_param_group --------------------------------------------------------------
def _refused_group(rank: int) -> dict:
    ddp, state, opt = _setup(make_model())
    _train(ddp, opt, rank, range(1))
    error = failure(lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]}))
    groups = len(opt.param_groups)
    return dict(error=error, groups=groups, next_step=failure(lambda: _train(ddp, opt, rank, range(1, 3))))


def test_a_refused_param_group_leaves_the_optimizer_as_it_was(launch):
    for r in launch:
        assert r["refused_group"]["error"].startswith("ValueError: a parameter of shape (3,) is not synchronized")
        assert r["refused_group"]["groups"] == 1 and r["refused_group"]["next_step"] == "no error", r["refused_group"]
    from scape_core import AdamS

    model = make_model()
    opt = AdamS(model[0].parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="lr must be a finite number"):
        opt.add_param_group({"params": model[2].parameters(), "lr": float("nan")})
    assert len(opt.param_groups) == 1


# ----- a step skipped after backward (opt.zero_grad() instead of opt.step()) -------------------------
def _train(ddp, opt, rank: int, steps: range, skip: tuple[int, ...] = ()) -> None:
    for t in steps:
        loss_fn(ddp, *batch(t, rank)).backward()
        if t not in skip:
            opt.step()
        opt.zero_grad()


def _skipped(rank: int, world: int) -> dict:
    """Backwards 1 (dense) and 5 (sparse) are not stepped; applied + mean residual still equals the sum of
    the mean gradients of every backward but the dense one (dropped, as in plain DDP)."""
    from tests.test_core_ddp import conservation_error

    model = make_model()
    ddp, state, opt = _setup(model, warmup=3)
    params = list(state.params.values())
    want = [torch.zeros_like(p) for p in params]
    applied = [torch.zeros_like(p) for p in params]
    skip = (1, 5)
    for t in range(9):
        x, y = batch(t, rank)
        local = torch.autograd.grad(loss_fn(model, x, y), params)
        loss_fn(ddp, x, y).backward()
        if t != 1:  # a skipped dense step's gradient is dropped
            for w, g in zip(want, local):
                g = g.clone()
                torch.distributed.all_reduce(g)
                w.add_(g / world)
        if t in skip:
            opt.zero_grad()
            continue
        for a, p in zip(applied, params):
            a.add_(p.grad)
        opt.step()
        opt.zero_grad()
    return dict(step=state.step, error=conservation_error(state, applied, want), replicas=replicated(state, opt))


def test_a_step_skipped_after_backward_loses_nothing_and_replicas_agree(launch):
    ranks = [r["skipped"] for r in launch]
    assert [r["step"] for r in ranks] == [7, 7]  # the schedule did not advance at the skipped steps
    assert max(r["error"] for r in ranks) < 1e-5, ranks
    assert not same_everywhere([r["replicas"] for r in ranks])


def _unstepped(rank: int) -> str:
    """A synchronized backward neither stepped nor zeroed: the next backward says what to do."""
    ddp, state, opt = _setup(make_model(), warmup=1)
    loss_fn(ddp, *batch(0, rank)).backward()
    for p in ddp.parameters():
        p.grad = None
    return failure(lambda: loss_fn(ddp, *batch(1, rank)).backward())


def test_two_backwards_without_a_step_name_the_way_to_skip_one(launch):
    for r in launch:
        assert "call opt.zero_grad() instead of opt.step(), on every rank" in r["unstepped"], r["unstepped"]
        assert "ddp.no_sync()" in r["unstepped"]


# ----- a GAN: G's loss flows back through D ---------------------------------------------------------
def _gan(rank: int, no_sync: bool) -> dict:
    torch.manual_seed(1)
    g = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()))
    d = DDP(make_model())
    states, opts = [], []
    for net in (g, d):
        state = ScapeState(net, sparsity=0.9, warmup_steps=2, ramp_steps=0)
        net.register_comm_hook(state, scape_hook)
        states.append(state)
        opts.append(ScapeAdamS(net.parameters(), state, lr=1e-2))
    opt_g, opt_d = opts

    def iteration(t: int) -> None:
        z = torch.randn(8, 8, generator=torch.Generator().manual_seed(t * 10 + rank))
        real, y = batch(t, rank)
        opt_d.zero_grad()
        (loss_fn(d, real, y) - loss_fn(d, g(z).detach(), y)).backward()
        opt_d.step()
        opt_g.zero_grad()
        if no_sync:
            with d.no_sync():
                loss_fn(d, g(z), y).backward()
        else:
            loss_fn(d, g(z), y).backward()
        opt_g.step()

    error = failure(lambda: [iteration(t) for t in range(5)])
    return dict(error=error, g=replicated(states[0], opt_g), d=replicated(states[1], opt_d))


def test_a_gan_without_no_sync_names_d_no_sync_and_with_it_trains(launch):
    for r in launch:
        error = r["gan"]["error"]
        assert "a backward went through this model from another model's output (e.g. a GAN" in error, error
        assert "with d.no_sync(): g_loss = loss_fn(d(g(z)))" in error
        assert r["gan_no_sync"]["error"] == "no error", r["gan_no_sync"]["error"]
    for net in ("g", "d"):
        assert not same_everywhere([r["gan_no_sync"][net] for r in launch])


# ----- a plain torch.save of the model and opt.state_dict() ------------------------------------------
def _plain_checkpoint(rank: int, tmp: str) -> dict:
    """Resumed from a plain torch.save (no SCAPE state), and from save_checkpoint, at step 6 of 2 warm-up steps."""
    from scape_core import load_checkpoint, save_checkpoint

    model = make_model()
    ddp, state, opt = _setup(model)
    _train(ddp, opt, rank, range(6))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{tmp}/plain{rank}.pt")
    save_checkpoint(f"{tmp}/scape.pt", state, model=model, optimizer=opt)
    out = {}
    for kind in ("plain", "scape"):
        model = make_model()
        ddp, state, opt = _setup(model)
        with said() as heard:
            if kind == "plain":
                saved = torch.load(f"{tmp}/plain{rank}.pt")
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
            else:
                load_checkpoint(f"{tmp}/scape.pt", state, model=model, optimizer=opt)
            _train(ddp, opt, rank, range(6, 8))
        out[kind] = [w for w in heard.warnings if "SCAPE" in w]
    return out


def test_a_plain_checkpoint_resume_names_what_was_not_restored(launch):
    first, second = (r["plain_checkpoint"] for r in launch)
    assert len(first["plain"]) == 1 and not second["plain"], first  # once, on rank 0
    said_ = first["plain"][0]
    assert said_.startswith("SCAPE: ScapeAdamS was resumed at optimizer step 6, but SCAPE's state is at step 0: its "
                            "schedule restarts there (the dense warm-up runs again) and the saved run's residuals")
    assert "scape_core.save_checkpoint / load_checkpoint" in said_ and "state.load_state_dict" in said_
    assert not first["scape"] and not second["scape"]  # the SCAPE checkpoint restores both: nothing to say


# ----- a checkpoint of selection="groups" resumed under the top-k default ------------------------------
def _other_selection(rank: int) -> dict:
    from scape_core import gather_state_dict

    ddp, state, opt = _setup(make_model(), selection="groups")
    _train(ddp, opt, rank, range(5))
    saved = gather_state_dict(state)
    out = {}
    for selection in ("topk", "groups"):
        _, state, _ = _setup(make_model(), selection=selection)
        with said() as heard:
            state.load_state_dict(saved)
        out[selection] = [w for w in heard.warnings if "selection" in w]
    return out


def test_a_checkpoint_of_another_selection_warns_naming_it(launch):
    first, second = (r["other_selection"] for r in launch)
    assert first["topk"] == ["SCAPE state was saved with selection='groups', this run uses selection='topk': the "
                             "masks from step 5 on are chosen by another rule, so the run does not continue the saved "
                             "one as it would have. Resume with selection='groups' to continue it (the default is "
                             "'topk')"], first
    assert not second["topk"] and not first["groups"] and not second["groups"]


# ----- fp64 parameters ------------------------------------------------------------------------------
def _fp64(rank: int) -> dict:
    model = make_model(dtype=torch.float64)
    ddp, state, opt = _setup(model, replica_check_every=2, wire="native")
    for t in range(5):  # dense steps 0-1, sparse 2-4
        loss_fn(ddp, *batch(t, rank, dtype=torch.float64)).backward()
        opt.step()
        opt.zero_grad()
    kept = [bool((p != p.float().double()).any()) for p in model.parameters()]
    with torch.no_grad():
        if rank == 1:
            model[0].weight[0, 0] += 1e-12
    return dict(kept=kept, dtype=str(model[0].weight.dtype), guard=failure(state.check_replicas))


def test_fp64_parameters_keep_their_precision_and_the_guard_sees_it(launch):
    for r in launch:
        assert r["fp64"]["dtype"] == "torch.float64" and all(r["fp64"]["kept"]), r["fp64"]
        assert r["fp64"]["guard"].startswith("ReplicaMismatch: SCAPE: the ranks' replicated state differs after "
                                             "optimizer step 5: parameters of parameter '0.weight'"), r["fp64"]["guard"]


# ----- many small tensors ------------------------------------------------------------------------------
class SmallTensors(torch.nn.Module):
    """300 tensors of 500 values: each starts its own row of chunk_size=4096."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(500)) for _ in range(300)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * sum(p.sum() for p in self.pieces)


def _small_tensors(rank: int) -> dict:
    out = {}
    for name, model in (("small", SmallTensors()), ("mlp", make_model())):
        with said() as heard:
            ScapeState(DDP(model), sparsity=0.99).announce()
        out[name] = [w for w in heard.warnings if "flat layout" in w]
    return out


def test_a_layout_much_larger_than_the_parameters_is_said_with_its_cost(launch):
    first, second = (r["small_tensors"] for r in launch)
    assert first["small"] == ["SCAPE: the flat layout holds 1,228,800 values for 150,000 parameters (8.2x): each of "
                              "the 300 tensors starts its own row of chunk_size=4096, so each of SCAPE's fp32 buffers "
                              "(the residual, m, the rule's statistics, the windows, the staging) carries 4.1 MiB of "
                              "padding. chunk_size=512 lays them out in 153,600 values (1.0x); every row sends at "
                              "least one coordinate, so keep chunk_size above 1 / (1 - sparsity)"], first
    assert not second["small"] and not first["mlp"]  # rank 0 only; a small model's padding is not worth a word


# ----- finite gradients whose fp32 sum overflows ----------------------------------------------------
def _overflowing_sum(rank: int) -> dict:
    """Sparse steps 2-4 add 1e35 to each of 4,096 gradients: every one finite, their fp32 sum past 3.4e38."""
    model = make_model()
    ddp, state, opt = _setup(model, skip_streak_warning=3)
    finite = []
    with said() as heard:
        for t in range(5):
            push = 1e35 * model[2].weight.sum() if t >= 2 else 0.0
            (loss_fn(ddp, *batch(t, rank)) + push).backward()
            finite.append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
            opt.step()
            opt.zero_grad()
        stats = state.stats()
    return dict(warnings=[w for w in heard.warnings if "finiteness" in w], skipped=stats["skipped_steps"],
                finite=finite)


def test_finite_gradients_whose_sum_overflows_are_named_as_such(launch):
    from scape_core.streak import NOT_FINITE

    for rank, r in enumerate(launch):
        got = r["overflowing_sum"]
        assert got["skipped"] == 3 and all(got["finite"][:2]), got
        assert "finite values so large (near fp32's limit, 3.4e38) that their fp32 sum overflowed" in NOT_FINITE
        streak = [w for w in got["warnings"] if "optimizer steps were skipped" in w]
        assert len(streak) == (1 if rank == 0 else 0) and all(NOT_FINITE in w for w in streak), got["warnings"]
        own = [w for w in got["warnings"] if "own gradients" in w]
        assert own == [f"SCAPE: rank {rank}'s own gradients failed the finiteness check in 3 of the 3 consecutive "
                       f"skipped steps (steps 2..4): {NOT_FINITE}"], got["warnings"]


def _launch(rank: int, world: int, tmp: str) -> dict:
    return dict(uneven=_uneven(rank, world), interrupted=_interrupted(rank), refused_group=_refused_group(rank),
                skipped=_skipped(rank, world), unstepped=_unstepped(rank), gan=_gan(rank, no_sync=False),
                gan_no_sync=_gan(rank, no_sync=True), plain_checkpoint=_plain_checkpoint(rank, tmp),
                other_selection=_other_selection(rank), fp64=_fp64(rank),
                small_tensors=_small_tensors(rank), overflowing_sum=_overflowing_sum(rank))


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    return run_distributed(_launch, str(tmp_path_factory.mktemp("launch")))


@pytest.fixture(scope="module")
def uneven(launch):
    return [r["uneven"] for r in launch]

